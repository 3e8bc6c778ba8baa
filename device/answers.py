"""What a server's answer must look like. Every tensor a server returns is checked against the plan before the
device uses it: a broken or lying server must neither crash the device nor change its output silently.

A mismatch raises :class:`deepco.wire.client.WrongAnswer` naming the server; the runtimes treat it as that
server's failure (the frame is recomputed elsewhere or yields an explicit error) and stop trusting the server.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire.client import WrongAnswer
from deepco.wire.rows import decode_rows
from deepco.wire.split_jobs import from_rows, rows_shape
from deepco.wire.tensors import TensorError

Shape = Sequence[int | None]  # None: any size (a symbolic dimension of the model)
Outputs = dict[str, np.ndarray]  # a frame's outputs by name, in the model's order


def value_dtype(value: onnx.ValueInfoProto) -> np.dtype:
    """The numpy data type of an ONNX graph input or output."""
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))


def value_shape(value: onnx.ValueInfoProto) -> tuple[int | None, ...]:
    """The shape of an ONNX graph input or output for one frame: batch 1, other symbolic dimensions None."""
    dims = value.type.tensor_type.shape.dim
    return tuple(1 if i == 0 and not d.dim_value else (d.dim_value or None) for i, d in enumerate(dims))


def check_tensor(array: np.ndarray, shape: Shape, dtype: np.dtype, what: str, address: str) -> np.ndarray:
    """``array`` if it has ``dtype`` and ``shape``; else WrongAnswer from the server at ``address``."""
    if array.dtype != dtype:
        raise WrongAnswer(address, f"{what} has data type {array.dtype}, expected {np.dtype(dtype)}")
    if len(array.shape) != len(shape) or any(w is not None and w != g for w, g in zip(shape, array.shape,
                                                                                    strict=False)):
        want = ["?" if w is None else w for w in shape]
        raise WrongAnswer(address, f"{what} has shape {list(array.shape)}, expected {want}")
    return array


@dataclass(frozen=True)
class OutputSpec:
    """What one output of a model must be in an answer: its name, shape (None: any size) and data type."""

    name: str
    shape: tuple[int | None, ...]
    dtype: np.dtype


def output_specs(model: onnx.ModelProto) -> tuple[OutputSpec, ...]:
    """Every output of ``model``, in its order."""
    return tuple(OutputSpec(v.name, value_shape(v), value_dtype(v)) for v in model.graph.output)


def check_outputs(outputs: Mapping[str, np.ndarray], specs: Sequence[OutputSpec], what: str,
                  address: str) -> Outputs:
    """Every output ``specs`` name, from an answer holding exactly those, each of its shape and data type, in
    the model's order; else WrongAnswer from the server at ``address``."""
    names = [s.name for s in specs]
    if sorted(outputs) != sorted(names):
        raise WrongAnswer(address, f"{what}: outputs {_names(list(outputs))}, expected {_names(names)}")
    return {s.name: check_tensor(outputs[s.name], s.shape, s.dtype, _of(what, s.name, len(specs)), address)
            for s in specs}


def check_named_rows(messages: Sequence[dpb.NamedRows], specs: Sequence[OutputSpec], what: str,
                     address: str) -> Outputs:
    """The outputs a gathering server returned (SplitResult.outputs, deepco.wire.split_jobs.named_rows), each
    back at its own rank and checked as `check_outputs` does."""
    arrays: dict[str, np.ndarray] = {}
    by_name = {s.name: s for s in specs}
    for message in messages:
        spec = by_name.get(message.name)
        if spec is None or message.name in arrays:
            got = [m.name for m in messages]
            raise WrongAnswer(address, f"{what}: outputs {_names(got)}, expected {_names(list(by_name))}")
        array = check_rows(message.rows, 0, rows_shape(spec.shape), spec.dtype, _of(what, spec.name, len(specs)),
                           address)
        arrays[spec.name] = from_rows(array, len(spec.shape))
    return check_outputs(arrays, specs, what, address)


def _of(what: str, name: str, count: int) -> str:
    return f"{what}'s output {name!r}" if count > 1 else what


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n[:40]) for n in names[:8])
    return f"[{shown}{', ...' if len(names) > 8 else ''}] ({len(names)})"


def check_rows(message: dpb.Rows, start: int, shape: Shape, dtype: np.dtype, what: str, address: str) -> np.ndarray:
    """The array of a Rows message that starts at global row ``start`` with ``shape`` and ``dtype``."""
    try:
        array, row = decode_rows(message, what)
    except TensorError as exc:
        raise WrongAnswer(address, str(exc)) from None
    if row != start:
        raise WrongAnswer(address, f"{what} starts at row {row}, expected {start}")
    return check_tensor(array, shape, dtype, what, address)


def relative_error(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]) -> float:
    """The worst of every output's max |got - want| / max |want|, each output judged on its own (a detector's
    box head and score head have different scales); inf if the outputs' names or shapes differ."""
    if list(got) != list(want) or any(np.shape(got[n]) != np.shape(want[n]) for n in want):
        return float("inf")
    worst = 0.0
    for name, reference in want.items():
        scale = float(np.abs(reference).max()) or 1.0
        worst = max(worst, float(np.abs(np.asarray(got[name], np.float64) - reference).max()) / scale)
    return worst
