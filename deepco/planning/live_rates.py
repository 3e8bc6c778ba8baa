"""Current rates from live frames: an online estimator with change-point detection.

Setup measures every rate once (a server's FLOP/s, an antenna's bytes/s, the device's FLOP/s); a run then sees
each of them again in every frame, as the time a piece of work took against the time setup's rate gives it.
That ratio (a *slowness*: 1 is as measured, 4 is four times slower) is noisy, and it carries a bias of its
own per plan (one plan's segments run at a different FLOP rate than another's), so the estimator does not
take its level as the rate. It watches each rate's stream of ratios for a **change point** instead, with a
two-window median test:

- the *recent* window is the last ``window`` samples, the *reference* the samples before them since the last
  change (at least ``REFERENCE`` of them, at most ``history``);
- a change is declared when every recent sample lies beyond the reference's range (less its most extreme
  sample either way), the same way, by more than ``threshold`` (relative): frames that share a server, or a
  busy machine, make samples bimodal, and a change must stand out of that noise; the recent samples become
  the new reference, and the rate is rescaled by the recent median over the first reference median of the
  plan (one origin: small errors cannot add up).

A transfer's time has a part that no bandwidth change moves: the request's round trip, the device's CPU to
marshal the bytes, the events' way back. Its size is not known per plan (it is measured once, at setup, on
one byte), and in a ratio of medians it dilutes the change: a tenfold drop of a link whose fixed part is as
long as its bytes' time reads as 5.5x. So the streams named in ``ADDITIVE`` (``antenna m``: samples are
seconds taken over the seconds setup's bandwidth gives the *bytes alone*, i.e. fixed + slowness) move by the
ratio of their medians less the fixed part (`moved`), which is the same on both sides of the change: the part
of the reference beyond the bytes' time at the factor it had then, or none where the reference is below that
(the link ran faster than setup's probe said).

A single outlier never makes every recent sample agree, and a real step has after ``window`` samples of the
new level: a change is seen at its ``window``-th sample, while a long moving average would take tens of frames
to move that far. The bias of a plan cancels in the ratio of two medians of the same plan, which is why
`LiveRates.restart` starts every stream again (from the factors found so far) when the plan changes.

Pure: no clocks, no threads; the device feeds it (device/health.py) and plans on `LiveRates.rates`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from deepco.planning.staged import Rates

WINDOW = 3  # recent samples tested against the reference
HISTORY = 15  # reference samples kept
THRESHOLD = 0.35  # every recent sample 35% beyond the reference's range, the same way, is a change point
REFERENCE = 5  # reference samples needed before a test
ADDITIVE = ("antenna ",)  # streams with a fixed part in every sample: it cancels (`moved`)
LEAST_STEP = 1 / 16  # an additive level that would fall below this share of the last one in one change: the new
# samples contradict the fixed part taken out, so the plain ratio of the medians is taken (the device's own work
# once put seconds into a reference where the link took 80 ms, and "moved" read the next frames as 16x faster)


def moved(before: float, origin: float, median: float) -> float:
    """An additive stream's new factor: ``before`` at its first reference median ``origin``, now ``median`` (in
    samples: seconds taken over the bytes' seconds at setup's rate). The fixed part is what the reference held
    beyond the bytes' time at ``before``, and never less than nothing: a link that runs faster than setup's
    probe said (tc's token bucket lets the first tens of kilobytes of a frame through at once; an operator's
    link can burst too) has a reference *below* ``before``, and a difference from there would read a tenfold
    rise as 2x. So the factor moves by the ratio of the medians less that fixed part."""
    fixed = max(0.0, origin - before)
    return before * (median - fixed) / (origin - fixed)


def _moved_or_plain(before: float, origin: float, median: float, was: float) -> float:
    """`moved`, or the plain ratio of the medians where that would fall below ``LEAST_STEP`` of ``was`` (the
    new samples at or below the fixed part the reference implied: it held no fixed part that large)."""
    now = moved(before, origin, median)
    return before * median / origin if now < was * LEAST_STEP else now


@dataclass(frozen=True)
class Change:
    """A change point: the rate ``key`` (e.g. ``server s0``, ``antenna 1``, ``device``) is now ``factor`` times
    slower than before it (below 1: faster)."""

    key: str
    factor: float
    run: int = WINDOW  # how many of the last samples made it (at the new level)

    def describe(self) -> str:
        """E.g. ``server s0 3.1x slower``."""
        return f"{self.key} {self.how()}"

    def how(self) -> str:
        """E.g. ``3.1x slower``."""
        return f"{self.factor:.2f}x slower" if self.factor >= 1 else f"{1 / self.factor:.2f}x faster"


class ChangeDetector:
    """The two-window median test on one stream of samples (see the module doc)."""

    def __init__(self, window: int = WINDOW, history: int = HISTORY, threshold: float = THRESHOLD):
        if window < 1 or history < window or threshold <= 0:
            raise ValueError("window >= 1, history >= window and threshold > 0")
        self.window, self.history, self.threshold = window, history, threshold
        self.samples: list[float] = []  # since the last change point (the reference, then the recent window)
        self.origin: float | None = None  # the first reference median since `clear`: the level 1 is measured from
        self.level = 1.0  # the current level against ``origin`` (moved at each change point)
        self.median: float | None = None  # the recent median at the last change point (linear)
        self.run = 0  # how many of the last samples made the last change point

    def add(self, sample: float) -> float | None:
        """Feed one sample (> 0); the ratio of the new median to the old one when this sample completes a change
        point, else None. ``level`` is then the new median over ``origin``: measured from one origin, not a
        product of steps, so that a run of small errors cannot add up."""
        if not sample > 0 or not math.isfinite(sample):
            return None
        self.samples.append(sample)
        del self.samples[:-(self.history + self.window)]
        logs = [math.log(x) for x in self.samples]
        if self.origin is None and len(logs) >= self.window + REFERENCE:
            self.origin = math.exp(statistics.median(logs[:-self.window]))
        k = self._changed(logs)
        if k is None:
            return None
        recent, reference = statistics.median(logs[-k:]), statistics.median(logs[:-k])
        self.samples, self.run = self.samples[-k:], k
        self.level = math.exp(recent) / (self.origin or math.exp(reference))
        self.origin = self.origin or math.exp(reference)
        self.median = math.exp(recent)
        return math.exp(recent - reference)

    def _changed(self, logs: list[float]) -> int | None:
        """How many of the last samples make a change point against those before them (None: no change).

        The last ``window`` samples are tested against a reference of at least REFERENCE; a longer run of new
        samples (a change that came soon after the last one) against a shorter reference of at least ``window``.
        Every sample of the run must lie beyond the reference's range, but its one most extreme sample either
        way, by the threshold and on the same side."""
        bar = math.log1p(self.threshold)
        for k in range(self.window, len(logs) - self.window + 1):
            if len(logs) - k < (REFERENCE if k == self.window else self.window):
                continue
            ordered = sorted(logs[:-k])
            low, high = ordered[1], ordered[-2]
            run = logs[-k:]
            if all(x > high + bar for x in run) or all(x < low - bar for x in run):
                return k
        return None

    def clear(self) -> None:
        """Forget the samples and the origin (a new plan: its own bias); the level starts again at 1."""
        self.samples.clear()
        self.origin, self.level, self.median = None, 1.0, None


class LiveRates:
    """Every rate's slowness factor against setup's measurement, moved at each change point (module doc)."""

    def __init__(self, window: int = WINDOW, history: int = HISTORY, threshold: float = THRESHOLD):
        self.window, self.history, self.threshold = window, history, threshold
        self.factors: dict[str, float] = {}  # key -> times slower than setup measured (absent: 1)
        self._detectors: dict[str, ChangeDetector] = {}
        self._before: dict[str, float] = {}  # the factors at the last restart: each detector's level multiplies them
        # additive streams started again in the run (a new plan, a probe): their next reference is tested against
        # the factor believed (`_faster_than_believed`); the run's first reference is the plan as calibrated
        self._cleared: set[str] = set()
        # an additive stream's level in the frames of the plan before its last restart, per unit of the factor
        # believed then: a plan's frames can read a link faster than setup's probe all run long (a shaper's burst),
        # so a new plan on the same link reading that level again is no change (`_faster_than_believed`)
        self._seen: dict[str, float] = {}
        self._own: set[str] = set()  # streams whose `_seen` is the running plan's own (its trial's frames)

    def observe(self, samples: dict[str, float]) -> list[Change]:
        """Feed one frame's samples (key -> seconds taken / seconds setup's rate gives); the change points they
        complete."""
        changes = []
        for key, sample in samples.items():
            detector = self._detectors.setdefault(key, ChangeDetector(self.window, self.history, self.threshold))
            fresh = detector.origin is None
            factor = detector.add(sample)
            if factor is None:
                if fresh and detector.origin is not None and key in self._cleared:
                    self._cleared.discard(key)
                    changes += self._faster_than_believed(key, detector)
                continue
            before, was = self._before.get(key, 1.0), self.factor(key)
            if key.startswith(ADDITIVE):  # fixed part + slowness: the fixed part cancels (module doc)
                now = _moved_or_plain(before, detector.origin, detector.median, was)
                self.factors[key] = now
                factor = now / was
            else:
                self.factors[key] = before * detector.level
            changes.append(Change(key, factor, detector.run))
        return changes

    def _faster_than_believed(self, key: str, detector: ChangeDetector) -> list[Change]:
        """A new reference of an additive stream, formed after a restart or a probe: a sample there is the fixed
        part plus the slowness, so one whose median lies below what is believed by more than the threshold says the
        link got faster while no reference stood (a change during a switch's search, when the frames measure
        nothing, was absorbed into the new reference: on the testbed a split ran at 110-130 ms for 70 frames
        after every antenna rose from 10 to 100 Mbit/s, beside an offload at 85, with no change point). What is
        believed is the factor, or less where the frames before the restart read the link below it (`_seen`, at
        the factor now): on the testbed an offload's frames read their link at 0.54 of setup's probe all run long,
        and the offload a slowed server led to, on the same link, read as "antenna 0 1.84x faster" and cost a
        probe and a search beside frames at 150-173 ms. Where the new plan's own level is known (its trial's
        frames, `restart`; or the same plan's frames before a probe), that is what is believed, fixed part and
        all, and the fixed part cancels (`moved`); else the factor moves by the new median over the belief (the
        fixed part taken as none: the slower reading of the two; a probe confirms it, device.adaptation). Above
        the belief says nothing: a plan's fixed part is its own."""
        was = self.factor(key)
        seen = self._seen.get(key, math.inf)
        believed = was * seen if key in self._own else min(was, was * seen)
        if detector.origin * (1 + self.threshold) >= believed:
            return []
        now = _moved_or_plain(was, believed, detector.origin, was)  # a level of the plan's own holds its fixed part
        self.factors[key] = self._before[key] = now
        detector.run = REFERENCE
        return [Change(key, now / was, REFERENCE)]

    def restart(self, own: dict[str, float] | None = None) -> None:
        """A new plan runs: its samples have a bias of their own, so every stream starts a new reference (the
        factors found so far are kept). ``own``: the new plan's own samples, by stream (the median of its trial's
        frames, which ran beside the old plan's at the factors now): an additive stream's first reference is
        then checked against the plan's own level, whatever its bias (a split's band read its link 2.93x
        faster than the offload before it had, on the same link and rate), and a stream the old plan did not
        have is checked too."""
        self._before = dict(self.factors)
        for key in self._detectors:
            self._clear(key)
        self._own.clear()
        for key, level in (own or {}).items():
            if key.startswith(ADDITIVE) and level > 0 and math.isfinite(level):
                self._seen[key] = level / self.factor(key)
                self._own.add(key)
                self._cleared.add(key)

    def measured(self, key: str, factor: float) -> None:
        """``key`` was measured apart from the frames (a probe): it is ``factor`` times slower than setup measured;
        its stream starts again from there."""
        if not factor > 0 or not math.isfinite(factor):
            return
        if key in self._detectors:  # the frames' level is read against the factor they ran at
            self._clear(key, same_plan=True)
        self.factors[key] = self._before[key] = factor

    def _clear(self, key: str, same_plan: bool = False) -> None:
        """``key``'s stream starts a new reference; an additive one's first is checked for a link faster than
        believed (`_faster_than_believed`) against the level its frames read so far (``same_plan``: they were
        the plan that goes on running, after a probe; else another plan's)."""
        detector = self._detectors[key]
        if key.startswith(ADDITIVE):
            self._cleared.add(key)
            if len(detector.samples) >= REFERENCE:  # else the reading before it stands (two restarts in a row)
                self._seen[key] = statistics.median(detector.samples) / self.factor(key)
                if same_plan:
                    self._own.add(key)
            if not same_plan:
                self._own.discard(key)
        detector.clear()

    def factor(self, key: str) -> float:
        """How many times slower than setup measured ``key`` is now."""
        return self.factors.get(key, 1.0)

    def rates(self, base: Rates, factors: dict[str, float] | None = None) -> Rates:
        """``base`` (setup's rates, with calibration's fit) with every rate divided by its factor (``factors``:
        others than the current ones, e.g. a copy of `factors` taken before a change)."""
        factors = self.factors if factors is None else factors

        def factor(key: str) -> float:
            return factors.get(key, 1.0)

        servers = {name: rate / factor(f"server {name}") for name, rate in base.server_flops_per_second.items()}
        antennas = [rate / factor(f"antenna {m}") for m, rate in enumerate(base.antenna_bytes_per_second)]
        return replace(base, server_flops_per_second=servers, antenna_bytes_per_second=antennas,
                       device_flops_per_second=base.device_flops_per_second / factor("device"))


