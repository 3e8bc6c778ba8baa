"""The training-job model shared by every policy, the simulator and the lower bound.

Times are in slots (the seeds use one slot = one hour). A job has D data chunks of M mini-batches each and
trains for E epochs, so it needs E * D * M mini-batches in all (eq. (2e) of She et al., (2b) of Wang et al.).
One worker trains p mini-batches per slot, by eq. (1) of both papers:

    p = 1 / (n + H + 2k/B)   if the workers and the PS are not all on one server   (xi = 0)
    p = 1 / (n + H)          if they are                                          (xi = 1)

This module is the one place that formula lives.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Job:
    """One distributed training job with a parameter server and up to ``chunks`` workers."""

    id: int
    arrival: int  # a_j (She) / r_j (Wang): first slot the job may be scheduled in
    chunks: int  # D_j: data chunks; at most one worker per chunk, so at most D_j workers
    minibatches: int  # M_j (She) / B_j (Wang): mini-batches per chunk
    epochs: int  # E_j
    worker_time: float  # n_j (She) / m_j (Wang): slots for one worker to process one mini-batch
    ps_time: float  # H_j (She) / G_j (Wang): slots for the PS to apply one update
    grad_size: float  # k_j / q_j: gradient (= parameter) size, MB
    bandwidth: float  # B_j / b_j: reserved bandwidth, MB per slot
    demand: int = 1  # workers the owner asks for (gang size of the job-level baselines), <= chunks
    worker_type: str | None = None  # u_j; None: any worker slot will do
    ps_type: str | None = None  # v_j
    name: str = ""
    # Delta_js per site index, in whole slots; filled by deepco.scheduling.topology.bind_delays
    upload: tuple[int, ...] = field(default=())

    @property
    def total_work(self) -> float:
        """E_j * D_j * M_j: mini-batches the whole job must train."""
        return float(self.epochs * self.chunks * self.minibatches)

    @property
    def chunk_work(self) -> float:
        """E_j * M_j: mini-batches one data chunk must train."""
        return float(self.epochs * self.minibatches)

    @property
    def comm_time(self) -> float:
        """2k/B: time to push gradients and pull parameters once."""
        return 2.0 * self.grad_size / self.bandwidth

    def rate(self, colocated: bool) -> float:
        """p_j of eq. (1): mini-batches one worker trains per slot."""
        step = self.worker_time + self.ps_time + (0.0 if colocated else self.comm_time)
        return 1.0 / step

    def check(self) -> None:
        """Raise ValueError naming the first impossible field."""
        for name in ("chunks", "minibatches", "epochs", "demand"):
            if getattr(self, name) < 1:
                raise ValueError(f"job {self.id}: {name} must be >= 1, got {getattr(self, name)}")
        if self.demand > self.chunks:
            raise ValueError(f"job {self.id}: demand {self.demand} exceeds its {self.chunks} data chunks")
        if self.arrival < 0:
            raise ValueError(f"job {self.id}: arrival must be >= 0, got {self.arrival}")
        for name in ("worker_time", "bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"job {self.id}: {name} must be > 0, got {getattr(self, name)}")
        for name in ("ps_time", "grad_size"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"job {self.id}: {name} must be >= 0, got {getattr(self, name)}")
