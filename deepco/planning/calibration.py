"""Calibrating the staged cost model on timed frames, and choosing among timed plans.

The cost model (`deepco.planning.staged.predict`) counts FLOPs and bytes against rates measured at setup. Two
things it cannot know until frames have run:

- how fast *this model's* layers run on the servers compared with the head they were profiled on
  (EfficientNet's depthwise convolutions run at a fraction of a ResNet convolution's FLOP rate): a
  ``compute_scale`` that divides every server's FLOP rate (not the device's: setup timed the device on the
  whole model);
- the fixed cost of one server step (message, ORT call, Python, all under a CPU quota): ``step_overhead``;
- how fast each server runs this model *against the others* (`Balance`): setup's short probe of each server
  can be off by a quarter either way, and a split sized on it makes the servers it overrates late at every
  level while their neighbours wait for their rows. The servers' own compute times in the frames of a split
  put each server's rate in proportion to the others'; the scale is fitted on top of that.

`fit` finds the first two from timed plans by least squares on *relative* error (the planner's quality is judged as
measured / predicted). `choose` picks among plans timed side by side. `calibrate` is the loop that times
plans through a callback (the device runs them on its servers), fits, plans again and chooses.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from deepco.planning.links import REST, Links, with_links
from deepco.planning.live_rates import stage_flops, work_of
from deepco.planning.staged import DEVICE, CostModel, Rates, StagedPlan, local_plan, predict, steps, unstreamed

SCALE_BOUNDS = (0.25, 4.0)  # a model's FLOP rate within 4x of the profiled head's, either way
SIMPLER_MARGIN = 0.03  # a plan with fewer server steps wins unless a busier one is this much faster


@dataclass
class Timed:
    """A plan and the latencies (seconds) of its timed frames."""

    plan: StagedPlan
    seconds: list[float]

    @property
    def mean(self) -> float:
        """Mean latency: a camera's CPU quota makes frame times bimodal, where a median of few frames jumps."""
        return statistics.fmean(self.seconds)


def with_compute_scale(rates: Rates, scale: float) -> Rates:
    """``rates`` with every server's FLOP rate divided by ``scale``."""
    return replace(rates, server_flops_per_second={k: v / scale for k, v in rates.server_flops_per_second.items()})


BALANCE_BOUNDS = (1 / 3, 3.0)  # a server's rate on this model within 3x of its probe's, against the others'
# a server's compute per stage below this measures ONNX Runtime's cost per call, not the server's rate: at
# 224x224 a 7-stage split over four servers (1-3 ms a stage) read two 0.35-core servers as 2.8 and 0.48
BALANCE_LEAST_STAGE_SECONDS = 0.01


def with_balance(rates: Rates, balance: dict[str, float]) -> Rates:
    """``rates`` with each server's FLOP rate divided by its factor in ``balance`` (`Balance.factors`; 1 where
    it has none)."""
    if not balance:
        return rates
    return replace(rates, server_flops_per_second={k: v / balance.get(k, 1.0)
                                                   for k, v in rates.server_flops_per_second.items()})


