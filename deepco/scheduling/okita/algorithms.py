"""The building blocks of Okita (Han et al.): the deployment metric Q_i^r(t) (eq. 6), the placement
algorithm PA (Alg. 2), the workload split d_i^r(t) and the data transmission algorithm DTA (Alg. 3).

Shared by the ``okita`` policy and the baselines (FIFO and DRF place with Q at a_i, OASiS moves data with DTA),
so each formula lives once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from deepco.scheduling.okita.model import UdlJob

BIG = 1 << 30


@dataclass
class Placement:
    """A PA result: workers per site, the PS site, and the parameter-exchange cost over the window."""

    y: np.ndarray
    ps: int
    cost: float


def deployment_metric(job: UdlJob, avail: np.ndarray, cap: np.ndarray, q: np.ndarray, remaining: np.ndarray,
                      betas: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> np.ndarray:
    """Q_i^r(t) of eq. (6) for every site r.

    A resource type a site does not have (C_r^k = 0) adds 0 to the first term; a site where the job has no
    data (D_i^r = 0) adds 0 to the third. With R = 1 the second term is 0.
    """
    b1, b2, b3 = betas
    r = cap.shape[0]
    with np.errstate(divide="ignore", invalid="ignore"):
        res = np.where(cap > 0, avail / np.where(cap > 0, cap, 1.0), 0.0).mean(axis=1)
        data = np.where(job.data > 0, remaining / np.where(job.data > 0, job.data, 1), 0.0)
    bw = q.sum(axis=1) * job.param_mb / (r - 1) if r > 1 else np.zeros(r)
    return b1 * res - b2 * bw + b3 * data


def assignable(job: UdlJob, avail: np.ndarray) -> np.ndarray:
    """A_i^r without the PS: min_k floor(U_r^k / m_i^k) over the types the worker needs (>= 0)."""
    need = job.worker_demand > 0
    a = np.floor(avail[:, need] / job.worker_demand[need] + 1e-9).min(axis=1)
    return np.clip(a, 0, BIG).astype(np.int64)


def _ps_assignable(job: UdlJob, avail: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(A at each site when the PS sits there, whether the PS fits there at all)."""
    rest = avail - job.ps_demand[None, :]
    fits = (rest >= -1e-9).all(axis=1)
    return assignable(job, np.maximum(rest, 0.0)), fits


