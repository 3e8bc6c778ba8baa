"""Where models come from: an ONNX file, or a model of the zoo exported on the fly."""

from __future__ import annotations

from pathlib import Path

import onnx

from deepco.errors import UserError
from deepco.model_cache import cached_export
from deepco.partition.flops import node_flops
from deepco.partition.graph import PartitionError, RowGraph


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
    from deepco import zoo

    if spec in zoo.MODELS:  # a file or folder of that name in the working directory does not shadow the zoo model
        return zoo.export(spec, height, width, weights=weights)
    if weights is not None:
        raise UserError("--weights applies to zoo models only, not to an ONNX file")
    return load_onnx(spec)


def model_flops(model: onnx.ModelProto, height: int, width: int) -> int:
    """FLOPs of the whole model at batch 1 and a ``height`` x ``width`` input (see deepco.partition.flops)."""
    graph = RowGraph(model, height, width)
    return sum(node_flops(node, graph.shapes) for node in graph.nodes)


__all__ = ["PartitionError", "load_model", "load_onnx", "model_flops"]