@dataclass(frozen=True)
class Work:
    """What one participant of a plan does per frame: FLOPs it computes, image bytes it is sent."""

    flops: float
    sent_bytes: int


def stage_flops(plan, costs, j: int, i: int) -> int:
    """FLOPs of participant ``i``'s band of level ``j`` (1-based) of ``plan`` (a split's or a plan across
    scales'), its window's: the halo included."""
    if plan.kind == "scales":  # stages across scales: image-row bands of stages between levels
        return costs.stage_window(plan.levels, j, *plan.bands[j][i]).flops
    return costs.window(None if j == 1 else plan.levels[j - 2], plan.levels[j - 1], *plan.bands[j][i]).flops


def work_of(plan, costs) -> list[Work]:
    """Per participant of ``plan`` (a StagedPlan; its servers in order, an offload's one server), its work:
    every segment of its band, and the tail where it runs it; a plan without servers has none."""
    if not plan.levels:  # local, offload, round-robin: the whole model where it runs
        return [Work(costs.total_flops, costs.input_bytes) for _ in plan.servers]
    out = []
    for i, server in enumerate(plan.servers):
        flops = sum(stage_flops(plan, costs, j, i) for j in range(1, len(plan.levels) + 1))
        if plan.tail == server:
            flops += costs.tail_flops(plan.levels[-1])
        a, b = plan.windows[0][i]
        out.append(Work(flops, (b - a) * costs.row_bytes(None)))
    return out
