"""Segments run on open rows (deepco/partition/open_rows.py): a window's sides that are not at the level's border
pad nothing and compute no row that is cropped. Each open run is checked against the whole model in ONNX Runtime,
for bands one participant runs at once and in two sub-runs (a participant's model serves all its runs of a level);
a plan saved before open rows runs the models' own nodes; real servers run both."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest
from deepco_device.runners import participant_sides
from deepco_device.staged import StagedPlanner, StagedRunner
from test_staged_runtime import check, make_device, pixels

from deepco.partition import Partitioner, load_model
from deepco.partition.derive import open_segment
from deepco.partition.graph import PartitionError
from deepco.partition.open_rows import CLOSED, open_model, sides_for
from deepco.planning.bands import ownership
from deepco.planning.staged import StagedPlan, split_plan

CHAINS = [  # model, height, width (odd: halos clipped unevenly), levels
    ("resnet18", 97, 131, ["maxpool", "layer1.0", "layer1", "layer2.0", "layer2", "layer3"]),
    ("resnet18", 97, 131, ["layer1", "layer3", "layer4"]),
    ("resnet50", 67, 90, ["layer1.0", "layer1", "layer2.1", "layer3"]),
    ("yolov8n", 96, 128, ["b0", "b1", "b2", "b3", "b4"]),  # C2f: channel Split, Concat, residual Add
    # stride 3 with asymmetric pads, dilated and depthwise branches concatenated, a ceil-mode pool (no open form)
    ("kitchen-sink", 101, 67, ["stem_relu", "branches", "clip", "residual", "lower"]),
]


def _model(name: str, h: int, w: int) -> onnx.ModelProto:
    if name == "kitchen-sink":
        from test_partition_ops import kitchen_sink

        return kitchen_sink()
    return load_model(name, h, w)
SHARES = [[1, 1], [1, 3, 1], [8, 1, 8], [2, 1, 1, 3, 1]]  # even, uneven, a thin middle band, five participants


def _whole_levels(p: Partitioner, segments, x: np.ndarray, partition_ort) -> dict[str, np.ndarray]:
    """Every level's tensor of the whole model on ``x``."""
    model = onnx.ModelProto()
    model.CopyFrom(p.whole())
    del model.graph.output[:]
    model.graph.output.extend(onnx.helper.make_tensor_value_info(s.target, onnx.TensorProto.FLOAT, None)
                              for s in segments)
    outs = partition_ort(model, {p.graph.input_name: x})
    return {p.graph.input_name: x} | {s.target: y for s, y in zip(segments, outs, strict=True)}


