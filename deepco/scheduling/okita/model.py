"""Okita's model (Han et al., "Online Scheduling Unbiased Distributed Learning over Wireless Edge Networks").

Sites r hold C_r^k units of K resource types; job i holds D_i^r data chunks at each site r, needs E_i epochs,
and one worker trains rho_i chunk-epochs per slot, so ``per_worker = rho_i / E_i`` chunks per slot ((2b)).
A worker takes m_i^k and the one PS n_i^k of each resource. Bandwidth cost (eq. 1) per slot:
sum_{r,r'} q^{rr'} (delta_i g_i^{rr'}(t) + pi_i y_i^r(t) s_i^{r'}(t)), with q^{rr} = 0.

Convention (the paper's Alg. 1 uses both f(t + l - a) and f(t - a)): a job that trains last in slot t_i
completes at the end of that slot, so its latency is t_i + 1 - a_i (one slot if it finishes where it
arrives), the same "completion at t + 1" the rest of ``deepco.scheduling`` uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

RESOURCES = ("gpu", "cpu", "mem_gb", "disk_gb")
COST_KINDS = ("sigmoid", "linear", "piecewise")


@dataclass(frozen=True)
class LatencyCost:
    """f_i of Sec. V-B: ``sigmoid`` (the paper's name for tau e^{0.25 t}, its default), ``linear``
    (tau t + b) or ``piecewise`` (tau1 before c, tau2 from c on)."""

    kind: str = "sigmoid"
    tau: float = 50.0  # tau (sigmoid, linear) or tau1 (piecewise)
    b: float = 0.0  # linear intercept
    tau2: float = 0.0  # piecewise: cost from the segment point on
    c: float = 0.0  # piecewise: segment point

    def __post_init__(self) -> None:
        if self.kind not in COST_KINDS:
            raise ValueError(f"latency cost kind must be one of {', '.join(COST_KINDS)}, got {self.kind!r}")

    def __call__(self, latency: float) -> float:
        """f(latency), latency in slots."""
        if self.kind == "sigmoid":
            return self.tau * math.exp(0.25 * latency)
        if self.kind == "linear":
            return self.tau * latency + self.b
        return self.tau if latency < self.c else self.tau2


@dataclass(eq=False)
class UdlJob:
    """One UDL job: its data per site, per-worker and per-PS demands, speed, and latency cost."""

    id: int
    arrival: int  # a_i
    data: np.ndarray  # D_i^r, chunks per site (int)
    worker_demand: np.ndarray  # m_i^k
    ps_demand: np.ndarray  # n_i^k
    per_worker: int  # rho_i / E_i: chunks one worker trains per slot (all E_i epochs)
    chunk_mb: float  # delta_i
    param_mb: float  # pi_i, per worker per slot
    cost: LatencyCost = field(default_factory=LatencyCost)
    epochs: int = 1  # E_i (only rho_i / E_i matters to the schedule)

    @property
    def total(self) -> int:
        """sum_r D_i^r."""
        return int(self.data.sum())

    def check(self, sites: int) -> None:
        """ValueError naming the first impossible field."""
        if self.data.shape != (sites,) or (self.data < 0).any() or self.total < 1:
            raise ValueError(f"job {self.id}: data must be {sites} non-negative chunk counts with a positive sum")
        if self.per_worker < 1:
            raise ValueError(f"job {self.id}: per_worker (rho/E) must be >= 1, got {self.per_worker}")
        if (self.worker_demand < 0).any() or (self.ps_demand < 0).any() or not self.worker_demand.any():
            raise ValueError(f"job {self.id}: worker demand must be non-negative and not all zero")
        if self.arrival < 0:
            raise ValueError(f"job {self.id}: arrival must be >= 0, got {self.arrival}")


@dataclass
class UdlInstance:
    """Sites (capacities), unit bandwidth costs and jobs."""

    capacity: np.ndarray  # C_r^k, shape (R, K)
    q: np.ndarray  # q^{rr'} per MB, shape (R, R), zero diagonal
    jobs: list[UdlJob]
    site_names: tuple[str, ...] = ()

    @property
    def sites(self) -> int:
        """R."""
        return int(self.capacity.shape[0])

    def check(self) -> None:
        """ValueError on the first inconsistency."""
        r = self.sites
        if self.q.shape != (r, r) or (self.q < 0).any() or np.diag(self.q).any():
            raise ValueError(f"q must be a non-negative {r}x{r} matrix with a zero diagonal")
        if (self.capacity < 0).any():
            raise ValueError("site capacities must be non-negative")
        ids = [j.id for j in self.jobs]
        if len(set(ids)) != len(ids):
            raise ValueError("job ids must be unique")
        for j in self.jobs:
            j.check(r)
            if j.worker_demand.shape != (self.capacity.shape[1],):
                raise ValueError(f"job {j.id}: demands must have one entry per resource type")


@dataclass
class SlotDecision:
    """One job's slot: workers per site y^r, the PS site, and chunks moved g[r, r'] (origin r trained at r';
    the diagonal is data trained where it lies)."""

    y: np.ndarray
    ps: int
    g: np.ndarray

    def bandwidth_cost(self, job: UdlJob, q: np.ndarray) -> tuple[float, float]:
        """(data transfer cost, parameter exchange cost) of eq. (1) for this slot."""
        data = job.chunk_mb * float((q * self.g).sum())
        param = job.param_mb * float(q[:, self.ps] @ self.y)
        return data, param
