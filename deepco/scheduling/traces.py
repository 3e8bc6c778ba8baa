"""Loaders for the real traces in ``shared/traces`` (see its README) and a cluster from Alibaba's node list.

Each loader maps what the trace has to job fields and fills what it lacks from a seed's ranges
(``deepco.scheduling.synthetic``) with a seeded generator:

- arrival: the trace's submit time, shifted so the first job arrives in slot 0, in slots of
  ``slot_seconds`` (default one hour, the seeds' slot);
- demand (the gang of the job-level baselines): the trace's GPU count;
- size: the trace's work (Gavel: total_steps x scale_factor; Alibaba: (deletion - scheduled) x num_gpu
  seconds; Tiresias: duration x num_gpu), turned into epochs so that the median job gets the middle of the
  seed's epoch range and every job keeps its size relative to the median (E_j = round(E_mid x size/median),
  clipped to [1, 10 x E_max] so a few extreme rows cannot make the run endless);
- D_j, M_j, n_j, H_j, k_j and the bandwidth: drawn from the seed's ranges (D_j at least the demand).

A malformed row is a ``TraceError`` naming file, line and field.
"""

from __future__ import annotations

import csv
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deepco.cluster import Cluster, parse_cluster
from deepco.errors import UserError
from deepco.scheduling.jobs import Job
from deepco.scheduling.synthetic import PRESETS, fill_job

FORMATS = ("alibaba", "gavel", "tiresias")


class TraceError(UserError):
    """A trace file is missing, unreadable, or has a malformed row."""


@dataclass
class TraceRow:
    """What a trace row says about one job, before filling."""

    line: int
    arrival_s: float
    demand: int
    size: float
    name: str = ""


def _open(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a folder; give one trace file") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a UTF-8 text file") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from None


