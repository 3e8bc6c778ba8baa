"""Bands sized level by level, halo included (deepco.planning.level_balance): the least slowest server that whole
rows allow, found against every contiguous split of a level; and the planner's use of it on ResNet-18."""

from __future__ import annotations

import itertools

import pytest

from deepco.partition import Partitioner, load_model
from deepco.planning.bands import ownership
from deepco.planning.level_balance import PRECISION, balanced
from deepco.planning.staged import CostModel, Rates, split_plan


def _halo_cost(speeds: list[float], halo: int, height: int):
    """A segment whose output rows [a, b) need ``halo`` rows more on each side inside the level."""
    def seconds(i: int, a: int, b: int) -> float:
        return (min(height, b + halo) - max(0, a - halo)) / speeds[i]
    return seconds


def _exhaustive(seconds, height: int, n: int) -> float:
    """The least largest time over every split of ``height`` rows into ``n`` contiguous non-empty bands."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, height), n - 1):
        bounds = [0, *cuts, height]
        best = min(best, max(seconds(i, bounds[i], bounds[i + 1]) for i in range(n)))
    return best


@pytest.mark.parametrize(("speeds", "halo", "height"), [
    ([1.0, 1.0, 1.0, 1.0], 2, 23),  # equal speeds: the middle servers' two halos make them the slowest
    ([0.45, 0.45, 0.35, 0.35], 3, 23),  # the camera preset's shares, a deep level's rows
    ([0.35, 0.45, 0.45, 0.35], 1, 45),
    ([3.0, 1.0, 2.0], 4, 14),
    ([1.0, 5.0], 0, 9),  # no halo: the proportional split is already the best
])
def test_balanced_bands_are_the_least_slowest_of_every_contiguous_split(speeds, halo, height):
    seconds = _halo_cost(speeds, halo, height)
    start = ownership(speeds, [height])[0]
    bands = balanced(seconds, height, start)
    assert bands[0][0] == 0 and bands[-1][1] == height
    assert all(a < b for a, b in bands) and all(x[1] == y[0] for x, y in itertools.pairwise(bands))
    worst = max(seconds(i, a, b) for i, (a, b) in enumerate(bands))
    assert worst <= _exhaustive(seconds, height, len(speeds)) * (1 + PRECISION)
    assert worst <= max(seconds(i, a, b) for i, (a, b) in enumerate(start))


def test_one_participant_keeps_its_band():
    assert balanced(lambda i, a, b: b - a, 7, [(0, 7)]) == [(0, 7)]


@pytest.fixture(scope="module")
def tall() -> CostModel:
    return CostModel(Partitioner(load_model("resnet18", 720, 128), 720, 128), 3 * 720 * 128, 1000 * 4)


def test_the_planner_sizes_each_level_halo_included_where_the_model_says_it_pays(tall):
    """Four servers of equal speed over ResNet-18's stages: with one fraction per level the middle two compute
    two halos at every level and are the slowest; sized level by level they get fewer rows, every level's slowest
    server is faster, and the frame is predicted faster."""
    rates = Rates({"s0": 4e9, "s1": 4e9, "s2": 4e9, "s3": 4e9}, [1e8, 1e8], 0.002, 1e9, 1e8, 0.002)
    chosen, levels = ["s0", "s1", "s2", "s3"], ["layer1", "layer2.0", "layer2", "layer3.0", "layer3", "layer4"]
    plan = split_plan(tall, rates, chosen, levels, True, None)
    alike = split_plan(tall, rates, chosen, levels, True, None, balance=False)
    assert plan is not None and alike is not None
    assert plan.predicted < alike.predicted
    names = [None, *levels]

    def slowest(p, j: int) -> float:
        return max(tall.window(names[j - 1], names[j], a, b).flops for a, b in p.bands[j])

    assert all(slowest(plan, j) <= slowest(alike, j) for j in range(2, len(names)))
    assert any(slowest(plan, j) < slowest(alike, j) for j in range(2, len(names)))
    rows = [b - a for a, b in plan.bands[-1]]  # layer4, two blocks of halo: the middle servers own fewer rows
    assert rows[1] < rows[0] and rows[2] < rows[3], plan.bands[-1]
    assert plan.bands[1] == alike.bands[1]  # the first stage is sized to the windows' arrival, not here
