"""The exact optimum of problem (2) on small instances, as a mixed-integer program solved by HiGHS.

Time-indexed over slots a_i..horizon-1: y (workers per site, integer), s (PS site, binary), g (chunks of
origin r trained at r', integer), x (job runs in the slot), e (job completes in the slot; f(t + 1 - a_i) is
linear in e), and z = y^r s^{r'} linearised (z >= y - Y (1 - s), z >= 0; minimisation keeps it tight).
The model is the engine's: (2a) per origin site, (2b), (2c) while running, (2d) with the PS counted in the
slots the job runs. Returns the objective; ``None`` when the horizon is too short or HiGHS gives up.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

from deepco.scheduling.okita.model import UdlInstance


def optimum(inst: UdlInstance, horizon: int, *, time_limit: float = 60.0) -> float | None:
    """min sum_i f_i(t_i + 1 - a_i) + B_i over every schedule finishing by ``horizon``."""
    inst.check()
    r_n = inst.sites
    cap, q = inst.capacity, inst.q
    idx: dict[tuple, int] = {}
    lo: list[float] = []
    hi: list[float] = []
    integ: list[int] = []
    cost: list[float] = []

    def var(key: tuple, upper: float, integer: bool, c: float = 0.0) -> int:
        idx[key] = len(lo)
        lo.append(0.0)
        hi.append(upper)
        integ.append(1 if integer else 0)
        cost.append(c)
        return idx[key]

    for j in inst.jobs:
        ymax = math.ceil(j.total / j.per_worker)
        for t in range(j.arrival, horizon):
            var(("x", j.id, t), 1, True)
            var(("e", j.id, t), 1, True, j.cost(t + 1 - j.arrival))
            for r in range(r_n):
                var(("y", j.id, r, t), ymax, True)
                var(("s", j.id, r, t), 1, True)
                for p in range(r_n):
                    var(("g", j.id, r, p, t), int(j.data[r]), True, j.chunk_mb * q[r, p])
                    if p != r:
                        var(("z", j.id, r, p, t), ymax, False, j.param_mb * q[r, p])
    rows: list[tuple[dict[int, float], float, float]] = []
    for j in inst.jobs:
        ymax = math.ceil(j.total / j.per_worker)
        ts = range(j.arrival, horizon)
        if not ts:
            return None
        rows.append(({idx[("e", j.id, t)]: 1.0 for t in ts}, 1, 1))
        for r in range(r_n):  # (2a) per origin
            rows.append(({idx[("g", j.id, r, p, t)]: 1.0 for p in range(r_n) for t in ts},
                         int(j.data[r]), int(j.data[r])))
        for t in ts:
            x = idx[("x", j.id, t)]
            rows.append(({**{idx[("s", j.id, r, t)]: 1.0 for r in range(r_n)}, x: -1.0}, 0, 0))  # (2c)
            rows.append(({**{idx[("y", j.id, r, t)]: 1.0 for r in range(r_n)}, x: -1.0}, 0, math.inf))
            later = {idx[("e", j.id, u)]: -1.0 for u in range(t, horizon)}
            rows.append(({x: 1.0, **later}, -math.inf, 0))  # runs only up to its completion slot
            for p in range(r_n):
                y = idx[("y", j.id, p, t)]
                rows.append(({y: 1.0, x: -float(ymax)}, -math.inf, 0))
                row = {idx[("g", j.id, r, p, t)]: 1.0 for r in range(r_n)}
                row[y] = -float(j.per_worker)
                rows.append((row, -math.inf, 0))  # (2b)
                for r in range(r_n):
                    if r != p:  # z >= y^r - Y (1 - s^p)
                        rows.append(({idx[("z", j.id, r, p, t)]: 1.0, idx[("y", j.id, r, t)]: -1.0,
                                      idx[("s", j.id, p, t)]: -float(ymax)}, -float(ymax), math.inf))
    for t in range(min(j.arrival for j in inst.jobs), horizon):  # (2d)
        for r in range(r_n):
            for k in range(cap.shape[1]):
                row = {}
                for j in inst.jobs:
                    if j.arrival <= t:
                        if j.worker_demand[k]:
                            row[idx[("y", j.id, r, t)]] = float(j.worker_demand[k])
                        if j.ps_demand[k]:
                            row[idx[("s", j.id, r, t)]] = float(j.ps_demand[k])
                if row:
                    rows.append((row, -math.inf, float(cap[r, k])))
    a = lil_matrix((len(rows), len(lo)))
    lb, ub = np.empty(len(rows)), np.empty(len(rows))
    for i, (row, low, up) in enumerate(rows):
        for col, v in row.items():
            a[i, col] = v
        lb[i], ub[i] = low, up
    res = milp(c=np.array(cost), constraints=LinearConstraint(a.tocsr(), lb, ub), integrality=np.array(integ),
               bounds=Bounds(np.array(lo), np.array(hi)), options={"time_limit": time_limit})
    if res.status != 0 or res.x is None:
        return None
    return float(res.fun)


def small_instance(seed: int, *, sites: int = 3, jobs: int = 4, kind: str = "sigmoid") -> UdlInstance:
    """A small random instance in Sec. V-B's spirit, scaled down so the MILP solves in seconds: 3 sites,
    a few chunks per site, workers taking a quarter to a half of a site, arrivals in the first 3 slots."""
    from deepco.scheduling.okita.model import UdlJob
    from deepco.scheduling.okita.workloads import latency_cost

    rng = np.random.default_rng(seed)
    cap = np.column_stack([rng.integers(8, 17, size=sites), rng.integers(16, 33, size=sites)]).astype(float)
    qm = np.triu(rng.uniform(0.02, 0.08, size=(sites, sites)), 1)
    js = []
    for i in range(jobs):
        js.append(UdlJob(id=i, arrival=int(rng.integers(0, 3)), data=rng.integers(1, 5, size=sites),
                         worker_demand=np.array([rng.integers(2, 5), rng.integers(4, 9)], float),
                         ps_demand=np.array([1.0, float(rng.integers(2, 5))]),
                         per_worker=int(rng.integers(1, 4)), chunk_mb=float(rng.uniform(20, 60)),
                         param_mb=float(rng.uniform(30, 575)), cost=latency_cost(rng, kind)))
    return UdlInstance(capacity=cap, q=qm + qm.T, jobs=js)