class Balance:
    """Each server's speed on this model in proportion to the others', from the frames of splits.

    A server step reports its own ONNX Runtime seconds (`StepTimes.compute`); over the FLOPs of its band
    (halo rows included, `work_of`) at the rate setup measured for it, that is its slowness. Only splits count
    (every server of one runs the same layers, so their slownesses compare like with like; an offload runs
    other layers), and only where a server's compute per stage is long enough to time its rate
    (``BALANCE_LEAST_STAGE_SECONDS`` at the rate setup measured). `factors` puts each server's median slowness
    over the geometric mean of all of them: a server the probe overrated gets a factor above 1, and the rates it
    is planned on are divided by it (`with_balance`); the common part stays for the compute scale. On the
    camera preset, a 0.35-core server probed faster than its 0.45-core neighbours computed every level of a
    YOLOv8n split 1.6-2.4x longer than them, and they waited 60-100 ms a level for its rows.

    Where a plan has several levels and the frame says what each server computed of the first (``first``), that
    level is left out of both sides: it runs while the device is still sending windows, on CPUs the transfer
    shares, and each server's overlaps it by another share (ResNet-18 at 720x1280 on the camera preset: the
    first level took 1.12-1.37x its predicted time, the later ones 0.70-0.98x, so a server that computed the later
    levels 10% faster than its neighbours, every level, showed no slowness of its own over the whole frame)."""

    def __init__(self, costs: CostModel, measured: Rates):
        self.costs, self.measured = costs, measured
        self.slowness: dict[str, list[float]] = {}

    def add(self, plan: StagedPlan, computes: dict[str, float], first: dict[str, float] | None = None) -> None:
        """One frame of ``plan``: ``computes``, each server's compute seconds in it; ``first``, of those, the
        seconds of the first level (see the class doc)."""
        servers = [s for s in plan.servers if s != DEVICE]
        if len(servers) < 2 or not plan.levels:
            return
        skip = first is not None and len(plan.levels) > 1
        for i, (name, work) in enumerate(zip(plan.servers, work_of(plan, self.costs), strict=True)):
            rate, seconds = self.measured.server_flops_per_second.get(name), computes.get(name)
            if name == DEVICE or not rate or not seconds or seconds <= 0:
                continue
            # a server that timed no phases (an older one) is counted whole
            mine = skip and first.get(name, 0.0) > 0
            flops = work.flops - (stage_flops(plan, self.costs, 1, i) if mine else 0)
            seconds -= first[name] if mine else 0.0
            if seconds > 0 and flops / rate >= BALANCE_LEAST_STAGE_SECONDS * (len(plan.levels) - mine):
                self.slowness.setdefault(name, []).append(seconds / (flops / rate))

    def factors(self) -> dict[str, float]:
        """Per server seen, its median slowness over the geometric mean of all of theirs, within
        ``BALANCE_BOUNDS``; none until two servers were seen."""
        medians = {name: statistics.median(v) for name, v in self.slowness.items() if v}
        if len(medians) < 2:
            return {}
        mean = math.exp(statistics.fmean(math.log(m) for m in medians.values()))
        low, high = BALANCE_BOUNDS
        return {name: min(high, max(low, m / mean)) for name, m in medians.items()}


def _overhead_for(timed: Sequence[Timed], bases: list[float]) -> float:
    """The step overhead >= 0 that minimises the squared relative error, given each plan's prediction without
    it (closed form: the model is linear in the overhead)."""
    num = sum(steps(t.plan) * (t.mean - b) / t.mean ** 2 for t, b in zip(timed, bases, strict=True))
    den = sum(steps(t.plan) ** 2 / t.mean ** 2 for t in timed)
    return max(0.0, num / den) if den else 0.0


def _error(timed: Sequence[Timed], costs: CostModel, rates: Rates, scale: float) -> tuple[float, float]:
    r = replace(with_compute_scale(rates, scale), step_overhead=0.0)
    bases = [predict(t.plan, costs, r)["frame"] for t in timed]
    overhead = _overhead_for(timed, bases)
    err = sum(((b + overhead * steps(t.plan)) / t.mean - 1) ** 2 for t, b in zip(timed, bases, strict=True))
    return err, overhead


DISTINCT = 0.2  # plans whose compute per step differs by less than this tell the scale from the overhead badly


def _compute_seconds(plan: StagedPlan, costs: CostModel, rates: Rates) -> float:
    """Seconds of server compute on ``plan``'s critical path: what a compute scale of 2 adds to its frame."""
    bare = replace(rates, step_overhead=0.0)
    return (predict(plan, costs, with_compute_scale(bare, 2.0))["frame"] - predict(plan, costs, bare)["frame"])


