"""Staged plans on real `deepco serve` processes on loopback: every plan shape equals the whole model (the
unpartitioned ONNX model on the same preprocessing, within 1e-4), and the planner's choices are plans the
runtime executes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from deepco_device.preprocess import normalise
from deepco_device.preprocess import pixels as camera_pixels
from deepco_device.session import Device
from deepco_device.sources import open_feed
from deepco_device.staged import StagedPlanner, StagedRunner
from test_server_support import serve_process

from deepco.cluster import parse_cluster
from deepco.planning.bands import ownership
from deepco.planning.staged import DEVICE, StagedPlan, split_plan, tables

PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"


@pytest.fixture(scope="module")
def servers(three_server_processes):
    return three_server_processes


def make_device(servers, model: str, h: int, w: int, antennas: int = 2) -> Device:
    data = {"device": {"antennas": antennas, "bandwidth": 100.0},
            "servers": [{"name": f"s{i}", "capacity": 1.0, "address": s.address} for i, s in enumerate(servers)]}
    dev = Device(parse_cluster(data), model, h, w, log=lambda _: None)
    dev.setup()
    return dev


def reference(dev: Device, px: np.ndarray) -> np.ndarray:
    """The unpartitioned model (no pixel prefix) on the reference preprocessing."""
    session = ort.InferenceSession(dev.reference_model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: normalise(px, dev.preprocessing)})[0]


def check(dev: Device, runner, px: np.ndarray) -> None:
    want = reference(dev, px)
    outputs, _ = runner.run_frame(px)
    (got,) = outputs.values()
    assert got.shape == want.shape
    error = float(np.abs(got - want).max()) / float(np.abs(want).max())
    assert error < 1e-4, f"{runner.plan.describe()}: relative error {error:.2e}"


@pytest.fixture(scope="module")
def resnet(servers):
    with make_device(servers, "resnet18", 97, 131) as dev:  # odd sizes: halos clipped unevenly
        yield dev


def pixels(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (1, 3, h, w), dtype=np.uint8)


SHAPES = [  # participants, levels, lookahead, tail on the first participant
    (["s0", "s1", "s2"], ["layer2"], True, False),  # the paper's THREAD: one fused stage, tail on the device
    (["s0", "s1", "s2"], ["maxpool", "layer1.0", "layer1", "layer2.0", "layer2"], False, False),  # MoDNN
    (["s0", "s1", "s2"], ["layer1", "layer3"], True, True),  # fused hybrid: two stages, exchange, tail on s0
    (["s1", "s2"], ["layer2", "layer3", "layer4"], True, True),  # ... to the last cut
    (["s2"], ["layer3"], True, True),  # one participant: offload in stages
    (["s0", "s1", "s2"], ["relu", "layer4"], False, False),  # exchange of pixels (uint8) at level 0
    (["s0", "s1", DEVICE], ["layer2"], True, False),  # the device computes a band of its own
    ([DEVICE, "s2"], ["layer3.0"], True, False),  # ... the top one
]


@pytest.mark.parametrize(("chosen", "levels", "lookahead", "tail"), SHAPES)
def test_every_plan_shape_equals_the_whole_model(resnet, chosen, levels, lookahead, tail):
    planner = StagedPlanner(resnet)
    plan = split_plan(planner.costs, planner.rates(), chosen, levels, lookahead, chosen[0] if tail else None)
    assert plan is not None
    runner = StagedRunner(resnet, plan)
    for seed in range(2):
        check(resnet, runner, pixels(97, 131, seed))


@pytest.mark.parametrize(("lookahead", "tail"), [(True, "s0"), (False, None)])
def test_bands_sized_level_by_level_equal_the_whole_model(resnet, lookahead, tail):
    """Levels sized each to its own halo (`tables` with speeds): a server's band moves from level to level,
    so it gets rows of its window beyond a halo's from its neighbours; the frame is still the whole model's."""
    planner = StagedPlanner(resnet)
    chosen, levels = ["s0", "s1", "s2"], ["layer1", "layer2", "layer3", "layer4"]
    bands, windows, crops = tables(planner.costs, levels, [1.0, 1.0, 1.0], lookahead, [4.0, 1.0, 2.0])
    alike = ownership([1.0, 1.0, 1.0], [planner.costs.height_of(n) for n in [None, *levels]])
    assert bands[1] == alike[1] and all(bands[j] != alike[j] for j in range(2, len(bands)))
    plan = StagedPlan("auto", "split", servers=chosen, antennas=[0, 1, 0], order=[0, 0, 1], levels=levels,
                      bands=bands, windows=windows, crops=crops, lookahead=lookahead, tail=tail)
    runner = StagedRunner(resnet, plan)
    for seed in range(2):
        check(resnet, runner, pixels(97, 131, seed))


def test_local_offload_round_robin_and_auto_are_exact(resnet):
    planner = StagedPlanner(resnet)
    for name in ("local", "offload", "auto"):
        check(resnet, StagedRunner(resnet, planner.named(name)), pixels(97, 131, 3))
    rr = StagedRunner(resnet, planner.named("round-robin"))
    for seed in range(3):  # one frame on each server
        check(resnet, rr, pixels(97, 131, seed))


def test_planner_ranks_local_offload_and_splits(resnet):
    planner = StagedPlanner(resnet)
    plans = planner.plans()
    kinds = {p.kind for p in plans}
    assert kinds == {"local", "offload", "split"}
    assert plans[0].predicted == min(p.predicted for p in plans)
    assert all(p.predicted > 0 for p in plans)


def test_efficientnet_hybrid_is_exact(servers):
    with make_device(servers, "efficientnet-lite0", 224, 224) as dev:
        planner = StagedPlanner(dev)
        cuts = [c.name for c in planner.costs.cuts]
        plan = split_plan(planner.costs, planner.rates(), ["s0", "s1"], [cuts[2], cuts[5]], True, "s0")
        check(dev, StagedRunner(dev, plan), pixels(224, 224, 5))


def test_a_live_source_faster_than_the_plan_drops_late_frames_and_every_frame_in_is_exact(resnet):
    """The photo played as a live source far faster than any plan (`deepco run --source-fps`): the frames that
    entered leave in order with outputs equal to the whole model's, the latest one always among them; every
    other frame is counted as dropped."""
    runner = StagedRunner(resnet, StagedPlanner(resnet).named("offload"))
    entered = []

    def prepare(frame: np.ndarray) -> np.ndarray:
        entered.append(camera_pixels(frame, 97, 131, resnet.preprocessing))
        return entered[-1]

    feed = open_feed(str(PHOTO), 12, None, 10000.0, prepare)
    results = list(runner.run_frames(feed, depth=1))
    done, dropped = [r.index for r in results], [d.index for d in feed.drops()]
    assert sorted(done + dropped) == list(range(12)) and done == sorted(done)
    assert dropped and done[-1] == 11 and len(entered) == len(results)
    want = reference(resnet, entered[0])  # one photo: every frame's pixels are the same
    for r, px in zip(results, entered, strict=True):
        assert r.error is None and np.array_equal(px, entered[0])
        assert float(np.abs(r.output - want).max()) / float(np.abs(want).max()) < 1e-4
        assert r.capture_to_result >= r.latency > 0


def test_models_a_server_evicted_are_loaded_again_and_no_frame_is_lost_nor_the_server_taken_for_down(resnet):
    """A server unloads a model nobody used for its lease (a device suspended that long): the runner's next frame
    meets NOT_FOUND, loads the missing models again and runs the frame again on the same plan, exactly; nothing
    replans, and the server is not marked down. Offload, round-robin and a split with its tail on a server."""
    planner = StagedPlanner(resnet)
    lines: list[str] = []
    replans: list[set[str]] = []
    split = split_plan(planner.costs, planner.rates(), ["s0", "s1", "s2"], ["layer1", "layer3"], True, "s0")
    for plan in (planner.named("offload"), planner.named("round-robin"), split):
        runner = StagedRunner(resnet, plan, log=lines.append)
        try:
            check(resnet, runner, pixels(97, 131, 0))  # every model in use once
            evicted = 0
            for client, name, _ in runner._models():  # gone behind the device's back, as a lease ends
                if name in client.loaded_models():
                    client.unload_model(name, force=True)
                    evicted += 1
            assert evicted > 0
            frames = [pixels(97, 131, k) for k in range(1, 4)]
            results = list(runner.run_frames(frames, depth=1, replan=lambda down: replans.append(down) or split))
            assert [r.index for r in results] == [0, 1, 2] and replans == []
            for r, px in zip(results, frames, strict=True):
                assert r.error is None, r.error
                want = reference(resnet, px)
                assert float(np.abs(r.output - want).max()) / float(np.abs(want).max()) < 1e-4
            assert all(name in client.loaded_models() for client, name, _ in runner._models())
            assert any("had lost" in line and "loaded again" in line for line in lines), lines
            lines.clear()
        finally:
            runner.close()


def test_a_server_killed_mid_run_loses_no_frame_under_a_multi_stage_plan(servers):
    """Three servers, a two-stage plan with exchanges and the tail on a server; one server is killed after
    the third frame: every frame still equals the whole model, the others carry on without it."""
    with serve_process("--threads", "1", "--max-models", "64") as doomed, \
            make_device([servers[0], servers[1], doomed], "resnet18", 97, 131) as dev:
        planner = StagedPlanner(dev)
        plan = split_plan(planner.costs, planner.rates(), ["s0", "s1", "s2"], ["layer1", "layer3"], True, "s0")
        runner = StagedRunner(dev, plan)
        frames = [pixels(97, 131, k) for k in range(8)]

        def source():
            for k, px in enumerate(frames):
                if k == 3:
                    doomed.proc.kill()
                    doomed.proc.wait()
                yield px

        results = list(runner.run_frames(source(), depth=2, replan=lambda down: planner.best(exclude=down)))
    assert [r.index for r in results] == list(range(8))
    for r, px in zip(results, frames, strict=True):
        assert r.error is None, r.error
        want = reference(dev, px)
        assert float(np.abs(r.output - want).max()) / float(np.abs(want).max()) < 1e-4


def test_every_plan_shape_is_exact_on_a_hand_made_net_with_strides_dilation_and_concat(servers, tmp_path):
    """The kitchen-sink net of test_partition_ops (stride 3 with asymmetric pads, a dilated branch concatenated
    with a depthwise one, ceil-mode pools, explicit Pad, residual, SAME_LOWER, VALID) under the staged plan
    shapes: one fused stage with the tail on the device, stages with exchanges and the tail on a server, bands
    exchanged from the image on, and the device as a participant."""
    import onnx
    from test_partition_ops import kitchen_sink

    path = tmp_path / "kitchen_sink.onnx"
    onnx.save(kitchen_sink(), str(path))
    h, w = 101, 67  # odd sizes: every stride leaves a remainder somewhere
    with make_device(servers, str(path), h, w) as dev:
        planner = StagedPlanner(dev)
        cuts = [c.name for c in planner.costs.cuts]
        assert {"branches", "clip"} <= set(cuts), cuts  # the concat and the stride-2 conv after the pad
        shapes = [(["s0", "s1", "s2"], ["residual"], True, None),
                  (["s0", "s1", "s2"], ["branches", "clip"], True, "s0"),
                  (["s1", "s2"], ["pool_ceil", "avg_ceil"], True, "s2"),
                  (["s0", "s1"], ["stem_relu", "branches", "pool_ceil"], False, "s1"),
                  (["s0", DEVICE], ["branches"], True, None)]
        for chosen, levels, lookahead, tail in shapes:
            plan = split_plan(planner.costs, planner.rates(), chosen, levels, lookahead, tail)
            assert plan is not None, (chosen, levels)
            runner = StagedRunner(dev, plan)
            for seed in range(2):
                check(dev, runner, pixels(h, w, seed))
        for name in ("local", "offload"):
            check(dev, StagedRunner(dev, planner.named(name)), pixels(h, w, 7))
