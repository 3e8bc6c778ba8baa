"""Carry a schedule out on Ray, step by step, as the simulator's loop decides it.

The simulator keeps admission, the policy and the constraint checks; this executor is its *execution* part
(``Simulator(..., executor=RayExecutor(...))``). For each step (``k`` slots of one unchanged decision) it:

1. parks the jobs the policy stopped (their PS checkpoints to the shared directory, then every actor of the
   job is killed, freeing its Ray resources) and moves a PS whose server changed the same way;
2. starts what is missing: a ``ParameterServer`` actor holding one unit of ``deepco_ps:<server>`` and, per
   server with n of the job's workers, a ``WorkerGroup`` actor holding n units of ``deepco_worker:<server>``;
   a PS started for a job that has a checkpoint resumes from it;
3. gives each PS its quota, the mini-batches the model says the step is worth (``k`` slots at the policy's
   rate, scaled to the job's real steps), paced over ``k * slot_seconds`` of wall clock, and lets the workers
   train until the quota is done: a step whose work is late (actor start-up, a restore, a fault, a busy CPU)
   runs on past its deadline, stretching wall-clock time rather than the schedule, so every decision the
   policy made stays feasible (a fixed-allocation plan such as online-batch's reserves the slots after a
   job's planned end for other jobs);
4. reports back what really happened: the step's work, once the PSs applied it, and the placement Ray really
   granted (the actors' own assigned resources), which the simulator checks against the model's
   constraints.

A worker process that dies is replaced on the same server and the job goes on; a PS process that dies is
replaced from the job's last checkpoint, so only the work since it is lost.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepco.errors import UserError
from deepco.scheduling.execution import training
from deepco.scheduling.execution.actors import ParameterServer, WorkerGroup
from deepco.scheduling.jobs import Job
from deepco.scheduling.simulator import Allocation, JobState, SimResult
from deepco.scheduling.topology import SimCluster

CLOUD_SLOTS = 10_000  # the cloud's worker and PS resources on Ray (unbounded in the model)
MAX_FAILURES = 10  # per job: beyond this the run stops with the last error instead of looping


class ExecutionError(RuntimeError):
    """The executed run could not go on (a job failing again and again, an actor never starting)."""


def worker_resource(server: str) -> str:
    """The Ray custom resource of one server's worker slots."""
    return f"deepco_worker:{server}"


def ps_resource(server: str) -> str:
    """The Ray custom resource of one server's PS slots."""
    return f"deepco_ps:{server}"


def ray_resources(cluster: SimCluster) -> dict[str, float]:
    """Every server's worker and PS slots as Ray custom resources (the cloud gets ``CLOUD_SLOTS`` of each)."""
    out: dict[str, float] = {}
    for s in cluster.servers:
        w, p = (CLOUD_SLOTS, CLOUD_SLOTS) if s.cloud else (s.worker_slots, s.ps_slots)
        if w > 0:
            out[worker_resource(s.name)] = float(w)
        if p > 0:
            out[ps_resource(s.name)] = float(p)
    return out


def import_ray() -> Any:
    """The ``ray`` module, or a one-line UserError saying how to get it."""
    try:
        import ray
    except ImportError:
        raise UserError("--execute ray needs Ray, which is not installed: pip install 'deepco[ray]'") from None
    return ray


def connect(cluster: SimCluster, address: str | None) -> bool:
    """Join the Ray cluster at ``address``, or start an embedded local one with the cluster's resources.

    Reuses a Ray already initialised in this process. Returns whether this call initialised Ray (the caller
    then shuts it down). A cluster lacking a server's resources is a UserError naming the first one.
    """
    ray = import_ray()
    need = ray_resources(cluster)
    started = False
    if not ray.is_initialized():
        quiet = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.ERROR}
        try:
            if address:
                ray.init(address=address, **quiet)
            else:
                ray.init(resources=need, object_store_memory=128 * 1024**2, **quiet)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            where = f"at {address}" if address else "locally"
            raise UserError(f"cannot start or reach a Ray cluster {where}: {exc}") from None
        started = True
    have = ray.cluster_resources()
    # the cloud is unbounded in the model: any amount of its resources will do on a real cluster
    missing = [(name, n) for name, n in need.items() if have.get(name, 0.0) < (1.0 if n == CLOUD_SLOTS else n)]
    if missing:
        if started:
            ray.shutdown()
        name, n = missing[0]
        raise UserError(f"the Ray cluster lacks resource {name!r} ({n:g} needed): start the node with "
                        f"`ray start --resources '{{\"{name}\": {n:g}, ...}}'`")
    return started