def scale_fittable(timed: Sequence[Timed], costs: CostModel, rates: Rates) -> bool:
    """Whether `fit` can fit the compute scale besides the overhead: among the timed plans that use the servers
    (a local plan's time depends on neither term), two whose server compute per step differs by ``DISTINCT``
    or more, so that a slowdown proportional to the FLOPs and one proportional to the steps can be told
    apart (two offloads to servers of different speeds, or a split of several steps and offload). Two plans
    suffice: calibration's first two are typically the deepest split and offload, and fitting the overhead
    alone from them made a uniform slowdown (yolov8n's SiLU and Concat layers run at half the profiled FLOP
    rate) look like ~250 ms per step, which then ruled out every plan of several steps when planning again."""
    per_step = [_compute_seconds(t.plan, costs, rates) / steps(t.plan) for t in timed if steps(t.plan) > 0]
    return len(per_step) >= 2 and min(per_step) < (1 - DISTINCT) * max(per_step)


def fit(timed: Sequence[Timed], costs: CostModel, rates: Rates) -> tuple[float, float]:
    """``(compute_scale, step_overhead)`` that best explain the timed plans. The scale needs plans on servers of
    different compute per step (`scale_fittable`; otherwise it and the overhead cannot be told apart): without
    them, only the overhead is fitted and the scale stays 1."""
    if not timed:
        return 1.0, rates.step_overhead
    if not scale_fittable(timed, costs, rates):
        return 1.0, _error(timed, costs, rates, 1.0)[1]
    from scipy.optimize import minimize_scalar  # here: a second of imports that a warm start does without

    best = minimize_scalar(lambda s: _error(timed, costs, rates, s)[0], bounds=SCALE_BOUNDS, method="bounded",
                           options={"xatol": 1e-3})
    scale = float(best.x)
    return scale, _error(timed, costs, rates, scale)[1]


def uses_the_device(plan: StagedPlan) -> bool:
    """Whether ``plan`` computes on the device besides sending (local, a split's tail or band on the device, the
    rest of the model after a stage across scales)."""
    return plan.kind == "local" or plan.kind == "scales" and plan.tail is None \
        or plan.kind == "split" and (plan.tail is None or DEVICE in plan.servers)


def choose(timed: Sequence[Timed]) -> Timed:
    """The fastest by mean latency; among plans within ``SIMPLER_MARGIN`` of it, the one with the fewest server
    steps (fewer messages and servers to fail, and on a noisy machine a few percent is not a difference), then
    one that leaves the device's CPU idle (a weak camera's quota'd CPU is the noisiest part of a frame to
    measure, and the camera has work of its own), then the fastest."""
    fastest = min(timed, key=lambda t: t.mean)
    close = [t for t in timed if t.mean <= fastest.mean * (1 + SIMPLER_MARGIN)]
    return min(close, key=lambda t: (steps(t.plan), uses_the_device(t.plan), t.mean))


def too_close(timed: Sequence[Timed], z: float = 2.0) -> list[str]:
    """The keys of the plans whose mean latency is within ``z`` standard errors (of the difference) of the
    fastest's, the fastest included: a runoff that cannot tell them apart yet (one plan or none: it can)."""
    fastest = min(timed, key=lambda t: t.mean)

    def error(t: Timed) -> float:
        return statistics.variance(t.seconds) / len(t.seconds) if len(t.seconds) > 1 else math.inf

    close = [t for t in timed if t.mean - fastest.mean <= z * math.sqrt(error(t) + error(fastest))]
    return [plan_key(t.plan) for t in close] if len(close) > 1 else []


FIDELITY = (0.8, 1.25)  # measured / predicted a plan's prediction is held to
NOISY_FRAMES = 0.2  # a coefficient of variation of the chosen plan's frames above this makes its mean uncertain


