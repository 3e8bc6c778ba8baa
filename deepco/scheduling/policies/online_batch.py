"""She et al., "Online Scheduling of Machine Learning Jobs in Edge-Cloud Networks": A_online (Alg. 1) with
geometric batches, A_maxsche (Alg. 2), COST_C (Alg. 3), COST_D (Alg. 4) and the price functions (7)-(8).

Time is cut at tau_i = 2^(i-1) (tau_0 = 1). At t = tau_i the jobs that arrived before tau_i and are not done
form J_i; A_maxsche accepts, in arrival order, every job whose best schedule l* has utility
eta_j = 1 - cost(l*) > 0 (eq. (6)), where a schedule runs D_u workers and one PS from tau_i to
c_j = tau_i + d_j, d_j = ceil(E_j D_j M_j / (p_j D_u)), and must end by tau_{i+1}; accepted jobs keep their
allocation unchanged until they finish ((2c)-(2d)); the rest wait for round i+1.

Prices: lambda_su(f) = theta_1^(f / W_su) - 1 with theta_1 = 2 T S U F_1 + 1 (eq. (7); the extraction lost the
superscript, this is the compact-exponential form the definition of theta implies: 0 when idle, 2TSUF_1 when
full), mu_sv(g) likewise with theta_2 = 2 T S V F_2 + 1 (eq. (8)).

The cloud: She et al. put the cloud in [S] with its own W and P, so a cloud server with finite
``worker_slots``/``ps_slots`` is priced by (7)-(8) like every edge server (and its slots are a hard limit).
A cloud without them is unbounded (Wang et al.'s model, the project's default); nothing can be priced
against an infinite W, so it costs 0 and theta, F and S then only act on the edge.

Ambiguities and our choices:
- Alg. 2 loops c_j from tau_i to tau_(i+1) outside the D_u loop, while COST_C/COST_D compute the completion
  themselves (c_j = tau_i + d_j, line 2 of Algs. 3-4). We read the pair as: at each c_j, the schedules of
  COST_C/COST_D for D_u = 1..D_j that complete at c_j; lines 7-9 keep COST_D only when strictly cheaper, and
  line 11 keeps a schedule only when its utility is strictly higher. Because the loops run c_j upward, a tie
  in utility (e.g. every schedule on idle servers costs 0) goes to the earliest completion, then to the
  fewest workers that reach it, then to co-location. A c_j at which no schedule completes evaluates nothing.
- Alg. 3/4 admit servers with a_j + Delta_js < tau_i; constraint (2i) allows a_j + Delta_js <= tau_i, and our
  first slot of work is tau_i itself, so we use (2i).
- Cost ties between servers inside COST_C/COST_D are broken by smaller upload delay, then lower index
  (edge before cloud on a tie).
- COST_D's last loop records a candidate only when it breaks; we also record it when the loop runs to the
  end (all workers moved), which the text clearly intends. Its price differences use the prices at tau_i
  as written.
- T (horizon) in theta is not known online; the planning hook sets it to the last arrival + 1, or use
  ``horizon``. F_1 = F_2 = 1 by default. S counts every server of [S] (edge servers and the cloud), U and V
  the distinct slot types of the priced servers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deepco.scheduling.jobs import Job
from deepco.scheduling.policies.base import Policy
from deepco.scheduling.simulator import Allocation, SimState
from deepco.scheduling.topology import SimCluster


@dataclass
class Schedule:
    """A schedule l: workers per server, the PS's server, duration d_j and its cost."""

    cost: float
    workers: dict[int, int]
    ps: int
    duration: int


def tau(i: int) -> int:
    """tau_i = 2^(i-1) for i >= 1, tau_0 = 1."""
    return 1 if i <= 1 else 2 ** (i - 1)


