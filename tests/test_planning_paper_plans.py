"""The paper's plans written as staged plans (deepco.planning.paper_plans): bands, antennas and transfer order
are the paper's, checked against values worked out here (the paper's association rule by hand, a brute-force
row split, the partitioner's own slice costs), not read back from the conversion."""

from __future__ import annotations

import pytest

from deepco.partition import Partitioner, load_model
from deepco.partition.pixels import with_pixel_input
from deepco.planning.paper_plans import paper_plan
from deepco.planning.staged import CostModel, Rates

H, W = 192, 64
CUT = "layer1"  # 48 rows at 192x64, a halo of 39 image rows


@pytest.fixture(scope="module")
def partitioner() -> Partitioner:
    model = with_pixel_input(load_model("resnet18", H, W), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    return Partitioner(model, H, W)


@pytest.fixture(scope="module")
def costs(partitioner) -> CostModel:
    return CostModel(partitioner, 3 * H * W, 4000)


def rates(servers: tuple[float, ...], antennas: int, bw: float = 1e6, overhead: float = 0.001) -> Rates:
    return Rates({f"s{k}": r for k, r in enumerate(servers)}, [bw] * antennas, overhead, 1e8, 1e8, 0.0005)


def check_paper_shape(plan, partitioner: Partitioner) -> None:
    """One lookahead stage to the cut, the tail on the device, windows of the partitioner's slices, crops of its
    segment's runs on open rows (the staged runtime's)."""
    cut = partitioner.cut(CUT)
    assert plan.kind == "split" and plan.levels == [CUT] and plan.lookahead and plan.tail is None
    bands = plan.bands[1]
    assert bands[0][0] == 0 and bands[-1][1] == cut.height
    assert all(x[1] == y[0] for x, y in zip(bands, bands[1:], strict=False))
    image = plan.bands[0]
    assert image[0][0] == 0 and image[-1][1] == H and all(x[1] == y[0] for x, y in zip(image, image[1:], strict=False))
    segment = partitioner.segments(CUT, through=[])[-1]
    for i, (a, b) in enumerate(bands):
        slice_cost = partitioner.cost(CUT, a, b)
        assert plan.windows[0][i] == plan.windows[1][i] == slice_cost.input_rows
        assert plan.crops[1][i] == segment.open_window(a, b).crop[0]


def test_equal_gives_every_server_equal_rows_round_robin_over_the_antennas(costs, partitioner):
    plan = paper_plan(costs, rates((4e9, 3e9, 2e9), 2), ["s0", "s1", "s2"], "equal", CUT)
    check_paper_shape(plan, partitioner)
    assert plan.servers == ["s0", "s1", "s2"]
    assert plan.bands[1] == [(0, 16), (16, 32), (32, 48)]
    assert plan.antennas == [0, 1, 0] and plan.order == [0, 0, 1]  # server k on antenna k mod 2


def finish_times(partitioner: Partitioner, r: Rates, names: list[str], bands: list[tuple[int, int]]) -> list[float]:
    """The row planner's timeline on one antenna, written out: sends one after another, each paying the request
    overhead, then the server's compute (of the band's run on open rows, as the staged runtime runs it) and the
    band's return."""
    bw, over = r.antenna_bytes_per_second[0], r.request_overhead
    clock, out = 0.0, []
    segment = partitioner.segments(CUT, through=[])[-1]
    for name, (a, b) in zip(names, bands, strict=True):
        cost = segment.open_window(a, b)
        transfer = cost.input_bytes / bw
        out.append(clock + over + transfer + cost.flops / r.server_flops_per_second[name] + cost.output_bytes / bw)
        clock += over + transfer
    return out


def test_thread_sa_sends_strongest_first_on_one_antenna_and_its_rows_finish_together(costs, partitioner):
    r = rates((2e9, 6e9), 1, bw=1e7)  # s1 is the stronger: THREAD-SA selects it first and sends to it first
    plan = paper_plan(costs, r, ["s0", "s1"], "thread-sa", CUT)
    check_paper_shape(plan, partitioner)
    assert plan.antennas == [0, 0]
    assert dict(zip(plan.servers, plan.order, strict=True)) == {"s1": 0, "s0": 1}
    assert plan.servers == ["s1", "s0"]  # the first sent takes the top band
    # the split point is the best one: brute force over every split of the cut's rows
    rows = partitioner.cut(CUT).height
    best = min(max(finish_times(partitioner, r, ["s1", "s0"], [(0, k), (k, rows)])) for k in range(1, rows))
    got = max(finish_times(partitioner, r, plan.servers, plan.bands[1]))
    assert got == pytest.approx(best, rel=1e-9)


def test_thread_associates_by_the_papers_rule(costs, partitioner):
    # equal antennas: s0 (strongest) to antenna 0, s1 to the empty antenna 1, s2 to the antenna whose servers
    # merge to the weaker capacity (antenna 1: s1 is weaker than s0), sent after s1
    r = rates((4e9, 3e9, 2e9), 2, bw=1e7)
    plan = paper_plan(costs, r, ["s0", "s1", "s2"], "thread", CUT)
    check_paper_shape(plan, partitioner)
    placed = {s: (m, k) for s, m, k in zip(plan.servers, plan.antennas, plan.order, strict=True)}
    assert placed == {"s0": (0, 0), "s1": (1, 0), "s2": (1, 1)}
    assert plan.servers == ["s0", "s1", "s2"]  # bands antenna by antenna, in transfer order


def test_single_uses_the_strongest_server_alone_and_without_a_cut_the_best_cut_is_chosen(costs, partitioner):
    r = rates((2e9, 6e9, 3e9), 2)
    plan = paper_plan(costs, r, ["s0", "s1", "s2"], "single")
    assert plan.servers == ["s1"] and plan.bands[1] == [(0, costs.height_of(plan.levels[0]))]
    assert plan.windows[0] == [(0, H)]  # the whole image, one message
    others = [paper_plan(costs, r, ["s0", "s1", "s2"], "single", c.name).predicted for c in costs.cuts]
    assert plan.predicted == pytest.approx(min(others))