def _num(path: Path, line: int, field: str, text: str, *, integer: bool = False,
         minimum: float = 0.0) -> float:
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise TraceError(f"{path}:{line}: field '{field}': must be {kind}, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise TraceError(f"{path}:{line}: field '{field}': must be finite, got {text!r}")
    if value < minimum:
        raise TraceError(f"{path}:{line}: field '{field}': must be >= {minimum:g}, got {text!r}")
    return value


def _csv_rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    lines = _open(path)
    if not lines:
        raise TraceError(f"{path}:1: empty file (expected a header with {', '.join(required)})")
    reader = csv.reader(lines)
    header = [h.strip() for h in next(reader)]
    missing = [f for f in required if f not in header]
    if missing:
        raise TraceError(f"{path}:1: header lacks field(s) {', '.join(missing)}")
    for i, row in enumerate(reader, start=2):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(header):
            raise TraceError(f"{path}:{i}: has {len(row)} fields, the header has {len(header)}")
        yield i, dict(zip(header, (c.strip() for c in row), strict=True))


def read_gavel(path: Path) -> list[TraceRow]:
    """Gavel's tab-separated trace, 10-field layout or the older 7-field one (detected per row)."""
    rows = []
    for i, line in enumerate(_open(path), start=1):
        if not line.strip():
            continue
        f = line.split("\t")
        if len(f) == 10:
            names = {"job_type": 0, "total_steps": 5, "scale_factor": 6, "arrival_time": 9}
        elif len(f) == 7:
            # job_type, command, num_steps_arg, needs_data_dir, total_steps, arrival_time, scale_factor
            names = {"job_type": 0, "total_steps": 4, "scale_factor": 6, "arrival_time": 5}
        else:
            raise TraceError(f"{path}:{i}: has {len(f)} tab-separated fields, expected 10 (or the older 7)")
        steps = _num(path, i, "total_steps", f[names["total_steps"]], integer=True, minimum=1)
        scale = int(_num(path, i, "scale_factor", f[names["scale_factor"]], integer=True, minimum=1))
        arrival = _num(path, i, "arrival_time", f[names["arrival_time"]])
        rows.append(TraceRow(line=i, arrival_s=arrival, demand=scale, size=steps * scale,
                             name=f[names["job_type"]].strip()))
    return rows


def read_alibaba(path: Path) -> list[TraceRow]:
    """Alibaba GPU 2023 pods: GPU pods that ran (CPU-only and never-scheduled Pending pods are skipped)."""
    rows = []
    need = ("name", "num_gpu", "pod_phase", "creation_time", "deletion_time", "scheduled_time")
    for i, r in _csv_rows(path, need):
        gpus = int(_num(path, i, "num_gpu", r["num_gpu"], integer=True))
        if gpus == 0 or r["pod_phase"] == "Pending" or not r["scheduled_time"]:
            continue  # not a training job, or it never ran: nothing to learn its size from
        created = _num(path, i, "creation_time", r["creation_time"])
        scheduled = _num(path, i, "scheduled_time", r["scheduled_time"])
        if not r["deletion_time"]:
            raise TraceError(f"{path}:{i}: field 'deletion_time': empty for a pod that was scheduled")
        deleted = _num(path, i, "deletion_time", r["deletion_time"])
        if deleted < scheduled:
            raise TraceError(f"{path}:{i}: field 'deletion_time': {deleted:g} is before scheduled_time "
                             f"{scheduled:g}")
        size = max(1.0, deleted - scheduled) * gpus
        rows.append(TraceRow(line=i, arrival_s=created, demand=gpus, size=size, name=r["name"]))
    return rows


def read_tiresias(path: Path) -> list[TraceRow]:
    """Tiresias' simulator CSV (job_id, num_gpu, submit_time, iterations, model_name, duration, interval)."""
    rows = []
    for i, r in _csv_rows(path, ("job_id", "num_gpu", "submit_time", "duration")):
        gpus = int(_num(path, i, "num_gpu", r["num_gpu"], integer=True, minimum=1))
        submit = _num(path, i, "submit_time", r["submit_time"])
        duration = _num(path, i, "duration", r["duration"], minimum=0)
        rows.append(TraceRow(line=i, arrival_s=submit, demand=gpus, size=max(1.0, duration) * gpus,
                             name=r.get("model_name", "")))
    return rows


READERS: dict[str, Callable[[Path], list[TraceRow]]] = {
    "alibaba": read_alibaba, "gavel": read_gavel, "tiresias": read_tiresias}


def load_trace(path: str | Path, fmt: str, *, seed: int = 0, jobs: int | None = None,
               slot_seconds: float = 3600.0, preset: str = "she") -> list[Job]:
    """Jobs from a trace file: the first ``jobs`` by arrival, unknown parameters drawn with ``seed``."""
    if fmt not in READERS:
        raise TraceError(f"unknown trace format {fmt!r} (known: {', '.join(FORMATS)})")
    if slot_seconds <= 0:
        raise TraceError(f"slot length must be positive, got {slot_seconds:g} s")
    path = Path(path)
    rows = sorted(READERS[fmt](path), key=lambda r: (r.arrival_s, r.line))
    if jobs is not None:
        rows = rows[:jobs]
    if not rows:
        raise TraceError(f"{path}: no usable job rows")
    ranges = PRESETS[preset]
    e_lo, e_hi = ranges.epochs
    e_mid = (e_lo + e_hi) / 2
    median = statistics.median(r.size for r in rows)
    first = rows[0].arrival_s
    rng = np.random.default_rng(seed)
    out = []
    for k, r in enumerate(rows):
        epochs = int(min(10 * e_hi, max(1, round(e_mid * r.size / median))))
        arrival = int((r.arrival_s - first) // slot_seconds)
        out.append(fill_job(rng, k, arrival, ranges, demand=r.demand, epochs=epochs,
                            name=r.name or f"{path.name}:{r.line}"))
    return out


def alibaba_cluster(path: str | Path, *, servers: int | None = None,
                    cloud_delay: tuple[float, float] = (10, 40), edge_delay: tuple[float, float] = (1, 4),
                    typed: bool = True, cloud_slots: tuple[int, int] | None = None) -> Cluster:
    """An edge-cloud cluster from ``openb_node_list_gpu_node.csv``: each node an edge server with W_s = GPUs
    and P_s = CPU cores (She et al.: "the number of GPUs and CPUs as that of workers and PSs"), the worker
    type its GPU model when ``typed``, plus one cloud: unbounded, or (worker slots, PS slots) = ``cloud_slots``.
    Delays are the seeds' ranges."""
    path = Path(path)
    nodes = []
    for i, r in _csv_rows(path, ("sn", "cpu_milli", "gpu", "model")):
        gpus = int(_num(path, i, "gpu", r["gpu"], integer=True))
        cpus = int(_num(path, i, "cpu_milli", r["cpu_milli"], integer=True)) // 1000
        nodes.append({"name": r["sn"], "capacity": 1.0, "site": "edge", "worker_slots": gpus,
                      "ps_slots": cpus, "gpus": gpus, "cpus": float(cpus),
                      **({"worker_type": r["model"]} if typed else {})})
        if servers is not None and len(nodes) >= servers:
            break
    if not nodes:
        raise TraceError(f"{path}: no node rows")
    cloud = {"worker_slots": cloud_slots[0], "ps_slots": cloud_slots[1]} if cloud_slots else {}
    nodes.append({"name": "cloud", "capacity": 1.0, "site": "cloud", **cloud})
    data = {
        "device": {"antennas": 1, "bandwidth": 1.0},
        "sites": [{"name": "edge", "kind": "edge", "upload_delay": edge_delay[0],
                   "upload_delay_max": edge_delay[1]},
                  {"name": "cloud", "kind": "cloud", "upload_delay": cloud_delay[0],
                   "upload_delay_max": cloud_delay[1]}],
        "servers": nodes,
    }
    return parse_cluster(data, str(path))
