"""`--objective slo --max-latency MS`: the plan and the frames in flight with the most sustained frames per
second whose p95 latency stays under a bound, chosen by measurement and kept by it.

Every plan offered is paired with every number of frames in flight that the cost model says still adds fps
(`options`; `deepco.planning.staged.pipelined` predicts each pair's latency and fps). The pairs predicted to
come within ``PREDICTION_SLACK`` of the bound, the most fps first, and always the one of least predicted
latency, make a short list (`shortlist`) that the device runs for a few frames each (``measure``). `choose`
keeps the pair of most measured fps whose measured p95 is within the bound; when none is, the pair of least
measured p95, and says so. During the run `SloWatch` keeps the choice honest: when the p95 of the last
frames exceeds the bound, one frame fewer is let in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from deepco.planning.calibration import FIDELITY, plan_key
from deepco.planning.staged import CostModel, Rates, StagedPlan, pipelined

MAX_DEPTH = 4  # frames in flight considered (beyond the plan's least)
SHORTLIST = 4  # pairs measured
PREDICTION_SLACK = FIDELITY[1]  # a pair predicted this far over the bound may still meet it when measured
MORE_FPS = 0.02  # another frame in flight is worth considering only when it is predicted this much faster
WATCH_FRAMES = 20  # SloWatch's window


@dataclass(frozen=True)
class Option:
    """A plan with ``depth`` frames in flight, and its predicted latency (seconds) and fps."""

    plan: StagedPlan
    depth: int
    latency: float
    fps: float

    def describe(self) -> str:
        """One line: the plan and its frames in flight."""
        return f"{self.plan.describe()}, {self.depth} frame(s) in flight"


@dataclass(frozen=True)
class Trial:
    """An option as measured: the p95 of its frames' latencies (seconds) and its sustained fps."""

    option: Option
    p95: float
    fps: float


@dataclass(frozen=True)
class SloChoice:
    """What `choose` picked, from which measured trials, and whether it meets the bound (``met``)."""

    option: Option
    trials: tuple[Trial, ...]
    bound: float
    met: bool

    def note(self) -> str:
        """The line `deepco run` prints once."""
        chosen = next(t for t in self.trials if t.option == self.option)
        if self.met:
            return (f"slo: {self.option.describe()}: measured p95 {chosen.p95 * 1e3:.1f} ms within "
                    f"{self.bound * 1e3:.1f} ms at {chosen.fps:.2f} fps (the most fps of {len(self.trials)} "
                    "measured)")
        return (f"slo: no plan measured a p95 within {self.bound * 1e3:.1f} ms ({len(self.trials)} measured); "
                f"running the lowest-latency one: {self.option.describe()}, p95 {chosen.p95 * 1e3:.1f} ms")


def options(plans: Iterable[StagedPlan], costs: CostModel, rates: Rates,
            least_depth: Callable[[StagedPlan], int] = lambda plan: 1, max_depth: int = MAX_DEPTH) -> list[Option]:
    """Every distinct plan (`plan_key`) with each number of frames in flight from ``least_depth(plan)`` up to
    ``max_depth`` past it, as long as one more frame is predicted to add at least ``MORE_FPS`` (beyond the
    busiest resource's rate, more frames in flight only queue)."""
    out: list[Option] = []
    seen: set[str] = set()
    for plan in plans:
        key = plan_key(plan)
        if key in seen:
            continue
        seen.add(key)
        least = least_depth(plan)
        previous = 0.0
        for depth in range(least, least + max_depth):
            latency, fps = pipelined(plan, costs, rates, depth)
            if fps < previous * (1 + MORE_FPS):
                break
            out.append(Option(plan, depth, latency, fps))
            previous = fps
    return out


def shortlist(candidates: Sequence[Option], bound: float, size: int = SHORTLIST) -> list[Option]:
    """The options worth measuring: the one of least predicted latency, then those predicted within
    ``PREDICTION_SLACK`` of ``bound``, most predicted fps first, ``size`` in all."""
    fastest = min(candidates, key=lambda o: o.latency)
    likely = sorted((o for o in candidates if o.latency <= bound * PREDICTION_SLACK and o is not fastest),
                    key=lambda o: -o.fps)
    return [fastest, *likely][:max(1, size)]


def choose(candidates: Sequence[Option], measure: Callable[[Option], Trial], bound: float,
           size: int = SHORTLIST) -> SloChoice:
    """Measure the `shortlist` and keep the option of most measured fps whose measured p95 is within
    ``bound`` seconds; none: the one of least measured p95 (``met`` False)."""
    if not candidates:
        raise ValueError("no plan to choose from")
    trials = tuple(measure(o) for o in shortlist(candidates, bound, size))
    meeting = [t for t in trials if t.p95 <= bound]
    if meeting:
        return SloChoice(max(meeting, key=lambda t: t.fps).option, trials, bound, True)
    return SloChoice(min(trials, key=lambda t: t.p95).option, trials, bound, False)


class SloWatch:
    """Keeps a run within its bound: fed each frame's latency, it lowers the frames in flight (``depth``) by
    one whenever the p95 of the last ``frames`` exceeds ``bound``, and starts its window afresh."""

    def __init__(self, bound: float, depth: int, least: int = 1, frames: int = WATCH_FRAMES):
        self.bound, self.depth, self.least, self.frames = bound, depth, least, frames
        self._window: list[float] = []

    def observe(self, latency: float, delivered: float | None = None) -> str | None:
        """Count one frame's latency (seconds; ``delivered``, when it left, is not needed here); a line saying
        what changed, or None."""
        self._window.append(latency)
        if len(self._window) < self.frames:
            return None
        p95 = float(np.percentile(self._window, 95))
        self._window = self._window[1:]
        if p95 <= self.bound or self.depth <= self.least:
            return None
        self.depth -= 1
        self._window = []
        return (f"slo: p95 {p95 * 1e3:.1f} ms over the last {self.frames} frames exceeds "
                f"{self.bound * 1e3:.1f} ms: now {self.depth} frame(s) in flight")
