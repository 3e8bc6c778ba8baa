"""Overlap (deepco/planning/overlap.py): a segment run in parts (the interior from a server's own rows while the
halo is in flight, then the borders) stitches to exactly the segment run once, in ONNX Runtime on the zoo's
ResNet-18 and on real `deepco serve` processes; thin bands with no interior fall back to one run; the cost
model's formula and the plan's data."""

from __future__ import annotations

from dataclasses import replace

import grpc
import numpy as np
import pytest
from deepco_device.staged import StagedPlanner, StagedRunner
from test_staged_runtime import check, make_device, pixels

from deepco.partition import Partitioner, load_model
from deepco.partition.derive import open_segment
from deepco.partition.open_rows import sides_for
from deepco.planning import overlap
from deepco.planning.staged import CostModel, Rates, StagedPlan, in_parts, predict, split_plan, tables
from deepco.wire import deepco_service_pb2 as dpb

H, W = 97, 131  # odd: halos clipped unevenly
MODNN = ["maxpool", "layer1.0", "layer1", "layer2.0", "layer2"]  # a stage per block: the most exchanges
CHAINS = [MODNN, ["layer1", "layer2", "layer3"], ["relu", "layer1"]]
WEIGHTS = [[1, 1, 1], [1, 3, 1], [8, 1, 8], [1, 20, 1]]  # even, uneven, a thin middle band, thin outer bands


@pytest.fixture(scope="module")
def costs() -> CostModel:
    return CostModel(Partitioner(load_model("resnet18", H, W), H, W), 3 * H * W * 4, 1000 * 4)


def _parts_of(costs: CostModel, levels: list[str], weights: list[float], lookahead: bool):
    bands, windows, _ = tables(costs, levels, weights, lookahead)
    names = [None, *levels]
    def window_of(j: int, i: int):
        return lambda a, b: costs.window(names[j - 1], names[j], a, b, windows[j][i])

    return bands, windows, overlap.plan_parts(window_of, bands, windows, lookahead, ["s"] * len(weights), "@device")


@pytest.mark.parametrize("levels", CHAINS)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_parts_stitch_to_the_segment_run_once_in_onnx_runtime(costs, partition_ort, levels, weights):
    bands, windows, parts = _parts_of(costs, levels, weights, lookahead=False)
    assert any(p for level in parts for p in level)
    segments = costs.p.segments(levels[-1], models=True, through=levels[:-1])
    x = np.random.default_rng(1).standard_normal((1, 3, H, W)).astype(np.float32)
    level = x
    for j, seg in enumerate(segments, start=1):
        name = seg.model.graph.input[0].name
        (whole,) = partition_ort(seg.model, {name: level})
        for i, band in enumerate(bands[j]):
            own = bands[j - 1][i]
            runs = parts[j][i]
            if not runs:
                continue
            (ia, ib), inner, _ = runs[0]
            assert own[0] <= inner[0] and inner[1] <= own[1], "the interior reads only the server's own rows"
            assert sorted(r for r, _, _ in runs)[0][0] == band[0] and ib <= band[1]
            pieces = []
            model = open_segment(seg.model, sides_for(windows[j][i], seg.in_height))
            for (a, b), (lo, hi), crop in runs:
                assert windows[j][i][0] <= lo and hi <= windows[j][i][1]
                (y,) = partition_ort(model, {name: level[:, :, lo:hi]})
                pieces.append((a, y[:, :, crop:crop + b - a]))
            stitched = np.concatenate([p for _, p in sorted(pieces, key=lambda p: p[0])], axis=2)
            want = whole[:, :, band[0]:band[1]]
            assert stitched.shape == want.shape
            assert float(np.abs(stitched - want).max()) <= 1e-4 * float(np.abs(want).max())
        level = whole


def test_a_band_thinner_than_its_halo_has_no_interior_and_runs_once(costs):
    bands, _, parts = _parts_of(costs, MODNN, [8, 1, 8], lookahead=True)
    assert bands[2][1][1] - bands[2][1][0] <= 2
    assert parts[2][1] == []  # every row of the thin band needs a neighbour's rows
    assert len(parts[2][0]) == len(parts[2][2]) == 2  # its neighbours: interior, and the border by it
    assert parts[0] == [[], [], []] and parts[1] == [[], [], []]  # level 1 with lookahead: nothing exchanged
    bands, _, parts = _parts_of(costs, ["layer1", "layer3"], [1, 1, 1], lookahead=True)
    assert parts[2] == [[], [], []]  # at 97 rows layer3's every row reads most of layer1: no interior


