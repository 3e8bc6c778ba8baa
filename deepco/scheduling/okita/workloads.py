"""Okita's workloads: the synthetic setup of Sec. V-B, a trace-driven variant, and sites from a cluster TOML.

Sec. V-B ranges: worker 0-4 GPUs, 1-10 vCPUs, 2-32 GB RAM, 5-10 GB disk; PS 0 GPUs, 1-10 vCPUs, 2-32 GB,
5-10 GB; q^{rr'} uniform in [2, 8] per 100 MB (so [0.02, 0.08] per MB); D_i^r in [10, 20]; delta_i in
[20, 60] MB; rho_i / E_i in [5, 15]; pi_i in [30, 575] MB; f: tau e^{0.25 t}, tau in [20, 100] (default),
tau t + b (b in [50, 200]) or piecewise (tau1 in [20, 100], tau2 in [300, 400], c in [3, 5]).

Choices where the paper is silent: sites are EC2 p3.16xlarge / p2.16xlarge / g3.16xlarge (GPUs, vCPUs,
RAM GB) drawn uniformly, each with 1000 GB disk (the instances are EBS-only); q is symmetric; arrivals are
uniform over the first ``2T/3`` slots so the jobs can finish inside T; rho_i / E_i is drawn as an integer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from deepco.cluster import Cluster
from deepco.errors import UserError
from deepco.scheduling.okita.model import RESOURCES, LatencyCost, UdlInstance, UdlJob

# (GPUs, vCPUs, RAM GB, disk GB) of p3.16xlarge, p2.16xlarge, g3.16xlarge (+ 1000 GB disk, our choice)
EC2 = np.array([[8, 64, 488, 1000], [16, 64, 732, 1000], [4, 64, 488, 1000]], dtype=float)


def latency_cost(rng: np.random.Generator, kind: str) -> LatencyCost:
    """A latency cost function of ``kind`` with Sec. V-B's parameter ranges."""
    if kind == "sigmoid":
        return LatencyCost("sigmoid", tau=float(rng.uniform(20, 100)))
    if kind == "linear":
        return LatencyCost("linear", tau=float(rng.uniform(20, 100)), b=float(rng.uniform(50, 200)))
    if kind == "piecewise":
        return LatencyCost("piecewise", tau=float(rng.uniform(20, 100)), tau2=float(rng.uniform(300, 400)),
                           c=float(rng.integers(3, 6)))
    raise UserError(f"latency cost must be sigmoid, linear or piecewise, got {kind!r}")


def random_sites(rng: np.random.Generator, sites: int) -> tuple[np.ndarray, np.ndarray]:
    """(C_r^k, q^{rr'}) for ``sites`` EC2-like sites."""
    cap = EC2[rng.integers(0, len(EC2), size=sites)]
    q = rng.uniform(0.02, 0.08, size=(sites, sites))
    q = np.triu(q, 1)
    return cap, q + q.T


def random_job(rng: np.random.Generator, jid: int, arrival: int, sites: int, kind: str = "sigmoid",
               data: np.ndarray | None = None) -> UdlJob:
    """One job with Sec. V-B's ranges (``data`` overrides D_i^r)."""
    wd = np.array([rng.integers(0, 5), rng.integers(1, 11), rng.integers(2, 33), rng.integers(5, 11)], float)
    pd = np.array([0, rng.integers(1, 11), rng.integers(2, 33), rng.integers(5, 11)], float)
    if data is None:
        data = rng.integers(10, 21, size=sites)
    epochs = int(rng.integers(1, 6))
    return UdlJob(id=jid, arrival=arrival, data=np.asarray(data, dtype=np.int64), worker_demand=wd, ps_demand=pd,
                  per_worker=int(rng.integers(5, 16)), chunk_mb=float(rng.uniform(20, 60)),
                  param_mb=float(rng.uniform(30, 575)), cost=latency_cost(rng, kind), epochs=epochs)


