"""What a server's answer must look like. Every tensor a server returns is checked against the plan before the
device uses it: a broken or lying server must neither crash the device nor change its output silently.

A mismatch raises :class:`deepco.wire.client.WrongAnswer` naming the server; the runtimes treat it as that
server's failure (the frame is recomputed elsewhere or yields an explicit error) and stop trusting the server.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire.client import WrongAnswer
from deepco.wire.rows import decode_rows
from deepco.wire.tensors import TensorError

Shape = Sequence[int | None]  # None: any size (a symbolic dimension of the model)


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


def only_output(outputs: Mapping[str, np.ndarray], what: str, address: str) -> np.ndarray:
    """The one output of a one-output model's answer."""
    if len(outputs) != 1:
        raise WrongAnswer(address, f"{what}: {len(outputs)} outputs, expected 1")
    return next(iter(outputs.values()))


def check_rows(message: dpb.Rows, start: int, shape: Shape, dtype: np.dtype, what: str, address: str) -> np.ndarray:
    """The array of a Rows message that starts at global row ``start`` with ``shape`` and ``dtype``."""
    try:
        array, row = decode_rows(message, what)
    except TensorError as exc:
        raise WrongAnswer(address, str(exc)) from None
    if row != start:
        raise WrongAnswer(address, f"{what} starts at row {row}, expected {start}")
    return check_tensor(array, shape, dtype, what, address)