def test_finish_is_the_slower_of_interior_and_halo_then_the_borders():
    # run once: waits for both, then the whole window
    assert overlap.finish(1.0, 3.0, 2.0, None, 0.0, 1, 0.1) == pytest.approx(5.1)
    # in 3 parts: the interior (1.5 s) hides under the halo's flight (until 3 s), then the borders
    assert overlap.finish(1.0, 3.0, 2.0, 1.5, 0.6, 3, 0.1) == pytest.approx(3.0 + 0.6 + 0.1 + 2 * overlap.PART_OVERHEAD)
    # a halo that lands early hides nothing: interior then borders, the parts' overhead on top
    assert overlap.finish(1.0, 0.5, 2.0, 1.5, 0.6, 3, 0.1) == pytest.approx(2.5 + 0.6 + 0.1 + 2 * overlap.PART_OVERHEAD)


def _rates(link: float) -> Rates:
    return Rates({"s0": 2e9, "s1": 2e9, "s2": 2e9}, [1e8, 1e8], 0.001, 1e9, link, 0.002)


@pytest.fixture(scope="module")
def tall() -> CostModel:
    """Bands of 30 rows: a border's recomputed rows cost less than a slow link's halo (at 97 rows they do not)."""
    return CostModel(Partitioner(load_model("resnet18", 360, 64), 360, 64), 3 * 360 * 64 * 4, 1000 * 4)


def test_the_planner_keeps_the_overlap_where_it_pays_and_the_plan_carries_it(tall):
    levels = MODNN
    slow = split_plan(tall, _rates(2e5), ["s0", "s1", "s2"], levels, False, None)  # a slow server-to-server link
    assert slow is not None and any(p for level in slow.overlap for p in level)
    once = replace(slow, overlap=[])
    gain = predict(once, tall, _rates(2e5))["frame"] - predict(slow, tall, _rates(2e5))["frame"]
    assert gain > 0
    back = StagedPlan.from_dict(slow.to_dict())
    assert back == slow  # the parts survive JSON (tuples)
    fast = split_plan(tall, Rates({"s0": 2e9, "s1": 2e9, "s2": 2e9}, [1e8, 1e8], 0.001, 1e9, 1e12, 0.0),
                      ["s0", "s1", "s2"], levels, False, None)
    assert fast is not None and fast.overlap == []  # a halo that costs nothing: extra runs do not pay


@pytest.fixture(scope="module")
def servers(three_server_processes):
    return three_server_processes


@pytest.fixture(scope="module")
def resnet(servers):
    with make_device(servers, "resnet18", H, W) as dev:
        yield dev


@pytest.mark.parametrize(("levels", "lookahead", "tail", "weights"), [
    (["layer1", "layer2", "layer3"], True, True, [1, 1, 1]),  # a fused hybrid: exchanges, the tail on s0
    (MODNN, False, False, [1, 1, 1]),  # MoDNN's shape: the image's halo exchanged too
    (MODNN, True, False, [8, 1, 8]),  # a thin middle band: it runs once, its neighbours in parts
])
def test_a_split_run_in_parts_on_real_servers_equals_the_whole_model(resnet, levels, lookahead, tail, weights):
    planner = StagedPlanner(resnet)
    costs, chosen = planner.costs, ["s0", "s1", "s2"]
    plan = split_plan(costs, planner.rates(), chosen, levels, lookahead, "s0" if tail else None, weights)
    assert plan is not None
    parted = in_parts(plan, costs)  # in parts whatever the prediction says
    assert parted.overlap
    runner = StagedRunner(resnet, parted)
    for seed in range(2):
        check(resnet, runner, pixels(H, W, seed))


def _refused(resnet, servers, edit) -> grpc.RpcError:
    """The error s1 answers a split whose level-2 parts for s1 were changed by ``edit(parts of s1)``."""
    planner = StagedPlanner(resnet)
    plan = split_plan(planner.costs, planner.rates(), ["s0", "s1", "s2"], MODNN, True, None)
    runner = StagedRunner(resnet, plan)
    parts = in_parts(plan, planner.costs).overlap
    parts[2][1] = edit(parts[2][1])
    runner.plan = replace(plan, overlap=parts)
    request = runner.request("bad-parts", 1, pixels(H, W))
    assert isinstance(request.levels[2].parts[1], dpb.ServerParts)
    stub = __import__("deepco.wire.deepco_service_pb2_grpc", fromlist=["x"]).DeepcoServiceStub(
        grpc.insecure_channel(servers[1].address))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.SplitRun(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return err.value


def test_parts_that_do_not_tile_the_band_are_refused(resnet, servers):
    def leave_a_row_out(mine):
        (a, b), window, crop = mine[0]
        return [((a, b - 1), window, crop), *mine[1:]]

    assert "parts of level 2" in _refused(resnet, servers, leave_a_row_out).details()


def test_a_band_cut_into_more_parts_than_interior_and_borders_is_refused(resnet, servers):
    # Each part is an ORT run on its own window: a band cut row by row would multiply the job's compute.
    def row_by_row(mine):
        (a, b), window, crop = mine[0]
        return [((r, r + 1), window, crop) for r in range(a, b)] + mine[1:]

    assert "at most 3" in _refused(resnet, servers, row_by_row).details()