def fidelity(chosen: Timed, timed: Sequence[Timed], costs: CostModel, rates: Rates) -> dict:
    """How well the fitted model (``rates``: compute scale and step overhead applied) predicts ``chosen``, as
    calibration measured it, and when measured / predicted is outside ``FIDELITY``, why: either the chosen
    plan's own frames vary too much for their mean to mean much, or the model's two fitted terms cannot fit
    every timed plan at once (their measured / predicted ratios are listed, so the plan kinds the model
    misjudges can be seen)."""
    predicted = predict(chosen.plan, costs, rates)["frame"]
    ratio = chosen.mean / predicted
    report = {"measured": chosen.mean, "frames": len(chosen.seconds), "predicted": predicted, "ratio": ratio,
              "within": FIDELITY[0] <= ratio <= FIDELITY[1], "why": ""}
    if report["within"]:
        return report
    spread = statistics.pstdev(chosen.seconds) / chosen.mean if len(chosen.seconds) > 1 else 0.0
    if spread > NOISY_FRAMES:
        report["why"] = (f"its {len(chosen.seconds)} calibration frames varied by {spread:.0%} of their mean "
                         "(a shared or quota'd CPU), so the measured mean is itself uncertain")
        return report
    others = sorted(((t.mean / predict(t.plan, costs, rates)["frame"], t.plan.describe()) for t in timed),
                    key=lambda rp: rp[0])
    listed = "; ".join(f"{r:.2f} for {d}" for r, d in others)
    ratios = [r for r, _ in others] or [ratio]
    if all(r < FIDELITY[0] for r in ratios) or all(r > FIDELITY[1] for r in ratios):
        cannot = ("a compute scale is fitted from two timed plans on servers of different compute per step "
                  f"on, and these were {len(timed)}" if not scale_fittable(timed, costs, rates) else
                  "the compute scale is bounded to 0.25-4 and the step overhead to >= 0")
        report["why"] = (f"every timed plan measured off its prediction the same way ({listed}): a common factor "
                         f"the fit could not take out ({cannot}). The plan was chosen on measured time, not on "
                         "this prediction")
        return report
    report["why"] = (f"the cost model's two fitted terms (the servers' FLOP rate on this model, the fixed cost of "
                     f"a step) cannot fit every timed plan at once: measured / predicted was {listed}. The "
                     "plan was chosen on measured time, not on this prediction")
    return report


# ---- the calibration loop ------------------------------------------------------------------------------

SETTLE_SECONDS = 0.03  # three CFS periods between timed frames: every quota starts a frame refilled
RUNOFF_WITHIN = 0.25  # calibrated plans this close to the fastest are timed again side by side
T = TypeVar("T")


class Unfit(Exception):
    """Raised by a `calibrate` ``time_plan`` callback: the plan's resources (its models on the servers) do not
    fit now; the message says why, in one line."""


# (plan, frames, warm_up) -> the latencies of ``frames`` frames (after one untimed frame when ``warm_up``); the
# plan's resources stay held until ``release``. Raises Unfit where they do not fit.
TimePlan = Callable[[StagedPlan, int, bool], list[float]]
# (rates, objective, shapes) -> the ranked candidates that fit, best first (shapes: ``all``, ``offload``,
# ``thread``); for shapes other than ``all``, empty where none fits.
Candidates = Callable[[Rates, str, str], list[StagedPlan]]


@dataclass
class Calibrated:
    """What `calibrate` found: the chosen plan (re-predicted, with its fidelity report), the fitted model and
    every timing (``trials``: one entry per timing, as logged)."""

    plan: StagedPlan
    compute_scale: float
    step_overhead: float
    trials: list[dict]
    balance: dict[str, float] = field(default_factory=dict)  # `Balance.factors` at the end
    links: dict[int, float] = field(default_factory=dict)  # `deepco.planning.links.Links.factors` at the end (and REST)


def plan_key(plan: StagedPlan) -> str:
    """What identifies a plan: everything but its name, prediction and calibration report."""
    return json.dumps(plan.to_dict() | {"predicted": 0, "breakdown": {}, "algorithm": "", "fidelity": {}},
                      sort_keys=True)


