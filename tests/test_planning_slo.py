"""`--objective slo` (deepco/planning/slo.py) on a fake cost model and fake measurements: which pairs of plan and
frames in flight are considered, which are measured, which is chosen, and how a run is kept within its bound."""

from __future__ import annotations

import pytest

from deepco.planning import slo
from deepco.planning.slo import Option, SloWatch, Trial, choose, options
from deepco.planning.staged import StagedPlan

A = StagedPlan("a", "local", servers=["a"])
B = StagedPlan("b", "local", servers=["b"])
C = StagedPlan("c", "local", servers=["c"])
RR = StagedPlan("rr", "round-robin", servers=["s0", "s1"])
# the fake cost model: (latency s, fps) of each plan with 1, 2, 3, ... frames in flight
MODEL = {"a": [(0.1, 10.0), (0.2, 10.0)],  # saturated at once: a second frame only queues
         "b": [(0.3, 3.3), (0.3, 6.6), (0.3, 9.9), (0.4, 10.0), (0.5, 10.0)],  # +1% at 4: not worth a frame
         "c": [(0.5, 2.0), (0.6, 3.0)],
         "rr": [(9.0, 0.1), (0.2, 8.0), (0.3, 12.0), (0.45, 12.0)]}


@pytest.fixture
def fake_model(monkeypatch):
    monkeypatch.setattr(slo, "pipelined", lambda plan, costs, rates, depth: MODEL[plan.algorithm][depth - 1])


def test_each_plan_is_paired_with_the_frames_in_flight_that_still_add_fps(fake_model):
    renamed_a = StagedPlan("a-again", "local", servers=["a"])  # the same plan under another name: once
    got = options([A, B, renamed_a, RR], None, None, least_depth=lambda p: 2 if p.kind == "round-robin" else 1)
    assert [(o.plan.algorithm, o.depth, o.latency, o.fps) for o in got] == [
        ("a", 1, 0.1, 10.0), ("b", 1, 0.3, 3.3), ("b", 2, 0.3, 6.6), ("b", 3, 0.3, 9.9),
        ("rr", 2, 0.2, 8.0), ("rr", 3, 0.3, 12.0)]  # round-robin starts at one frame per server


def option(plan: StagedPlan, depth: int) -> Option:
    latency, fps = MODEL[plan.algorithm][depth - 1]
    return Option(plan, depth, latency, fps)


def measuring(measured: dict):
    calls = []

    def measure(o: Option) -> Trial:
        calls.append((o.plan.algorithm, o.depth))
        p95, fps = measured[(o.plan.algorithm, o.depth)]
        return Trial(o, p95, fps)

    return measure, calls


CANDIDATES = [option(A, 1), option(B, 1), option(B, 2), option(B, 3), option(C, 1)]


def test_the_most_measured_fps_within_the_bound_wins_not_the_most_predicted():
    measure, calls = measuring({("a", 1): (0.11, 9.0), ("b", 3): (0.33, 9.8), ("b", 2): (0.24, 9.5),
                                ("b", 1): (0.2, 3.0)})
    choice = choose(CANDIDATES, measure, bound=0.25)
    # the least predicted latency first, then within 1.25 x the bound by predicted fps; c (0.5 s) is not measured
    assert calls == [("a", 1), ("b", 3), ("b", 2), ("b", 1)]
    assert (choice.option.plan, choice.option.depth, choice.met) == (B, 2, True)  # b at 3 missed the bound
    assert choice.note() == ("slo: b: the whole model on the device, 2 frame(s) in flight: measured p95 240.0 ms "
                             "within 250.0 ms at 9.50 fps (the most fps of 4 measured)")


def test_when_no_pair_meets_the_bound_the_least_measured_p95_runs_and_says_so():
    measure, _ = measuring({("a", 1): (0.4, 9.0), ("b", 3): (0.5, 9.8), ("b", 2): (0.3, 6.0), ("b", 1): (0.35, 3.0)})
    choice = choose(CANDIDATES, measure, bound=0.25)
    assert (choice.option.plan, choice.option.depth, choice.met) == (B, 2, False)
    assert choice.note() == ("slo: no plan measured a p95 within 250.0 ms (4 measured); running the lowest-latency "
                             "one: b: the whole model on the device, 2 frame(s) in flight, p95 300.0 ms")


def test_a_bound_below_every_prediction_still_measures_the_fastest():
    measure, calls = measuring({("a", 1): (0.09, 10.5)})
    choice = choose(CANDIDATES, measure, bound=0.01)
    assert calls == [("a", 1)] and choice.option.plan == A and not choice.met


def test_the_watch_takes_a_frame_out_of_flight_while_the_p95_exceeds_the_bound():
    watch = SloWatch(bound=0.1, depth=3, least=1, frames=20)
    assert [watch.observe(0.05) for _ in range(30)] == [None] * 30 and watch.depth == 3
    assert watch.observe(0.2) is None  # one slow frame in 20 is within a p95
    assert watch.observe(0.2) == "slo: p95 200.0 ms over the last 20 frames exceeds 100.0 ms: now 2 frame(s) in flight"
    assert watch.depth == 2
    lines = [watch.observe(0.2) for _ in range(20)]  # a fresh window: 20 frames before the next step
    assert lines[:19] == [None] * 19 and lines[19] is not None and watch.depth == 1
    assert [watch.observe(0.2) for _ in range(30)] == [None] * 30 and watch.depth == 1  # never below the least
