"""A window streamed in sub-bands (deepco/planning/overlap.py `stream_parts`, SplitRequest.input_rest): the
device sends a server the rows its first sub-band reads with the request and the rest of its window after
every first request on the antenna, and the server computes the first sub-band while the rest is on the air.
On real `deepco serve` processes the streamed plans equal the whole model; the server refuses a rest that is
not the end of its window and names the device when the rest never comes; the cost model sends the rests
after the first messages and the planner keeps streaming only where it predicts it faster."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
from deepco_device.staged import StagedPlanner, StagedRunner
from test_staged_runtime import check, make_device, pixels

from deepco.partition import Partitioner, load_model
from deepco.planning import overlap
from deepco.planning.staged import (
    DEVICE,
    CostModel,
    Rates,
    StagedPlan,
    _best_levels,
    predict,
    refine,
    search,
    split_plan,
    streamed,
    streaming,
)
from deepco.wire import deepco_service_pb2_grpc as dpb_grpc
from deepco.wire.split_jobs import rest_message

H, W = 241, 97  # tall enough that a sub-band of a deep stage leaves rows to stream; odd: halos clipped unevenly


@pytest.fixture(scope="module")
def servers(three_server_processes):
    return three_server_processes


@pytest.fixture(scope="module")
def resnet(servers):
    with make_device(servers, "resnet18", H, W) as dev:
        yield dev


@pytest.mark.parametrize(("chosen", "levels", "tail", "share"), [
    (["s0", "s1", "s2"], ["layer2"], None, 0.5),  # the paper's THREAD shape, every window streamed
    (["s0", "s1", "s2"], ["layer1", "layer2.0", "layer3"], "s0", 1 / 3),  # fused, exchanges, the tail on s0
    (["s0", "s1", DEVICE], ["layer1"], None, 0.5),  # the device's own band is not streamed
])
def test_a_streamed_window_on_real_servers_equals_the_whole_model(resnet, chosen, levels, tail, share):
    planner = StagedPlanner(resnet)
    plan = split_plan(planner.costs, planner.rates(), chosen, levels, True, tail)
    assert plan is not None
    plan = streaming(replace(plan, overlap=[]), planner.costs, share)  # streamed whatever the prediction says
    rests = streamed(plan)
    # a band whose first sub-band reads its whole window has nothing to stream (a deep stage's bottom band)
    assert any(rests) and all(r is None for r, s in zip(rests, chosen, strict=True) if s == DEVICE)
    runner = StagedRunner(resnet, plan)
    for i in range(len(chosen)):
        if rests[i]:  # the request carries the window's rows above the rest, and names the rest
            request = runner.request("look", i, pixels(H, W))
            assert (request.input_rest.start, request.input_rest.stop) == rests[i]
            assert request.input.start + request.input.shape[2] == rests[i][0] == plan.overlap[1][i][0][1][1]
    for seed in range(2):
        check(resnet, runner, pixels(H, W, seed))


def _thread(resnet) -> StagedRunner:
    planner = StagedPlanner(resnet)
    plan = split_plan(planner.costs, planner.rates(), ["s0", "s1", "s2"], ["layer2"], True, None)
    return StagedRunner(resnet, streaming(replace(plan, overlap=[]), planner.costs, 0.5))


def _stub(server) -> dpb_grpc.DeepcoServiceStub:
    return dpb_grpc.DeepcoServiceStub(grpc.insecure_channel(server.address))


@pytest.mark.parametrize(("edit", "words"), [
    (lambda r: setattr(r.input_rest, "stop", r.input_rest.stop - 1), "must be the last rows"),
    (lambda r: setattr(r, "lookahead", False), "only for a job with lookahead"),
    (lambda r: setattr(r.input_rest, "start", r.input_rest.start + 1), "input holds rows"),
])
def test_a_rest_that_is_not_the_end_of_the_window_is_refused(resnet, servers, edit, words):
    request = _thread(resnet).request("bad-rest", 1, pixels(H, W))
    edit(request)
    with pytest.raises(grpc.RpcError) as err:
        list(_stub(servers[1]).SplitRun(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()


def test_a_rest_that_never_comes_ends_the_job_naming_the_device_and_one_that_does_completes_it(resnet, servers):
    runner = _thread(resnet)
    x = pixels(H, W)
    request = runner.request("no-rest", 1, x)
    request.exchange_timeout_seconds = 1.0
    with pytest.raises(grpc.RpcError) as err:
        list(_stub(servers[1]).SplitRun(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "the device" in err.value.details()

    request = runner.request("with-rest", 1, x)
    events = _stub(servers[1]).SplitRun(request, timeout=30)
    assert next(events).HasField("received")
    assert _stub(servers[1]).SplitExchange(iter([rest_message("with-rest", 1, x, runner.rests[1])]),
                                           timeout=30).messages == 1
    (last,) = list(events)
    assert last.split_result.output.shape[2] == runner.plan.bands[-1][1][1] - runner.plan.bands[-1][1][0]


@pytest.fixture(scope="module")
def tall() -> CostModel:
    return CostModel(Partitioner(load_model("resnet18", 720, 128), 720, 128), 3 * 720 * 128, 1000 * 4)


def _rates(radio: float) -> Rates:
    return Rates({"s0": 4e9, "s1": 4e9, "s2": 4e9}, [radio, radio], 0.002, 1e9, 1e8, 0.002)


def test_the_cost_model_sends_every_rest_after_the_first_messages_and_the_planner_streams_where_it_pays(tall):
    slow = _rates(2e6)  # the radio carries a window for about as long as a server computes its first stage
    plan = split_plan(tall, slow, ["s0", "s1", "s2"], ["layer1", "layer2"], True, None)
    assert plan is not None and any(streamed(plan)), plan.describe()
    assert "windows streamed in two sub-bands" in plan.describe()
    once = replace(plan, overlap=[])
    assert predict(once, tall, slow)["frame"] > plan.predicted
    # every rest goes after the first messages, once the last of them was acknowledged (as the device's sender
    # waits for it): the antennas carry the same bytes, the last window is whole one round trip later than when
    # it was unstreamed, and the first stage ends earlier
    streamed_at, whole_at = predict(plan, tall, slow), predict(once, tall, slow)
    assert max(streamed_at["arrived"]) == pytest.approx(max(whole_at["arrived"]) + slow.request_overhead)
    assert streamed_at["stages"][0] < whole_at["stages"][0]
    assert StagedPlan.from_dict(plan.to_dict()) == plan  # the sub-bands survive JSON
    # a radio that carries the window in no time: nothing to hide, and a second run costs PART_OVERHEAD
    fast = _rates(1e12)
    kept = split_plan(tall, fast, ["s0", "s1", "s2"], ["layer1", "layer2"], True, None)
    assert kept is not None and not any(streamed(kept))


def _camera(radio: float) -> Rates:
    """The camera preset's shape at a tenth of its width: two antennas, each carrying two servers' windows."""
    return Rates({"s0": 4.6e9, "s1": 4.6e9, "s2": 3.5e9, "s3": 3.4e9}, [radio, radio], 0.008, 0.96e9, 1.4e7,
                 0.0007, 1.8e-8, step_overhead=0.008)


def test_longer_first_stages_are_ranked_and_the_search_is_no_slower_than_the_barrier_models_chain(tall):
    chosen = ["s0", "s1", "s2", "s3"]
    shared = _camera(1.2e6)  # the windows take about 115 ms on the air; the second on an antenna comes last
    chains = _best_levels(tall, shared, chosen, True, None)
    barrier = next(c for c in chains if c[-1] == "layer4")  # the barrier model's chain through the network
    assert {"maxpool", "layer1.0", "layer1"} <= {c[0] for c in chains if c[-1] == "layer4"}
    best = search(tall, shared, chosen)[0]
    assert best.kind == "split", best.describe()
    for tail in (None, "s0"):  # the barrier model's own chain, refined as search refines it, is no faster
        plan = split_plan(tall, shared, chosen, barrier, True, tail)
        assert best.predicted <= refine(plan, tall, shared).predicted
    # a radio that carries the image in no time leaves nothing to absorb: only the barrier model's chains
    instant = _camera(1e12)
    assert _best_levels(tall, instant, chosen, True, None) == _best_levels(tall, instant, chosen, True, len(tall.cuts))


def test_stream_parts_tile_the_band_and_the_rest_follows_the_first_window(tall):
    def window(a: int, b: int):
        return tall.window(None, "layer1", a, b)

    for band in [(0, 60), (45, 130), (170, 180)]:
        for share in overlap.STREAM_SHARES:
            parts = overlap.stream_parts(window, band, share)
            (a, c), first, _ = parts[0]
            (c2, b), second, _ = parts[1]
            assert (a, c2, b) == (band[0], c, band[1]) and a < c < b
            whole = window(*band).input_rows
            assert first[0] == whole[0] and second[1] == whole[1]
            assert overlap.rest(parts, whole) == (first[1], whole[1])
    assert overlap.stream_parts(window, (0, 1), 0.5) == []  # one row: nothing to split

