"""numpy arrays <-> `deepco.Rows` messages (some rows of a level, with the global row they start at)."""

from __future__ import annotations

import numpy as np

from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire.tensors import TensorError, array_from_raw, datatype_of, raw_bytes


def encode_rows(array: np.ndarray, start: int, into: dpb.Rows | None = None) -> dpb.Rows:
    """Rows of an NCHW tensor (any view: a band's rows are copied once, in row-major order) that start at
    global row ``start`` of their level; written into ``into`` (a field of the message that carries them) when
    given, so that the bytes are not copied again from a message of their own."""
    rows = dpb.Rows() if into is None else into
    rows.datatype = datatype_of(array.dtype)
    rows.shape[:] = array.shape
    rows.data = raw_bytes(array)
    rows.start = start
    return rows


def decode_rows(message: dpb.Rows, what: str = "rows") -> tuple[np.ndarray, int]:
    """(array, start row); a malformed message raises TensorError naming ``what``."""
    array = array_from_raw(message.datatype, message.shape, message.data, what)
    if array.ndim != 4:
        raise TensorError(f"{what}: shape {list(array.shape)} is not 4-d NCHW")
    if message.start < 0:
        raise TensorError(f"{what}: start row {message.start} is negative")
    return array, int(message.start)
