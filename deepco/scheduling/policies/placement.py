"""Free-slot bookkeeping and gang placement shared by the job-level baselines."""

from __future__ import annotations

from deepco.scheduling.jobs import Job
from deepco.scheduling.simulator import Allocation
from deepco.scheduling.topology import SimCluster, SimServer

NEVER = 1 << 62  # "no event": stable_until's value when only an arrival or completion can change a decision


def next_ready(job: Job, cluster: SimCluster, t: int) -> int:
    """The first slot after ``t`` at which ``job``'s data reaches one more site (a_j + Delta_js), or NEVER."""
    later = [job.arrival + d for d in job.upload if job.arrival + d > t]
    return min(later, default=NEVER)


class FreeSlots:
    """Worker and PS slots still free in one slot, while a policy fills it."""

    def __init__(self, cluster: SimCluster):
        self.cluster = cluster
        self.workers = [s.worker_slots for s in cluster.servers]
        self.ps = [s.ps_slots for s in cluster.servers]
        self.cloud = [s.cloud for s in cluster.servers]
        self.edge_free = sum(s.worker_slots for s in cluster.servers if not s.cloud)  # a quick reject test

    def take(self, alloc: Allocation) -> None:
        """Reserve an allocation's slots."""
        for s, c in alloc.workers.items():
            self.workers[s] -= c
            if not self.cloud[s]:
                self.edge_free -= c
        self.ps[alloc.ps] -= 1

    def fits(self, alloc: Allocation) -> bool:
        """Whether an allocation still fits."""
        return all(self.workers[s] >= c for s, c in alloc.workers.items()) and self.ps[alloc.ps] >= 1

    def edge_servers(self, job: Job, t: int) -> list[SimServer]:
        """Edge servers whose worker type fits ``job`` and that hold its data by slot ``t`` (2i)."""
        c = self.cluster
        return [s for s in c.servers if not s.cloud and s.serves_worker(job) and c.ready(job, s) <= t]

    def place_edge(self, job: Job, n: int, t: int) -> Allocation | None:
        """``n`` workers + 1 PS on the edge: on one server if any fits (xi = 1, best fit), else spread over
        the servers with most free slots, the PS on one of them if possible. None if it does not fit."""
        if n > self.edge_free:
            return None
        cands = self.edge_servers(job, t)
        whole = [s for s in cands
                 if self.workers[s.index] >= n and self.ps[s.index] >= 1 and s.serves_ps(job)]
        if whole:
            best = min(whole, key=lambda s: (self.workers[s.index] - n, s.index))
            return Allocation(workers={best.index: n}, ps=best.index)
        cands.sort(key=lambda s: (-self.workers[s.index], s.index))
        workers: dict[int, int] = {}
        need = n
        for s in cands:
            if need == 0:
                break
            take = min(need, self.workers[s.index])
            if take > 0:
                workers[s.index] = take
                need -= take
        if need > 0:
            return None
        c = self.cluster
        ps_cands = [s for s in c.servers if not s.cloud and self.ps[s.index] >= 1 and s.serves_ps(job)
                    and c.ready(job, s) <= t]
        if not ps_cands:
            return None
        ps = min(ps_cands, key=lambda s: (s.index not in workers, s.index))
        return Allocation(workers=workers, ps=ps.index)

    def place_cloud(self, job: Job, n: int, t: int) -> Allocation | None:
        """All ``n`` workers and the PS on the cloud (xi = 1) once the data is there and, for a finite cloud,
        while it has ``n`` free worker slots and a free PS slot; else None."""
        cloud = self.cluster.cloud
        if cloud is None or not cloud.serves_worker(job) or not cloud.serves_ps(job):
            return None
        if self.cluster.ready(job, cloud) > t:
            return None
        if self.workers[cloud.index] < n or self.ps[cloud.index] < 1:
            return None
        return Allocation(workers={cloud.index: n}, ps=cloud.index)

    def cloud_ready(self, job: Job, t: int) -> bool:
        """Whether the cloud could run ``job`` now."""
        cloud = self.cluster.cloud
        return cloud is not None and cloud.serves_worker(job) and self.cluster.ready(job, cloud) <= t
