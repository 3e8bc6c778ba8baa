"""Job-level baselines of the two papers: FIFO, DRF, SRTF, Tiresias-L (2D-LAS) and BatchSche.

They share one rule the papers leave open: a job runs its ``demand`` workers (the gang the owner asks for,
from the trace's GPU count) on the edge if they fit now, and is sent to the cloud, where it then stays until
it completes (the cloud is never preempted, Wang et al. Sec. III-A), once its data could be there
(a_j + Delta_j,cloud), the edge still has no room and, for a finite cloud (She et al.), the cloud has room.
Placement prefers one server (xi = 1, best fit), then spreads the gang over the servers with most free slots.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence

from deepco.scheduling.jobs import Job
from deepco.scheduling.policies.base import Policy
from deepco.scheduling.policies.placement import NEVER, FreeSlots, next_ready
from deepco.scheduling.simulator import Allocation, SimState
from deepco.scheduling.topology import SimCluster

GANGS = ("demand", "chunks")


class _Gang(Policy):
    """A job-level baseline whose gang is the job's ``demand`` (the trace's GPUs, default) or all its D_j
    chunks (``gang="chunks"``: as wide as the elastic policies may go, for a like-for-like comparison)."""

    def __init__(self, gang: str = "demand"):
        if gang not in GANGS:
            raise ValueError(f"gang must be one of {', '.join(GANGS)}, got {gang!r}")
        self.gang = gang

    def width(self, job: Job) -> int:
        """Workers this baseline gives ``job``."""
        return job.demand if self.gang == "demand" else job.chunks


class Fifo(_Gang):
    """FIFO (She et al. [26]): arrival order, non-preemptive; a job that cannot start blocks the rest."""

    name = "fifo"
    fixed_allocation = True

    def plan(self, cluster: SimCluster, jobs: Sequence[Job]) -> None:
        self.cluster = cluster
        self.queue: deque[Job] = deque()
        self.running: dict[int, Allocation] = {}

    def on_arrival(self, t: int, jobs: list[Job]) -> None:
        self.queue.extend(jobs)

    def on_complete(self, t: int, job: Job) -> None:
        self.running.pop(job.id, None)

    def schedule(self, t: int, state: SimState) -> dict[int, Allocation]:
        free = FreeSlots(self.cluster)
        for a in self.running.values():
            free.take(a)
        while self.queue:
            job = self.queue[0]
            alloc = free.place_edge(job, self.width(job), t) or free.place_cloud(job, self.width(job), t)
            if alloc is None:
                break  # head-of-line blocking is what FIFO is
            self.running[job.id] = alloc
            free.take(alloc)
            self.queue.popleft()
        return dict(self.running)

    def stable_until(self, t: int, state: SimState) -> int:
        # only the blocked head matters; it can start when a completion frees slots or its data reaches a site
        return next_ready(self.queue[0], self.cluster, t) - 1 if self.queue else NEVER


class Drf(_Gang):
    """DRF (YARN/Mesos default, She et al. [7]): progressive filling on dominant shares of worker/PS slots.

    Each slot, free edge slots go one worker at a time to the active job with the lowest dominant share
    max(workers / W_edge, PSs / P_edge), up to its demand; granted workers are never taken back (YARN does
    not preempt by default), so running jobs only grow.
    """

    name = "drf"

    def plan(self, cluster: SimCluster, jobs: Sequence[Job]) -> None:
        self.cluster = cluster
        self.alloc: dict[int, Allocation] = {}
        self.cloud: set[int] = set()
        edge = cluster.edge
        self.w_total = max(1, sum(s.worker_slots for s in edge))
        self.p_total = max(1, sum(s.ps_slots for s in edge))

    def on_complete(self, t: int, job: Job) -> None:
        self.alloc.pop(job.id, None)

    def _share(self, workers: int, ps: int) -> float:
        return max(workers / self.w_total, ps / self.p_total)

    def schedule(self, t: int, state: SimState) -> dict[int, Allocation]:
        free = FreeSlots(self.cluster)
        for a in self.alloc.values():
            free.take(a)
        heap = []
        for jid, st in state.active.items():
            if jid in self.cloud:
                continue
            a = self.alloc.get(jid)
            n = a.total_workers if a else 0
            if n < self.width(st.job):
                heap.append((self._share(n, 1 if a else 0), st.job.arrival, jid))
        heapq.heapify(heap)
        while heap:
            _, _, jid = heapq.heappop(heap)
            job = state.active[jid].job
            a = self.alloc.get(jid)
            if a is None:
                grown = free.place_edge(job, 1, t)
                if grown is None:
                    continue
                free.take(grown)
            else:
                # grow by one worker: on the PS's server first (keeps xi = 1 when it can), else anywhere
                cands = [s for s in free.edge_servers(job, t) if free.workers[s.index] > 0]
                if not cands:
                    continue
                s = min(cands, key=lambda s: (s.index != a.ps, -free.workers[s.index], s.index))
                workers = dict(a.workers)
                workers[s.index] = workers.get(s.index, 0) + 1
                free.workers[s.index] -= 1
                free.edge_free -= 1
                grown = Allocation(workers=workers, ps=a.ps)
            self.alloc[jid] = grown
            if grown.total_workers < self.width(job):
                heapq.heappush(heap, (self._share(grown.total_workers, 1), job.arrival, jid))
        for jid, st in state.active.items():
            if jid not in self.alloc and jid not in self.cloud:
                c = free.place_cloud(st.job, self.width(st.job), t)
                if c is not None:
                    free.take(c)
                    self.alloc[jid] = c
                    self.cloud.add(jid)
        return dict(self.alloc)

    def stable_until(self, t: int, state: SimState) -> int:
        # jobs short of their gang can only grow when slots free up (a completion) or their data arrives
        growing = [st.job for jid, st in state.active.items() if jid not in self.cloud
                   and (jid not in self.alloc or self.alloc[jid].total_workers < self.width(st.job))]
        return min((next_ready(j, self.cluster, t) for j in growing), default=NEVER) - 1


class _PriorityPreemptive(_Gang):
    """Job-level preemptive gang scheduling by a priority key (all-or-nothing): each slot, jobs in key order
    keep their previous placement if it still fits, else get a new one (their data may move: the papers'
    SRTF and Tiresias-L migrate); jobs that do not fit are preempted, or go to the cloud once it is ready.

    Two ablations (not the papers' baselines) isolate how ``preemptive`` differs: ``pinned=True`` forbids
    migration: a job keeps the servers and worker counts of its first placement, and waits while they are
    taken. ``cloud_at_arrival=True`` decides edge or cloud once, as A_greedy dispatches, in the first slot
    its data is on the edge (a_j + Delta_j,edge): a job with no edge room then waits for its upload to the
    cloud and runs there; a job that got the edge never moves to the cloud."""

    def __init__(self, gang: str = "demand", pinned: bool = False, cloud_at_arrival: bool = False):
        super().__init__(gang)
        self.pinned = pinned
        self.cloud_at_arrival = cloud_at_arrival

    def plan(self, cluster: SimCluster, jobs: Sequence[Job]) -> None:
        self.cluster = cluster
        self.cloud: dict[int, Allocation] = {}
        self.prev: dict[int, Allocation] = {}
        self.first: dict[int, Allocation] = {}  # pinned: each job's one placement
        self.bound: dict[int, bool] = {}  # cloud_at_arrival: job id -> sent to the cloud

    def _to_cloud(self, free, job: Job, t: int, out: dict) -> None:  # noqa: ANN001 - FreeSlots
        """Place ``job`` on the cloud if it has room; remembered as on the cloud."""
        c = free.place_cloud(job, self.width(job), t)
        if c is not None:
            free.take(c)
            self.cloud[job.id] = c
            out[job.id] = c

    def key(self, st, t: int) -> tuple:  # noqa: ANN001 - JobState
        raise NotImplementedError

    def on_complete(self, t: int, job: Job) -> None:
        self.cloud.pop(job.id, None)
        self.prev.pop(job.id, None)
        self.first.pop(job.id, None)
        self.bound.pop(job.id, None)

    def schedule(self, t: int, state: SimState) -> dict[int, Allocation]:
        free = FreeSlots(self.cluster)
        out: dict[int, Allocation] = dict(self.cloud)
        for a in self.cloud.values():
            free.take(a)
        order = sorted((st for jid, st in state.active.items() if jid not in self.cloud),
                       key=lambda st: self.key(st, t))
        for st in order:
            job = st.job
            prev = self.prev.get(job.id)
            pin = self.first.get(job.id) if self.pinned else None
            if self.cloud_at_arrival and self.bound.get(job.id):
                self._to_cloud(free, job, t, out)
                continue
            if pin is not None:
                if not free.fits(pin):
                    self.prev.pop(job.id, None)  # preempted; its data stays where it is
                    continue
                alloc = pin
            elif prev is not None and free.fits(prev):
                alloc = prev
            else:
                alloc = free.place_edge(job, self.width(job), t)
            if self.cloud_at_arrival and job.id not in self.bound and free.edge_servers(job, t):
                self.bound[job.id] = alloc is None and free.cloud_ready(job, NEVER)
                if self.bound[job.id]:
                    continue
            if alloc is None:
                if self.cloud_at_arrival:
                    self.prev.pop(job.id, None)
                    continue  # it took the edge at arrival: it stays there
                self.prev.pop(job.id, None)
                self._to_cloud(free, job, t, out)
                continue
            free.take(alloc)
            self.prev[job.id] = alloc
            if self.pinned:
                self.first.setdefault(job.id, alloc)
            out[job.id] = alloc
        return out

    def stable_until(self, t: int, state: SimState) -> int:
        # running jobs only gain priority as they progress (SRTF), so the order changes only through data
        # arriving at a site, or a Tiresias demotion (``demotion``)
        until = NEVER
        for jid, st in state.active.items():
            if jid in self.cloud:
                continue
            until = min(until, next_ready(st.job, self.cluster, t) - 1)
            if jid in self.prev:
                until = min(until, self.demotion(st, t))
        return until

    def demotion(self, st, t: int) -> int:  # noqa: ANN001 - JobState
        """The last slot before a running job's priority may drop."""
        return NEVER


class Srtf(_PriorityPreemptive):
    """SRTF (Wang et al. [16]): shortest remaining training time (remaining work / gang rate) first.

    ``static=True`` (an ablation) ranks by the whole job's training time instead, fixed at arrival, as
    ``preemptive``'s HAPRF rate gamma = n / (E D B) is."""

    name = "srtf"

    def __init__(self, gang: str = "demand", pinned: bool = False, static: bool = False,
                 cloud_at_arrival: bool = False):
        super().__init__(gang, pinned, cloud_at_arrival)
        self.static = static

    def key(self, st, t: int) -> tuple:  # noqa: ANN001
        job = st.job
        work = job.total_work if self.static else st.remaining
        return (work / (self.width(job) * job.rate(True)), job.arrival, job.id)


class TiresiasL(_PriorityPreemptive):
    """Tiresias-L (Gu et al. NSDI'19; Wang et al. [13]): discretised 2D-LAS, all-or-nothing.

    Priority is the attained service in worker-slots (workers x slots run, the "2D" of 2D-LAS); jobs fall into
    queues at ``thresholds`` and are FIFO inside a queue. Tiresias' starvation guard (promote after waiting
    too long) is left out, as in Wang et al.'s description.
    """

    name = "tiresias-l"

    def __init__(self, thresholds: Sequence[float] = (100.0, 1000.0), gang: str = "demand",
                 pinned: bool = False, cloud_at_arrival: bool = False):
        super().__init__(gang, pinned, cloud_at_arrival)
        self.thresholds = tuple(thresholds)

    def key(self, st, t: int) -> tuple:  # noqa: ANN001
        queue = sum(1 for th in self.thresholds if st.attained >= th)
        return (queue, st.job.arrival, st.job.id)

    def demotion(self, st, t: int) -> int:  # noqa: ANN001
        width = self.prev[st.job.id].total_workers
        above = [th for th in self.thresholds if th > st.attained]
        if not above:
            return NEVER
        # attained after this slot's k slots: st.attained + width * k; demoted once it reaches min(above)
        return t + max(1, math.ceil((min(above) - st.attained) / width)) - 1


class BatchSche(_Gang):
    """BatchSche (Zhang et al. Mobihoc'20, [8]/[11]): every ``interval`` slots the waiting jobs form a batch,
    and each is placed, non-preemptively, at the least resource cost among the options open now.

    Cost = workers x duration x unit price, the duration from eq. (1). Ambiguity: the seeds give no prices;
    we price an edge worker-slot 0.5 * 8^(load) (cheap when idle, 4 when full, a load-dependent price like the
    family's price functions) and a cloud worker-slot 1.0, so BatchSche favours the cloud as soon as the edge
    is loaded -- the behaviour Wang et al. report for it.
    """

    name = "batchsche"
    fixed_allocation = True

    def __init__(self, interval: int = 4, cloud_price: float = 1.0, edge_idle: float = 0.5,
                 edge_full: float = 4.0, gang: str = "demand"):
        super().__init__(gang)
        self.interval, self.cloud_price = interval, cloud_price
        self.edge_idle, self.edge_full = edge_idle, edge_full

    def plan(self, cluster: SimCluster, jobs: Sequence[Job]) -> None:
        self.cluster = cluster
        self.waiting: list[Job] = []
        self.running: dict[int, Allocation] = {}

    def on_arrival(self, t: int, jobs: list[Job]) -> None:
        self.waiting.extend(jobs)

    def on_complete(self, t: int, job: Job) -> None:
        self.running.pop(job.id, None)

    def _cost(self, job: Job, alloc: Allocation, free: FreeSlots) -> float:
        duration = job.total_work / (alloc.total_workers * job.rate(alloc.colocated()))
        cost = 0.0
        for s, n in alloc.workers.items():
            srv = self.cluster.servers[s]
            if srv.cloud:
                price = self.cloud_price
            else:
                load = 1.0 - (free.workers[s] - n) / max(1, srv.worker_slots)
                price = self.edge_idle * (self.edge_full / self.edge_idle) ** load
            cost += n * duration * price
        return cost

    def schedule(self, t: int, state: SimState) -> dict[int, Allocation]:
        if t % self.interval == 0 and self.waiting:
            free = FreeSlots(self.cluster)
            for a in self.running.values():
                free.take(a)
            still = []
            for job in self.waiting:
                n = self.width(job)
                options = [a for a in (free.place_edge(job, n, t), free.place_cloud(job, n, t))
                           if a is not None]
                if not options:
                    still.append(job)
                    continue
                best = min(options, key=lambda a: self._cost(job, a, free))
                free.take(best)
                self.running[job.id] = best
            self.waiting = still
        return dict(self.running)

    def stable_until(self, t: int, state: SimState) -> int:
        return (t // self.interval + 1) * self.interval - 1 if self.waiting else NEVER
