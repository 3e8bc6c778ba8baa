"""A server step's timeline (``deepco.StepTimes``): the server records it, the device reads it, here once.

Every part of a step is timed as an interval of ``time.perf_counter()``; `StepClock.add` adds it both to its
phase's sum (``input_seconds`` ... ``send_seconds``) and to the timeline (``phases``, seconds since the step's
start), so the sums and the timeline cannot disagree.
"""

from __future__ import annotations

import time

from deepco.wire import deepco_service_pb2 as dpb

# A phase's name (the JSON log's, device/records.py's StepTimes field) -> its StepTimes sum field.
PHASES: dict[str, str] = {"input": "input_seconds", "halo": "halo_seconds", "queue": "queue_seconds",
                          "compute": "compute_seconds", "encode": "encode_seconds", "send": "send_seconds",
                          "assemble": "assemble_seconds"}
_KIND = {name: dpb.StepPhase.Kind.Value(name.upper()) for name in PHASES}
_NAME = {kind: name for name, kind in _KIND.items()}


class StepClock:
    """Records one step's phases into ``times`` (a ``dpb.StepTimes``), relative to ``origin`` (perf_counter
    at the step's start)."""

    def __init__(self, times: dpb.StepTimes, origin: float):
        self.times, self.origin = times, origin

    def add(self, phase: str, start: float, end: float, level: int = 0) -> None:
        """The interval [``start``, ``end``) (perf_counter) spent in ``phase`` (a key of PHASES) on ``level``."""
        field = PHASES[phase]
        setattr(self.times, field, getattr(self.times, field) + (end - start))
        self.times.phases.add(kind=_KIND[phase], level=level, start_seconds=start - self.origin,
                              end_seconds=end - self.origin)

    def since(self, phase: str, start: float, level: int = 0) -> float:
        """`add` from ``start`` until now; returns now (perf_counter), the next phase's start."""
        now = time.perf_counter()
        self.add(phase, start, now, level)
        return now

    def finish(self) -> None:
        """The step's answer is ready: its wall time since ``origin``."""
        self.times.wall_seconds = time.perf_counter() - self.origin


def phases_of(times: dpb.StepTimes) -> tuple[tuple[str, int, float, float], ...]:
    """The timeline of ``times`` as (phase name, level, start, end) tuples, seconds since the step's start
    (phases of kinds this code does not know, from a newer server, are left out)."""
    return tuple((_NAME[p.kind], int(p.level), float(p.start_seconds), float(p.end_seconds))
                 for p in times.phases if p.kind in _NAME)
