"""Okita's three baselines (Sec. V-A), as the paper describes them:

- ``FIFO``: jobs start in arrival order (head-of-line blocking) with a fixed number of workers drawn in
  [1, 0.5 A_i(a_i)], A_i = workers the available resources could hold; workers and PS are placed with the
  deployment metric Q_i^r (PA at start) and never move; the job's data is dispatched once, in proportion to
  the workers of each site, cheapest link first (DTA). The draw uses the policy's seed (the paper does not
  say how the number is chosen inside the range).
- ``DRF``: the same fixed deployment, with the number of workers from multi-resource max-min fairness
  (progressive filling of dominant shares over the pooled free resources) among the jobs waiting to start.
- ``OASiS``: at arrival, each job's whole schedule (start, window, workers per site, PS) is chosen to
  minimise the resource price sum_k m^k/C_r^k P(u_r^k(t)) (the exponential price of OASiS,
  P(u) = L (U/L)^u with L = 1, U = 100, u the reserved fraction) plus f_i; the reservation is kept; data
  moves online each slot with DTA. Parameter exchange is not priced, as OASiS knows no bandwidth cost.
  Starts are searched up to ``look_ahead`` slots after arrival (further when nothing fits there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from deepco.scheduling.okita.algorithms import assignable, deployment_metric, dta, pa, split_workload
from deepco.scheduling.okita.engine import UdlJobState, UdlState
from deepco.scheduling.okita.model import SlotDecision, UdlInstance, UdlJob


@dataclass
class Fixed:
    """A fixed deployment: workers, PS, and the data each site was sent at start (assigned[orig, dest])."""

    y: np.ndarray
    ps: int
    assigned: np.ndarray


def _dispatch(job: UdlJob, y: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Split D_i over the worker sites in proportion to y (largest remainder), then move it with DTA."""
    total = job.total
    share = total * y / y.sum()
    d = np.floor(share).astype(np.int64)
    for r in np.argsort(-(share - d), kind="stable")[: total - int(d.sum())]:
        d[r] += 1
    _, g = dta(job, d, job.data.astype(np.int64), q)
    return g


class _FixedPolicy:
    """What FIFO and DRF share: running jobs keep their deployment and train their assigned data."""

    name = "fixed"

    def reset(self, instance: UdlInstance) -> None:
        self.inst = instance
        self.fixed: dict[int, Fixed] = {}

    def _run(self, state: UdlState) -> tuple[dict[int, SlotDecision], np.ndarray]:
        avail = self.inst.capacity.astype(float).copy()
        out: dict[int, SlotDecision] = {}
        for jid, fx in self.fixed.items():
            if jid not in state.active:
                continue
            job = state.active[jid].job
            cap = job.per_worker * fx.y
            g = np.zeros_like(fx.assigned)
            for r in np.flatnonzero(fx.y):
                left = int(cap[r])
                for src in [r, *[s for s in range(len(cap)) if s != r]]:  # local data first
                    take = min(left, int(fx.assigned[src, r]))
                    g[src, r] = take
                    left -= take
                    if not left:
                        break
            fx.assigned -= g
            out[jid] = SlotDecision(y=fx.y, ps=fx.ps, g=g)
            avail -= np.outer(fx.y, job.worker_demand)
            avail[fx.ps] -= job.ps_demand
        return out, avail

    def _start(self, st: UdlJobState, n: int, avail: np.ndarray) -> Fixed | None:
        """PA with the Q order at a_i for n workers, or fewer when fragmentation leaves no room for n."""
        job, q = st.job, self.inst.q
        order = np.argsort(-deployment_metric(job, avail, self.inst.capacity, q, st.remaining), kind="stable")
        for k in range(n, 0, -1):
            p = pa(job, avail, q, order, k, 1)
            if p is not None:
                return Fixed(y=p.y, ps=p.ps, assigned=_dispatch(job, p.y, q))
        return None

    def _commit(self, jid: int, fx: Fixed, avail: np.ndarray, job: UdlJob) -> None:
        self.fixed[jid] = fx
        avail -= np.outer(fx.y, job.worker_demand)
        avail[fx.ps] -= job.ps_demand


