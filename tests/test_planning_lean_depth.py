"""LeanDepth: a live source keeps as few frames in flight as keep its measured frame rate."""

from __future__ import annotations

import pytest

from deepco.planning.lean_depth import LeanDepth


def drive(watch: LeanDepth, fps: dict[int, float], results: int = 200) -> list[str]:
    """Deliver ``results`` results from a full pipeline whose rate at depth ``d`` is ``fps[d]``: each result's
    latency is then d / fps[d] (Little's law); the lines said."""
    lines = []
    for _ in range(results):
        if line := watch.observe(watch.depth / fps[watch.depth]):
            lines.append(line)
    return lines


def test_a_second_frame_in_flight_that_buys_no_fps_is_given_back():
    watch = LeanDepth(least=1, most=3)
    lines = drive(watch, {1: 10.2, 2: 9.3, 3: 9.3})  # offload on a quota'd server: two at once run slower
    assert watch.depth == 1 and watch.decided
    assert len(lines) == 1 and "1 frame(s) in flight" in lines[0] and "2 in flight" in lines[0]


def test_frames_in_flight_are_added_while_each_pays():
    watch = LeanDepth(least=1, most=4)
    drive(watch, {1: 1.0, 2: 1.67, 3: 1.82, 4: 2.0})  # 2 pays (+67%), 3 does not (+9%)
    assert watch.depth == 2 and set(watch.rates) == {1, 2, 3}


def test_it_stops_at_the_most_it_may_use():
    watch = LeanDepth(least=1, most=2)
    drive(watch, {1: 1.0, 2: 2.0})
    assert watch.depth == 2 and watch.decided


def test_a_plan_that_needs_several_frames_at_once_starts_there():
    watch = LeanDepth(least=2, most=2)
    assert watch.decided and watch.depth == 2 and watch.observe(1.0) is None


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="least"):
        LeanDepth(least=3, most=2)


def test_a_few_frames_decide_and_noise_in_one_does_not():
    """The decision takes a settle and a window at the least depth, then at the one tried; one frame ten
    times slower in a window moves the median nothing."""
    watch = LeanDepth(least=1, most=2, window=5, settle=2)
    latencies = [0.3, 0.3] + [0.1, 0.1, 1.0, 0.1, 0.1] + [0.2, 0.2] + [0.2, 0.2, 0.2, 2.0, 0.2]
    lines = [line for x in latencies if (line := watch.observe(x))]
    assert watch.decided and watch.depth == 1 and len(lines) == 1
    assert watch.rates == pytest.approx({1: 10.0, 2: 10.0})
