"""The slot-by-slot engine for Okita's model: admission, the policy's decision, constraint checks, execution.

Each slot t: jobs with a_i = t are admitted; the policy returns a ``SlotDecision`` per job that runs; the
engine checks (2b) (chunks trained at a site <= per_worker x workers there), (2c) (one PS in a valid site),
(2d) (sum of worker and PS demands <= C_r^k at every site) and that no more chunks leave a site than remain
there ((2a)/(3)), and raises ``UdlError`` on the first violation. It then charges eq. (1) and, when a job's
remaining data M_i(t) reaches zero, f_i(t + 1 - a_i).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from deepco.scheduling.okita.model import SlotDecision, UdlInstance, UdlJob

TOL = 1e-9


class UdlError(RuntimeError):
    """A policy broke a constraint of problem (2), or the run could not finish."""


@dataclass
class UdlJobState:
    """The engine's record of one admitted job."""

    job: UdlJob
    remaining: np.ndarray  # M_i^r(t)
    started: int | None = None
    completed: int | None = None
    data_cost: float = 0.0
    param_cost: float = 0.0
    idle_after_start: int = 0  # slots without workers after the first (waits between slots)
    preemptions: int = 0  # slots in which it, started and unfinished, ran fewer workers than the slot before
    last_workers: int = 0  # workers it ran in the previous slot (0: did not run)

    @property
    def left(self) -> int:
        """M_i(t)."""
        return int(self.remaining.sum())


@dataclass
class UdlState:
    """What a policy sees when it decides slot t."""

    t: int
    instance: UdlInstance
    active: dict[int, UdlJobState]


class UdlPolicy(Protocol):
    """A policy for Okita's model."""

    name: str

    def reset(self, instance: UdlInstance) -> None:
        """Called once before the first slot."""

    def schedule(self, t: int, state: UdlState) -> dict[int, SlotDecision]:
        """The decision of every job that runs in slot t."""


@dataclass
class UdlJobResult:
    """Per-job outcome."""

    id: int
    arrival: int
    start: int
    completion: int  # t_i + 1
    latency_cost: float
    data_cost: float
    param_cost: float
    idle: int  # slots without workers between its start and its completion
    preemptions: int = 0  # see UdlJobState.preemptions

    @property
    def latency(self) -> int:
        """t_i + 1 - a_i."""
        return self.completion - self.arrival


@dataclass
class UdlResult:
    """Costs and times of one run; ``to_dict`` has the fields of ``deepco schedule --json`` plus costs."""

    policy: str
    jobs: list[UdlJobResult]
    worker_busy: float = 0.0  # sum over slots and resource kinds of (workers' use / edge capacity), per kind
    slots: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def bandwidth_cost(self) -> float:
        """sum_i B_i (eq. 1)."""
        return sum(j.data_cost + j.param_cost for j in self.jobs)

    @property
    def latency_cost(self) -> float:
        """sum_i f_i(t_i + 1 - a_i)."""
        return sum(j.latency_cost for j in self.jobs)

    @property
    def total_cost(self) -> float:
        """Objective (2)."""
        return self.latency_cost + self.bandwidth_cost

    @property
    def makespan(self) -> int:
        """Last completion minus first start (the paper's definition)."""
        if not self.jobs:
            return 0
        return max(j.completion for j in self.jobs) - min(j.start for j in self.jobs)

    @property
    def utilization(self) -> float:
        """The workers' share of the edge's capacity from the first arrival to the last completion, averaged
        over the resource kinds the sites have (the simulator's ``utilization`` with C_r^k for W_s)."""
        if not self.jobs:
            return 0.0
        window = max(j.completion for j in self.jobs) - min(j.arrival for j in self.jobs)
        kinds = self.extra.get("resource_kinds", 1.0)
        return self.worker_busy / (kinds * window) if window else 0.0

    def to_dict(self) -> dict[str, object]:
        """The JSON row: the other policies' fields (JCT = latency in slots) plus the costs. ``cloud_jobs`` is
        null: Okita's sites are the cluster's edge sites, its model has no cloud."""
        n = len(self.jobs)
        total_jct = float(sum(j.latency for j in self.jobs))
        return {"policy": self.policy, "jobs": n, "avg_jct": total_jct / n if n else 0.0, "total_jct": total_jct,
                "makespan": self.makespan, "preemptions": sum(j.preemptions for j in self.jobs),
                "utilization": self.utilization, "cloud_jobs": None,
                "total_cost": self.total_cost, "bandwidth_cost": self.bandwidth_cost,
                "latency_cost": self.latency_cost,
                "data_cost": sum(j.data_cost for j in self.jobs),
                "param_cost": sum(j.param_cost for j in self.jobs)}