def placement_costs(job: UdlJob, avail: np.ndarray, q: np.ndarray, order: np.ndarray, n_max: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """PA (Alg. 2) for every N in 1..n_max at once, per slot of the window (multiply by l_i).

    Returns (cost[N-1], ps[N-1]) with cost = inf where no PS site gives N workers. For each PS site
    r~ the workers fill the sites in the order of Q (decreasing) up to A_i^r(t) (line 10); the PS site
    kept is the last one with the smallest cost, as line 12's "<=" does.
    """
    base = assignable(job, avail)
    at_ps, ps_fits = _ps_assignable(job, avail)
    ns = np.arange(1, n_max + 1)
    cost = np.full(n_max, np.inf)
    best = np.full(n_max, -1)
    ps_sites = np.flatnonzero(ps_fits)
    if not len(ps_sites):
        return cost, best
    # one row per PS site r~: A with the PS's share taken at r~, in the Q order (all PS sites at once)
    a = np.tile(base, (len(ps_sites), 1))
    a[np.arange(len(ps_sites)), ps_sites] = at_ps[ps_sites]
    a_sorted = a[:, order]
    prev = np.cumsum(a_sorted, axis=1) - a_sorted
    y = np.clip(ns[None, :, None] - prev[:, None, :], 0, a_sorted[:, None, :])  # [PS site, N, site]
    qs = q[order][:, ps_sites].T  # [PS site, site in Q order]: q^{r r~}
    c = np.einsum("pnr,pr->pn", y, qs) * job.param_mb
    ok = y.sum(axis=2) >= ns[None, :]
    c = np.where(ok, c, np.inf)
    # the last PS site with the smallest cost (Alg. 2 line 12's "<="), as a sequential scan would keep
    rev = c[::-1]
    idx = len(ps_sites) - 1 - np.argmin(rev, axis=0)
    cost = c[idx, np.arange(n_max)]
    best = np.where(np.isfinite(cost), ps_sites[idx], -1)
    return cost, best


def place(job: UdlJob, avail: np.ndarray, q: np.ndarray, order: np.ndarray, n: int, ps: int) -> np.ndarray:
    """The workers per site PA gives for N = n with the PS at ``ps``."""
    a = assignable(job, avail)
    at_ps, _ = _ps_assignable(job, avail)
    a[ps] = at_ps[ps]
    y = np.zeros(avail.shape[0], dtype=np.int64)
    left = n
    for s in order:
        take = min(int(a[s]), left)
        y[s] = take
        left -= take
    return y


def pa(job: UdlJob, avail: np.ndarray, q: np.ndarray, order: np.ndarray, n: int, window: int
       ) -> Placement | None:
    """Alg. 2 for one N: the cheapest PS site and its worker placement, or None when N workers do not fit."""
    cost, best = placement_costs(job, avail, q, order, n)
    if not math.isfinite(cost[n - 1]):
        return None
    p = int(best[n - 1])
    return Placement(y=place(job, avail, q, order, n, p), ps=p, cost=window * float(cost[n - 1]))


def split_workload(job: UdlJob, y: np.ndarray, remaining: np.ndarray, q: np.ndarray, window: int = 1
                   ) -> np.ndarray:
    """d_i^r: the chunks each site trains over ``window`` slots with workers y (Alg. 1 line 22).

    The paper only says d is computed "based on" y. Choice: every site trains up to its capacity
    (per_worker x y^r x window), its own data first; the rest of the total min(capacity, M_i(t)) goes to the
    spare capacity nearest (smallest q) to the data that must move, so DTA then moves as cheaply as it can.
    """
    capy = job.per_worker * y.astype(np.int64) * window
    total = int(min(capy.sum(), remaining.sum()))
    d = np.minimum(capy, remaining).astype(np.int64)
    need = total - int(d.sum())
    if need > 0:
        spare = capy - d
        surplus = remaining - d
        src = np.flatnonzero(surplus > 0)
        dst = np.flatnonzero(spare > 0)
        sub = q[np.ix_(src, dst)]
        # cheapest (source, destination) pairs first; ties by destination then source index
        keys = np.lexsort((np.repeat(src, len(dst)), np.tile(dst, len(src)), sub.ravel()))
        for kidx in keys:
            if need == 0:
                break
            s, r = int(src[kidx // len(dst)]), int(dst[kidx % len(dst)])
            if s == r:
                continue
            take = int(min(spare[r], surplus[s], need))
            if take > 0:
                d[r] += take
                spare[r] -= take
                surplus[s] -= take
                need -= take
    return d


def dta(job: UdlJob, d: np.ndarray, remaining: np.ndarray, q: np.ndarray) -> tuple[float, np.ndarray]:
    """Alg. 3: g[r', r] chunks of origin r' trained at r, filling each short site (H^r < 0, in site order)
    from the sites with data to spare in increasing q^{r' r}; returns (delta_i sum q g, g).

    Line 7's "H^{r_j} - sum g" is read as: what site r_j still has after what it already gave away.
    """
    r = len(d)
    g = np.zeros((r, r), dtype=np.int64)
    local = np.minimum(d, remaining)
    g[np.arange(r), np.arange(r)] = local
    h = remaining - d
    given = np.zeros(r, dtype=np.int64)
    for dst in range(r):
        if h[dst] >= 0:
            continue
        want = int(-h[dst])
        for src in sorted(range(r), key=lambda s: (q[s, dst], s)):
            if want == 0:
                break
            if src == dst or h[src] <= 0:
                continue
            take = int(min(h[src] - given[src], want))
            if take > 0:
                g[src, dst] += take
                given[src] += take
                want -= take
        if want:
            raise ValueError(f"job {job.id}: DTA cannot find {want} chunks for site {dst}")
    return job.chunk_mb * float((q * g).sum()), g
