"""A discrete-time simulator split as Blox does: admission, policy, placement check, execution.

Each slot t: jobs whose arrival is t are admitted and handed to the policy (``on_arrival``); the policy
returns an ``Allocation`` per job (workers per server and the PS's server; placement is part of the policy's
decision); the simulator checks every constraint of the papers' formulations against it and raises
``SimulationError`` on the first violation (it is a bug, not a statistic); execution then advances each job
by workers * p_j mini-batches (eq. (1)), or by the smaller useful amount a chunk-level policy reports. A job
whose remaining work reaches zero in slot t completes at c_j = t + 1 (the end of that slot), so its JCT is
c_j - a_j, counted in whole slots like the papers' objective (2).

Speed: a policy may say (``stable_until``) that its decision cannot change before some later slot unless a
job arrives or completes; the simulator then executes that many identical slots at once (stopping at the
next arrival or completion). The result is the same as slot by slot: the same allocation, the same checks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from deepco.scheduling.jobs import Job
from deepco.scheduling.topology import SimCluster

if TYPE_CHECKING:
    from deepco.scheduling.policies.base import Policy

EPS = 1e-9


class Executor(Protocol):
    """The execution part of the loop when a schedule is carried out for real (not only simulated)."""

    def execute(self, t: int, k: int, allocs: dict[int, Allocation], per_slot: dict[int, float],
                active: dict[int, JobState]) -> tuple[dict[int, float], dict[int, Allocation]]:
        """Run slots [t, t + k) of the running jobs' ``allocs`` (planned mini-batches per slot in
        ``per_slot``); return the mini-batches each really trained and the allocation it really had."""


class SimulationError(RuntimeError):
    """A policy broke a constraint of the model, or the run could not finish."""


@dataclass
class Allocation:
    """What one job gets in one slot. Build a new one to change it: only ``work`` may be set afterwards."""

    workers: dict[int, int]  # server index -> number of this job's workers running there
    ps: int  # server index of its one PS
    work: float | None = None  # useful mini-batches this slot, when less than workers * p_j (chunk policies)
    total_workers: int = field(init=False)  # workers the job runs this slot

    def __post_init__(self) -> None:
        self.total_workers = sum(self.workers.values())

    def colocated(self) -> bool:
        """xi_j = 1: every worker and the PS on one server (She et al. (2f))."""
        return len(self.workers) == 1 and self.ps in self.workers


@dataclass
class JobState:
    """The simulator's record of one admitted job."""

    job: Job
    remaining: float
    started: int | None = None
    completed: int | None = None
    attained: float = 0.0  # worker-slots received so far (Tiresias' attained service)
    last: Allocation | None = None  # allocation of the previous slot (None: did not run)
    servers_used: set[int] = field(default_factory=set)
    preemptions: int = 0


@dataclass
class SimState:
    """What a policy may look at when it decides a slot: the cluster, the clock, and the active jobs."""

    t: int
    cluster: SimCluster
    active: dict[int, JobState]  # admitted, not completed, keyed by job id


@dataclass
class JobResult:
    """Per-job outcome."""

    id: int
    arrival: int
    start: int
    completion: int
    preemptions: int
    cloud: bool

    @property
    def jct(self) -> int:
        """c_j - a_j."""
        return self.completion - self.arrival


