"""An exact lower bound on total JCT for small instances: a time-indexed MILP solved by HiGHS (scipy's milp).

The MILP is problem (2) of both papers in slots, relaxed in one way only: every worker trains at the
co-located rate p_j = 1/(n_j + H_j) (xi = 1), as Wang et al. do for their competitive-ratio figures
("we simplify ILP (4) by setting zeta_j = 1, whose optimal objective is smaller"). Variables:

    y[j,s,t] in {0..min(D_j, W_s)}  workers of j on server s in slot t (only for t >= a_j + Delta_js)
    z[j,s,t] in {0, 1}              j's PS on s in slot t
    u[j,t]   in {0, 1}              j still has work at the start of slot t (t >= a_j)

    minimise   sum_j sum_t u[j,t]                                   (= sum_j c_j - a_j)
    s.t.       sum_{t'<t} sum_s p_j y[j,s,t'] >= W_j (1 - u[j,t])   (progress; W_j = E_j D_j M_j, (2e))
               sum_s p_j y[j,s,t] over all t >= W_j                  (it finishes inside its horizon)
               sum_s y[j,s,t] <= D_j u[j,t]                          ((2a), nothing after completion)
               sum_s y[j,s,t] <= D_j sum_s z[j,s,t],  sum_s z[j,s,t] <= 1     ((2b))
               sum_j y[j,s,t] <= W_s,  sum_j z[j,s,t] <= P_s   (edge servers; the cloud is unbounded)

Any schedule the simulator accepts is feasible here with at least the same objective, so the optimum is a
lower bound on every policy. The horizon of job j is a_j + UB - sum_{k != j} lb_k, where UB is a known
schedule's total JCT and lb_k job k's JCT alone on the cluster: no schedule better than UB finishes j later.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from deepco.scheduling.jobs import Job
from deepco.scheduling.topology import SimCluster


@dataclass
class LowerBound:
    """The MILP's result."""

    total_jct: float  # optimal objective (a lower bound on every policy's total JCT)
    status: str
    variables: int
    horizon: int


def solo_jct(job: Job, cluster: SimCluster) -> int:
    """A lower bound on one job's JCT in any schedule: its smallest upload delay plus its work done by
    D_j workers at the co-located rate."""
    delay = min(cluster.delay(job, s) for s in cluster.servers if s.serves_worker(job))
    return delay + math.ceil(job.total_work / (job.chunks * job.rate(True)) - 1e-9)


def lower_bound(cluster: SimCluster, jobs: Sequence[Job], upper: float, *,
                time_limit: float = 60.0) -> LowerBound:
    """Solve the relaxed MILP; ``upper`` is any feasible schedule's total JCT (e.g. the best policy's)."""
    servers = cluster.servers
    lbs = [solo_jct(j, cluster) for j in jobs]
    slack = int(math.floor(upper)) - sum(lbs)
    horizon_of = [j.arrival + lbs[k] + max(0, slack) for k, j in enumerate(jobs)]
    t_max = max(horizon_of)
    index: dict[tuple[str, int, int, int], int] = {}
    lo: list[float] = []
    hi: list[float] = []
    cost: list[float] = []
    integral: list[int] = []

    def var(key: tuple[str, int, int, int], upper_bound: float, c: float = 0.0) -> int:
        index[key] = len(lo)
        lo.append(0.0)
        hi.append(upper_bound)
        cost.append(c)
        integral.append(1)
        return index[key]

    for k, j in enumerate(jobs):
        for t in range(j.arrival, horizon_of[k]):
            var(("u", k, 0, t), 1.0, 1.0)
        for s in servers:
            ready = cluster.ready(j, s)
            for t in range(ready, horizon_of[k]):
                if s.serves_worker(j) and s.worker_slots > 0:
                    var(("y", k, s.index, t), float(min(j.chunks, s.worker_slots)))
                if s.serves_ps(j) and s.ps_slots > 0:
                    var(("z", k, s.index, t), 1.0)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    b_lo: list[float] = []
    b_hi: list[float] = []

    def row(entries: list[tuple[int, float]], low: float, high: float) -> None:
        r = len(b_lo)
        for c, v in entries:
            rows.append(r)
            cols.append(c)
            vals.append(v)
        b_lo.append(low)
        b_hi.append(high)

    for k, j in enumerate(jobs):
        p, work = j.rate(True), j.total_work
        ys = {t: [index[key] for s in servers if (key := ("y", k, s.index, t)) in index]
              for t in range(j.arrival, horizon_of[k])}
        zs = {t: [index[key] for s in servers if (key := ("z", k, s.index, t)) in index]
              for t in range(j.arrival, horizon_of[k])}
        done: list[tuple[int, float]] = []
        for t in range(j.arrival, horizon_of[k]):
            # work before slot t + W_j u[t] >= W_j
            row(done + [(index[("u", k, 0, t)], work)], work, np.inf)
            row([(c, 1.0) for c in ys[t]] + [(index[("u", k, 0, t)], -float(j.chunks))], -np.inf, 0.0)
            row([(c, 1.0) for c in ys[t]] + [(c, -float(j.chunks)) for c in zs[t]], -np.inf, 0.0)
            if zs[t]:
                row([(c, 1.0) for c in zs[t]], -np.inf, 1.0)
            done = done + [(c, p) for c in ys[t]]
        row(done, work, np.inf)
    for s in servers:
        if s.cloud:
            continue
        for t in range(t_max):
            yk = [index[key] for k in range(len(jobs)) if (key := ("y", k, s.index, t)) in index]
            zk = [index[key] for k in range(len(jobs)) if (key := ("z", k, s.index, t)) in index]
            if yk:
                row([(c, 1.0) for c in yk], -np.inf, float(s.worker_slots))
            if zk:
                row([(c, 1.0) for c in zk], -np.inf, float(s.ps_slots))
    a = coo_matrix((vals, (rows, cols)), shape=(len(b_lo), len(lo))).tocsr()
    res = milp(c=np.array(cost), integrality=np.array(integral), bounds=Bounds(np.array(lo), np.array(hi)),
               constraints=LinearConstraint(a, np.array(b_lo), np.array(b_hi)),
               options={"time_limit": time_limit, "disp": False})
    if res.x is None:
        return LowerBound(total_jct=math.nan, status=res.message, variables=len(lo), horizon=t_max)
    # an unproven optimum is not a bound: report HiGHS' dual bound then
    bound = float(res.fun) if res.status == 0 else float(getattr(res, "mip_dual_bound", math.nan))
    return LowerBound(total_jct=bound, status=res.message, variables=len(lo), horizon=t_max)
