"""The cluster as the scheduler sees it: typed worker and PS slots per server, edge or cloud, upload delays.

Built from the one cluster model (``deepco.cluster``): a server's ``resources.worker_slots`` and
``resources.ps_slots`` are W_s and P_s; ``worker_type``/``ps_type`` are the slot types u and v (None serves
any type); a server in a site of kind ``cloud`` is the papers' cloud s_c. The cloud is unbounded in workers
and PSs (Wang et al.'s model, and the default) unless its server gives ``worker_slots`` (and ``ps_slots``):
then it is a finite server of [S] like She et al.'s cloud, and every policy must respect its W and P.
A server with no site sits in an implicit edge site with no upload delay.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deepco.cluster import Cluster, Site
from deepco.errors import UserError
from deepco.scheduling.jobs import Job

UNBOUNDED = 1 << 40  # the cloud's worker and PS slots: larger than any job could use


@dataclass(frozen=True)
class SimServer:
    """One server: its slots, slot types, and where it is."""

    index: int
    name: str
    site: int  # index into SimCluster.sites
    cloud: bool
    worker_slots: int
    ps_slots: int
    worker_type: str | None = None
    ps_type: str | None = None

    def serves_worker(self, job: Job) -> bool:
        """Whether a worker slot here may run one of ``job``'s workers (type match)."""
        return self.worker_type is None or job.worker_type is None or self.worker_type == job.worker_type

    def serves_ps(self, job: Job) -> bool:
        """Whether a PS slot here may host ``job``'s PS (type match)."""
        return self.ps_type is None or job.ps_type is None or self.ps_type == job.ps_type


@dataclass(frozen=True)
class SimCluster:
    """Servers and sites for the simulator."""

    servers: tuple[SimServer, ...]
    sites: tuple[Site, ...]
    source: str = "<memory>"

    @property
    def edge(self) -> tuple[SimServer, ...]:
        """The edge servers (bounded slots)."""
        return tuple(s for s in self.servers if not s.cloud)

    @property
    def cloud(self) -> SimServer | None:
        """The cloud server, if the cluster has one (the first server in a cloud site)."""
        return next((s for s in self.servers if s.cloud), None)

    @property
    def finite_cloud(self) -> bool:
        """Whether the cloud has finite worker/PS slots (She et al.'s priced cloud) rather than unbounded ones."""
        c = self.cloud
        return c is not None and c.worker_slots < UNBOUNDED

    def edge_worker_capacity(self) -> int:
        """Total worker slots on edge servers (the denominator of utilisation)."""
        return sum(s.worker_slots for s in self.servers if not s.cloud)

    def delay(self, job: Job, server: SimServer) -> int:
        """Delta_js: slots before ``job``'s data is on ``server``."""
        return job.upload[server.site]

    def ready(self, job: Job, server: SimServer) -> int:
        """a_j + Delta_js: the first slot ``job`` may use ``server`` (constraint (2i))."""
        return job.arrival + job.upload[server.site]

    @classmethod
    def from_cluster(cls, cluster: Cluster) -> SimCluster:
        """Read the training view of a cluster; a ClusterError-style UserError if it has no slots."""
        sites = list(cluster.sites)
        by_name = {s.name: i for i, s in enumerate(sites)}
        servers: list[SimServer] = []
        for srv in cluster.servers:
            if srv.site is None:
                if "_edge" not in by_name:
                    by_name["_edge"] = len(sites)
                    sites.append(Site(name="_edge", kind="edge", upload_delay=0.0))
                site = by_name["_edge"]
            else:
                site = by_name[srv.site]
            cloud = sites[site].kind == "cloud"
            res = srv.resources
            # a cloud server that names its worker slots is finite (She et al.); else unbounded (Wang et al.)
            bounded = not cloud or res.worker_slots > 0
            if cloud and bounded and res.ps_slots < 1:
                raise UserError(f"{cluster.source}: key 'servers.{srv.name}.ps_slots': a cloud with finite "
                                "worker_slots needs ps_slots >= 1 too")
            servers.append(SimServer(
                index=len(servers), name=srv.name, site=site, cloud=cloud,
                worker_slots=res.worker_slots if bounded else UNBOUNDED,
                ps_slots=res.ps_slots if bounded else UNBOUNDED,
                worker_type=srv.worker_type, ps_type=srv.ps_type))
        if sum(1 for s in servers if s.cloud) > 1:
            # the papers have one cloud s_c; several unbounded servers would only be aliases of it
            raise UserError(f"{cluster.source}: key 'servers': at most one server may sit in a cloud site")
        if not any(s.cloud or (s.worker_slots > 0 and s.ps_slots > 0) for s in servers):
            raise UserError(f"{cluster.source}: key 'servers': no server has both worker_slots and ps_slots "
                            "(and there is no cloud); no training job could run")
        return cls(servers=tuple(servers), sites=tuple(sites), source=cluster.source)


def bind_delays(jobs: Sequence[Job], cluster: SimCluster, seed: int = 0) -> None:
    """Fill each job's Delta_js per site: upload_delay, or a draw in [upload_delay, upload_delay_max].

    Delays are rounded up to whole slots. Jobs that already carry one delay per site are left as they are.
    """
    rng = np.random.default_rng(seed)
    for job in jobs:
        if len(job.upload) == len(cluster.sites):
            continue
        delays = []
        for site in cluster.sites:
            if site.upload_delay_max is None or site.upload_delay_max <= site.upload_delay:
                delays.append(math.ceil(site.upload_delay))
            else:
                lo, hi = math.ceil(site.upload_delay), math.floor(site.upload_delay_max)
                delays.append(int(rng.integers(lo, max(lo, hi) + 1)))
        job.upload = tuple(delays)


def usable(job: Job, cluster: SimCluster, edge_only: bool = False) -> bool:
    """Whether some server could ever host the job's workers and its PS."""
    servers = [s for s in cluster.servers if not (edge_only and s.cloud)]
    workers = sum(s.worker_slots for s in servers if s.serves_worker(job))
    return workers > 0 and any(s.ps_slots > 0 and s.serves_ps(job) for s in servers)
