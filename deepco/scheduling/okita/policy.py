"""The ``okita`` policy: Alg. 1 of Han et al. (preprocessing with OSF, priority O_i(t), conflicts, DTA).

Ambiguities of the paper and the choices made here:

- Latency: a job training last in slot t completes at t + 1 (``model`` module); a window of l slots from t
  therefore costs f(t + l - a_i), as Alg. 1 line 9 writes.
- OSF's bandwidth cost (lines 32-37) covers the whole window of l_i slots: PA's parameter cost
  l_i pi_i sum q y (Alg. 2 line 12) plus DTA's cost for the workload the window trains (``split_workload``
  over l_i slots). To keep the enumeration of N (line 5) fast, PA and f are evaluated for every N and
  DTA only for the ``top_k`` cheapest N by PA + f (default 6); the smallest full cost among those wins.
- Conflict (lines 14-20): read literally, cost2 = cost1 - f(t + l) + f(t + 2l) >= cost1 always, so the job
  would never be delayed. The evident intent is comparing "migrate now" (cost1 = OSF on the available
  resources + f(t + l - a)) with "keep the tentative placement but start l slots later"
  (cost2 = tentative bandwidth cost + f(t + 2l - a)); bcost_i^* (already spent) is common and dropped.
- When N_i^* workers fit nowhere in the available resources, the job takes the best N <= N_i^* that fits
  (the line-5 enumeration on the available resources), or waits when that costs more than the delay.
- Eq. (4) with max_j tau_j (t - a_j) = 0 (every job just arrived) has its first term set to 0. Piecewise
  costs use the first term of Sec. V-C, alpha_1 min((t - a - c) / max_j (t - a_j - c_j), 0).
- Jobs are re-planned every slot (Alg. 1 lines 4-10 run for all of J_a), so workers and the PS may move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from deepco.scheduling.okita.algorithms import deployment_metric, dta, pa, place, placement_costs, split_workload
from deepco.scheduling.okita.engine import UdlJobState, UdlState
from deepco.scheduling.okita.model import SlotDecision, UdlInstance, UdlJob


@dataclass
class Tentative:
    """The preprocessing result of one job (Alg. 1 line 9)."""

    n: int
    window: int
    y: np.ndarray
    ps: int
    bcost: float  # OSF bandwidth cost over the window
    total: float  # bcost + f(t + l - a)


def window(job: UdlJob, left: int, n: int) -> int:
    """l_i = ceil(E_i M_i(t) / rho_i / N_i(t)) (Alg. 1 line 6)."""
    return math.ceil(left / job.per_worker / n)


def priority(states: list[UdlJobState], t: int, alphas: tuple[float, float] = (1.0, 1.0)) -> dict[int, float]:
    """O_i(t) of eq. (4) for every active job."""
    a1, a2 = alphas
    out: dict[int, float] = {}
    waits = {s.job.id: s.job.cost.tau * (t - s.job.arrival) for s in states if s.job.cost.kind != "piecewise"}
    top = max(waits.values(), default=0.0)
    pw = {s.job.id: t - s.job.arrival - s.job.cost.c for s in states if s.job.cost.kind == "piecewise"}
    top_pw = max(pw.values(), default=0.0)
    for s in states:
        jid = s.job.id
        pw_first = min(pw[jid] / top_pw, 0.0) if jid in pw and top_pw else 0.0
        first = pw_first if jid in pw else (waits[jid] / top if top else 0.0)
        out[jid] = a1 * first - a2 * s.left / s.job.total
    return out


class Okita:
    """Alg. 1-3 of Han et al.; see the module docstring for the choices made where the paper is open."""

    name = "okita"

    def __init__(self, alphas: tuple[float, float] = (1.0, 1.0), betas: tuple[float, float, float] = (1.0, 1.0, 1.0),
                 top_k: int = 6, blocked: frozenset[int] = frozenset()):
        """``blocked``: sites where no worker or PS may run (e.g. the sites whose inference would miss its SLO
        with training beside it, ``deepco.scheduling.deep_edge.sites_to_protect``); their data still trains
        elsewhere."""
        self.alphas, self.betas, self.top_k = alphas, betas, top_k
        self.blocked = frozenset(blocked)

    def reset(self, instance: UdlInstance) -> None:
        """Keep the instance; blocked sites offer training no resources."""
        self.inst = instance
        self.cap = instance.capacity.astype(float).copy()
        for r in self.blocked:
            if not 0 <= r < instance.sites:
                raise ValueError(f"okita: blocked site {r} is not one of the {instance.sites} sites")
            self.cap[r] = 0.0

    def osf(self, st: UdlJobState, t: int, avail: np.ndarray, n_max: int) -> Tentative | None:
        """OSF (lines 32-38) for every N in 1..n_max on ``avail``; the cheapest bcost + f(t + l - a)."""
        job, q = st.job, self.inst.q
        left = st.left
        order = np.argsort(-deployment_metric(job, avail, self.cap, q, st.remaining, self.betas),
                           kind="stable")
        per_slot, ps = placement_costs(job, avail, q, order, n_max)
        ns = np.arange(1, n_max + 1)
        wins = np.ceil(left / job.per_worker / ns).astype(int)
        lat = np.array([job.cost(t + w - job.arrival) for w in wins])
        rough = per_slot * wins + lat
        cands = [int(i) for i in np.argsort(rough, kind="stable")[: self.top_k] if math.isfinite(rough[i])]
        best: Tentative | None = None
        for i in cands:
            n, w, p = i + 1, int(wins[i]), int(ps[i])
            y = place(job, avail, q, order, n, p)
            d = split_workload(job, y, st.remaining, q, w)
            dcost, _ = dta(job, d, st.remaining, q)
            b = w * float(per_slot[i]) + dcost
            tot = b + float(lat[i])
            if best is None or tot < best.total:
                best = Tentative(n=n, window=w, y=y, ps=p, bcost=b, total=tot)
        return best

    def schedule(self, t: int, state: UdlState) -> dict[int, SlotDecision]:
        """One slot of Alg. 1."""
        inst = self.inst
        avail = self.cap.copy()
        states = list(state.active.values())
        tent: dict[int, Tentative] = {}
        for st in states:
            n_max = math.ceil(st.left / st.job.per_worker)
            tt = self.osf(st, t, self.cap, n_max)
            if tt is not None:
                tent[st.job.id] = tt
        prio = priority(states, t, self.alphas)
        out: dict[int, SlotDecision] = {}
        for st in sorted(states, key=lambda s: (-prio[s.job.id], s.job.arrival, s.job.id)):
            job = st.job
            tt = tent.get(job.id)
            if tt is None:
                continue  # the job fits nowhere even on an empty cluster; the engine reports starvation
            y, ps = tt.y, tt.ps
            if not _fits(job, y, ps, avail):
                delay = tt.bcost + job.cost(t + 2 * tt.window - job.arrival)
                mig = self._migrate(st, t, avail, tt)
                if mig is None or mig.total > delay:
                    continue  # delay training (lines 18-19)
                y, ps = mig.y, mig.ps
            d = split_workload(job, y, st.remaining, inst.q, 1)
            _, g = dta(job, d, st.remaining, inst.q)
            out[job.id] = SlotDecision(y=y, ps=ps, g=g)
            avail -= np.outer(y, job.worker_demand)
            avail[ps] -= job.ps_demand
        return out

    def _migrate(self, st: UdlJobState, t: int, avail: np.ndarray, tt: Tentative) -> Tentative | None:
        """Line 15: OSF on the available resources with N^*; if N^* does not fit, the best N < N^* that does."""
        job = st.job
        order = np.argsort(-deployment_metric(job, avail, self.cap, self.inst.q, st.remaining,
                                              self.betas), kind="stable")
        p = pa(job, avail, self.inst.q, order, tt.n, tt.window)
        if p is not None:
            d = split_workload(job, p.y, st.remaining, self.inst.q, tt.window)
            dcost, _ = dta(job, d, st.remaining, self.inst.q)
            b = p.cost + dcost
            return Tentative(n=tt.n, window=tt.window, y=p.y, ps=p.ps, bcost=b,
                             total=b + job.cost(t + tt.window - job.arrival))
        if tt.n <= 1:
            return None
        return self.osf(st, t, avail, tt.n - 1)


def _fits(job: UdlJob, y: np.ndarray, ps: int, avail: np.ndarray) -> bool:
    """Line 14: Av_r^k - (m y + n s) >= 0 everywhere."""
    need = np.outer(y, job.worker_demand)
    need[ps] += job.ps_demand
    return bool((need <= avail + 1e-9).all())
