"""The staged planner's cost model and search, checked against hand-computed values, and the benchmark's
physical bound."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from deepco_bench.benchmark import bound

from deepco.partition import Partitioner, load_model
from deepco.partition.pixels import with_pixel_input
from deepco.planning.plan import PlanningError
from deepco.planning.staged import (
    CostModel,
    Rates,
    _best_levels,
    local_plan,
    offload_plan,
    pipelined,
    round_robin_fps,
    round_robin_plan,
    same_plan,
    search,
    split_plan,
    throughput,
)

H, W = 64, 96


@pytest.fixture(scope="module")
def costs() -> CostModel:
    model = with_pixel_input(load_model("resnet18", H, W), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    return CostModel(Partitioner(model, H, W), 3 * H * W, 4000)


def rates(device: float = 1e9, servers: tuple[float, ...] = (4e9, 2e9), bw: float = 1e6, **kw) -> Rates:
    return Rates({f"s{k}": r for k, r in enumerate(servers)}, [bw, bw], 0.001, device, 1e8, 0.0005, **kw)


def test_local_and_offload_are_the_closed_forms(costs):
    r = rates(device_seconds_per_byte=1e-9, step_overhead=0.002)
    assert local_plan(costs, r).predicted == pytest.approx(costs.total_flops / 1e9)
    # marshal, send at 1 MB/s, one request overhead, compute on s0, one step, the output back
    want = (3 * H * W * 1e-9 + 3 * H * W / 1e6 + 0.001 + costs.total_flops / 4e9 + 0.002
            + 4000 / 1e6 + 4000 * 1e-9)
    assert offload_plan(costs, r, "s0").predicted == pytest.approx(want)


def test_round_robin_fps_is_set_by_the_slowest_server_or_the_links(costs):
    r = rates(bw=1e12)
    assert round_robin_fps(costs, r, ["s0", "s1"]) == pytest.approx(2 * 2e9 / costs.total_flops)
    slow_links = rates(bw=1e3)
    assert round_robin_fps(costs, slow_links, ["s0", "s1"]) == pytest.approx(2e3 / (3 * H * W))
    plan = round_robin_plan(costs, r, ["s0", "s1"])
    assert throughput(plan, costs, r) == pytest.approx(round_robin_fps(costs, r, ["s0", "s1"]))


def test_search_picks_local_when_the_network_is_hopeless_and_splits_when_it_is_not(costs):
    hopeless = rates(bw=1e2)  # 100 B/s: sending a frame takes minutes
    assert search(costs, hopeless, ["s0", "s1"])[0].kind == "local"
    fast = rates(device=1e8, bw=1e9)  # a weak device, fast links, two strong servers
    best = search(costs, fast, ["s0", "s1"])[0]
    assert best.kind == "split" and len(best.servers) == 2
    ranked = search(costs, fast, ["s0", "s1"])
    assert [p.predicted for p in ranked[:5]] == sorted(p.predicted for p in ranked[:5])


def test_a_split_plans_tables_tile_every_level_and_the_device_sends_windows(costs):
    r = rates(device=1e8, bw=1e9)
    plan = split_plan(costs, r, ["s0", "s1"], ["layer1", "layer3"], True, "s0")
    for level, h in zip(plan.bands, [H] + [costs.height_of(n) for n in plan.levels], strict=True):
        assert level[0][0] == 0 and level[-1][1] == h and level[0][1] == level[1][0]
    assert plan.windows[0] == plan.windows[1]  # lookahead: the first stage's windows, halo included
    assert plan.windows[1][0][1] > plan.bands[0][0][1]  # the top band's window reaches below its band
    without = split_plan(costs, r, ["s0", "s1"], ["layer1", "layer3"], False, None)
    assert without.windows[0] == without.bands[0]  # MoDNN's way: disjoint bands, the halo is exchanged


def test_the_physical_bound_is_the_formula():
    device = SimpleNamespace(
        height=10, width=20, channels=3,
        partitioner=SimpleNamespace(graph=SimpleNamespace(itemsize=1), total_flops=6e9),
        costs=SimpleNamespace(output_bytes=40),
        measured=SimpleNamespace(antenna_bytes_per_second=[100.0, 200.0], server_flops_per_second={"a": 1e9},
                                 device_flops_per_second=2e9),
        cluster=SimpleNamespace(device=SimpleNamespace(antennas=[SimpleNamespace(bandwidth=None),
                                                                  SimpleNamespace(bandwidth=None)])))
    b = bound(device)
    assert b["latency"] == pytest.approx(max(600 / 300.0, 6e9 / 3e9))
    assert b["fps"] == pytest.approx(min(300.0 / 600, 3e9 / 6e9))
    # a declared (shaped) rate above the measured one counts: 0.0032 Mbit/s is 400 B/s on the second antenna
    device.cluster.device.antennas[1].bandwidth = 0.0032
    device.measured.server_flops_per_second = {"a": 1e12}  # compute no longer binds: the links do
    assert bound(device)["fps"] == pytest.approx(500.0 / 600)
    assert bound(device)["latency"] == pytest.approx(600 / 500.0)
    # outputs larger than the image (a detector's raw heads) come back over the same antennas: they bind
    device.costs.output_bytes = 1500
    assert bound(device)["latency"] == pytest.approx(1500 / 500.0)
    assert bound(device)["fps"] == pytest.approx(500.0 / 1500)


def test_same_plan_ignores_the_name_and_the_prediction_only(costs):
    r = rates()
    offload = offload_plan(costs, r, "s0")
    auto = replace(offload_plan(costs, rates(servers=(8e9, 2e9)), "s0"),  # another prediction, the same plan
                   algorithm="auto", fidelity={"ratio": 1.1})
    assert auto.predicted != offload.predicted
    assert same_plan(auto.to_dict(), offload.to_dict())
    assert not same_plan(offload_plan(costs, r, "s1").to_dict(), offload.to_dict())
    assert not same_plan(local_plan(costs, r).to_dict(), offload.to_dict())


def test_throughput_counts_every_step_a_server_takes(costs):
    """Pipelining hides transfers, not a server's own per-step work: a plan of many stages pays the step
    overhead on every server for every stage (by hand: FLOPs at the server's rate + steps x overhead)."""
    fast_links = dict(bw=1e12)
    r = rates(step_overhead=0.05, **fast_links)
    # round-robin over s0 (4 GFLOP/s) and s1 (2 GFLOP/s): s1 sets the pace, one step per frame it takes
    assert round_robin_fps(costs, r, ["s0", "s1"]) == pytest.approx(2 / (costs.total_flops / 2e9 + 0.05))
    offload = offload_plan(costs, r, "s0")
    assert throughput(offload, costs, r) == pytest.approx(1 / (costs.total_flops / 4e9 + 0.05), rel=1e-6)
    levels = ["layer1", "layer2", "layer3"]
    many, one = (split_plan(costs, r, ["s0", "s1"], lv, True, "s0") for lv in (levels, levels[-1:]))
    without = rates(**fast_links)
    split_without = split_plan(costs, without, ["s0", "s1"], levels, True, "s0")
    # with no overhead the three-stage plan's fps is the FLOPs' alone; with it, every server pays 3 or 4 steps
    assert throughput(many, costs, r) < throughput(split_without, costs, without)
    assert 1 / throughput(many, costs, r) >= 4 * 0.05  # s0 takes 3 stages and the tail
    assert throughput(many, costs, r) < throughput(one, costs, r)


def test_frames_in_flight_queue_at_the_busiest_resource(costs):
    """`pipelined`, by hand: a local plan is one resource, so every extra frame in flight waits a whole frame
    and adds no fps; an offload over free links is bound by its server (FLOPs and a step), so a second frame
    in flight hides the request overhead and then waits for the server."""
    r = rates(step_overhead=0.002, bw=1e12)
    alone = costs.total_flops / 1e9
    local = local_plan(costs, r)
    assert pipelined(local, costs, r, 1) == pytest.approx((alone, 1 / alone))
    assert pipelined(local, costs, r, 3) == pytest.approx((3 * alone, 1 / alone))
    offload = offload_plan(costs, r, "s0")
    server = costs.total_flops / 4e9 + 0.002
    assert offload.predicted > server + 0.001  # the request overhead and the transfers come on top
    assert pipelined(offload, costs, r, 1) == pytest.approx((offload.predicted, 1 / offload.predicted))
    assert pipelined(offload, costs, r, 2) == pytest.approx((2 * server, 1 / server))
    with pytest.raises(PlanningError, match="frames in flight must be >= 1, got 0"):
        pipelined(local, costs, r, 0)


def test_refit_sizes_a_plans_bands_for_the_rates_it_meets_and_keeps_its_shape(costs):
    """A split planned on s1 as fast as s0, run where s1 is a quarter as fast: refitted, s1's band shrinks,
    the shape stays, and it is predicted faster than the plan as made (re-predicted on the true rates)."""
    from deepco.planning.staged import predict, refit

    guessed, true = rates(servers=(4e9, 4e9), bw=1e9), rates(servers=(4e9, 1e9), bw=1e9)
    levels = [costs.cuts[len(costs.cuts) // 2].name]
    made = split_plan(costs, guessed, ["s0", "s1"], levels, True, None)
    fitted = refit(made, costs, true)
    assert (fitted.servers, fitted.levels, fitted.lookahead, fitted.tail) == (made.servers, made.levels, True, None)
    rows = lambda p: [b - a for a, b in p.bands[1]]  # noqa: E731 - rows of each participant at the first level
    assert rows(fitted)[1] < rows(made)[1] and rows(fitted)[0] > rows(made)[0]
    assert fitted.predicted == pytest.approx(predict(fitted, costs, true)["frame"])
    assert fitted.predicted < predict(made, costs, true)["frame"]
    offload = offload_plan(costs, guessed, "s1")  # no bands: re-predicted only
    assert refit(offload, costs, true).predicted == pytest.approx(predict(offload, costs, true)["frame"])


def test_the_programme_that_proposes_stage_boundaries_charges_each_stage_a_step(costs):
    """Every stage costs the simulation a step's fixed cost (`Rates.step_overhead`); the dynamic programme
    that proposes the chains of stages charges it too, so a costly step leaves chains of fewer stages, and
    the chain it finds is predicted no slower than the one found as if steps were free."""
    chosen = ["s0", "s1"]
    free = rates(bw=1e12)
    costly = replace(free, step_overhead=0.5)
    many = _best_levels(costs, free, chosen, False, None)
    few = _best_levels(costs, costly, chosen, False, None)
    assert max(len(chain) for chain in many) > 1  # free steps: exchanging beats recomputing the halo
    assert all(len(chain) == 1 for chain in few), few  # a step dearer than any halo: one stage to each cut
    deepest = costs.cuts[-1].name
    for lookahead in (False, True):
        plans = [split_plan(costs, costly, chosen, next(c for c in chains if c[-1] == deepest), lookahead, None)
                 for chains in (few, many)]
        assert plans[0].predicted <= plans[1].predicted