@dataclass
class SimResult:
    """The run's metrics; ``to_dict`` is the row ``deepco schedule --json`` writes."""

    policy: str
    jobs: list[JobResult]
    edge_busy: float  # worker-slots used on edge servers
    edge_capacity: int  # edge worker slots
    slots: int

    @property
    def total_jct(self) -> float:
        """sum_j (c_j - a_j): objective (2) of both papers."""
        return float(sum(j.jct for j in self.jobs))

    @property
    def avg_jct(self) -> float:
        """Average JCT."""
        return self.total_jct / len(self.jobs) if self.jobs else 0.0

    @property
    def makespan(self) -> int:
        """Last completion minus first arrival."""
        if not self.jobs:
            return 0
        return max(j.completion for j in self.jobs) - min(j.arrival for j in self.jobs)

    @property
    def preemptions(self) -> int:
        """Slots in which a running, unfinished job lost workers (worker- or job-level preemption)."""
        return sum(j.preemptions for j in self.jobs)

    @property
    def utilization(self) -> float:
        """Edge worker-slots used / (edge worker slots x makespan); the cloud is left out."""
        denom = self.edge_capacity * self.makespan
        return self.edge_busy / denom if denom else 0.0

    def to_dict(self) -> dict[str, object]:
        """The JSON row of one policy. The keys every scheduler shares (Okita's engine uses the same ones):
        ``preemptions``: times a started, unfinished job ran fewer workers than in its previous slot (none
        included); ``utilization``: workers' busy share of the edge's worker capacity from the first arrival to
        the last completion; ``cloud_jobs``: jobs that ran at least one slot on the cloud."""
        return {"policy": self.policy, "jobs": len(self.jobs), "avg_jct": self.avg_jct,
                "total_jct": self.total_jct, "makespan": self.makespan, "preemptions": self.preemptions,
                "utilization": self.utilization,
                "cloud_jobs": sum(1 for j in self.jobs if j.cloud)}


def _work_per_slot(allocs: dict, active: dict[int, JobState], k: int) -> tuple[dict[int, float], int]:
    """The work each running job does per slot under ``allocs``, and ``k`` cut to the first completion."""
    per_slot: dict[int, float] = {}
    for jid, alloc in allocs.items():
        if alloc.total_workers > 0:
            st = active[jid]
            work = alloc.work
            if work is None:
                work = alloc.total_workers * st.job.rate(alloc.colocated())
            per_slot[jid] = work
            if work > 0:
                left = st.remaining - EPS * max(1.0, st.job.total_work)
                k = min(k, max(1, math.ceil(left / work - 1e-12)))
    return per_slot, max(1, k)