@pytest.mark.parametrize(("name", "h", "w", "levels"), CHAINS)
def test_open_runs_equal_the_whole_model_at_every_band_and_in_sub_runs(partition_ort, name, h, w, levels):
    p = Partitioner(_model(name, h, w), h, w)
    segments = p.segments(levels[-1], models=True, through=levels[:-1])
    assert any(s.steps is not None for s in segments)
    x = np.random.default_rng(0).standard_normal((1, 3, h, w)).astype(np.float32)
    tensors = _whole_levels(p, segments, x, partition_ort)
    opened = padded = 0
    for seg in segments:
        models = {}
        for shares in SHARES:
            if len(shares) > seg.height:
                continue
            for a, b in ownership(shares, [seg.height])[0]:
                window = seg.window(a, b)
                sides = sides_for(window.input_rows, seg.in_height)
                if sides not in models:
                    models[sides] = open_segment(seg.model, sides) if seg.steps is not None else seg.model
                whole_run = seg.open_window(a, b)
                opened, padded = opened + whole_run.flops, padded + window.flops
                assert whole_run.input_rows == window.input_rows and whole_run.flops <= window.flops
                halves = ((a, (a + b) // 2), ((a + b) // 2, b)) if b - a >= 2 else ()
                runs = [whole_run] + [seg.open_window(*rows, window.input_rows) for rows in halves]
                for run in runs:
                    lo, hi = run.input_rows
                    feed = {seg.model.graph.input[0].name: tensors[seg.source][:, :, lo:hi]}
                    (y,) = partition_ort(models[sides], feed)
                    got = y[:, :, run.crop[0]:run.crop[1]]
                    want = tensors[seg.target][:, :, run.output_rows[0]:run.output_rows[1]]
                    assert got.shape == want.shape, (seg.name, run.output_rows, sides)
                    scale = max(float(np.abs(want).max()), 1e-6)
                    assert float(np.abs(got - want).max()) <= 1e-4 * scale, (seg.name, run.output_rows, sides)
    assert opened < padded  # the rows the padded runs computed to crop


def test_a_resnets_split_computes_less_on_open_rows():
    """ResNet-18 at 360x640 over four servers, a stage per block: the padded runs compute the rows they crop at
    every convolution of every level; open runs only the rows their bands need."""
    p = Partitioner(load_model("resnet18", 360, 640), 360, 640)
    levels = ["layer1.0", "layer1", "layer2.0", "layer2", "layer3.0", "layer3", "layer4.0", "layer4"]
    segments = p.segments(levels[-1], through=levels[:-1])
    padded = opened = 0
    for seg in segments:
        for a, b in ownership([1, 1, 1, 1], [seg.height])[0]:
            padded += seg.window(a, b).flops
            opened += seg.open_window(a, b).flops
    whole = sum(p.cut(c).head_flops for c in levels[-1:])
    assert opened < 0.9 * padded
    assert whole <= opened  # a band's own rows are computed still, and the halo's


def test_a_segment_with_no_open_form_runs_padded():
    """EfficientNet-Lite0 pads with a Pad node: no open form, so its windows stay the models' own."""
    p = Partitioner(load_model("efficientnet-lite0", 224, 224), 224, 224)
    seg = p.segments("_blocks.2", models=True)[-1]
    assert seg.steps is None
    assert seg.open_window(10, 30) == seg.window(10, 30)
    with pytest.raises(PartitionError, match="cannot run on open rows"):
        open_model(seg.model, (True, True))
    assert open_segment(seg.model, CLOSED) is seg.model


@pytest.fixture(scope="module")
def servers(three_server_processes):
    return three_server_processes


def test_open_and_saved_padded_plans_run_on_servers_and_equal_the_whole_model(servers):
    """A split's participants each get the model of their sides (the middle one both open, the outer ones one),
    and a plan saved before open rows existed (no ``open_rows``: its crops the padded runs') runs the models'
    own nodes; both equal the whole model."""
    with make_device(servers, "resnet18", 97, 131) as dev:
        planner = StagedPlanner(dev)
        levels = ["layer1", "layer2.0", "layer3"]
        plan = split_plan(planner.costs, planner.rates(), ["s0", "s1", "s2"], levels, True, "s0")
        assert plan is not None and plan.open_rows
        assert [participant_sides(dev, plan, 2, i) for i in range(3)] == [(False, True), (True, True), (True, False)]
        runner = StagedRunner(dev, plan)
        check(dev, runner, pixels(97, 131, 1))
        kinds = {(j, participant_sides(dev, plan, j, i)) for i in range(3) for j in range(1, len(levels) + 1)}
        assert len(kinds) > len(levels) and len(runner.segment_names) == len(kinds)  # a model per level and sides
        runner.close()
        segments = dev.partitioner.segments(levels[-1], through=levels[:-1])
        crops = [[]] + [[seg.window(*band).crop[0] for band in plan.bands[j]] for j, seg in enumerate(segments, 1)]
        saved = {k: v for k, v in replace(plan, crops=crops).to_dict().items() if k != "open_rows"}
        old = StagedPlan.from_dict(saved)
        assert not old.open_rows and participant_sides(dev, old, 2, 1) == CLOSED
        runner = StagedRunner(dev, old)
        check(dev, runner, pixels(97, 131, 2))
        assert len(runner.segment_names) == len(levels)  # the models' own, alike on every server
        runner.close()
