"""Every garbage collection of every Python process started with this folder on PYTHONPATH, one line each in
$DEEPCO_GC_LOG/<pid>.txt: wall-clock time, generation, wall ms, CPU ms, objects collected. How the full passes
in a split's frames were found (deepco.heap):

    DEEPCO_GC_LOG=/tmp/gc PYTHONPATH=$PWD/bench/gc_log python bench/plan_run.py PLAN.json --frames 30 --rounds 1
    awk '$2 == 2' /tmp/gc/*.txt      # the full passes
"""

from __future__ import annotations

import atexit
import gc
import os
import time

_DIR = os.environ.get("DEEPCO_GC_LOG")
_started: list[float] = []
_lines: list[str] = []


def _flush() -> None:
    with open(os.path.join(_DIR, f"{os.getpid()}.txt"), "a") as f:
        f.writelines(_lines)
    _lines.clear()


def _on_collection(phase: str, info: dict) -> None:
    if phase == "start":
        _started[:] = [time.perf_counter(), time.process_time()]
        return
    if not _started:
        return
    wall, cpu = time.perf_counter() - _started[0], time.process_time() - _started[1]
    _lines.append(f"{time.time():.3f} {info['generation']} {wall * 1e3:.2f} {cpu * 1e3:.2f} {info['collected']}\n")
    if info["generation"] == 2 or len(_lines) >= 50:
        _flush()


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    gc.callbacks.append(_on_collection)
    atexit.register(_flush)