def synthetic(sites: int = 50, jobs: int = 100, horizon: int = 150, *, seed: int = 0, kind: str = "sigmoid"
              ) -> UdlInstance:
    """The paper's default setup: R sites, I jobs arriving in the first 2T/3 slots."""
    rng = np.random.default_rng(seed)
    cap, q = random_sites(rng, sites)
    last = max(1, (2 * horizon) // 3)
    arrivals = np.sort(rng.integers(0, last, size=jobs))
    js = [random_job(rng, i, int(a), sites, kind) for i, a in enumerate(arrivals)]
    return UdlInstance(capacity=cap, q=q, jobs=js, site_names=tuple(f"site{r}" for r in range(sites)))


def trace_jobs(path: str | Path, fmt: str, sites: int, jobs: int | None, rng: np.random.Generator, *,
               slot_seconds: float = 3600.0, kind: str = "sigmoid") -> list[UdlJob]:
    """Jobs with arrivals and relative sizes from a real trace (``deepco.scheduling.traces`` readers): job i
    arrives at its submit time in slots and holds about 15 x size_i / median size chunks per site (clipped to
    [1, 60], +-1/3 per site; 15 is the middle of Sec. V-B's [10, 20]); the rest is drawn from Sec. V-B."""
    from deepco.scheduling.traces import READERS, TraceError

    if fmt not in READERS:
        raise TraceError(f"unknown trace format {fmt!r}")
    rows = sorted(READERS[fmt](Path(path)), key=lambda r: (r.arrival_s, r.line))
    rows = rows[:jobs] if jobs is not None else rows
    if not rows:
        raise TraceError(f"{path}: no usable job rows")
    med = float(np.median([r.size for r in rows])) or 1.0
    first = rows[0].arrival_s
    js = []
    for i, r in enumerate(rows):
        per_site = int(np.clip(round(15 * r.size / med), 1, 60))
        data = np.clip(rng.integers(per_site - per_site // 3, per_site + per_site // 3 + 1, size=sites), 1, None)
        js.append(random_job(rng, i, int((r.arrival_s - first) // slot_seconds), sites, kind, data=data))
    return js


def trace_driven(path: str | Path, fmt: str, sites: int = 50, jobs: int = 100, *, seed: int = 0,
                 slot_seconds: float = 3600.0, kind: str = "sigmoid") -> UdlInstance:
    """Sec. V-B's sites with ``trace_jobs`` from a real trace."""
    rng = np.random.default_rng(seed)
    cap, q = random_sites(rng, sites)
    js = trace_jobs(path, fmt, sites, jobs, rng, slot_seconds=slot_seconds, kind=kind)
    return UdlInstance(capacity=cap, q=q, jobs=js, site_names=tuple(f"site{r}" for r in range(sites)))


def cluster_sites(cluster: Cluster) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Sites of a cluster TOML as Okita's sites: C_r^k sums its servers' (gpus, cpus, memory_gb, and 1000 GB
    disk each), q^{rr'} is the [[links]] cost (per MB; a missing link between two edge sites is an error)."""
    sites = [s for s in cluster.sites if s.kind == "edge"]
    if not sites:
        raise UserError(f"{cluster.source}: okita needs [[sites]] of kind 'edge' with servers in them")
    idx = {s.name: i for i, s in enumerate(sites)}
    cap = np.zeros((len(sites), len(RESOURCES)))
    for srv in cluster.servers:
        if srv.site in idx:
            cap[idx[srv.site]] += [srv.resources.gpus, srv.resources.cpus, srv.resources.memory_gb, 1000.0]
    if not (cap[:, 1] > 0).any():
        raise UserError(f"{cluster.source}: okita needs servers with cpus > 0 in its edge sites")
    q = np.full((len(sites), len(sites)), np.nan)
    np.fill_diagonal(q, 0.0)
    for link in cluster.links:
        if link.a in idx and link.b in idx:
            q[idx[link.a], idx[link.b]] = q[idx[link.b], idx[link.a]] = link.cost
    if np.isnan(q).any():
        a, b = map(int, np.argwhere(np.isnan(q))[0])
        raise UserError(f"{cluster.source}: okita needs a [[links]] cost between sites {sites[a].name!r} and "
                        f"{sites[b].name!r}")
    return cap, q, tuple(s.name for s in sites)


def fit_jobs(jobs: list[UdlJob], cap: np.ndarray) -> None:
    """Shrink demands drawn for EC2-sized sites so one worker and one PS fit the largest site of a small
    cluster (a worker at most half of it, a PS a quarter)."""
    top = cap.max(axis=0)
    for j in jobs:
        j.worker_demand = np.minimum(j.worker_demand, top / 2)
        j.ps_demand = np.minimum(j.ps_demand, top / 4)


def from_cluster(cluster: Cluster, jobs: int = 20, horizon: int = 30, *, seed: int = 0, kind: str = "sigmoid"
                 ) -> UdlInstance:
    """``cluster_sites`` with synthetic Sec. V-B jobs arriving in the first 2/3 of ``horizon``."""
    cap, q, names = cluster_sites(cluster)
    rng = np.random.default_rng(seed)
    last = max(1, (2 * horizon) // 3)
    arrivals = np.sort(rng.integers(0, last, size=jobs))
    js = [random_job(rng, i, int(a), len(names), kind) for i, a in enumerate(arrivals)]
    fit_jobs(js, cap)
    return UdlInstance(capacity=cap, q=q, jobs=js, site_names=names)