@dataclass
class ExecJob:
    """The executor's record of one job."""

    job: Job
    target: int  # real SGD steps the job's E*D*M mini-batches stand for
    arrival: float  # wall clock when its arrival slot began
    steps: int = 0  # steps applied so far (as of the last step boundary)
    ps: Any = None
    ps_server: int | None = None
    incarnation: int = 0  # PS processes started so far (a replaced PS makes older worker runs stale)
    groups: dict[int, tuple[int, Any]] = field(default_factory=dict)  # server -> (workers, actor)
    placed: dict[int, int] = field(default_factory=dict)  # server -> workers as Ray granted them
    ps_placed: int | None = None
    pids: dict[str, int] = field(default_factory=dict)  # "ps" or a server's name -> process id
    finish: float | None = None
    loss_start: float | None = None
    loss_end: float | None = None
    accuracy_end: float | None = None
    checkpoints: int = 0
    failures: int = 0
    resumed_from: list[int] = field(default_factory=list)  # checkpointed step counts a new PS restored
    ps_servers: list[str] = field(default_factory=list)
    worker_servers: set[str] = field(default_factory=set)
    spans: list[tuple[str, str, float, float]] = field(default_factory=list)  # (server, role, start, end)


class RayExecutor:
    """The execution part of the simulator's loop, on a connected Ray cluster (see the module docstring)."""

    def __init__(self, cluster: SimCluster, *, slot_seconds: float, steps_per_job: int = 200, lr: float = 0.1,
                 checkpoint_dir: str | Path, seed: int = 0, grace: float = 60.0, progress: Any = None):
        self.ray = import_ray()
        self.cluster, self.slot_seconds, self.steps_per_job = cluster, slot_seconds, steps_per_job
        self.lr, self.seed, self.grace, self.progress = lr, seed, grace, progress
        self.dir = Path(checkpoint_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ps_cls = self.ray.remote(ParameterServer)
        self.group_cls = self.ray.remote(WorkerGroup)
        self.jobs: dict[int, ExecJob] = {}
        self.origin: float | None = None
        self.index = {s.name: s.index for s in cluster.servers}
        self.data = self.ray.put(training.digits())  # once, shared by every actor
        self.timing = {"place": 0.0, "train": 0.0, "book": 0.0}  # wall seconds per phase (overheads)

    # ---- the hook the simulator calls -------------------------------------------------------------------
    def execute(self, t: int, k: int, allocs: dict[int, Allocation], per_slot: dict[int, float],
                active: dict[int, JobState]) -> tuple[dict[int, float], dict[int, Allocation]]:
        """Run slots [t, t + k) for real; returns the mini-batches (model units) each running job trained and
        the allocation Ray really granted it."""
        now = time.time()
        if self.origin is None:
            self.origin = now
        for jid, st in active.items():
            if jid not in self.jobs:
                target = max(1, min(self.steps_per_job, math.ceil(st.job.total_work)))
                self.jobs[jid] = ExecJob(job=st.job, target=target, arrival=now)
        if self.progress is not None:
            self.progress.set_postfix_str(f"slot {t}")
        deadline = now + k * self.slot_seconds
        running = {jid: allocs[jid] for jid in per_slot}
        self._park([ej for jid, ej in self.jobs.items() if ej.ps is not None and jid not in running])
        self._place(running)
        placed = time.time()
        self.timing["place"] += placed - now
        begin = {jid: self.jobs[jid].steps for jid in running}
        quotas: dict[int, int] = {}
        for jid in running:
            ej, total = self.jobs[jid], self.jobs[jid].job.total_work
            # real steps track the model's cumulative progress, so the job ends in the step the model says
            after = max(0.0, active[jid].remaining - per_slot[jid] * k)
            goal = ej.target if after <= 1e-9 * total else round(ej.target * (1.0 - after / total))
            quotas[jid] = max(0, goal - ej.steps)
        self._on_each_ps([self.jobs[j] for j in quotas], "begin_step", lambda ej: (quotas[ej.job.id], deadline))
        pending: dict[Any, tuple[int, int, int]] = {}
        for jid, q in quotas.items():
            if q > 0:
                for s in self.jobs[jid].groups:
                    self._launch(jid, s, pending)
        self._wait(t, pending, quotas, begin, deadline)
        self._top_up(t, quotas, begin, deadline)
        trained = time.time()
        self.timing["train"] += trained - placed
        done: dict[int, float] = {}
        actual: dict[int, Allocation] = {}
        status = self._on_each_ps([self.jobs[j] for j in running], "status")
        ends = time.time()
        finished, boundary = [], []
        for (jid, alloc), st in zip(running.items(), status, strict=True):
            ej = self.jobs[jid]
            ej.steps = int(st["steps"])
            if ej.steps - begin[jid] < quotas[jid]:
                raise ExecutionError(f"slot {t}: job {jid} trained {ej.steps - begin[jid]} of its {quotas[jid]} steps")
            done[jid] = per_slot[jid] * k  # the step's work, done for real (the simulator caps it at what is left)
            actual[jid] = Allocation(workers=dict(ej.placed), ps=ej.ps_placed, work=alloc.work)  # type: ignore[arg-type]
            for s, n in ej.placed.items():
                ej.spans.append((self.cluster.servers[s].name, f"{n} worker{'s' * (n > 1)}", now, ends))
            ej.spans.append((self.cluster.servers[ej.ps_placed].name, "PS", now, ends))  # type: ignore[index]
            if ej.steps >= ej.target:
                ej.finish = float(st["last_update"] or ends)
                finished.append(ej)
            else:
                boundary.append(ej)
        self._finish(finished)
        if boundary:  # every running job starts its next step from a checkpoint
            counts = self._on_each_ps(boundary, "checkpoint")
            for ej, c in zip(boundary, counts, strict=True):
                ej.checkpoints = c
        self.timing["book"] += time.time() - trained
        left = deadline - time.time()
        if left > 0:
            time.sleep(left)  # slot time is wall time, also when nothing (or little) ran
        return done, actual

    # ---- placement ----------------------------------------------------------------------------------------
    def _park(self, jobs: list[ExecJob]) -> None:
        """Checkpoint and stop whole jobs (preempted), freeing their Ray resources."""
        if not jobs:
            return
        counts = self._on_each_ps(jobs, "checkpoint")
        for ej, c in zip(jobs, counts, strict=True):
            ej.checkpoints = c
            self._kill_all(ej)

    def _kill_all(self, ej: ExecJob) -> None:
        for _, handle in ej.groups.values():
            self.ray.kill(handle)
        ej.groups.clear()
        ej.placed.clear()
        ej.pids.clear()
        if ej.ps is not None:
            self.ray.kill(ej.ps)
        ej.ps = ej.ps_server = ej.ps_placed = None

    def _place(self, running: dict[int, Allocation]) -> None:
        """Start, move or resize the actors of every running job to match its allocation."""
        movers = [self.jobs[j] for j, a in running.items()
                  if self.jobs[j].ps is not None and self.jobs[j].ps_server != a.ps]
        if movers:  # a PS moving to another server goes through the checkpoint
            counts = self._on_each_ps(movers, "checkpoint")
            for ej, c in zip(movers, counts, strict=True):
                ej.checkpoints = c
                self.ray.kill(ej.ps)
                ej.ps = None
        infos: list[tuple[ExecJob, int | None, Any]] = []  # (job, server of a worker group or None: PS, ref)
        for jid, alloc in running.items():
            ej = self.jobs[jid]
            if ej.ps is None:
                self._start_ps(ej, alloc.ps)
                infos.append((ej, None, ej.ps.info.remote()))
            want = {s: n for s, n in alloc.workers.items() if n > 0}
            for s, (n, handle) in list(ej.groups.items()):
                if want.get(s) != n:
                    self.ray.kill(handle)
                    del ej.groups[s]
                    ej.placed.pop(s, None)
            for s, n in want.items():
                if s not in ej.groups:
                    self._start_group(ej, s, n)
                    infos.append((ej, s, ej.groups[s][1].info.remote()))
        for ej, s, info in zip([i[0] for i in infos], [i[1] for i in infos],
                               self.ray.get([i[2] for i in infos]), strict=True):
            self._record(ej, s, info)
        fresh = [ej for ej in {id(i[0]): i[0] for i in infos}.values() if ej.loss_start is None]
        for ej, (loss, _) in zip(fresh, self._on_each_ps(fresh, "evaluate"), strict=True):
            ej.loss_start = loss

    def _start_ps(self, ej: ExecJob, server: int) -> None:
        name = self.cluster.servers[server].name
        ej.ps = self.ps_cls.options(num_cpus=0, max_restarts=0, resources={ps_resource(name): 1}).remote(
            ej.job.id, self.seed * 1000 + ej.job.id, self.lr, str(self.dir / f"job-{ej.job.id}.npz"),
            self.slot_seconds, self.data)
        ej.ps_server = server
        ej.incarnation += 1
        if not ej.ps_servers or ej.ps_servers[-1] != name:
            ej.ps_servers.append(name)

    def _start_group(self, ej: ExecJob, server: int, count: int) -> None:
        name = self.cluster.servers[server].name
        handle = self.group_cls.options(num_cpus=0, max_restarts=0,
                                        resources={worker_resource(name): count}).remote(
            ej.job.id, name, count, self.seed, self.data)
        ej.groups[server] = (count, handle)
        ej.worker_servers.add(name)

    def _record(self, ej: ExecJob, server: int | None, info: dict[str, Any]) -> None:
        """Where Ray really put an actor: from the resources it holds, not from what was asked."""
        ej.pids["ps" if server is None else self.cluster.servers[server].name] = int(info["pid"])
        for res, amount in info["resources"].items():
            kind, _, name = res.partition(":")
            if kind == "deepco_ps" and server is None:
                ej.ps_placed = self.index[name]
                if info["restored_from"] is not None:
                    ej.resumed_from.append(int(info["restored_from"]))
            elif kind == "deepco_worker" and server is not None:
                ej.placed[self.index[name]] = round(amount)

    # ---- running a step and its faults ---------------------------------------------------------------------
    def _launch(self, jid: int, server: int, pending: dict[Any, tuple[int, int, int]]) -> None:
        ej = self.jobs[jid]
        ref = ej.groups[server][1].run.remote(ej.ps)
        pending[ref] = (jid, server, ej.incarnation)

    def _wait(self, t: int, pending: dict[Any, tuple[int, int, int]], quotas: dict[int, int],
              begin: dict[int, int], deadline: float) -> None:
        """Until every worker group is told to stop; replace what dies on the way."""
        ray = self.ray
        while pending:
            left = deadline + self.grace - time.time()
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, left))
            if not ready:
                jobs = sorted({p[0] for p in pending.values()})
                raise ExecutionError(f"slot {t}: the workers of job(s) {jobs} did not stop {self.grace:g} s after "
                                     "the step's end (an actor that cannot be placed?)")
            for ref in ready:
                jid, server, inc = pending.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as exc:
                    self._recover(jid, server, inc, exc, quotas[jid], begin[jid], deadline, pending)

    def _top_up(self, t: int, quotas: dict[int, int], begin: dict[int, int], deadline: float) -> None:
        """A worker killed between taking a mini-batch and pushing its gradient leaves its job a step short
        though every ticket was issued: issue what is missing again, a bounded number of times."""
        for _ in range(MAX_FAILURES):
            jobs = [self.jobs[j] for j in quotas]
            status = self._on_each_ps(jobs, "status")
            short = {ej.job.id: quotas[ej.job.id] - (int(st["steps"]) - begin[ej.job.id])
                     for ej, st in zip(jobs, status, strict=True)}
            short = {jid: q for jid, q in short.items() if q > 0}
            if not short:
                return
            self._on_each_ps([self.jobs[j] for j in short], "begin_step",
                             lambda ej, short=short: (short[ej.job.id], time.time()))
            pending: dict[Any, tuple[int, int, int]] = {}
            for jid in short:
                for s in self.jobs[jid].groups:
                    self._launch(jid, s, pending)
            self._wait(t, pending, quotas, begin, max(deadline, time.time()))

    def _alive(self, handle: Any) -> bool:
        ray = self.ray
        try:
            ray.get(handle.info.remote(), timeout=30)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            return False
        return True

    def _recover(self, jid: int, server: int, inc: int, exc: Exception, quota: int, begin: int, deadline: float,
                 pending: dict[Any, tuple[int, int, int]]) -> None:
        """A worker group's run failed: replace the PS from its checkpoint if it died, else the group."""
        ej = self.jobs[jid]
        if inc != ej.incarnation:
            return  # the run was against a PS already replaced; the group was relaunched with the new one
        ej.failures += 1
        if ej.failures > MAX_FAILURES:
            raise ExecutionError(f"job {jid}: {ej.failures} failures; the last: {exc}")
        if not self._alive(ej.ps):
            restored = self._revive_ps(ej)
            self.ray.get(ej.ps.begin_step.remote(max(0, quota - (restored - begin)), deadline))
            for s in ej.groups:
                if s != server:
                    self._launch(jid, s, pending)
        if not self._alive(ej.groups[server][1]):
            count = ej.groups[server][0]
            self.ray.kill(ej.groups[server][1])
            self._start_group(ej, server, count)
            self._record(ej, server, self.ray.get(ej.groups[server][1].info.remote()))
        self._launch(jid, server, pending)

    def _revive_ps(self, ej: ExecJob) -> int:
        """A new PS on the same server from the job's last checkpoint; returns the steps it restored."""
        self.ray.kill(ej.ps)
        self._start_ps(ej, ej.ps_server)  # type: ignore[arg-type]
        info = self.ray.get(ej.ps.info.remote())
        self._record(ej, None, info)
        return int(info["steps"])

    def _on_each_ps(self, jobs: list[ExecJob], method: str, args: Any = None) -> list[Any]:
        """Call ``method`` on each job's PS at once; a PS found dead is revived from its checkpoint (a failure
        of the job) and asked again."""
        ray = self.ray
        refs = [getattr(ej.ps, method).remote(*(args(ej) if args else ())) for ej in jobs]
        out = []
        for ej, ref in zip(jobs, refs, strict=True):
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                ej.failures += 1
                if ej.failures > MAX_FAILURES:
                    raise ExecutionError(f"job {ej.job.id}: {ej.failures} failures; its PS keeps dying") from None
                self._revive_ps(ej)
                out.append(ray.get(getattr(ej.ps, method).remote(*(args(ej) if args else ()))))
        return out

    def _finish(self, jobs: list[ExecJob]) -> None:
        """Completed jobs: final loss on the held-out digits, a last checkpoint, and their actors stopped."""
        if not jobs:
            return
        evals = self._on_each_ps(jobs, "evaluate")
        counts = self._on_each_ps(jobs, "checkpoint")
        for ej, (loss, acc), c in zip(jobs, evals, counts, strict=True):
            ej.loss_end, ej.accuracy_end, ej.checkpoints = loss, acc, c
            self._kill_all(ej)

    def close(self) -> None:
        """Stop every actor still alive (a run cut short)."""
        for ej in self.jobs.values():
            if ej.ps is not None or ej.groups:
                self._kill_all(ej)

    # ---- what happened ---------------------------------------------------------------------------------------
    def pids(self, job_id: int) -> dict[str, int]:
        """The processes of a job's current actors: "ps" and each worker server's name -> pid (for fault
        tests; read from what the actors reported when they started, so it never waits on a busy actor)."""
        return dict(self.jobs[job_id].pids)

    def rows(self, executed: SimResult, simulated: SimResult) -> list[dict[str, Any]]:
        """One JSON row per executed job; JCTs in seconds (wall) and slots (the executed loop, the simulation)."""
        sim = {j.id: j for j in simulated.jobs}
        out = []
        for r in executed.jobs:
            ej = self.jobs[r.id]
            wall = (ej.finish or ej.arrival) - ej.arrival
            out.append({
                "policy": executed.policy, "job": r.id, "arrival": r.arrival,
                "ps_node": ej.ps_servers[-1] if ej.ps_servers else None, "ps_nodes": ej.ps_servers,
                "worker_nodes": sorted(ej.worker_servers), "wall_jct": wall,
                "wall_jct_slots": wall / self.slot_seconds, "exec_jct": r.jct, "sim_jct": sim[r.id].jct,
                "preemptions": r.preemptions, "failures": ej.failures, "resumed_from": ej.resumed_from,
                "steps": ej.steps, "loss_start": ej.loss_start, "loss_end": ej.loss_end,
                "accuracy_end": ej.accuracy_end, "checkpoints": ej.checkpoints})
        return out

    def spans(self) -> list[tuple[int, str, str, float, float]]:
        """(job, server, role, start, end) in seconds since the first step, as executed."""
        origin = self.origin or 0.0
        return [(jid, s, role, a - origin, b - origin) for jid, ej in sorted(self.jobs.items())
                for s, role, a, b in ej.spans]


__all__ = ["CLOUD_SLOTS", "ExecJob", "ExecutionError", "RayExecutor", "connect", "import_ray", "ps_resource",
           "ray_resources", "worker_resource"]
