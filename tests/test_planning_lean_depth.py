"""LeanDepth: a live source keeps as few frames in flight as keep its measured frame rate."""

from __future__ import annotations

import pytest

from deepco.planning.lean_depth import LeanDepth


def drive(watch: LeanDepth, seconds_per_frame: dict[int, float], results: int = 200) -> list[str]:
    """Deliver ``results`` results, each depth ``d`` spacing them ``seconds_per_frame[d]`` apart; the lines said."""
    now, lines = 0.0, []
    for _ in range(results):
        now += seconds_per_frame[watch.depth]
        if line := watch.observe(0.0, now):
            lines.append(line)
    return lines


def test_a_second_frame_in_flight_that_buys_no_fps_is_given_back():
    watch = LeanDepth(least=1, most=3)
    lines = drive(watch, {1: 0.098, 2: 0.107, 3: 0.107})  # offload on a quota'd server: two at once run slower
    assert watch.depth == 1 and watch.decided
    assert len(lines) == 1 and "1 frame(s) in flight" in lines[0] and "2 in flight" in lines[0]


def test_frames_in_flight_are_added_while_each_pays():
    watch = LeanDepth(least=1, most=4)
    drive(watch, {1: 1.0, 2: 0.6, 3: 0.55, 4: 0.5})  # 2 pays (+67%), 3 does not (+9%)
    assert watch.depth == 2 and set(watch.rates) == {1, 2, 3}


def test_it_stops_at_the_most_it_may_use():
    watch = LeanDepth(least=1, most=2)
    drive(watch, {1: 1.0, 2: 0.5})
    assert watch.depth == 2 and watch.decided


def test_a_plan_that_needs_several_frames_at_once_starts_there():
    watch = LeanDepth(least=2, most=2)
    assert watch.decided and watch.depth == 2 and watch.observe(0.0, 1.0) is None


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="least"):
        LeanDepth(least=3, most=2)
