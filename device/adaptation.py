"""Live adaptation: every plan keeps measuring while it runs, and the device moves to a better plan without
losing a frame.

- **Measuring.** Each frame's timing (device/records.py: the servers' own `StepTimes` and the device's
  send times) becomes one sample per rate: a server's compute (with its wait for a compute slot, which
  another device's frames make), an antenna's transfer (not when paced: pacing
  makes it exact), the device's own compute (local, or the tail on the device), each as seconds taken over
  seconds setup's rate gives (an antenna's: over its bytes' seconds alone; the request's fixed cost stays in
  the time taken, and the estimator takes it out of both sides of a change, `deepco.planning.live_rates.moved`).
  `deepco.planning.live_rates.LiveRates` watches them for change points.
- **Re-planning.** On a change point (or a server back from down), ``propose(down, rates)`` makes the plan
  the cost model prefers on the current rates (auto: the staged planner's best; a paper plan: the same
  algorithm). A candidate predicted faster than the running plan by more than ``margin`` is a `Trial`:
  its models are uploaded in the background (frames go on meanwhile), then every other frame runs on it
  until ``frames`` frames have run on each; the device switches if its median latency is lower.
- **No search where it can be helped.** A search on a weak camera slows the frames beside it for seconds. A
  change point too small for any plan to gain ``margin`` (`matters`) starts none; an antenna's change point is
  confirmed by probing the antenna first (`confirm`); a server down at the start joins on the plans setup made
  ahead for it (``ahead``, at ``assumed`` rates), refitted to the rate it measured (`joined`).
- **No upload where it can be helped.** An upload from a weak camera takes its CPU and its antennas from the
  live frames for seconds (a ResNet-18 is 45 MB). So calibration's finalists keep their models on the
  servers for the run (`StagedPlanner.calibrate(standby=True)`), a plan the device left keeps its own, and of
  the proposed plans one whose models are all held (``warm``: device.runners.warm; models are shared by
  content, so a split over fewer servers at the same levels is warm too) is tried rather than the best when
  predicted within ``margin`` of it; a plan that must be uploaded is tried only where its predicted gain pays for
  the upload within ``PAYBACK_SECONDS`` (`pays_back`). Frames are
  never held back nor blank, and the pipeline yields them in order whatever plan ran them
  (device/pipeline.py), so a switch loses, duplicates and reorders none.

The runners themselves are health's (device/health.py): this module says what to try and when it is better.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from deepco_device.cpu_share import Pacer
from deepco_device.records import FrameTiming

from deepco.errors import UserError
from deepco.planning.live_rates import Change, ChangeDetector, LiveRates, work_of
from deepco.planning.pacing import pace, paced
from deepco.planning.staged import DEVICE, Rates, StagedPlan, predict, refit, same_plan

if TYPE_CHECKING:
    from deepco_device.session import Device

MIN_SAMPLE_SECONDS = 1e-3  # work setup's rates give less time than this is all overhead and jitter: no sample
MARGIN = 0.15  # a candidate is tried when the cost model predicts it this much (15%) faster than the running plan
TRIAL_FRAMES = 3  # frames a candidate runs, and frames of the running plan it is compared with
WARM_LOOKED_AT = 40  # of the proposed plans, best first, how many are looked at for one whose models are held
BIAS_FRAMES = 15  # the running plan's last frames before a change point whose latency over prediction is its bias
BIAS_LEAST = 5  # fewer such frames: no bias (1)
AHEAD_WITHIN = 2.0  # a joining server measured within this factor of the rate setup planned ahead on: no search
# (its bands are refitted to the rate measured; the testbed's probes of two servers of the same CPU share differ
# by 25%, and a factor of two can change which shape is best)
AHEAD_REFITTED = 3  # of the plans made ahead, the best on the live rates, refitted to them (`refit`)
RECHECK_EVERY = 10.0  # seconds between looks at the antennas' sustained rates, which a plan's frames may not show
RECHECK_RISE = 10.0  # the rise of every antenna against which a recheck is worth its frames (`recheck_due`)
# a switch whose models must be uploaded is tried only where the time its predicted gain saves pays for the upload
# within this long (`pays_back`): a mobile link may not stay where it is for longer, and the frames beside an upload
# over a fallen radio run for seconds (on the testbed 18 s of a 10 Mbit/s radio took frames to 0.6-3.1 s each)
PAYBACK_SECONDS = 30.0
RATIO_RANGE = (0.5, 2.0)  # a known plan's measured / predicted outside this is taken as this: a plan of few frames
# a known plan's measured ratio was taken at rates one of which has moved more than this factor since: the cost
# model's error for the plan has moved with them (`quick`: on the testbed the offload measured at 0.97 of its
# predictions on a 10 Mbit/s radio ran at 0.73 of them after the radio rose tenfold)
RATIO_HOLDS_WITHIN = 2.0


def _matters(factors: Iterable[float], margin: float) -> bool:
    """Whether rates moved by ``factors`` could make some plan faster than the best before them by ``margin``.
    A plan's predicted time never falls when a rate falls nor rises when it rises, and moves by at most the
    rate's factor; so a rate moved by f moves two plans' ratio by at most f either way, and several rates by at
    most the product of theirs. (The square of it, assumed before, let an antenna read as 1.08x slower start
    a probe of the link the frames were using, and the frames beside it took 130-190 ms instead of 90.)"""
    return sum(abs(math.log(f)) for f in factors) > math.log1p(margin)


def _within(value: float, bounds: tuple[float, float]) -> float:
    """``value`` clipped to ``bounds``."""
    return min(max(value, bounds[0]), bounds[1])


def _opposite(seen: float, probed: float) -> bool:
    """Whether the frames (``seen``) and a probe (``probed``), each a factor against the rate before a change
    point, say the rate moved opposite ways (one slower, the other faster or unchanged)."""
    return math.log(seen) * math.log(probed) <= 0


@dataclass
class Trial:
    """A candidate plan on trial: its runner (made, its models on the servers, before the trial starts), and the
    latencies of the frames it ran and of the running plan's frames interleaved with them."""

    plan: StagedPlan
    why: str
    frames: int = TRIAL_FRAMES
    runner: Any = None
    cause: str = ""  # the change that led to it; set on a quick trial (`Adaptation.quick`): a search follows it
    tried: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    samples: list[dict[str, float]] = field(default_factory=list)  # the candidate's quiet frames' rate samples
    every: int = 2  # the candidate takes every ``every``-th frame (1: every frame, its rival's frames measured)
    _dealt: int = 0
    _turn: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def takes_frame(self) -> bool:
        """Whether the next frame runs on the candidate: every other frame (``every``), ``frames`` of them."""
        with self._lock:
            if self._dealt >= self.frames:
                return False
            self._turn += 1
            if self._turn % self.every:
                return False
            self._dealt += 1
            return True

    def record(self, on_trial: bool, latency: float) -> None:
        """A frame of the candidate (``on_trial``) or of the running plan finished in ``latency`` seconds."""
        with self._lock:
            (self.tried if on_trial else self.running).append(latency)

    def own(self) -> dict[str, float]:
        """The candidate's own level of every rate its frames sampled (at least two of them): the median, for
        `LiveRates.restart` once it runs."""
        keys = {key for sample in self.samples for key in sample}
        levels = {key: [sample[key] for sample in self.samples if key in sample] for key in keys}
        return {key: statistics.median(values) for key, values in levels.items() if len(values) >= 2}

    @property
    def decided(self) -> bool:
        """Whether enough frames of both have run."""
        return len(self.tried) >= self.frames and len(self.running) >= self.frames

    @property
    def faster(self) -> bool:
        """Whether the candidate measured faster (median latency)."""
        return statistics.median(self.tried) < statistics.median(self.running)

    def verdict(self) -> str:
        """E.g. ``12.0 vs 20.1 ms`` (medians of the frames each ran)."""
        return f"{statistics.median(self.tried) * 1e3:.1f} vs {statistics.median(self.running) * 1e3:.1f} ms"