def round_order(items: list[T], k: int) -> list[T]:
    """The order of the ``k``-th round when plans are timed side by side: a permutation of ``items`` drawn
    afresh for every round (seeded by ``k``, so runs repeat). A frame's time depends on what ran just before
    it (a CPU quota the previous frame drained, caches). A fixed order biases the plans that follow a heavy
    one, and so does a rotation, which keeps every item's predecessor (in the benchmark, offload always ran
    after local and auto after round-robin, and auto measured 3-6% slower than offload running the very
    same plan); a fresh permutation gives every item every predecessor alike."""
    order = list(items)
    random.Random(k).shuffle(order)
    return order


class _Bench:
    """One calibration's state: the plans timed, those refused for room, those whose resources are held (only
    those that can still be chosen: a plan too slow to reach the runoff is released at once), and the fit."""

    def __init__(self, costs: CostModel, measured: Rates, time_plan: TimePlan, release: Callable[[StagedPlan], None],
                 log: Callable[[str], None], frames: int, scale: float, overhead: float, settle: float,
                 balance: Balance | None = None, links: Links | None = None):
        self.costs, self.measured, self.time_plan, self.release = costs, measured, time_plan, release
        self.balance, self.links = balance, links
        self.log, self.frames, self.settle = log, frames, settle
        self.scale, self.overhead = scale, overhead
        self.timed: dict[str, Timed] = {}
        self.unfit: set[str] = set()
        self.held: dict[str, StagedPlan] = {}
        self.trials: list[dict] = []
        self._kept: str | None = None

    def base(self) -> Rates:
        """The measured rates, each server's put in proportion to the others' and each antenna's rate as the
        frames so far showed."""
        rates = with_balance(self.measured, self.balance.factors()) if self.balance is not None else self.measured
        return with_links(rates, self.links.factors()) if self.links is not None else rates

    def rates(self) -> Rates:
        """The measured rates with the model fitted so far."""
        return replace(with_compute_scale(self.base(), self.scale), step_overhead=self.overhead)

    def first_new(self, ranked: list[StagedPlan]) -> StagedPlan | None:
        """The best of ``ranked`` not refused for room (timed or not: the caller stops when it repeats)."""
        return next((p for p in ranked if plan_key(p) not in self.unfit), None)

    def fastest(self) -> Timed:
        """The timed plan of least mean latency."""
        return min(self.timed.values(), key=lambda t: t.mean)

    def finalists(self) -> list[str]:
        """Keys of the timed plans within ``RUNOFF_WITHIN`` of the fastest."""
        fastest = self.fastest().mean
        return [k for k, t in self.timed.items() if t.mean <= fastest * (1 + RUNOFF_WITHIN)]

    def run(self, plan: StagedPlan, frames: int, warm_up: bool,
            keep: Collection[str] | None = ()) -> list[float] | None:
        """``time_plan``, or None with a note when the plan does not fit even after the other held plans but
        ``keep`` were released (they may be what fills the servers). With ``keep`` None, none is released."""
        key = plan_key(plan)
        tries = 1 if keep is None else 2
        for attempt in range(tries):
            try:
                seconds = self.time_plan(plan, frames, warm_up)
                break
            except Unfit as exc:
                if attempt == tries - 1:
                    self.unfit.add(key)
                    self.log(f"calibration: skipped {plan.describe()}: {exc}")
                    return None
                self.give_back(lambda k: k != key and k not in keep)
        self.held[key] = plan
        return seconds

    def refit(self) -> None:
        self.scale, self.overhead = fit(list(self.timed.values()), self.costs, self.base())

    def time(self, plan: StagedPlan, note: str, keep: Collection[str] | None = ()) -> None:
        """Time ``plan`` on ``frames`` frames after a warm-up, refit the cost model, log it, and release the
        plans that can no longer be chosen (`run`'s ``keep``)."""
        seconds = self.run(plan, self.frames, True, keep)
        if seconds is None:
            return
        key = plan_key(plan)
        self.timed[key] = Timed(plan, seconds)
        self.refit()
        factors = self.balance.factors() if self.balance is not None else {}
        links = self.links.factors() if self.links is not None else {}
        self.trials.append({"plan": plan.describe(), "predicted": plan.predicted, "measured": self.timed[key].mean,
                            "steps": steps(plan), "step_overhead": self.overhead, "compute_scale": self.scale,
                            "note": note} | ({"balance": factors} if factors else {})
                           | ({"links": {str(m): k for m, k in links.items()}} if links else {}))
        slowness = (", servers' slowness against each other " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(
            factors.items()))) if factors else ""
        antennas = {m: k for m, k in links.items() if m != REST}
        slowness += (", antennas' time against the probe's " + ", ".join(f"{m} {k:.2f}" for m, k in sorted(
            antennas.items()))) if antennas else ""
        slowness += f", streamed windows' rests' time against their bytes' {links[REST]:.2f}" if REST in links else ""
        self.log(f"calibration ({note}): {plan.describe()}: predicted {plan.predicted * 1e3:.1f} ms, "
                 f"measured {self.timed[key].mean * 1e3:.1f} ms; now compute scale "
                 f"{self.scale:.2f}, step overhead {self.overhead * 1e3:.2f} ms{slowness}")
        finalists = set(self.finalists())
        self.give_back(lambda k: k not in finalists)

    def runoff(self, finalists: list[str], frames: int, before: Sequence[Timed] = ()) -> list[Timed]:
        """The ``finalists`` run again side by side, interleaved in a fresh order every round on refilled
        quotas; their timings (added to ``timed`` too), after those of an earlier runoff (``before``). A
        finalist whose resources do not fit beside the faster ones' is left out (`_ready`)."""
        ready = self._ready(finalists)
        earlier = {plan_key(t.plan): t.seconds for t in before}
        runoff = {k: Timed(plan, list(earlier.get(k, []))) for k, plan in ready.items()}
        new = {k: len(t.seconds) for k, t in runoff.items()}
        for i in range(frames):
            for k in round_order(list(ready), i):
                time.sleep(self.settle)
                runoff[k].seconds.extend(self.run(ready[k], 1, False, keep=ready) or [])
        for k, t in runoff.items():
            self.timed[k] = Timed(t.plan, self.timed[k].seconds + t.seconds[new[k]:])
            self.trials.append({"plan": t.plan.describe(), "measured": t.mean, "steps": steps(t.plan),
                                "note": "runoff", "frames": len(t.seconds)})
            self.log(f"calibration (runoff, {len(t.seconds)} frames): {t.plan.describe()}: {t.mean * 1e3:.1f} ms")
        return list(runoff.values())

    def _ready(self, finalists: list[str]) -> dict[str, StagedPlan]:
        """The finalists held together for a runoff, fastest first. Room for one is made only by giving back
        slower finalists, so that each plan's resources are set up at most once here: with more finalists
        than the servers' model slots hold, interleaving would otherwise swap (upload) models every frame."""
        ready: dict[str, StagedPlan] = {}
        for key in sorted(finalists, key=lambda k: self.timed[k].mean):
            if self.run(self.timed[key].plan, 0, False, keep=ready) is not None:
                ready[key] = self.timed[key].plan
        return ready

    def repredict(self, plan: StagedPlan) -> StagedPlan:
        """``plan`` predicted with the fitted model."""
        breakdown = predict(plan, self.costs, self.rates())
        return replace(plan, breakdown=breakdown, predicted=breakdown["frame"])

    def keep(self, plan: StagedPlan) -> StagedPlan:
        """``plan`` is the one chosen: its resources stay held for the run; the rest go on `give_back`."""
        self._kept = plan_key(plan)
        return plan

    def give_back(self, drop: Callable[[str], bool]) -> None:
        for key in [k for k in self.held if drop(k)]:
            self.release(self.held.pop(key))


