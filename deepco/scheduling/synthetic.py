"""Synthetic workloads with the seeds' parameter ranges, and the filler for what a real trace lacks.

She et al. Sec. VI: E_j in [50, 100], D_j in [20, 50], M_j in [10, 50], arrival in [1, T/1.5],
n_j in [0.001, 0.05] h, H_j in [10, 100] ms, k_j in [30, 575] MB, bandwidth in [100, 5 * 1024] Mbps.
Wang et al. Sec. V-A: E_j in [20, 60], (D_j, B_j) from Table II ((27, 58), (115, 58), (60, 58)), and the
same n_j (m_j), H_j (G_j), k_j (q_j) and bandwidth ranges. One slot is one hour, as in both papers.
The upload delays come from the cluster's sites (``upload_delay`` .. ``upload_delay_max``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deepco.scheduling.jobs import Job

SLOT_SECONDS = 3600.0  # one slot is one hour in both seeds
DEMANDS = (1, 2, 4, 8)  # gang sizes for the job-level baselines (the GPU counts Philly/Gavel jobs ask for)
WANG_MODELS = ((27, 58), (115, 58), (60, 58))  # Table II: (D_j, B_j)


@dataclass(frozen=True)
class Ranges:
    """The seeds' ranges for the parameters a trace may lack."""

    epochs: tuple[int, int] = (50, 100)
    chunks: tuple[int, int] = (20, 50)
    minibatches: tuple[int, int] = (10, 50)
    worker_hours: tuple[float, float] = (0.001, 0.05)  # n_j, per mini-batch
    ps_ms: tuple[float, float] = (10.0, 100.0)  # H_j
    grad_mb: tuple[float, float] = (30.0, 575.0)  # k_j
    bandwidth_mbps: tuple[float, float] = (100.0, 5 * 1024.0)
    models: tuple[tuple[int, int], ...] = ()  # (D_j, M_j) pairs; when set, replaces chunks/minibatches


PRESETS = {
    "she": Ranges(),
    "wang": Ranges(epochs=(20, 60), models=WANG_MODELS),
}


def fill_job(rng: np.random.Generator, job_id: int, arrival: int, ranges: Ranges, *,
             demand: int | None = None, epochs: int | None = None, worker_type: str | None = None,
             ps_type: str | None = None, name: str = "") -> Job:
    """A job with the given fields and every other parameter drawn from ``ranges``."""
    if ranges.models:
        chunks, minibatches = ranges.models[int(rng.integers(len(ranges.models)))]
    else:
        chunks = int(rng.integers(ranges.chunks[0], ranges.chunks[1] + 1))
        minibatches = int(rng.integers(ranges.minibatches[0], ranges.minibatches[1] + 1))
    if demand is None:
        demand = int(DEMANDS[int(rng.integers(len(DEMANDS)))])
    chunks = max(chunks, demand)  # a gang of g workers needs g chunks (constraint (2a))
    if epochs is None:
        epochs = int(rng.integers(ranges.epochs[0], ranges.epochs[1] + 1))
    worker_time = float(rng.uniform(*ranges.worker_hours)) * 3600.0 / SLOT_SECONDS
    ps_time = float(rng.uniform(*ranges.ps_ms)) / 1000.0 / SLOT_SECONDS
    grad = float(rng.uniform(*ranges.grad_mb))
    bandwidth = float(rng.uniform(*ranges.bandwidth_mbps)) / 8.0 * SLOT_SECONDS  # MB per slot
    return Job(id=job_id, arrival=arrival, chunks=chunks, minibatches=minibatches, epochs=epochs,
               worker_time=worker_time, ps_time=ps_time, grad_size=grad, bandwidth=bandwidth, demand=demand,
               worker_type=worker_type, ps_type=ps_type, name=name)


def synthetic_jobs(count: int, *, seed: int = 0, preset: str = "she", horizon: int = 100,
                   worker_types: Sequence[str] = (), ps_types: Sequence[str] = ()) -> list[Job]:
    """``count`` jobs arriving uniformly in [1, horizon / 1.5] (She et al.'s x_j), parameters from ``preset``.

    Worker and PS types are drawn uniformly from the given ones (the cluster's), or left open if none.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    if count < 0:
        raise ValueError(f"job count must be >= 0, got {count}")
    ranges = PRESETS[preset]
    rng = np.random.default_rng(seed)
    last = max(1, int(horizon / 1.5))
    arrivals = np.sort(rng.integers(1, last + 1, size=count))
    jobs = []
    for i, a in enumerate(arrivals):
        wt = str(worker_types[int(rng.integers(len(worker_types)))]) if worker_types else None
        pt = str(ps_types[int(rng.integers(len(ps_types)))]) if ps_types else None
        jobs.append(fill_job(rng, i, int(a), ranges, worker_type=wt, ps_type=pt, name=f"syn-{i}"))
    return jobs