class OnlineBatch(Policy):
    """A_online of She et al. (``online-batch``)."""

    name = "online-batch"
    fixed_allocation = True

    def __init__(self, f1: float = 1.0, f2: float = 1.0, horizon: int | None = None, cj_loop: bool = True):
        """``f1``/``f2``: F_1, F_2 of eqs. (7)-(8); ``horizon``: T (default: last arrival + 1);
        ``cj_loop=False`` is an ablation that drops Alg. 2's c_j loop (D_u loop only), so a utility tie goes
        to the fewest workers (the project's behaviour before issue 17)."""
        self.f1, self.f2, self.horizon, self.cj_loop = f1, f2, horizon, cj_loop

    def plan(self, cluster: SimCluster, jobs: Sequence[Job]) -> None:
        self.cluster = cluster
        # the servers with prices: the edge and a finite cloud (an unbounded cloud is the free extra row)
        priced = [s for s in cluster.servers if not s.cloud or cluster.finite_cloud]
        horizon = self.horizon or (max((j.arrival for j in jobs), default=0) + 1)
        n_servers = max(1, len(cluster.servers))
        u = max(1, len({s.worker_type for s in priced}))
        v = max(1, len({s.ps_type for s in priced}))
        self.theta1 = 2.0 * horizon * n_servers * u * self.f1 + 1.0
        self.theta2 = 2.0 * horizon * n_servers * v * self.f2 + 1.0
        self.priced_idx = np.array([s.index for s in priced], dtype=int)
        self._pos = {s.index: i for i, s in enumerate(priced)}
        self.W = np.array([s.worker_slots for s in priced], dtype=float)
        self.P = np.array([s.ps_slots for s in priced], dtype=float)
        self.waiting: list[Job] = []
        self.running: dict[int, Allocation] = {}
        self.round = 1
        self.accepted_log: list[tuple[int, int, Schedule]] = []  # (tau_i, job id, schedule) for tests

    def on_arrival(self, t: int, jobs: list[Job]) -> None:
        self.waiting.extend(jobs)

    def on_complete(self, t: int, job: Job) -> None:
        self.running.pop(job.id, None)

    # ---- prices (7)-(8) ----------------------------------------------------------------------------------
    def worker_price(self, used: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """lambda(f) per server (``rows`` of the priced servers, default all) and slot (eq. (7))."""
        w = (self.W if rows is None else self.W[rows])[:, None]
        return self.theta1 ** np.where(w > 0, used / np.maximum(w, 1), 1.0) - 1.0

    def ps_price(self, used: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """mu(g) per server (``rows``, default all) and slot (eq. (8))."""
        p = (self.P if rows is None else self.P[rows])[:, None]
        return self.theta2 ** np.where(p > 0, used / np.maximum(p, 1), 1.0) - 1.0

    # ---- Alg. 1 ------------------------------------------------------------------------------------------
    def schedule(self, t: int, state: SimState) -> dict[int, Allocation]:
        while tau(self.round) < t:
            self.round += 1
        if t == tau(self.round) and t >= 1:
            start, end = tau(self.round), tau(self.round + 1)
            batch = [j for j in self.waiting if j.arrival < start]
            accepted = self.maxsche(batch, start, end)
            self.waiting = [j for j in self.waiting if j.id not in accepted]
            self.round += 1
        return dict(self.running)

    def stable_until(self, t: int, state: SimState) -> int:
        # allocations are fixed; the next decision is the next round boundary tau_i
        if not self.waiting:
            return 1 << 62
        i = self.round
        while tau(i) <= t:
            i += 1
        return tau(i) - 1

    # ---- Alg. 2 ------------------------------------------------------------------------------------------
    def maxsche(self, jobs: list[Job], start: int, end: int) -> set[int]:
        """A_maxsche on window [start, end): accept jobs with positive utility; returns the accepted ids."""
        length = end - start
        n = len(self.priced_idx)
        # no schedule outlasts the slowest one (one worker, spread): price only that many slots of the window
        longest = max((math.ceil(j.total_work / j.rate(False) - 1e-9) for j in jobs), default=1)
        span = max(1, min(length, longest))
        self.fw = np.zeros((n, span))  # f_su(t): workers taken in each slot of the window
        self.fp = np.zeros((n, span))  # g_sv(t)
        self._refresh()
        accepted: set[int] = set()
        for job in jobs:
            view = self._view(job, start)
            if view is None:
                continue
            # L_j: COST_C's and COST_D's schedule for each D_u, filed under the slot c_j = tau_i + d_j at
            # which it completes (line 2 of Algs. 3-4)
            pairs = {d_u: (self.cost_c(job, d_u, length, view), self.cost_d(job, d_u, length, view))
                     for d_u in range(1, job.chunks + 1)}
            if self.cj_loop:
                by_end: dict[int, dict[int, list[Schedule | None]]] = {}
                for d_u, pair in pairs.items():
                    for k, sch in enumerate(pair):
                        if sch is not None:
                            by_end.setdefault(start + sch.duration, {}).setdefault(d_u, [None, None])[k] = sch
                steps = [by_end[c_j][d_u] for c_j in sorted(by_end) for d_u in sorted(by_end[c_j])]  # lines 3-4
            else:
                steps = [list(pair) for pair in pairs.values()]
            best: Schedule | None = None
            eta = 0.0
            for central, spread in steps:
                chosen = central
                if spread is not None and (central is None or spread.cost < central.cost):  # lines 7-9
                    chosen = spread
                if chosen is not None and 1.0 - chosen.cost > eta:  # line 11: strictly higher utility only
                    best, eta = chosen, 1.0 - chosen.cost
            if best is None:
                continue
            accepted.add(job.id)
            self._reserve(best)
            self.running[job.id] = Allocation(workers=dict(best.workers), ps=best.ps)
            self.accepted_log.append((start, job.id, best))
        return accepted

    def _refresh(self) -> None:
        """Cumulative prices Lambda_s(d) = sum_{k<d} lambda_s(k) (and Mu_s), after reservations change."""
        lam = self.worker_price(self.fw)
        mu = self.ps_price(self.fp)
        self.lam0, self.mu0 = lam[:, 0].copy(), mu[:, 0].copy()
        zeros = np.zeros((len(self.priced_idx), 1))
        # one extra row of zeros stands for an unbounded cloud (always priced 0)
        self.Lam = np.vstack([np.concatenate([zeros, np.cumsum(lam, axis=1)], axis=1),
                              np.zeros((1, lam.shape[1] + 1))])
        self.Mu = np.vstack([np.concatenate([zeros, np.cumsum(mu, axis=1)], axis=1),
                             np.zeros((1, mu.shape[1] + 1))])

    def _reserve(self, sch: Schedule) -> None:
        """Take a schedule's slots and reprice the servers it touched (only their rows change)."""
        pos = self._pos
        rows = set()
        for s, c in sch.workers.items():
            if s in pos:
                self.fw[pos[s], :sch.duration] += c
                rows.add(pos[s])
        if sch.ps in pos:
            self.fp[pos[sch.ps], :sch.duration] += 1
            rows.add(pos[sch.ps])
        if rows:
            r = np.array(sorted(rows))
            lam = self.worker_price(self.fw[r], r)
            mu = self.ps_price(self.fp[r], r)
            self.lam0[r], self.mu0[r] = lam[:, 0], mu[:, 0]
            self.Lam[r, 1:] = np.cumsum(lam, axis=1)
            self.Mu[r, 1:] = np.cumsum(mu, axis=1)

    def _view(self, job: Job, start: int) -> _View | None:
        """The servers job may use in this round with their prices at tau_i (fixed while it is priced): the
        priced rows (edge, and a finite cloud), then an unbounded cloud as the free zero row."""
        cl = self.cluster
        rows, ids, delay, free_p = [], [], [], []
        for i, s in enumerate(self.priced_idx):
            srv = cl.servers[int(s)]
            if srv.serves_worker(job) and cl.ready(job, srv) <= start:
                rows.append(i)
                ids.append(int(s))
                delay.append(cl.delay(job, srv))
                free_p.append(self.P[i] - self.fp[i, 0] if srv.serves_ps(job) else 0.0)
        r = np.array(rows, dtype=int)
        free_w = list(self.W[r] - self.fw[r, 0])  # reservations all start at tau_i: slot 0 is the fullest
        lam0, mu0 = list(self.lam0[r]), list(self.mu0[r])
        c = cl.cloud
        free_cloud = c is not None and not cl.finite_cloud
        if free_cloud and c.serves_worker(job) and c.serves_ps(job) and cl.ready(job, c) <= start:
            rows.append(len(self.priced_idx))  # the zero row of Lam/Mu
            ids.append(c.index)
            delay.append(cl.delay(job, c))
            free_w.append(float(1 << 40))
            free_p.append(float(1 << 40))
            lam0.append(0.0)
            mu0.append(0.0)
        if not ids:
            return None
        v = _View(rows=np.array(rows, dtype=int), ids=np.array(ids, dtype=int),
                  delay=np.array(delay, dtype=float), free_w=np.array(free_w), free_p=np.array(free_p),
                  lam0=np.array(lam0), mu0=np.array(mu0))
        v.order = np.lexsort((v.ids, v.delay, v.lam0))  # COST_D line 3: by lambda at tau_i, ties by delay, id
        return v

    # ---- Alg. 3 ------------------------------------------------------------------------------------------
    def cost_c(self, job: Job, d_u: int, length: int, v: _View) -> Schedule | None:
        """COST_C: all D_u workers and the PS on one server, the cheapest by lambda D_u + mu at tau_i."""
        d = math.ceil(job.total_work / (job.rate(True) * d_u) - 1e-9)
        if d > length:
            return None
        fit = np.flatnonzero((v.free_w >= d_u) & (v.free_p >= 1))
        if fit.size == 0:
            return None
        key = v.lam0[fit] * d_u + v.mu0[fit]
        k = fit[np.lexsort((v.ids[fit], v.delay[fit], key))[0]]
        cost = float(self.Lam[v.rows[k], d] * d_u + self.Mu[v.rows[k], d])
        s = int(v.ids[k])
        return Schedule(cost=cost, workers={s: d_u}, ps=s, duration=d)

    # ---- Alg. 4 ------------------------------------------------------------------------------------------
    def cost_d(self, job: Job, d_u: int, length: int, v: _View) -> Schedule | None:
        """COST_D: workers spread over the cheapest servers, the PS placed by the two cases of lines 12-33."""
        d = math.ceil(job.total_work / (job.rate(False) * d_u) - 1e-9)
        if d > length:
            return None
        o = v.order
        free_w, free_p = v.free_w[o], v.free_p[o]
        lam0, mu0 = v.lam0[o], v.mu0[o]
        lam_d, mu_d = self.Lam[v.rows[o], d], self.Mu[v.rows[o], d]
        # lines 4-7: as many workers as fit on each server, cheapest first
        before = np.concatenate([[0.0], np.cumsum(free_w)[:-1]])
        y = np.clip(np.minimum(free_w, d_u - before), 0, None)
        if y.sum() < d_u:
            return None
        last = int(np.flatnonzero(y > 0)[-1])
        cost_u = float(y @ lam_d)
        costs = [cost_u + mu_d[i] if free_p[i] >= 1 else np.inf for i in range(last)]  # lines 13-17
        # lines 18-33 for i1 = s_z (moving workers onto the last used server itself)
        y_last, cost_last = self._move(y, last, last, lam0, mu0, free_w, cost_u + mu_d[last])
        costs.append(cost_last if free_p[last] >= 1 else np.inf)
        # ... and for every i1 beyond it, vectorised: workers move from s_z, s_z - 1, ... while
        # lambda_i1 - lambda_i2 - mu_i1 <= 0 (a prefix, since lambda is sorted) and room is left
        if last + 1 < len(o):
            i1 = np.arange(last + 1, len(o))
            rev = np.arange(last, -1, -1)
            lam_rev, y_rev = lam0[rev], y[rev]
            c_y = np.concatenate([[0.0], np.cumsum(y_rev)])
            c_ly = np.concatenate([[0.0], np.cumsum(y_rev * lam_rev)])
            m = np.searchsorted(-lam_rev, -(lam0[i1] - mu0[i1]), side="right")  # leading i2 that qualify
            room = free_w[i1]
            avail = c_y[m]
            k = np.minimum(np.searchsorted(c_y[1:], room, side="left"), len(rev) - 1)
            partial = c_ly[k] + (room - c_y[k]) * lam_rev[k]
            moved = np.where(room >= avail, avail, room)
            lam_sum = np.where(room >= avail, c_ly[m], partial)
            extra = mu_d[i1] + moved * (lam0[i1] - mu0[i1]) - lam_sum
            costs.extend(np.where(free_p[i1] >= 1, cost_u + extra, np.inf))
        best = int(np.argmin(costs))
        if not np.isfinite(costs[best]):
            return None
        if best < last:
            ys, ps = y, best
        else:
            ys, _ = self._move(y, best, last, lam0, mu0, free_w, 0.0) if best > last else (y_last, 0.0)
            ps = best
        workers = {int(v.ids[o[i]]): int(c) for i, c in enumerate(ys) if c > 0}
        return Schedule(cost=float(costs[best]), workers=workers, ps=int(v.ids[o[ps]]), duration=d)

    @staticmethod
    def _move(y: np.ndarray, i1: int, last: int, lam0: np.ndarray, mu0: np.ndarray, free_w: np.ndarray,
              cost: float) -> tuple[np.ndarray, float]:
        """Lines 19-32 for one i1, as written: move workers from s_z down to s_1 onto s_i1."""
        ys = y.copy()
        room = free_w[i1] - y[i1]
        for i2 in range(last, -1, -1):
            if i2 == i1:
                continue
            delta = lam0[i1] - lam0[i2] - mu0[i1]
            if not (delta <= 0 and room > 0):
                break
            move = min(ys[i2], room)
            room -= move
            cost += delta * move
            ys[i2] -= move
            ys[i1] += move
        return ys, cost


@dataclass
class _View:
    """One job's usable servers in a round (priced rows of the price tables, then an unbounded cloud)."""

    rows: np.ndarray
    ids: np.ndarray
    delay: np.ndarray
    free_w: np.ndarray
    free_p: np.ndarray
    lam0: np.ndarray
    mu0: np.ndarray
    order: np.ndarray | None = None
