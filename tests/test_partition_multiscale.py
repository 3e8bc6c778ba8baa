"""Cuts across scales on the zoo's detector (YOLOv8n) and U-Net: staged execution on row bands is exact.

A staged plan is a list of levels (the tensors alive at points of the graph, at strides 1..32); every
stage runs on bands of image rows, each band reading its inputs' windows from the stitched level before,
and the stitched outputs must equal ONNX Runtime on the whole model within 1e-4 of each output's scale.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepco.cli import main
from deepco.partition import Partitioner, PartitionError

SIZES = {"yolov8n": (128, 160), "unet": (160, 192)}
_parts: dict[tuple[str, int, int], Partitioner] = {}


def _partitioner(partition_zoo, name: str, height: int, width: int):
    model, _ = partition_zoo(name, height, width)
    if (name, height, width) not in _parts:
        _parts[(name, height, width)] = Partitioner(model, height, width)
    return model, _parts[(name, height, width)]


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


def staged_run(part: Partitioner, through: list[int], bands: list[list[int]], image: np.ndarray,
               ort_run) -> list[np.ndarray]:
    """Partitioner.run_stages, with every band's crop and every stitched level checked on the way."""

    def run(model, feeds):
        outs = ort_run(model, feeds)
        for vi, y in zip(model.graph.output, outs, strict=True):
            assert y.ndim != 4 or y.shape[2] >= 1, vi.name
        return outs

    for stage, bounds in zip(part.stages(through, models=False), bands, strict=True):
        for w in stage.bands(bounds):
            for t, (c0, c1) in w.crop.items():
                assert 0 <= c0 < c1 and c1 - c0 == w.output_rows[t][1] - w.output_rows[t][0]
    return part.run_stages(through, bands, image, run)


def _bands(draw, part: Partitioner, align: int, most: int = 4) -> list[int]:
    """Random band boundaries in image rows: multiples of ``align``, 0 and the image height included."""
    inner = [r for r in range(align, part.height, align)]
    chosen = draw(st.lists(st.sampled_from(inner), max_size=most - 1, unique=True)) if inner else []
    return [0, *sorted(chosen), part.height]


@pytest.mark.parametrize("name", sorted(SIZES))
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_staged_plans_equal_the_whole_model(partition_zoo, partition_ort, name, data):
    height, width = SIZES[name]
    model, part = _partitioner(partition_zoo, name, height, width)
    last = len(part.levels) - 1
    through = sorted(set(data.draw(st.lists(st.integers(1, last), min_size=1, max_size=6))) | {last})
    bounds = [_bands(data.draw, part, s.align) for s in part.stages(through, models=False)]
    image = np.random.default_rng(height).standard_normal((1, 3, height, width)).astype(np.float32)
    want = partition_ort(model, {part.graph.input_name: image})
    got = staged_run(part, through, bounds, image, partition_ort)
    errors = [_rel(g, w) for g, w in zip(got, want, strict=True)]
    assert len(got) == len(want) and max(errors) <= 1e-4, (through, bounds, errors)


@pytest.mark.parametrize("name", sorted(SIZES))
@pytest.mark.parametrize("plan", ["every level", "one stage", "every fourth level"])
def test_plan_shapes_equal_the_whole_model(partition_zoo, partition_ort, name, plan):
    """Fixed plan shapes: a stage per level (MoDNN-like), the whole network as one stage, a coarse plan;
    every stage on the finest bands its alignment allows, capped at 5."""
    height, width = SIZES[name]
    model, part = _partitioner(partition_zoo, name, height, width)
    last = len(part.levels) - 1
    through = {"every level": list(range(1, last + 1)), "one stage": [last],
               "every fourth level": sorted(set(range(4, last + 1, 4)) | {last})}[plan]
    bounds = []
    for s in part.stages(through, models=False):
        rows = list(range(0, height, s.align))[:5]
        bounds.append([*rows, height])
    image = np.random.default_rng(7).standard_normal((1, 3, height, width)).astype(np.float32)
    want = partition_ort(model, {part.graph.input_name: image})
    got = staged_run(part, through, bounds, image, partition_ort)
    errors = [_rel(g, w) for g, w in zip(got, want, strict=True)]
    assert len(got) == len(want) and max(errors) <= 1e-4, errors