class Adaptation:
    """The live rates of a device's run and the plans they suggest (see the module doc). ``propose(down, rates)``
    makes the plan the run would choose on ``rates`` without the servers in ``down``, or the plans it would
    choose from, best first; ``seconds(plan, rates)`` is what it optimises, seconds per frame (default: the
    predicted latency; with frames pipelined, 1 / the predicted fps). ``warm(plan)``: whether the plan's models
    are on its servers already; of the proposed plans, one that is and is predicted within ``margin`` of the
    best is tried rather than the best (a switch to it uploads nothing, while an upload from a weak camera
    takes its CPU and antennas from the live frames for seconds). ``known``: plans whose models were put on the
    servers (calibration's finalists); a plan the run leaves is added. ``frames_measure``: whether ``seconds`` is
    what a frame's latency measures (default: where it is the default), so that `bar` may use the frames.
    ``keep_reserve``: the run keeps `reserve`'s plan on the servers from its first frames. ``measured``: seconds
    a frame calibration measured for the known plans, by `StagedPlan.describe` (`ratio`). ``upload(plan)``: the
    bytes a switch to ``plan`` sends to the servers' models (`pays_back`; default: none)."""

    def __init__(self, device: Device, propose: Callable[[set[str], Rates], StagedPlan | list[StagedPlan]], *,
                 margin: float = MARGIN, frames: int = TRIAL_FRAMES, live: LiveRates | None = None,
                 seconds: Callable[[StagedPlan, Rates], float] | None = None,
                 warm: Callable[[StagedPlan], bool] | None = None, known: list[StagedPlan] = (),
                 ahead: list[StagedPlan] = (), assumed: dict[str, float] | None = None,
                 frames_measure: bool | None = None, keep_reserve: bool = False,
                 measured: dict[str, float] | None = None, upload: Callable[[StagedPlan], int] | None = None):
        self.device, self.propose, self.margin, self.frames = device, propose, margin, frames
        # seconds a frame calibration measured for the known plans, and measured / predicted per plan once known
        # (a plan the run leaves: its frames' median), both by `StagedPlan.describe` (which names no rows: a plan
        # refitted to other rows is taken at its shape's ratio), for `ratio`
        self._measured = dict(measured or {})
        self._ratios: dict[str, float] = {}
        self._ratio_at: dict[str, dict[str, float]] = {}  # the live factors each ratio was measured at (none: setup's)
        self.upload = upload or (lambda plan: 0)  # bytes a switch to a plan sends to the servers' models
        # plans made at setup with the servers down then, at the rates ``assumed`` for them (`joined`)
        self.ahead, self.assumed = list(ahead), dict(assumed or {})
        self.live = live or LiveRates()
        self.costs = device.costs
        self.paced = device.measured.paced
        self.seconds = seconds or (lambda plan, rates: predict(plan, self.costs, rates)["frame"])
        # whether ``seconds`` is a frame's latency, which the frames measure (`bar`; default: the predicted latency)
        self.latency = seconds is None if frames_measure is None else frames_measure
        self.keep_reserve = keep_reserve  # whether the run keeps a plan in reserve on the servers (`reserve`)
        # the running plan's quiet frames: latencies, and latency over predicted while no change point was pending
        self._plan: StagedPlan | None = None
        self._latencies: deque[float] = deque(maxlen=TRIAL_FRAMES)
        self._bias: deque[float] = deque(maxlen=BIAS_FRAMES)
        self._steady: deque[float] = deque(maxlen=BIAS_FRAMES)  # the latencies of the frames in ``_bias``
        # the running plan's median latency before the change points not yet acted on (None: too few frames),
        # and the factors before the change points last acted on (`settled`)
        self.level_before: float | None = None
        self._acted_from: dict[str, float] | None = None
        self._predicted: tuple[tuple, float] | None = None  # (the plan and factors it was for, seconds)
        self.warm = warm or (lambda plan: False)
        self.known = list(known)  # plans whose runners were made (calibration's finalists, plans left): `quick`
        self.passed_over: list[str] = []  # the plans `quick` last passed over, each with why (a JSON log event)
        self._unseen_stale = False  # an antenna changed: those the running plan leaves idle are probed (`candidate`)
        self._unconfirmed: set[int] = set()  # antennas whose change point the frames saw: probed first (`confirm`)
        self._servers_stale = False  # a server of the plan slowed: the others are probed (`probe_idle_servers`)
        self._before: dict[str, float] | None = None  # the factors before the change points not yet acted on
        # whether the last change points made the running plan slower by more than ``margin`` (predicted): only
        # then does the search for a way out hurry; else it yields the camera's CPU to the frames (``gentle``)
        self.worse = False
        self._looked: float | None = None  # when (perf_counter) the antennas were last probed (`recheck`)
        # the running plan's own latency, watched as a rate is (`slowed`): a change that no one rate shows
        self._frames_level = ChangeDetector()
        self.slowed: float | None = None

    def rates(self) -> Rates:
        """The current rates: setup's (with calibration's fit) moved by every change point seen."""
        return self.live.rates(self.device.rates())

    def observe(self, plan: StagedPlan, timing: FrameTiming) -> list[Change]:
        """Feed a frame of the running ``plan``; the change points it completes (`worse` then says whether they
        made ``plan`` slower)."""
        before = dict(self.live.factors)
        if plan is not self._plan:  # another plan: another bias, and no change point has made it slower yet
            if self._plan is not None and len(self._bias) >= BIAS_LEAST:  # the plan left: its own ratio (`ratio`)
                self._ratios[self._plan.describe()] = _within(statistics.median(self._bias), RATIO_RANGE)
                self._ratio_at[self._plan.describe()] = dict(before)
            self._plan, self.worse = plan, False
            self._frames_level.clear()
            self._latencies.clear()
            self._bias.clear()
            self._steady.clear()
        self._latencies.append(timing.latency)
        if self.latency and self._before is None:
            self._bias.append(timing.latency / self._running_seconds(plan))
            self._steady.append(timing.latency)
        changes = self.live.observe(self.samples(plan, timing))
        if changes:  # the frames that made the change point ran at the new level: no part of the plan's bias
            for _ in range(min(max(c.run for c in changes), len(self._bias))):
                self._bias.pop()
                self._steady.pop()
            if self._before is None:  # the first change point since the plan was last acted on
                self.level_before = statistics.median(self._steady) if len(self._steady) >= BIAS_LEAST else None
        if any(c.key.startswith("antenna ") for c in changes):
            self._unseen_stale = True  # the radio changed: the antennas the plan leaves idle may have too
            self._unconfirmed |= {int(c.key.split()[1]) for c in changes if c.key.startswith("antenna ")}
        if changes:
            self._before = before if self._before is None else self._before
            base = self.device.rates()
            was = self.seconds(plan, self.live.rates(base, before))
            self.worse = self.seconds(plan, self.live.rates(base)) > was * (1 + self.margin)
            if self.worse and any(c.key.startswith("server ") and c.factor > 1 for c in changes):
                self._servers_stale = True  # its work moves to servers known only by setup's one probe
        # the frames themselves slower by a change point of their own while no rate made one: another device's
        # frames on the same server spread the time over the transfer (13 -> 20-40 ms), a wait for the compute
        # slot (0-60) and the compute (68 -> 72-90), each bimodal, and on the testbed no rate's change point ever
        # came while the offload went from 82 to 130-145 ms for 140 frames (a fresh setup: 83)
        factor = self._frames_level.add(timing.latency) if self.latency else None
        self.slowed = factor if factor is not None and factor > 1 and not changes else None
        if self.slowed is not None:
            self.worse = True  # its last frames, which ran slow, stand for its side in a trial (`_trial`)
        return changes

    def settled(self, trial: Trial) -> bool:
        """Whether ``trial``, switched to after the change points last acted on, measured within ``margin`` of
        the best any plan can do now: then the search after the switch would only take the camera's CPU from
        the frames (on the testbed its probes and search took the frames after the switch from 70-90 ms to
        100-145 for ten frames). No plan runs faster than the plan replaced ran before the change points (it
        was the best then) over the product of the factors by which rates got faster since: a rate that moves
        by f moves any plan's time by at most f. (Asking that every change point made a rate slower let an
        antenna's "1.06x faster", too small to act on, send a search after the switch a server's slowdown led
        to, beside frames at 95-111 ms for 6 s.) Never where a probe, not a change point, led to it."""
        before = self._acted_from
        if self.level_before is None or before is None:
            return False
        gain = math.prod(max(1.0, before.get(k, 1.0) / self.live.factor(k)) for k in set(before) | set(
            self.live.factors))
        return statistics.median(trial.tried) * gain <= self.level_before * (1 + self.margin)

    def ratio(self, plan: StagedPlan) -> float | None:
        """``plan``'s measured seconds a frame over its predicted ones where frames of it were measured (by
        calibration: ``measured``; or while the run used it), else None: the cost model's own error for that
        plan, which on the testbed ran from 0.75-0.86 for offloads to 1.2-2.9 for splits on the same fit. Only
        where the frames measure what ``seconds`` predicts."""
        key = plan.describe()
        if not self.latency or (key not in self._ratios and key not in self._measured):
            return None
        if key not in self._ratios:
            self._ratios[key] = _within(self._measured[key] / self.seconds(plan, self.device.rates()), RATIO_RANGE)
        return self._ratios[key]

    def ratio_moved(self, plan: StagedPlan) -> bool:
        """Whether a rate has moved more than ``RATIO_HOLDS_WITHIN`` times either way since ``plan``'s `ratio` was
        measured (calibration's: at setup's rates)."""
        at = self._ratio_at.get(plan.describe(), {})
        return any(abs(math.log(self.live.factor(k) / at.get(k, 1.0))) > math.log(RATIO_HOLDS_WITHIN)
                   for k in set(at) | set(self.live.factors))

    def _frames_now(self, running: StagedPlan) -> float | None:
        """The median latency of ``running``'s last frames (None: too few, or the frames measure something
        else than ``seconds``)."""
        if not self.latency or running is not self._plan or len(self._latencies) < self._latencies.maxlen:
            return None
        return statistics.median(self._latencies)

    def pays_back(self, plan: StagedPlan, new: float, now: float, rates: Rates) -> str | None:
        """Why a switch to ``plan`` (``new`` seconds a frame against the running plan's ``now``, on ``rates``) does
        not pay for the upload of its models within ``PAYBACK_SECONDS``, or None where it does (or uploads
        nothing). The upload is timed at the antennas' current rates all together, the fastest it can cross (a
        server that derives stage models fetches a whole model from a peer instead, which costs the frames on
        that server about as much: 13.5 s at 1-2 s a frame for a 45 MB ResNet-18 on the testbed); the time
        saved is the predicted gain over every second of frames after the switch."""
        nbytes = self.upload(plan)
        if nbytes <= 0:
            return None
        seconds = nbytes / sum(rates.antenna_bytes_per_second)
        saves = (now - new) / now
        if saves > 0 and seconds <= saves * PAYBACK_SECONDS:
            return None
        return (f"its models' upload ({nbytes / 1e6:.1f} MB, {seconds:.1f} s at the antennas' current "
                f"{sum(rates.antenna_bytes_per_second) * 8e-6:.1f} Mbit/s) would take "
                + (f"{seconds / saves:.0f} s" if saves > 0 else "forever")
                + f" of frames to pay back (more than {PAYBACK_SECONDS:.0f} s)")

    def _running_seconds(self, plan: StagedPlan) -> float:
        """``seconds(plan)`` on the current rates, worked out once per plan and rates."""
        key = (id(plan), tuple(sorted(self.live.factors.items())))
        if self._predicted is None or self._predicted[0] != key:
            self._predicted = (key, self.seconds(plan, self.rates()))
        return self._predicted[1]

    def bar(self, running: StagedPlan, now: float) -> float:
        """What a candidate is compared with: ``now`` (``running``'s predicted seconds a frame on the current
        rates), or less where its last frames ran faster than that, by their median, put on the predictions'
        scale by the ratio of its frames to its predictions before the change point (the cost model's own bias
        for the plan). A probe of a slow radio can read it slower than the frames cross it (a token bucket lets a
        frame's first kilobytes through at once): on the testbed's former 64 KiB bucket an offload at 10 Mbit/s
        was predicted 207-238 ms while its frames took 151-167, and splits predicted at 148-167 ms were tried,
        their models uploaded over that radio, and measured slower."""
        frames = self._frames_now(running)
        if frames is None:
            return now
        # never above 1: a plan that ran slower than predicted is held to its frames as they are (frames of a
        # change not yet seen in its bias would otherwise rule out the way out: on the testbed a bias of 2.5,
        # from the slowed server's own frames, kept an offload at 300-400 ms beside a reserve predicted at 115)
        bias = min(1.0, statistics.median(self._bias)) if len(self._bias) >= BIAS_LEAST else 1.0
        return min(now, frames / bias)

    def matters(self, changes: list[Change]) -> bool:
        """Whether the change points ``changes``, with those before them not yet acted on (a drift comes as
        several small steps), could make some plan faster than the running one, the best before them, by
        ``margin`` (`_matters`; a change point of an antenna read as 1.00x and 1.06x on the testbed, whose fixed
        part dilutes what its samples show, and each cost a search of 1.3-2.5 s beside the frames)."""
        moved = {c.key: c.factor for c in changes}
        if self._before is not None:  # every rate against where it was when the plan was last acted on
            keys = set(self._before) | set(self.live.factors) | set(moved)
            moved = {k: self.live.factor(k) / self._before.get(k, 1.0) for k in keys}
        return _matters(moved.values(), self.margin)

    def confirm(self) -> str | None:
        """Probe the antennas whose change points the frames saw (`Device.measure_antenna`, as setup probes) and
        take the probe's rate: on a weak camera a frame's transfer holds the camera's own CPU (a 0.1-core
        quota's throttling, another process starting on the same cores), and three such frames in a row read on
        the testbed as "antenna 0 3.43x slower" while the link was unchanged; the search that hurried after it
        took the frames to 210-360 ms. Where the frames and the probe disagree on the way the rate moved, the
        faster reading is taken (each errs only slow), and where neither is faster the rate before. Returns what
        the probes found where, with them, the rates moved too little since before the change points for any
        plan to gain ``margin`` (then no search), else None."""
        before, self._before = self._before, None
        self._acted_from = before
        antennas, self._unconfirmed = sorted(self._unconfirmed), set()
        if not antennas or self.paced:
            return None
        found = []
        for m in antennas:
            key, seen = f"antenna {m}", self.live.factor(f"antenna {m}")
            probed = self._probe_antenna(m)
            if probed is None:  # its server busy or gone: the frames' reading stands
                continue
            was = (before or {}).get(key, 1.0)
            if _opposite(seen / was, probed / was):
                # the frames and the probe disagree on the way it moved: the faster reading is taken, since each
                # errs only slow. A frame's send or a probe beside the frames waits for a busy weak camera's CPU
                # (three frames read an unchanged link as "3.43x slower"; after every antenna rose from 10 to 100
                # Mbit/s the frames read "3.13x faster" and a probe "1.16x slower", and keeping the old rate
                # left a split at 125 ms beside an offload at 91). Neither faster: the rate stays where it was.
                faster = min(seen, probed)
                self.live.measured(key, min(faster, was))
                found.append(f"{key} {Change(key, seen / was).how()} in the frames but "
                             f"{Change(key, probed / was).how()} probed: "
                             + ("kept as before" if faster >= was else
                                "the frames' reading taken" if seen < probed else "the probe's reading taken"))
                continue
            self.live.measured(key, probed)
            found.append(f"{key} {Change(key, seen / was).how()} in the frames, "
                         f"{Change(key, probed / was).how()} probed")
        if not found or before is None:
            return None
        keys = set(before) | set(self.live.factors)
        if _matters((self.live.factor(k) / before.get(k, 1.0) for k in keys), self.margin):
            return None
        return "; ".join(found)

    def recheck_due(self, now: float, running: StagedPlan) -> bool:
        """Whether `recheck` is due at ``now`` (perf_counter), ``running`` being the plan the frames use:
        ``RECHECK_EVERY`` after the first frame observed, or after the last recheck or search, where a plan whose
        models are on the servers would beat ``running`` by ``margin`` were the antennas ``RECHECK_RISE`` times
        faster: a recheck's probes share the antennas and the weak camera's CPU with the frames beside them
        (each antenna's echoes grow to about 0.6 MB sent, three times, at 100 Mbit/s), so it is made only where
        it could lead somewhere. The caller then calls it (the clock restarts here)."""
        if self.paced:  # pacing enforces the configured bandwidths: nothing to find
            return False
        if self._looked is None or now - self._looked < RECHECK_EVERY:
            self._looked = self._looked or now
            return False
        self._looked = now
        rates = self.rates()
        rise = replace(rates, antenna_bytes_per_second=[r * RECHECK_RISE for r in rates.antenna_bytes_per_second])
        bar = self.seconds(running, rise) * (1 - self.margin)
        return any(self.seconds(p, rise) < bar for p in self.known
                   if not same_plan(p.to_dict(), running.to_dict()) and self.warm(p))

    def recheck(self) -> str | None:
        """Probe every antenna as setup probed it (`Device.measure_antenna`) and take each rate that reads faster
        than the current one by more than ``margin``; what was found (None: nothing). A plan whose bands fit in
        a radio's burst (a link that aggregates, a shaper's bucket) shows no rise of its sustained rate in its
        frames: on the testbed's former 64 KiB bucket a 4-server split ran at 130 ms for the rest of a run after
        every antenna rose from 10 to 100 Mbit/s, beside a fresh setup's offload at 83-93, and no change point
        came. A reading slower than the current rate is not taken: a
        probe beside the live frames on a busy camera waits for its CPU, so it reads a link slow, never fast
        (the frames show a drop themselves)."""
        self._looked = math.inf  # no other recheck meanwhile
        found = []
        try:
            for m in range(len(self.device.rates().antenna_bytes_per_second)):
                key, probed = f"antenna {m}", self._probe_antenna(m)
                if probed is None:  # its server busy or gone: looked at next time
                    continue
                current = self.live.factor(key)
                if probed * (1 + self.margin) < current:
                    self.live.measured(key, probed)
                    found.append(f"{key} {Change(key, probed / current).how()} probed")
        finally:
            self._looked = time.perf_counter()
        return ", ".join(found) or None

    def probe_unseen(self, running: StagedPlan) -> None:
        """After an antenna's change point: the antennas ``running`` does not use show nothing in its frames (a
        plan planned on their setup rates would trust stale numbers), so each is probed as setup probes it
        (`Device.measure_antenna`; idle, so the live frames do not share it) and its rate set from that."""
        if not self._unseen_stale or self.paced:
            return
        self._unseen_stale = False
        for m in sorted(set(range(len(self.device.rates().antenna_bytes_per_second))) - set(running.antennas)):
            probed = self._probe_antenna(m)
            if probed is not None:  # else its server busy or gone: planned on what is known
                self.live.measured(f"antenna {m}", probed)

    def _probe_antenna(self, m: int) -> float | None:
        """Antenna ``m`` probed as setup probes it (`Device.measure_antenna`), the frames meanwhile measuring
        nothing: how many times slower than setup's rate it is (None: its server busy or gone)."""
        try:
            with self.device.uploads.busy():
                now = self.device.measure_antenna(m)
        except UserError:
            return None
        return self.device.rates().antenna_bytes_per_second[m] / now

    def probe_idle_servers(self, running: StagedPlan, down: set[str]) -> None:
        """After a server of the ``running`` plan slowed it: the servers up that it leaves idle are probed
        again (`Device.server_rates_now`), and their rates taken, before a search moves the work to them. Setup
        timed each once, for 0.3 s, and on the testbed's shared cores that read a 0.45-core server as fast as
        the 0.35-core ones (49.2 vs 50.0 and 39.2 vs 39.3 GFLOP/s): the search chose a 0.35-core one by a hair,
        its frames ran at ~108 ms where the other's ran at ~80, and nothing measured the plans it did not run."""
        if not self._servers_stale or self.paced:
            return
        self._servers_stale = False
        idle = [s for s in self.device.servers(down) if s not in running.servers]
        try:
            with self.device.uploads.busy():
                found = self.device.server_rates_now(idle)
        except UserError:  # one busy or gone: planned on what is known
            return
        setup = self.device.measured.server_flops_per_second
        for name, rate in found.items():
            self.live.measured(f"server {name}", setup[name] / rate)
        if found:
            self.device.log("adapt: the servers the plan leaves idle probed again: " + ", ".join(
                f"{name} {rate / 1e9:.2f} GFLOP/s (setup {setup[name] / 1e9:.2f})" for name, rate in found.items()))

    def samples(self, plan: StagedPlan, timing: FrameTiming) -> dict[str, float]:
        """One frame's slowness samples (seconds taken / seconds at setup's rates), by rate."""
        base = self.device.rates()
        out: dict[str, float] = {}
        device_flops = self.costs.total_flops if not plan.servers else (  # the device ran the whole model ...
            self.costs.tail_flops(plan.levels[-1]) if plan.levels and plan.tail is None else 0)  # ... or the tail
        device_seconds = timing.compute if not plan.servers else timing.tail
        if device_flops / base.device_flops_per_second > MIN_SAMPLE_SECONDS and device_seconds > 0:
            out["device"] = device_seconds / (device_flops / base.device_flops_per_second)
        work = dict(zip(plan.servers, work_of(plan, self.costs), strict=True))
        taken: dict[int, float] = {}
        given: dict[int, float] = {}
        for step in timing.servers:
            w = work.get(step.name)
            if step.name == DEVICE or w is None:
                continue
            rate = base.server_flops_per_second.get(step.name)
            if rate and w.flops / rate > MIN_SAMPLE_SECONDS and step.compute > 0:
                # with the wait for a compute slot: another device's frames on the server take turns with ours
                # (its compute alone does not change: a second camera on it read as nothing)
                out[f"server {step.name}"] = (step.compute + step.queue) / (w.flops / rate)
            # until the server step began (its input there): not until its `received` event reached the device,
            # which a server whose CPU share is taken by computing sends late (tens of ms of noise at 100 Mbit/s)
            transfer = step.origin - step.send_start
            sending = w.sent_bytes / base.antenna_bytes_per_second[step.antenna]
            if not self.paced and transfer > 0 and sending > MIN_SAMPLE_SECONDS:
                m = step.antenna
                taken[m] = taken.get(m, 0.0) + transfer
                given[m] = given.get(m, 0.0) + sending  # the bytes alone: the fixed part cancels (live_rates)
        for m, seconds in taken.items():
            out[f"antenna {m}"] = seconds / given[m]
        return out

    def candidate(self, running: StagedPlan, down: set[str], why: str, margin: float | None = None,
                  quick: bool = True, gentle: bool = False, back: Iterable[str] = (),
                  search: bool = True) -> Trial | None:
        """A trial of the plan the current rates suggest, if the cost model predicts it better than ``running``
        by ``margin`` (default: the adaptation's; None returned: keep running). With ``quick`` (and a margin of
        0 or more: a server back needs a plan with it), one of the plans already on the servers (`known`) that
        is predicted better comes first, without a search (a weak camera takes seconds to search while frames
        run slow): its trial's ``cause`` asks for the search after it. ``gentle``: nothing got slower (a server
        back, a link faster), so the search leaves most of the camera's CPU to the frames
        (deepco.planning.pacing; `device.cpu_share.Pacer`) rather than hurry. ``back``: servers that joined;
        where setup planned ahead for them at about the rate they measured (`joined`), no search. Without
        ``search`` (the frames slowed and no rate moved: `slowed`), only the plans on the servers are looked at,
        by their measured ratios against the frames (a search on rates that did not move finds the running plan),
        and no search follows the trial."""
        margin = self.margin if margin is None else margin
        self.passed_over = []
        if not search:
            rates = self.rates()
            found = self.quick(running, down, rates, self.bar(running, self.seconds(running, rates)), margin)
            return None if found is None else self._trial(
                found[0], f"{why}; {found[1]} (its models on the servers already)")
        if self._looked is not None and self._looked != math.inf:
            self._looked = time.perf_counter()  # planned just now: the next `recheck` a while from here
        unconfirmed = self.confirm()
        if unconfirmed is not None:
            self.device.log(f"adapt: {why}, but {unconfirmed}: no search")
            return None
        self.probe_unseen(running)
        rates = self.rates()
        now = self.seconds(running, rates)
        if back and self.guessed(back, rates):
            with self._searching(gentle):  # refitting: a few plans' worth
                return self.joined(running, down, why, rates, now)
        if quick and margin >= 0:  # before the idle servers' probe: the trial measures them (and it follows)
            found = self.quick(running, down, rates, self.bar(running, now), margin)
            if found is not None:
                return self._trial(found[0], f"{why}; {found[1]} (its models on the servers already)", cause=why)
        self.probe_idle_servers(running, down)
        rates = self.rates()
        now = self.bar(running, self.seconds(running, rates))
        with self._searching(gentle):
            plan, held = self.choose(self.propose(down, rates), rates)
        if same_plan(plan.to_dict(), running.to_dict()):
            return None
        new, ratio, frames = self.seconds(plan, rates), self.ratio(plan), self._frames_now(running)
        compared = f"predicted {new * 1e3:.1f} vs {now * 1e3:.1f} ms"
        if ratio is not None and frames is not None:  # each side as it runs, as in `quick` (on the testbed after a
            # rise a split ran at 102 ms, its prediction 1.06 of its frames, and the offload, measured at 0.9 of
            # its predictions and 84 ms in a fresh setup, was predicted within 15% of the split: never tried)
            new, now = new * ratio, frames
            compared = f"expected {new * 1e3:.1f} ms (x{ratio:.2f} as measured) vs {now * 1e3:.1f} ms measured"
        if new >= now * (1 - margin):
            return None
        costly = None if held or margin < 0 else self.pays_back(plan, new, now, rates)
        if costly is not None:
            self.device.log(f"adapt: {why}; {plan.brief()} {compared}, but {costly}: kept")
            return None
        return self._trial(plan, f"{why}; {compared}{'' if held else '; its models uploaded first'}")

    @contextmanager
    def _searching(self, gentle: bool) -> Iterator[None]:
        """A search beside the frames. Hurried, it takes the camera's CPU from them, so they measure nothing
        meanwhile (`Uploads.busy`: they would measure the search, not the network). ``gentle``, it is paced
        (`device.cpu_share.Pacer`) and the frames go on measuring: on the testbed's 0.1-core camera frames took
        90.1 and 92.2 ms p50 alone and 92.9 and 93.3 beside a paced search (bench/search_beside_frames.py), far
        inside a change point's 35%; and a search that blinded them for its 4-12 s let every antenna rise
        tenfold unseen (a split ran at 110-130 ms for 70 frames after it, beside an offload at 85)."""
        if not gentle:
            with self.device.uploads.busy(), paced(None):
                yield
            return
        with paced(Pacer()):
            yield

    def _trial(self, plan: StagedPlan, why: str, cause: str = "") -> Trial:
        """A trial of ``plan``. Where the change points made the running plan slower (`worse`) and the frames
        measure what is compared (``latency``), its last frames, which ran after them, stand for its side: three
        more of its slow frames interleaved would only put off the way out (on the testbed a server cut to a
        quarter made the offload's frames 300-500 ms against 70-90 on the server it moved to), so the candidate
        takes the next ``frames`` frames."""
        trial = Trial(plan, why, self.frames, cause=cause)
        if self.worse and self.latency and len(self._latencies) >= self.frames:
            trial.running, trial.every = list(self._latencies)[-self.frames:], 1
        return trial

    def reserve(self, running: StagedPlan, down: set[str]) -> tuple[StagedPlan, str] | None:
        """The plan to keep on the servers in reserve beside ``running``: the one the cost model prefers without
        the server ``running`` gives the most work (searched beside the frames, paced), and that server; None
        where ``running`` uses no server, no other server is up, or that plan uses none or is known already
        (`known`). A server of the plan that slows down then has a way out that needs no upload: on the testbed,
        a server cut to a quarter took the offload's frames to 300-500 ms for 5.3 s while its replacement's model
        was fetched and loaded."""
        if not running.servers:
            return None
        work = work_of(running, self.costs)
        heaviest = max(zip(running.servers, work, strict=True), key=lambda sw: sw[1].flops)[0]
        if not [s for s in self.device.servers(down) if s != heaviest]:  # no other server up: nothing to keep
            return None
        rates = self.rates()
        with self._searching(gentle=True):
            plan, _ = self.choose(self.propose(down | {heaviest}, rates), rates)
        if not plan.servers or any(same_plan(plan.to_dict(), p.to_dict()) for p in self.known):
            return None
        return plan, heaviest

    def guessed(self, back: Iterable[str], rates: Rates) -> bool:
        """Whether setup planned ahead for every server in ``back`` at a rate within a factor of
        ``AHEAD_WITHIN`` of the one it measured on joining (further off, the best shape may differ: a search is
        worth its CPU)."""
        return bool(self.ahead) and all(
            s in self.assumed and s in rates.server_flops_per_second
            and 1 / AHEAD_WITHIN <= rates.server_flops_per_second[s] / self.assumed[s] <= AHEAD_WITHIN for s in back)

    def joined(self, running: StagedPlan, down: set[str], why: str, rates: Rates, now: float) -> Trial | None:
        """Of the plans made ahead, without the servers in ``down``, the ``AHEAD_REFITTED`` best on ``rates``
        refitted to them (`deepco.planning.staged.refit`: bands for the rates measured), the fastest, on trial
        whatever the margin (a server back: the frames decide); None where ``running`` (``now`` seconds a frame
        on ``rates``) is predicted no slower."""
        plans = sorted((p for p in self.ahead if not set(p.servers) & down), key=lambda p: self.seconds(p, rates))
        fitted = [refit(p, self.costs, rates) for p in plans[:AHEAD_REFITTED]]
        best = min(fitted, key=lambda p: self.seconds(p, rates), default=running)
        new = self.seconds(best, rates)
        if new >= now or same_plan(best.to_dict(), running.to_dict()):
            return None
        return Trial(best, f"{why}; planned ahead for them, predicted {new * 1e3:.1f} vs {now * 1e3:.1f} ms",
                     self.frames)

    def quick(self, running: StagedPlan, down: set[str], rates: Rates, bar: float,
              margin: float) -> tuple[StagedPlan, str] | None:
        """Of the `known` plans whose models are on the servers, without the servers in ``down``, the one expected
        fastest on ``rates`` (its prediction times its `ratio` where known) of those worth a trial, and why. Each
        plan is compared on the best scale there is: where its own measured ratio and the running plan's last
        frames are known, expected (prediction times ratio) below those frames (each side as it runs: on the
        testbed a split ran at 100-140 ms after a rise beside its prediction of 95, and the offload on the servers,
        predicted 104 and measured at 0.84 of its predictions, was never tried; faster at all is enough, since
        both sides are measured and the trial costs no upload, only a few frames), or where its ratio was measured
        at rates far from the current ones (`ratio_moved`), expected within ``margin`` above them: the ratio has
        moved by more than the margin (on the testbed after a tenfold rise the offload, at 0.97 of its predictions
        as calibration measured it on the slow radio, would have been expected at about 114 ms by the later
        search's prediction of 117.5, beside a split measured at 111; it ran at 86 when that search found it 43
        frames later; the run's log did not record the quick rule's own figures); else predicted below ``bar``
        (`bar`) by ``margin``.
        None: no such plan."""
        frames = self._frames_now(running)
        best: tuple[float, StagedPlan, str] | None = None
        self.passed_over = []
        for plan in self.known:
            if same_plan(plan.to_dict(), running.to_dict()):
                continue
            gone = set(plan.servers) & down
            if gone or not self.warm(plan):
                self.passed_over.append(f"{plan.brief()}: " + ("a server down" if gone
                                                               else "its models not on the servers"))
                continue
            new, ratio = self.seconds(plan, rates), self.ratio(plan)
            expected = new * (ratio or 1.0)
            if frames is not None and ratio is not None:  # both sides as measured: expected faster at all
                why = (f"expected {expected * 1e3:.1f} ms (predicted {new * 1e3:.1f}, x{ratio:.2f} as measured) vs "
                       f"{frames * 1e3:.1f} ms measured")
                moved = self.ratio_moved(plan)
                if moved:
                    why += (f" (its ratio measured at rates over {RATIO_HOLDS_WITHIN:g}x away: within "
                            f"{margin:.0%} above is enough)")
                if expected >= frames * (1 + margin if moved else 1):
                    self.passed_over.append(f"{plan.brief()}: {why}")
                    continue
            elif new < bar * (1 - margin):
                why = f"predicted {new * 1e3:.1f} vs {bar * 1e3:.1f} ms"
            else:
                self.passed_over.append(f"{plan.brief()}: predicted {new * 1e3:.1f} vs {bar * 1e3:.1f} ms")
                continue
            if best is None or expected < best[0]:
                best = (expected, plan, why)
        return None if best is None else best[1:]

    def choose(self, proposed: StagedPlan | list[StagedPlan], rates: Rates) -> tuple[StagedPlan, bool]:
        """Of the ``proposed`` plans (best first), the best, or the best whose models are on the servers already
        when it is predicted within ``margin`` of it; and whether the one chosen is such a plan."""
        plans = [proposed] if isinstance(proposed, StagedPlan) else list(proposed)
        best = plans[0]
        held = None
        for plan in plans[:WARM_LOOKED_AT]:
            pace()  # a paced search's caller (deepco.planning.pacing): yield between plans
            if self.warm(plan):
                held = plan
                break
        if held is not None and self.seconds(held, rates) <= self.seconds(best, rates) * (1 + self.margin):
            return held, True
        return best, held is best
