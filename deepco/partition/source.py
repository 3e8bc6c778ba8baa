"""Where models come from: an ONNX file, or a model of the zoo exported on the fly."""

from __future__ import annotations

from pathlib import Path

import onnx

from deepco.errors import UserError
from deepco.model_cache import cached_export
from deepco.parsing import parse_size
from deepco.partition.flops import node_flops
from deepco.partition.graph import PartitionError, RowGraph, _dims


def load_onnx(path: str | Path) -> onnx.ModelProto:
    """Read and check an ONNX file; a missing, unreadable or non-ONNX file is a one-line UserError."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"model file {str(p)!r} does not exist")
    if not p.is_file():
        raise UserError(f"model path {str(p)!r} is not a file")
    try:
        model = onnx.load(str(p))
    except Exception as exc:  # protobuf's DecodeError, OSError, ...: all mean "not an ONNX model"
        raise UserError(
            f"{str(p)!r} is not an ONNX model ({type(exc).__name__}: {exc})".splitlines()[0]
        ) from None
    if not model.graph.node:
        raise UserError(f"{str(p)!r} is not an ONNX model (no graph nodes)")
    try:
        onnx.checker.check_model(model)
    except Exception as exc:  # ValidationError and friends
        raise UserError(f"{str(p)!r} is not a valid ONNX model: {exc}".splitlines()[0]) from None
    return model


def _export(spec: str, height: int, width: int, weights: str | None) -> onnx.ModelProto:
    from deepco import zoo  # torch is only imported when a zoo model is exported

    if spec not in zoo.MODELS:
        raise UserError(f"unknown model {spec!r} (zoo: {', '.join(zoo.MODELS)}; or a path to an .onnx file)")
    return zoo.export(spec, height, width, weights=weights)


def load_model(spec: str, height: int, width: int, weights: str | None = None) -> onnx.ModelProto:
    """``spec`` is a zoo name (exported at ``height`` x ``width``, or read from the model cache:
    deepco.model_cache) or a path to an .onnx file."""
    if not spec.endswith(".onnx") and not Path(spec).exists():
        return cached_export(spec, height, width, weights,
                             lambda: _export(spec, height, width, weights))
    if not spec.endswith(".onnx"):  # no zoo name ends so: a run on an ONNX file never imports torch (seconds)
        from deepco import zoo

        if spec in zoo.MODELS:  # a file or folder of that name in the working directory does not shadow it
            return zoo.export(spec, height, width, weights=weights)
    if weights is not None:
        raise UserError("--weights applies to zoo models only, not to an ONNX file")
    return load_onnx(spec)


def input_size(spec: str, given: str | None) -> tuple[int, int]:
    """The input size a command runs ``spec`` at: ``given`` (--input-size) when there is one, else the model's own
    fixed height and width. A model whose height or width is dynamic (every zoo model) has no size of its own, so
    without --input-size it is a UserError that names its input and the flag."""
    if given is not None:
        return parse_size(given)
    if not spec.endswith(".onnx") and not Path(spec).exists():
        from deepco.zoo import MODELS  # imports torch: only on this error path

        if spec not in MODELS:
            raise UserError(f"unknown model {spec!r} (zoo: {', '.join(MODELS)}; or a path to an .onnx file)")
        raise UserError(f"{spec} takes any input size: give --input-size HxW, e.g. --input-size 224x224")
    model = load_onnx(spec)
    init = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in init]
    dims = _dims(inputs[0]) if len(inputs) == 1 else []
    if len(dims) == 4 and all(isinstance(d, int) and d > 0 for d in dims[2:]):
        return int(dims[2]), int(dims[3])
    name = repr(inputs[0].name) if len(inputs) == 1 else "image input"
    shape = "x".join(str(d) if d else "?" for d in dims) or "?"
    raise UserError(f"the model's input {name} has no fixed height and width (shape {shape}): give --input-size HxW, "
                    "e.g. --input-size 224x224")


def model_flops(model: onnx.ModelProto, height: int, width: int) -> int:
    """FLOPs of the whole model at batch 1 and a ``height`` x ``width`` input (see deepco.partition.flops)."""
    graph = RowGraph(model, height, width)
    return sum(node_flops(node, graph.shapes) for node in graph.nodes)


__all__ = ["PartitionError", "input_size", "load_model", "load_onnx", "model_flops"]