def calibrate(costs: CostModel, rates: Rates, candidates: Candidates, time_plan: TimePlan,
              release: Callable[[StagedPlan], None], *, objective: str = "latency", frames: int = 2, rounds: int = 3,
              runoff_frames: int = 6, log: Callable[[str], None] = print, compute_scale: float = 1.0,
              step_overhead: float = 0.0, settle: float = SETTLE_SECONDS,
              spare: Callable[[StagedPlan], None] | None = None, balance: Balance | None = None,
              links: Links | None = None) -> Calibrated:
    """Plan (``candidates`` on the rates fitted so far), time the plan (``time_plan``), fit the cost model's
    compute scale and per-step overhead (`fit`, from the measured ``rates``), plan again; stop when the plan
    repeats. For latency, time local, the best offload and the paper's shape as contenders too, then run the
    plans within ``RUNOFF_WITHIN`` of the fastest side by side (interleaved, ``settle`` seconds apart,
    ``runoff_frames`` each) and return the one `choose` picks, re-predicted with the fitted model.

    A plan ``time_plan`` refuses (Unfit) is skipped with a one-line note, after the other held plans were
    released in case they are what fills the servers; every plan that cannot be chosen any more is released
    at once (``release``), and at the end every plan but the chosen one: calibration never holds more than the
    finalists' resources. With ``spare``, the finalists still held at the end go to it instead of ``release``
    (live adaptation keeps their models on the servers: a switch to a plan that needs them uploads nothing).
    With ``balance`` (fed by ``time_plan`` with every split frame's server compute times), each server's rate is
    put in proportion to the others' as measured before the scale is fitted and plans are made again; with
    ``links`` (fed with every split frame's window arrivals), each antenna's rate as the frames carried them."""
    bench = _Bench(costs, rates, time_plan, release, log, frames, compute_scale, step_overhead, settle, balance,
                   links)
    try:
        plan = _calibrate(bench, candidates, objective, rounds, runoff_frames)
        if spare is not None:
            for key in [k for k in bench.held if k != bench._kept]:
                spare(bench.held.pop(key))
    finally:
        bench.give_back(lambda k: k != bench._kept)
    return Calibrated(plan, bench.scale, bench.overhead, bench.trials,
                      balance.factors() if balance is not None else {}, links.factors() if links is not None else {})


