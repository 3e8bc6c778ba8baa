"""Wang et al., "Preemptive Scheduling for Distributed ML Jobs in Edge-Cloud Networks": A_online (Alg. 1)
= A_greedy (Algs. 2-4, dispatch rule eq. (5), HAPRF) + A_ps (Alg. 5); and A_online-E (edge only).

Each data chunk of an arriving job is dispatched once to one worker (edge) or to the cloud, never migrated.
Every edge worker then runs, each slot, its released chunk with the highest average processing rate
gamma_jd = n_jsw / (E_j D_j B_j) (HAPRF); a later chunk with a higher rate preempts the running one, which
keeps its data on the worker and resumes later. The cloud is unbounded and never preempted (a cluster whose
cloud has finite slots is refused; ``preemptive-edge`` never uses the cloud).

Ambiguities and our choices:
- A(t0) in eq. (5), the chunks pending at t0 = r_j + Delta_js: we project the worker's queue from the arrival
  slot to t0 by running it in HAPRF order for t0 - r_j slots (release times of queued chunks ignored in this
  projection); p-hat is the remaining processing time at the planned rate n_jsw.
- n_jsw on edge workers uses zeta_j = 0 (Alg. 3 sets zeta = 1 only for the first chunk on the cloud); the
  simulator executes with the physical rate of eq. (1) (workers and PS on one server are faster).
- Alg. 2 line 11 picks the argmin over C_j; ties go to the lower server index, then the lower worker index.
- Alg. 5 picks a random qualified PS when the job's previous PS cannot be kept; we draw it, with a seed,
  among edge servers whose data is ready and that have a free PS slot of the job's type; a job with every
  worker on the cloud gets its PS on the cloud; if no edge PS is free, the cloud hosts it when it can, else
  the job waits this slot and its workers run their next chunk.
- Completed chunks free their worker at the end of the slot (slots are indivisible).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deepco.scheduling.jobs import Job
from deepco.scheduling.policies.base import Policy
from deepco.scheduling.simulator import Allocation, SimState, SimulationError
from deepco.scheduling.topology import SimCluster


@dataclass(eq=False)
class Chunk:
    """One data chunk dispatched to one worker (or to the cloud)."""

    job: Job
    index: int
    gamma: float  # average processing rate, the HAPRF priority
    release: int  # r_j + Delta_js: first slot its data is on the worker's server
    remaining: float  # mini-batches left (E_j B_j at dispatch)
    plan_rate: float  # n_jsw used by the dispatch rule
    seq: int  # dispatch order, the tie-break of HAPRF (earlier first)
    server: int = -1  # where it was dispatched (-1: the cloud)
    worker: int = -1
    count: int = 1  # identical chunks this record stands for (a job's cloud chunks start and run together)

    def sort_key(self) -> tuple[float, int]:
        return (-self.gamma, self.seq)

    @property
    def remaining_time(self) -> float:
        return self.remaining / self.plan_rate


def q_value(job: Job, delay: int, now: int, queue: Sequence[Chunk], rate: float) -> tuple[float, float]:
    """Eq. (5): Q_jdsw for one chunk of ``job`` sent to a worker holding ``queue`` (in HAPRF order).

    Returns (Q, planned start t*). ``rate`` is n_jsw; ``delay`` is Delta_js; ``now`` is r_j.
    """
    d = job.chunks
    proc = job.chunk_work / rate  # E_j B_j / n_jsw
    gamma = rate / job.total_work
    t0 = job.arrival + delay
    budget = float(max(0, t0 - now))
    ahead = 0.0  # sum of p-hat(t0) over pending chunks with gamma' >= gamma
    behind = 0.0  # sum of 1/D_j' over pending chunks with gamma' < gamma
    for c in queue:
        rem = c.remaining / c.plan_rate
        if budget > 0.0:
            used = budget if budget < rem else rem
            budget -= used
            rem -= used
            if rem <= 1e-12:
                continue
        if c.gamma >= gamma:
            ahead += rem
        else:
            behind += 1.0 / c.job.chunks
    q = delay / d + ahead / d + proc / d + proc * behind
    return q, t0 + ahead


class Preemptive(Policy):
    """A_online of Wang et al. (``preemptive``), or A_online-E with ``edge_only`` (``preemptive-edge``)."""

    name = "preemptive"
    no_migration = True

    def __init__(self, edge_only: bool = False, seed: int = 0):
        self.edge_only = edge_only
        self.seed = seed
        self.needs_unbounded_cloud = not edge_only  # a job's cloud chunks all start at once (Alg. 2 l. 12-16)
        if edge_only:
            self.name = "preemptive-edge"

    def plan(self, cluster: SimCluster, jobs: Sequence[Job]) -> None:
        if self.needs_unbounded_cloud and cluster.finite_cloud:
            raise SimulationError(f"{self.name}: Wang et al.'s A_online assumes an unbounded cloud; this cluster's "
                                  "cloud has finite worker_slots")
        self.cluster = cluster
        self.rng = np.random.default_rng(self.seed)
        # queues[s][w]: chunks on worker w of edge server s, in HAPRF order
        self.queues: dict[int, list[list[Chunk]]] = {
            s.index: [[] for _ in range(s.worker_slots)] for s in cluster.edge}
        self.busy: dict[int, set[int]] = {s: set() for s in self.queues}  # workers with a non-empty queue
        self.cloud_chunks: dict[int, list[Chunk]] = {}  # job id -> its chunks on the cloud
        self.where: dict[int, set[int]] = {}  # job id -> servers holding its data
        self.ps: dict[int, int] = {}  # job id -> PS server of the previous slot
        self.running: dict[int, list[tuple[Chunk, float]]] = {}
        # bookkeeping that keeps each slot's work proportional to what changed, not to the cluster size:
        # every edge worker gets a global id g (in server, worker order) for the vectorised bounds of Q
        self.gid: dict[tuple[int, int], int] = {}
        for srv in cluster.edge:
            for w in range(srv.worker_slots):
                self.gid[(srv.index, w)] = len(self.gid)
        n = len(self.gid)
        self.g_server = np.array([k[0] for k in self.gid], dtype=int)
        self.g_worker = np.array([k[1] for k in self.gid], dtype=int)
        self.g_site = np.array([cluster.servers[k[0]].site for k in self.gid], dtype=int)
        self.load = np.zeros(n)  # sum of remaining processing times in each worker's queue
        self.dmax = np.ones(n)  # an upper bound on D_j' over the chunks in that queue
        self.g_busy = np.zeros(n, dtype=bool)
        self._type_mask: dict[str | None, np.ndarray] = {}
        self.pick: dict[tuple[int, int], Chunk] = {}  # each worker's HAPRF choice (first released chunk)
        self.job_picks: dict[int, set[tuple[int, int]]] = {}  # job id -> workers whose choice is its chunk
        self.dirty: set[tuple[int, int]] = set()  # workers whose queue changed since their choice was made
        self.releases: list[tuple[int, int, int]] = []  # (release slot, server, worker), a heap
        self.seq = 0
        self.alpha: dict[tuple[int, int], float] = {}  # alpha_jd, the dual variables (for inspection/tests)

    # ---- A_greedy (Alg. 2) -------------------------------------------------------------------------------
    def on_arrival(self, t: int, jobs: list[Job]) -> None:
        for job in jobs:
            self._dispatch(job, t)

    def _dispatch(self, job: Job, now: int) -> None:
        cluster = self.cluster
        cloud = None if self.edge_only else cluster.cloud
        if cloud is not None and not (cloud.serves_worker(job) and cloud.serves_ps(job)):
            cloud = None
        edge_rate = job.rate(False)
        heap: list[tuple[float, int, int, float]] = []  # exact (Q, server, worker, t*); worker -1 = the cloud
        version: dict[tuple[int, int], float] = {}

        proc_d = job.chunk_work / edge_rate / job.chunks
        proc = job.chunk_work / edge_rate

        def push(s: int, w: int) -> None:
            srv = cluster.servers[s]
            q, start = q_value(job, cluster.delay(job, srv), now, self.queues[s][w], edge_rate)
            version[(s, w)] = q
            heapq.heappush(heap, (q, s, w, start))

        for srv in cluster.edge:
            if srv.serves_worker(job) and srv.worker_slots > 0:
                empty = self._first_empty(srv.index)
                if empty is not None:
                    push(srv.index, empty)  # every idle worker of a server has the same Q: one stands for all
        # Busy workers get a lower bound on Q first: Delta/D + proc/D, plus, if the queue still holds work
        # at t0 (its load minus the slots before t0), at least that work / D (all ahead of the chunk) or one
        # lower-rate chunk's proc / D_j' >= proc / dmax. A worker's exact Q is computed only when its bound
        # is not above the best exact Q so far (bounds first on ties), so the argmin and its ties are those
        # of evaluating every worker.
        busy = np.flatnonzero(self.g_busy & self._serves(job))
        delays = np.array(job.upload, dtype=float)[self.g_site[busy]]
        left = self.load[busy] - np.maximum(0.0, job.arrival + delays - now)
        extra = np.where(left > 1e-9, np.minimum(left / job.chunks, proc / self.dmax[busy]), 0.0)
        bounds = delays / job.chunks + proc_d + extra - 1e-9
        order = np.argsort(bounds, kind="stable")
        b_sorted, g_sorted = bounds[order].tolist(), busy[order].tolist()
        pos = 0
        if cloud is not None:
            delay = cluster.delay(job, cloud)
            q1 = delay / job.chunks + job.chunk_work / job.rate(True) / job.chunks  # zeta = 1 for d_1
            version[(cloud.index, -1)] = q1
            heapq.heappush(heap, (q1, cloud.index, -1, float(job.arrival + delay)))
        if not heap and not g_sorted:
            raise SimulationError(f"job {job.id}: no worker of its type on any "
                                  f"{'edge ' if self.edge_only else ''}server")
        self.where[job.id] = set()
        for d in range(job.chunks):
            while True:
                while pos < len(b_sorted) and (not heap or b_sorted[pos] <= heap[0][0]):
                    g = g_sorted[pos]
                    pos += 1
                    key = (int(self.g_server[g]), int(self.g_worker[g]))
                    if key not in version:
                        push(*key)  # its bound reached the top: compute the real Q
                q, s, w, start = heapq.heappop(heap)
                if version.get((s, w)) == q:
                    break
            if w == -1:
                # Alg. 2 lines 12-16: this and every remaining chunk go to the cloud
                rate = job.rate(d == 0)
                for dd in range(d, job.chunks):
                    self.alpha[(job.id, dd)] = q
                # the cloud is never preempted: all these chunks start at r_j + Delta and run side by side
                self.cloud_chunks[job.id] = [Chunk(job, d, rate / job.total_work, int(start), job.chunk_work,
                                                   rate, self._next_seq(), count=job.chunks - d)]
                self.where[job.id].add(s)
                return
            if d == 0 and cloud is not None:
                # lines 17-20: once a chunk is on the edge the job's workers and PS cannot all share the
                # cloud, so the cloud's Q is recomputed with zeta = 0
                delay = cluster.delay(job, cloud)
                q0 = delay / job.chunks + job.chunk_work / job.rate(False) / job.chunks
                version[(cloud.index, -1)] = q0
                heapq.heappush(heap, (q0, cloud.index, -1, float(job.arrival + delay)))
            self.alpha[(job.id, d)] = q
            was_empty = self._enqueue(job, d, s, w, edge_rate, now)
            push(s, w)  # lines 21-22: only the chosen worker's Q changes
            if was_empty:
                empty = self._first_empty(s)
                if empty is not None and (s, empty) not in version:
                    push(s, empty)

    def _enqueue(self, job: Job, d: int, s: int, w: int, edge_rate: float, now: int) -> bool:
        """Queue chunk ``d`` of ``job`` on edge worker ``w`` of server ``s`` (its load, release and the job's
        servers kept up to date); whether that worker's queue was empty before."""
        chunk = Chunk(job, d, edge_rate / job.total_work, self.cluster.ready(job, self.cluster.servers[s]),
                      job.chunk_work, edge_rate, self._next_seq(), server=s, worker=w)
        queue = self.queues[s][w]
        was_empty = not queue
        bisect.insort(queue, chunk, key=Chunk.sort_key)
        self.busy[s].add(w)
        g = self.gid[(s, w)]
        self.load[g] += chunk.remaining_time
        self.dmax[g] = max(self.dmax[g], job.chunks)
        self.g_busy[g] = True
        if chunk.release <= now:
            self.dirty.add((s, w))
        else:
            heapq.heappush(self.releases, (chunk.release, s, w))
        self.where[job.id].add(s)
        return was_empty

    def _serves(self, job: Job) -> np.ndarray:
        """Mask over edge workers whose server takes ``job``'s worker type."""
        mask = self._type_mask.get(job.worker_type)
        if mask is None:
            servers = self.cluster.servers
            mask = np.array([servers[s].serves_worker(job) for s in self.g_server], dtype=bool)
            self._type_mask[job.worker_type] = mask
        return mask

    def _first_empty(self, s: int) -> int | None:
        busy = self.busy[s]
        if len(busy) >= len(self.queues[s]):
            return None
        for w in range(len(self.queues[s])):
            if w not in busy:
                return w
        return None

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    # ---- execution: HAPRF per worker, A_ps (Alg. 5) ------------------------------------------------------
    def schedule(self, t: int, state: SimState) -> dict[int, Allocation]:
        cluster = self.cluster
        self._refresh_picks(t)
        blocked: set[int] = set()
        for _ in range(8):  # a job left without a PS frees its workers for their next chunks; few rounds do
            # each worker runs its first released chunk (HAPRF) whose job is not blocked this slot
            picks: dict[int, list[tuple[int, Chunk]]] = {
                jid: [(s, self.pick[(s, w)]) for s, w in ws] for jid, ws in self.job_picks.items()
                if jid not in blocked}
            for jid in blocked:
                for s, w in self.job_picks.get(jid, ()):
                    for c in self.queues[s][w]:
                        if c.release <= t and c.job.id not in blocked:
                            picks.setdefault(c.job.id, []).append((s, c))
                            break
            for jid, chunks in self.cloud_chunks.items():
                for c in chunks:
                    if c.release <= t and c.remaining > 1e-9 * c.job.chunk_work:
                        picks.setdefault(jid, []).append((-1, c))
            ps_free = {s.index: s.ps_slots for s in cluster.servers}
            ps_of: dict[int, int] = {}
            new_block = set()
            # jobs keeping last slot's PS go first (Alg. 5 line 3-4), then the rest in job order
            order = sorted(picks, key=lambda j: (j not in self.ps, j))
            for jid in order:
                job = picks[jid][0][1].job
                prev = self.ps.get(jid)
                on_cloud_only = all(s == -1 for s, _ in picks[jid])
                keep = prev is not None and (cluster.servers[prev].cloud or not on_cloud_only)
                if prev is not None and keep and ps_free[prev] > 0:
                    ps_of[jid] = prev
                    ps_free[prev] -= 1
                    continue
                cloud = cluster.cloud
                if on_cloud_only and cloud is not None:
                    ps_of[jid] = cloud.index
                    continue
                cands = [s.index for s in cluster.edge if ps_free[s.index] > 0 and s.serves_ps(job)
                         and cluster.ready(job, s) <= t]
                if cands:
                    p = int(cands[int(self.rng.integers(len(cands)))])
                    ps_of[jid] = p
                    ps_free[p] -= 1
                elif (not self.edge_only and cloud is not None and cloud.serves_ps(job)
                      and cluster.ready(job, cloud) <= t):
                    ps_of[jid] = cloud.index
                else:
                    new_block.add(jid)
            if not new_block:
                break
            blocked |= new_block
        out: dict[int, Allocation] = {}
        self.running = {}
        cloud_index = cluster.cloud.index if cluster.cloud is not None else -1
        for jid, ps in ps_of.items():
            workers: dict[int, int] = {}
            for s, c in picks[jid]:
                s = cloud_index if s == -1 else s
                workers[s] = workers.get(s, 0) + c.count
            alloc = Allocation(workers=workers, ps=ps)
            rate = picks[jid][0][1].job.rate(alloc.colocated())
            useful = [(c, c.count * min(rate, c.remaining)) for _, c in picks[jid]]
            alloc.work = sum(u for _, u in useful)
            out[jid] = alloc
            self.running[jid] = useful
        self.ps = ps_of
        return out

    def _refresh_picks(self, t: int) -> None:
        """Redo the HAPRF choice of workers whose queue changed or got a chunk released by slot ``t``."""
        while self.releases and self.releases[0][0] <= t:
            _, s, w = heapq.heappop(self.releases)
            self.dirty.add((s, w))
        for key in self.dirty:
            old = self.pick.pop(key, None)
            if old is not None:
                ws = self.job_picks[old.job.id]
                ws.discard(key)
                if not ws:
                    del self.job_picks[old.job.id]
            for c in self.queues[key[0]][key[1]]:
                if c.release <= t:
                    self.pick[key] = c
                    self.job_picks.setdefault(c.job.id, set()).add(key)
                    break
        self.dirty.clear()

    def stable_until(self, t: int, state: SimState) -> int:
        # HAPRF picks change only when a chunk is released at its server or a running chunk completes;
        # a chunk that would finish mid-slot is run one slot at a time (its last slot is partial)
        until = 1 << 62
        for useful in self.running.values():
            for c, u in useful:
                per_chunk = u / c.count
                if per_chunk <= 0:
                    continue
                full = math.floor(c.remaining / per_chunk + 1e-12)
                until = min(until, t + max(1, full) - 1)
        if self.releases:
            until = min(until, self.releases[0][0] - 1)
        for chunks in self.cloud_chunks.values():
            for c in chunks:
                if c.release > t:
                    until = min(until, c.release - 1)
        return until

    def observe(self, t: int, executed: dict[int, float]) -> None:
        for jid, useful in self.running.items():
            claimed = sum(u for _, u in useful)
            scale = executed.get(jid, 0.0) / claimed if claimed > 0 else 0.0
            for c, u in useful:
                done = u * scale / c.count
                c.remaining -= done
                if c.server < 0:
                    continue
                key = (c.server, c.worker)
                g = self.gid[key]
                self.load[g] -= done / c.plan_rate
                if c.remaining <= 1e-9 * c.job.chunk_work:
                    queue = self.queues[c.server][c.worker]
                    queue.remove(c)
                    self.dirty.add(key)
                    if not queue:
                        self.busy[c.server].discard(c.worker)
                        self.load[g] = 0.0  # no drift
                        self.dmax[g] = 1.0
                        self.g_busy[g] = False

    def on_complete(self, t: int, job: Job) -> None:
        self.cloud_chunks.pop(job.id, None)
        self.ps.pop(job.id, None)

    def dispatched_servers(self, job_id: int) -> set[int]:
        return self.where.get(job_id, set())