class UdlFifo(_FixedPolicy):
    """FIFO of Sec. V-A (see the module docstring)."""

    name = "okita-fifo"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def reset(self, instance: UdlInstance) -> None:
        super().reset(instance)
        self.rng = np.random.default_rng(self.seed)

    def schedule(self, t: int, state: UdlState) -> dict[int, SlotDecision]:
        out, avail = self._run(state)
        for st in sorted(state.active.values(), key=lambda s: (s.job.arrival, s.job.id)):
            if st.job.id in self.fixed:
                continue
            free = int(_max_workers(st.job, avail))
            if free < 1:
                break  # head-of-line blocking
            hi = max(1, free // 2)
            n = min(int(self.rng.integers(1, hi + 1)), math.ceil(st.job.total / st.job.per_worker))
            fx = self._start(st, n, avail)
            if fx is None:
                break
            self._commit(st.job.id, fx, avail, st.job)
            out.update(self._first(st, fx))
        return out

    def _first(self, st: UdlJobState, fx: Fixed) -> dict[int, SlotDecision]:
        """The first slot of a just-started job, trained from its assignment like every later slot."""
        saved = self.fixed
        self.fixed = {st.job.id: fx}
        try:
            out, _ = self._run(UdlState(t=0, instance=self.inst, active={st.job.id: st}))
        finally:
            self.fixed = saved
        return out


class UdlDrf(UdlFifo):
    """DRF of Sec. V-A: worker counts by progressive filling of dominant shares among waiting jobs."""

    name = "okita-drf"

    def schedule(self, t: int, state: UdlState) -> dict[int, SlotDecision]:
        out, avail = self._run(state)
        waiting = sorted((s for s in state.active.values() if s.job.id not in self.fixed),
                         key=lambda s: (s.job.arrival, s.job.id))
        if not waiting:
            return out
        total = self.inst.capacity.sum(axis=0)
        pool = avail.sum(axis=0)
        counts = {s.job.id: 0 for s in waiting}
        share = {s.job.id: float(np.max(np.where(total > 0, s.job.worker_demand / np.where(total > 0, total, 1), 0)))
                 for s in waiting}
        growing = {s.job.id: s for s in waiting}
        while growing:
            jid = min(growing, key=lambda j: (counts[j] * share[j], growing[j].job.arrival, j))
            job = growing[jid].job
            need = job.worker_demand + (job.ps_demand if counts[jid] == 0 else 0)
            if counts[jid] >= math.ceil(job.total / job.per_worker) or (need > pool + 1e-9).any():
                del growing[jid]
                continue
            pool = pool - need
            counts[jid] += 1
        for st in waiting:
            n = counts[st.job.id]
            if n < 1:
                continue
            fx = self._start(st, n, avail)
            if fx is None:
                continue
            self._commit(st.job.id, fx, avail, st.job)
            out.update(self._first(st, fx))
        return out


def _max_workers(job: UdlJob, avail: np.ndarray) -> int:
    """A_i: the workers the available resources could hold (with the PS on the site that loses least)."""
    a = assignable(job, avail)
    rest = avail - job.ps_demand[None, :]
    fits = (rest >= -1e-9).all(axis=1)
    if not fits.any():
        return 0
    loss = a - assignable(job, np.maximum(rest, 0))
    return int(a.sum() - loss[fits].min())


class Oasis:
    """OASiS as Okita's paper uses it (see the module docstring)."""

    name = "okita-oasis"

    def __init__(self, look_ahead: int = 15, low: float = 1.0, high: float = 100.0):
        self.look_ahead, self.low, self.high = look_ahead, low, high

    def reset(self, instance: UdlInstance) -> None:
        self.inst = instance
        horizon = max(j.arrival for j in instance.jobs) + 64 if instance.jobs else 64
        self.used = np.zeros((horizon, *instance.capacity.shape))
        self.plan: dict[int, tuple[int, int, np.ndarray, int]] = {}  # start, window, y, ps

    def _grow(self, t: int) -> None:
        if t >= self.used.shape[0]:
            extra = np.zeros((t + 64 - self.used.shape[0], *self.inst.capacity.shape))
            self.used = np.concatenate([self.used, extra])

    def _admit(self, job: UdlJob, t: int) -> None:
        """Reserve the cheapest schedule starting in [t, t + look_ahead]; if none fits there (a full
        timeline), the search moves on to the next ``look_ahead + 1`` starts, and so on."""
        first = t
        while True:
            best = self._search(job, first, first + self.look_ahead)
            if best is not None:
                break
            first += self.look_ahead + 1
            if first > t + 100_000:
                raise RuntimeError(f"okita-oasis: job {job.id} fits in no window")
        _, s, w, y, p = best
        self.used[s:s + w] += np.outer(y, job.worker_demand)[None]
        self.used[s:s + w, p] += job.ps_demand
        self.plan[job.id] = (s, w, y, p)

    def _search(self, job: UdlJob, first: int, last: int) -> tuple | None:
        cap = self.inst.capacity
        n_max = math.ceil(job.total / job.per_worker)
        wins = sorted({math.ceil(job.total / job.per_worker / n) for n in range(1, n_max + 1)})
        self._grow(last + max(wins) + 1)
        util = np.where(cap > 0, self.used / np.where(cap > 0, cap, 1), 1.0)
        price = self.low * (self.high / self.low) ** np.clip(util, 0, 1)
        frac_w = np.where(cap > 0, job.worker_demand / np.where(cap > 0, cap, 1), 0)
        frac_p = np.where(cap > 0, job.ps_demand / np.where(cap > 0, cap, 1), 0)
        wprice = (price * frac_w).sum(axis=2)  # [t, r]
        pprice = (price * frac_p).sum(axis=2)
        best = None
        for s in range(first, last + 1):
            for w in wins:
                n = math.ceil(job.total / job.per_worker / w)
                free = (cap[None] - self.used[s:s + w]).min(axis=0)
                a = assignable(job, free)
                ps_ok = ((free - job.ps_demand) >= -1e-9).all(axis=1)
                if not ps_ok.any():
                    continue
                wp, pp = wprice[s:s + w].sum(axis=0), pprice[s:s + w].sum(axis=0)
                p = int(np.argmin(np.where(ps_ok, pp, np.inf)))
                a[p] = assignable(job, np.maximum(free - job.ps_demand, 0)[p:p + 1])[0]
                if a.sum() < n:
                    continue
                y = np.zeros(len(a), dtype=np.int64)
                left = n
                for r in np.argsort(wp, kind="stable"):
                    y[r] = min(int(a[r]), left)
                    left -= int(y[r])
                cost = float(wp @ y + pp[p]) + job.cost(s + w - job.arrival)
                if best is None or cost < best[0]:
                    best = (cost, s, w, y, p)
        return best

    def schedule(self, t: int, state: UdlState) -> dict[int, SlotDecision]:
        for st in sorted(state.active.values(), key=lambda s: (s.job.arrival, s.job.id)):
            if st.job.id not in self.plan:
                self._admit(st.job, t)
        out = {}
        for jid, st in state.active.items():
            s, w, y, p = self.plan[jid]
            if not s <= t < s + w:
                continue
            d = split_workload(st.job, y, st.remaining, self.inst.q, 1)
            _, g = dta(st.job, d, st.remaining, self.inst.q)
            out[jid] = SlotDecision(y=y, ps=p, g=g)
        return out