@pytest.mark.parametrize("name", sorted(SIZES))
def test_single_tensor_cuts_still_work_on_the_new_models(partition_zoo, partition_compare, name):
    height, width = SIZES[name]
    model, part = _partitioner(partition_zoo, name, height, width)
    image = np.random.default_rng(3).standard_normal((1, 3, height, width)).astype(np.float32)
    for cut in (part.cuts[0], part.cuts[len(part.cuts) // 2], part.cuts[-1]):
        partition_compare(model, part, cut, part.equal_boundaries(cut, min(3, cut.height)), image)


@pytest.mark.parametrize("name", sorted(SIZES))
def test_most_flops_split_at_736x1280(partition_zoo, name):
    """Before levels across scales only the encoder's first stages could be split (a cut was one tensor
    with no skip leaving the head): 18% of YOLOv8n's FLOPs. Now the whole row-local prefix can."""
    _, part = _partitioner(partition_zoo, name, 736, 1280)
    assert part.stop is None
    assert part.split_share() >= 0.85
    last = part.levels[-1]
    assert set(part.graph.outputs) <= set(last.tensors)
    stages = part.stages([lv.index for lv in part.levels[1:]], models=False)
    for s in stages:  # every stage of the finest plan bands: a middle band's window is checked exact
        if part.height > 2 * s.align:
            s.window(s.align, 2 * s.align)


def test_stage_band_must_line_up_with_every_stride(partition_zoo):
    _, part = _partitioner(partition_zoo, "yolov8n", *SIZES["yolov8n"])
    stage = part.stages([len(part.levels) - 1], models=False)[0]
    assert stage.align == 32
    with pytest.raises(PartitionError, match="multiples of 32"):
        stage.window(0, 40)


def test_partition_cli_refuses_a_size_the_detector_cannot_run_at(capsys):
    """Before the check, `deepco partition` printed a plan for 720x1280 (exit 0) and ONNX Runtime failed later."""
    code = main(["partition", "--model", "yolov8n", "--input-size", "720x1280", "--slices", "2"])
    _, err = capsys.readouterr()
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert "does not run at 720x1280" in line and "704x1280 below, 736x1280 above" in line


def test_export_cli_refuses_a_size_the_detector_cannot_run_at(capsys, tmp_path):
    out = tmp_path / "y.onnx"
    code = main(["export", "--model", "yolov8n", "--input-size", "720x1280", "--output", str(out)])
    _, err = capsys.readouterr()
    assert code == 2 and "multiples of 32" in err and not out.exists()


def test_partition_cli_reports_the_split_share(capsys):
    code = main(["partition", "--model", "unet", "--input-size", "160x192", "--slices", "2", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)
    assert doc["split_share"] == pytest.approx(1.0) and doc["levels"][0]["name"] == "image"


@pytest.mark.parametrize(("how", "op"), [("chunk", "Shape"), ("split", "Split")])
def test_detector_exported_with_ultralytics_c2f_split(partition_ort, monkeypatch, how, op):
    """Ultralytics' own C2f splits the channels with ``chunk`` (exported as Shape -> Div -> Slice: folded
    for the size) or ``split`` (an ONNX Split, two outputs: the partitioner follows every output of a
    node); either export bands like the zoo's."""
    import torch

    from deepco import zoo
    from deepco.zoo import yolo

    def forward(self, x):
        y = self.cv1(x)
        ys = list(y.chunk(2, 1) if how == "chunk" else y.split((self.c, self.c), 1))
        ys.extend(m(ys[-1]) for m in self.m)
        return self.cv2(torch.cat(ys, 1))

    monkeypatch.setattr(yolo.C2f, "forward", forward)
    height, width = SIZES["yolov8n"]
    model = zoo.to_onnx(zoo.build("yolov8n"), height, width)
    assert any(n.op_type == op for n in model.graph.node)
    part = Partitioner(model, height, width)
    assert part.stop is None and part.split_share() == pytest.approx(1.0)
    last = len(part.levels) - 1
    through = sorted(set(range(3, last + 1, 3)) | {last})
    bounds = [[*list(range(0, height, s.align))[:4], height] for s in part.stages(through, models=False)]
    image = np.random.default_rng(11).standard_normal((1, 3, height, width)).astype(np.float32)
    want = partition_ort(model, {part.graph.input_name: image})
    got = staged_run(part, through, bounds, image, partition_ort)
    assert max(_rel(g, w) for g, w in zip(got, want, strict=True)) <= 1e-4