class Simulator:
    """Drives one policy over one workload on one cluster, checking every constraint each slot."""

    def __init__(self, cluster: SimCluster, jobs: Sequence[Job], policy: Policy, *,
                 max_slots: int = 10_000_000, progress: object | None = None, executor: Executor | None = None):
        """``progress``: anything with ``update(n)`` (a tqdm bar), told of each completed job. ``executor``:
        carries each step out for real (``deepco.scheduling.execution``); the books then follow what it did."""
        ids = [j.id for j in jobs]
        if len(set(ids)) != len(ids):
            raise SimulationError("job ids must be unique")
        for job in jobs:
            job.check()
            if len(job.upload) != len(cluster.sites):
                raise SimulationError(f"job {job.id}: upload delays not bound to the cluster's sites")
        self.cluster, self.jobs, self.policy = cluster, list(jobs), policy
        self.max_slots = max_slots
        self.progress = progress
        self.executor = executor

    def run(self) -> SimResult:
        """Simulate until every job completes."""
        cluster, policy = self.cluster, self.policy
        policy.plan(cluster, self.jobs)
        pending = sorted(self.jobs, key=lambda j: (j.arrival, j.id))
        nxt = 0
        active: dict[int, JobState] = {}
        done: list[JobResult] = []
        edge_busy = 0.0
        t = pending[0].arrival if pending else 0
        slots = 0
        tick = getattr(self.progress, "update", None)
        # the last checked allocation of each running job, and the per-server totals it adds up to
        self._snap: dict[int, tuple[dict[int, int], int, float | None]] = {}
        self._used_w: dict[int, int] = {}
        self._used_p: dict[int, int] = {}
        self._edge_of: dict[int, int] = {}  # edge workers of each running job's current allocation
        running: set[int] = set()  # jobs that ran in the previous step
        while nxt < len(pending) or active:
            if not active and nxt < len(pending) and pending[nxt].arrival > t:
                t = pending[nxt].arrival  # nothing to run: jump to the next arrival
            arrived = []
            while nxt < len(pending) and pending[nxt].arrival <= t:
                job = pending[nxt]
                active[job.id] = JobState(job=job, remaining=job.total_work)
                arrived.append(job)
                nxt += 1
            if arrived:
                policy.on_arrival(t, arrived)
            state = SimState(t=t, cluster=cluster, active=active)
            allocs = policy.schedule(t, state)
            self._check(t, active, allocs)
            # the decision holds for k slots: until the policy may change it, the next arrival, or the
            # first completion (constraints only depend on t through a_j + Delta_js, which stays satisfied)
            k = max(1, policy.stable_until(t, state) - t + 1)
            if nxt < len(pending):
                k = min(k, pending[nxt].arrival - t)
            per_slot, k = _work_per_slot(allocs, active, k)
            if self.executor is not None:  # execution for real: check and count what really ran, not the plan
                really, allocs = self.executor.execute(t, k, {j: allocs[j] for j in per_slot}, per_slot, active)
                self._check(t, active, allocs)
                per_slot = {jid: really[jid] / k for jid in per_slot}
            executed: dict[int, float] = {}
            for jid in running - per_slot.keys():
                st = active[jid]
                st.preemptions += 1  # it ran last slot, is unfinished, and runs nothing now
                st.last = None
            running = set(per_slot)
            finished = []
            for jid, per in per_slot.items():
                st = active[jid]
                alloc = allocs[jid]
                work = min(k * per, st.remaining)
                st.remaining -= work
                executed[jid] = work
                st.attained += alloc.total_workers * k
                if st.started is None:
                    st.started = t
                if st.last is not alloc:
                    st.servers_used.update(alloc.workers)
                    edge = sum(n for s, n in alloc.workers.items() if not cluster.servers[s].cloud)
                    self._edge_of[jid] = edge
                    if st.last is not None and alloc.total_workers < st.last.total_workers:
                        st.preemptions += 1
                    st.last = alloc
                edge_busy += k * self._edge_of[jid]
                if st.remaining <= EPS * max(1.0, st.job.total_work):
                    finished.append(jid)
            policy.observe(t, executed)
            for jid in finished:
                st = active.pop(jid)
                running.discard(jid)
                self._forget(jid)
                assert st.started is not None
                done.append(JobResult(id=jid, arrival=st.job.arrival, start=st.started, completion=t + k,
                                      preemptions=st.preemptions,
                                      cloud=any(cluster.servers[s].cloud for s in st.servers_used)))
                policy.on_complete(t + k, st.job)
            if tick is not None and finished:
                tick(len(finished))
            t += k
            slots += k
            if slots > self.max_slots:
                raise SimulationError(f"policy {policy.name}: {len(active)} jobs still unfinished after "
                                      f"{self.max_slots} slots (starvation?)")
        done.sort(key=lambda r: r.id)
        return SimResult(policy=policy.name, jobs=done, edge_busy=edge_busy,
                         edge_capacity=cluster.edge_worker_capacity(), slots=slots)

    def _forget(self, jid: int) -> None:
        """Drop a job's allocation from the usage totals (it stopped or completed)."""
        old = self._snap.pop(jid, None)
        if old is not None:
            for s, c in old[0].items():
                self._used_w[s] -= c
            self._used_p[old[1]] -= 1

    def _check(self, t: int, active: dict[int, JobState], allocs: dict[int, Allocation]) -> None:
        """Every constraint of (2a)-(2l) (She) / (2a)-(2k) (Wang) that one slot's decision can break.

        Allocations equal to the previous step's were checked then and stay valid (the only time-dependent
        constraint, t >= a_j + Delta_js, cannot become false later), so only changed ones are re-checked;
        server totals are kept up to date incrementally and checked where they changed.
        """
        cluster, policy = self.cluster, self.policy
        servers = cluster.servers
        live: dict[int, Allocation] = {}
        for jid, alloc in allocs.items():
            if jid not in active:
                raise SimulationError(f"slot {t}: {policy.name} allocated job {jid}, which is not active")
            if alloc.total_workers > 0:
                live[jid] = alloc
        touched_w: set[int] = set()
        touched_p: set[int] = set()
        for jid in [j for j in self._snap if j not in live]:
            if policy.fixed_allocation:
                raise SimulationError(f"slot {t}: {policy.name} paused job {jid} after its start (2c)")
            self._forget(jid)
        for jid, alloc in live.items():
            old = self._snap.get(jid)
            if old is not None and old[1] == alloc.ps and old[2] == alloc.work and old[0] == alloc.workers:
                continue
            job = active[jid].job
            n = alloc.total_workers
            if policy.fixed_allocation and old is not None:
                raise SimulationError(f"slot {t}: {policy.name} changed or paused job {jid}'s allocation "
                                      "after its start (2c)-(2d)")
            if any(c < 0 for c in alloc.workers.values()):
                raise SimulationError(f"slot {t}: job {jid} has a negative worker count")
            if n > job.chunks:
                raise SimulationError(f"slot {t}: job {jid} runs {n} workers > D_j = {job.chunks} (2a)")
            if not 0 <= alloc.ps < len(servers):
                raise SimulationError(f"slot {t}: job {jid} has no valid PS server ({alloc.ps}) (2b)")
            ps = servers[alloc.ps]
            if not ps.serves_ps(job) or ps.ps_slots == 0:
                raise SimulationError(f"slot {t}: job {jid}'s PS on {ps.name} has no PS slot of its type")
            if t < cluster.ready(job, ps):
                raise SimulationError(f"slot {t}: job {jid}'s PS on {ps.name} before a_j + Delta_js (2i)")
            for s, c in alloc.workers.items():
                if c == 0:
                    continue
                srv = servers[s]
                if not srv.serves_worker(job):
                    raise SimulationError(f"slot {t}: job {jid} on {srv.name}: worker type mismatch")
                if t < cluster.ready(job, srv):
                    raise SimulationError(f"slot {t}: job {jid} on {srv.name} before a_j + Delta_js = "
                                          f"{cluster.ready(job, srv)} (2i)")
            if alloc.work is not None and alloc.work > n * job.rate(alloc.colocated()) * (1 + 1e-9) + EPS:
                raise SimulationError(f"slot {t}: job {jid} claims more work than its workers can do")
            if policy.no_migration and not set(alloc.workers) <= policy.dispatched_servers(jid):
                raise SimulationError(f"slot {t}: job {jid} runs on a server its data was never sent to")
            self._forget(jid)
            workers = {s: c for s, c in alloc.workers.items() if c}
            for s, c in workers.items():
                self._used_w[s] = self._used_w.get(s, 0) + c
                touched_w.add(s)
            self._used_p[alloc.ps] = self._used_p.get(alloc.ps, 0) + 1
            touched_p.add(alloc.ps)
            self._snap[jid] = (workers, alloc.ps, alloc.work)
        for s in touched_w:
            if self._used_w[s] > servers[s].worker_slots:
                raise SimulationError(f"slot {t}: {servers[s].name} runs {self._used_w[s]} workers > W_s = "
                                      f"{servers[s].worker_slots} (2g)")
        for s in touched_p:
            if self._used_p[s] > servers[s].ps_slots:
                raise SimulationError(f"slot {t}: {servers[s].name} hosts {self._used_p[s]} PSs > P_s = "
                                      f"{servers[s].ps_slots} (2h)")


def simulate(cluster: SimCluster, jobs: Sequence[Job], policy: Policy, **kw: object) -> SimResult:
    """Run one policy; a convenience wrapper around ``Simulator``."""
    return Simulator(cluster, jobs, policy, **kw).run()  # type: ignore[arg-type]


__all__ = ["Allocation", "JobResult", "JobState", "SimResult", "SimState", "SimulationError", "Simulator",
           "simulate"]