def _calibrate(bench: _Bench, candidates: Candidates, objective: str, rounds: int, runoff_frames: int) -> StagedPlan:
    plan = bench.first_new(candidates(bench.rates(), objective, "all"))
    for _ in range(rounds):
        if plan is None or plan_key(plan) in bench.timed:
            break
        bench.time(plan, "planned")
        plan = bench.first_new(candidates(bench.rates(), objective, "all"))
    if not bench.timed:  # every planned candidate was refused for room: the device alone always fits
        bench.time(local_plan(bench.costs, bench.rates()), "the only plan that fits")
    if objective != "latency":  # one frame's time says little about sustained fps: keep the last plan
        return bench.keep(bench.repredict(bench.fastest().plan))
    # The fitted model can still misjudge plan kinds it was fitted on least (a weak camera's own
    # per-message CPU, a model whose layers run at another FLOP rate than the profiled head): local, the
    # best offload and the paper's shape (one lookahead stage, the tail on the device) are timed too, so
    # auto is never slower than them as measured.
    local = local_plan(bench.costs, bench.rates())
    # the device alone is compute only, predicted well: when far slower, not worth seconds here
    contenders = [local] if local.predicted <= 2 * bench.fastest().mean else []
    rates = bench.rates()
    contenders += candidates(rates, "latency", "offload")[:1] + candidates(rates, "latency", "thread")[:1]
    # A window streamed in sub-bands costs what the model does not see: a server reads the rest of its window
    # on the CPU quota its first sub-band computes on (ResNet-18 at 720x1280 on the camera preset: the antennas
    # were busy 50-70 ms longer, and the plan measured 796 ms where it sent whole measured 760). The fastest
    # plan's twin that sends its windows whole is timed too, so that the runoff chooses between them on frames.
    whole = unstreamed(bench.fastest().plan)
    if whole is not bench.fastest().plan:
        contenders.append(bench.repredict(whole))
    for contender in contenders:
        if plan_key(contender) not in bench.timed and plan_key(contender) not in bench.unfit:
            bench.time(contender, "contender")
    # the contenders may be what let the fit tell a slower model from a step overhead: the plan the final fit
    # ranks first is timed too, so that it is not ruled out by a misfit of the first rounds (only where it fits
    # beside the plans timed so far: those are now the finalists)
    replanned = bench.first_new(candidates(bench.rates(), objective, "all"))
    if replanned is not None and plan_key(replanned) not in bench.timed:
        bench.time(replanned, "planned on the final fit", keep=None)
    finalists = bench.finalists()
    if len(finalists) > 1:
        # Two frames each cannot tell plans 10% apart on a quota'd CPU: the close ones run again, side by
        # side as the benchmark runs them (interleaved in a fresh order every round, on refilled quotas).
        runoff = _with_late_finalists(bench, bench.runoff(finalists, runoff_frames), runoff_frames)
        tied = too_close(runoff)
        if len(tied) > 1:  # the measured order of these is noise so far: they run as many frames again
            bench.log(f"calibration: {len(tied)} plans within the noise of each other: a longer runoff")
            runoff = _run_again(bench, runoff, tied, runoff_frames)
        bench.refit()
        chosen = bench.timed[plan_key(choose(runoff).plan)]
    else:
        chosen = bench.timed[finalists[0]]
    plan = bench.repredict(chosen.plan)
    plan = replace(plan, fidelity=fidelity(chosen, list(bench.timed.values()), bench.costs, bench.rates()))
    if plan.fidelity["why"]:
        bench.log(f"calibration: the prediction for the chosen plan does not hold "
                  f"(measured / predicted {plan.fidelity['ratio']:.2f}): {plan.fidelity['why']}")
    return bench.keep(plan)


