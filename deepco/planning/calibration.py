"""Calibrating the staged cost model on timed frames, and choosing among timed plans.

The cost model (`deepco.planning.staged.predict`) counts FLOPs and bytes against rates measured at setup. Two
things it cannot know until frames have run:

- how fast *this model's* layers run on the servers compared with the head they were profiled on
  (EfficientNet's depthwise convolutions run at a fraction of a ResNet convolution's FLOP rate): a
  ``compute_scale`` that divides every server's FLOP rate (not the device's: setup timed the device on the
  whole model);
- the fixed cost of one server step (message, ORT call, Python, all under a CPU quota): ``step_overhead``.

`fit` finds both from timed plans by least squares on *relative* error (the planner's quality is judged as
measured / predicted). `choose` picks among plans timed side by side.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from scipy.optimize import minimize_scalar

from deepco.planning.staged import DEVICE, CostModel, Rates, StagedPlan, predict, steps

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


def scale_fittable(timed: Sequence[Timed]) -> bool:
    """Whether `fit` can fit the compute scale: at least three timed plans, of at least two step counts."""
    return len(timed) >= 3 and len({steps(t.plan) for t in timed}) >= 2


def fit(timed: Sequence[Timed], costs: CostModel, rates: Rates) -> tuple[float, float]:
    """``(compute_scale, step_overhead)`` that best explain the timed plans. The scale needs plans with at least
    two different numbers of steps besides (otherwise it and the overhead cannot be told apart): with fewer,
    only the overhead is fitted and the scale stays 1."""
    if not timed:
        return 1.0, rates.step_overhead
    if not scale_fittable(timed):
        return 1.0, _error(timed, costs, rates, 1.0)[1]
    best = minimize_scalar(lambda s: _error(timed, costs, rates, s)[0], bounds=SCALE_BOUNDS, method="bounded",
                           options={"xatol": 1e-3})
    scale = float(best.x)
    return scale, _error(timed, costs, rates, scale)[1]


def uses_the_device(plan: StagedPlan) -> bool:
    """Whether ``plan`` computes on the device besides sending (local, a split's tail or band on the device)."""
    return plan.kind == "local" or (plan.kind == "split" and (plan.tail is None or DEVICE in plan.servers))


def choose(timed: Sequence[Timed]) -> Timed:
    """The fastest by mean latency; among plans within ``SIMPLER_MARGIN`` of it, the one with the fewest server
    steps (fewer messages and servers to fail, and on a noisy machine a few percent is not a difference), then
    one that leaves the device's CPU idle (a weak camera's quota'd CPU is the noisiest part of a frame to
    measure, and the camera has work of its own), then the fastest."""
    fastest = min(timed, key=lambda t: t.mean)
    close = [t for t in timed if t.mean <= fastest.mean * (1 + SIMPLER_MARGIN)]
    return min(close, key=lambda t: (steps(t.plan), uses_the_device(t.plan), t.mean))


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
        cannot = ("a compute scale is fitted from three timed plans of two step counts on, and these were "
                  f"{len(timed)}" if not scale_fittable(timed) else
                  "the compute scale is bounded to 0.25-4 and the step overhead to >= 0")
        report["why"] = (f"every timed plan measured off its prediction the same way ({listed}): a common factor "
                         f"the fit could not take out ({cannot}). The plan was chosen on measured time, not on "
                         "this prediction")
        return report
    report["why"] = (f"the cost model's two fitted terms (the servers' FLOP rate on this model, the fixed cost of "
                     f"a step) cannot fit every timed plan at once: measured / predicted was {listed}. The "
                     "plan was chosen on measured time, not on this prediction")
    return report