def run_udl(instance: UdlInstance, policy: UdlPolicy, *, max_slots: int = 100_000) -> UdlResult:
    """Drive ``policy`` over ``instance`` until every job completes, checking every slot."""
    instance.check()
    policy.reset(instance)
    pending = sorted(instance.jobs, key=lambda j: (j.arrival, j.id))
    nxt, active, done = 0, {}, []
    cap = instance.capacity
    t = pending[0].arrival if pending else 0
    busy = 0.0
    slots = 0
    total = cap.sum(axis=0)
    kinds = total > 0  # resource kinds the edge has
    while nxt < len(pending) or active:
        while nxt < len(pending) and pending[nxt].arrival <= t:
            j = pending[nxt]
            active[j.id] = UdlJobState(job=j, remaining=j.data.astype(np.int64).copy())
            nxt += 1
        decisions = policy.schedule(t, UdlState(t=t, instance=instance, active=active))
        used = np.zeros_like(cap, dtype=float)
        for jid, dec in decisions.items():
            st = active.get(jid)
            if st is None:
                raise UdlError(f"slot {t}: {policy.name} scheduled job {jid}, which is not active")
            _check(t, policy.name, st, dec, instance)
            used += np.outer(dec.y, st.job.worker_demand)
            used[dec.ps] += st.job.ps_demand
        over = used > cap + TOL
        if over.any():
            r, k = map(int, np.argwhere(over)[0])
            raise UdlError(f"slot {t}: {policy.name} uses {used[r, k]:g} of resource {k} at site {r} > "
                           f"C = {cap[r, k]:g} (2d)")
        worker_use = np.zeros(cap.shape[1])
        for jid, dec in decisions.items():
            worker_use += float(dec.y.sum()) * active[jid].job.worker_demand
        busy += float((worker_use[kinds] / total[kinds]).sum())
        for jid, st in list(active.items()):
            dec = decisions.get(jid)
            workers = int(dec.y.sum()) if dec is not None else 0
            if st.started is not None and workers < st.last_workers:
                st.preemptions += 1
            st.last_workers = workers
            if dec is None:
                if st.started is not None:
                    st.idle_after_start += 1
                continue
            if st.started is None:
                st.started = t
            dcost, pcost = dec.bandwidth_cost(st.job, instance.q)
            st.data_cost += dcost
            st.param_cost += pcost
            st.remaining -= dec.g.sum(axis=1)
            if st.left == 0:
                st.completed = t + 1
                lat = st.completed - st.job.arrival
                done.append(UdlJobResult(id=jid, arrival=st.job.arrival, start=st.started, completion=t + 1,
                                         latency_cost=st.job.cost(lat), data_cost=st.data_cost,
                                         param_cost=st.param_cost, idle=st.idle_after_start,
                                         preemptions=st.preemptions))
                del active[jid]
        t += 1
        slots += 1
        if not active and nxt < len(pending):
            t = max(t, pending[nxt].arrival)
        if slots > max_slots:
            raise UdlError(f"{policy.name}: {len(active)} jobs unfinished after {max_slots} slots (starvation?)")
    done.sort(key=lambda r: r.id)
    return UdlResult(policy=policy.name, jobs=done, worker_busy=busy, slots=slots,
                     extra={"resource_kinds": float(kinds.sum())})


def _check(t: int, name: str, st: UdlJobState, dec: SlotDecision, inst: UdlInstance) -> None:
    """(2b), (2c) and (3) for one job's slot."""
    job, r = st.job, inst.sites
    if dec.y.shape != (r,) or dec.g.shape != (r, r):
        raise UdlError(f"slot {t}: {name}: job {job.id}'s decision has the wrong shape")
    if (dec.y < 0).any() or (dec.g < 0).any() or dec.y.sum() < 1:
        raise UdlError(f"slot {t}: {name}: job {job.id} needs >= 1 worker and non-negative counts")
    if not 0 <= dec.ps < r:
        raise UdlError(f"slot {t}: {name}: job {job.id} has no valid PS site ({dec.ps}) (2c)")
    trained = dec.g.sum(axis=0)
    if (trained > job.per_worker * dec.y).any():
        s = int(np.argmax(trained - job.per_worker * dec.y))
        raise UdlError(f"slot {t}: {name}: job {job.id} trains {trained[s]} chunks at site {s} with "
                       f"{dec.y[s]} workers x {job.per_worker} (2b)")
    if (dec.g.sum(axis=1) > st.remaining).any():
        raise UdlError(f"slot {t}: {name}: job {job.id} moves more chunks out of a site than remain there (3)")