def _with_late_finalists(bench: _Bench, runoff: list[Timed], frames: int) -> list[Timed]:
    """``runoff`` with the plans its frames made finalists. The finalists were chosen against the fastest
    plan's first few frames, which can be lucky: on the camera preset at 224x224 a split timed at 101 ms
    ran at 127 in its runoff, while offload, timed at 141 ms on its two frames (1.39x) and so left out, ran
    at 124 in the benchmark's frames beside the split's 149. With the runoff's frames in, the plans now within
    ``RUNOFF_WITHIN`` of the fastest run as many frames beside the runoff's leaders (the fastest and the one
    `choose` picks, their runoff frames kept)."""
    ran = {plan_key(t.plan) for t in runoff}
    late = [k for k in bench.finalists() if k not in ran and k not in bench.unfit]
    if not late:
        return runoff
    leaders = list(dict.fromkeys(plan_key(t.plan) for t in (min(runoff, key=lambda t: t.mean), choose(runoff))))
    bench.log(f"calibration: {len(late)} plan(s) within {RUNOFF_WITHIN:.0%} of the runoff's fastest, left out "
              "against its first frames: they run beside it")
    return _run_again(bench, runoff, leaders + late, frames)


def _run_again(bench: _Bench, runoff: list[Timed], keys: list[str], frames: int) -> list[Timed]:
    """``runoff`` with the plans of ``keys`` (of it or new to it) run ``frames`` more side by side, the frames
    those of it ran there kept."""
    return [t for t in runoff if plan_key(t.plan) not in keys] + bench.runoff(
        keys, frames, before=[t for t in runoff if plan_key(t.plan) in keys])
