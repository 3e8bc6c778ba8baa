"""numpy arrays <-> Open Inference Protocol tensors.

The protocol names data types as strings ("FP32", "INT64", ...) and carries tensor data either as raw
little-endian, row-major bytes (``raw_input_contents`` / ``raw_output_contents``, one entry per tensor,
what tritonclient and DeepCo send) or as typed repeated fields (``InferTensorContents``). Both are read;
raw is written. Every malformed tensor raises :class:`TensorError` with a message naming the tensor and
the problem, which the server turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from deepco.wire import inference_pb2 as pb

# protocol data type -> numpy dtype (little-endian, as the protocol's raw contents are)
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}

# protocol data type -> the InferTensorContents field that holds it
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}

# ONNX Runtime's type strings ("tensor(float)") -> protocol data types
ORT_TYPES: dict[str, str] = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16", "tensor(uint32)": "UINT32", "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8", "tensor(int16)": "INT16", "tensor(int32)": "INT32", "tensor(int64)": "INT64",
    "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64",
}


class TensorError(ValueError):
    """A tensor in a message is malformed: unknown data type, bad shape, or wrong amount of data."""


def datatype_of(dtype: np.dtype | type) -> str:
    """The protocol data type of a numpy dtype, e.g. float32 -> "FP32"."""
    dt = np.dtype(dtype)
    for name, known in DATATYPES.items():
        if known.kind == dt.kind and known.itemsize == dt.itemsize:
            return name
    raise TensorError(f"numpy dtype {dt} has no Open Inference Protocol data type "
                      f"(supported: {', '.join(DATATYPES)})")


def numpy_dtype(datatype: str, what: str = "tensor") -> np.dtype:
    """The numpy dtype of a protocol data type, e.g. "FP32" -> float32; ``what`` names the tensor."""
    try:
        return DATATYPES[datatype]
    except KeyError:
        raise TensorError(f"{what}: unsupported datatype {datatype!r} (supported: {', '.join(DATATYPES)})") \
            from None


# numpy arrays have at most 32 (numpy 1.x) or 64 dimensions; a CNN tensor has 4 or 5.
MAX_RANK = 32
MAX_ELEMENTS = 2**59  # numpy's bound on elements x item size is 2**63 - 1; 8 bytes is the largest item here


def check_shape(shape: Sequence[int], what: str = "tensor") -> tuple[int, ...]:
    """The shape as a tuple of ints, rejecting negative dimensions and ranks over MAX_RANK."""
    if len(shape) > MAX_RANK:
        raise TensorError(f"{what}: shape has {len(shape)} dimensions, over the {MAX_RANK} limit")
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise TensorError(f"{what}: shape {list(dims)} has a negative dimension")
    # numpy cannot even describe an array this large, empty or not (e.g. [0, 2**62, 2**62]): refuse it here
    # rather than fail inside numpy.
    if math.prod(max(d, 1) for d in dims) > MAX_ELEMENTS:
        raise TensorError(f"{what}: shape {list(dims)} is absurdly large (over {MAX_ELEMENTS} elements)")
    return dims


def array_from_raw(datatype: str, shape: Sequence[int], raw: bytes, what: str = "tensor") -> np.ndarray:
    """Decode raw little-endian row-major bytes; the byte length must match shape x element size exactly."""
    dtype = numpy_dtype(datatype, what)
    dims = check_shape(shape, what)
    # math.prod on Python ints: np.prod in int64 wraps around on absurd shapes (dims of 1e12) and could
    # "match" a short payload.
    expected = math.prod(dims) * dtype.itemsize
    if len(raw) != expected:
        raise TensorError(f"{what}: {len(raw)} bytes of raw data, but shape {list(dims)} of {datatype} "
                          f"needs {expected}")
    # frombuffer shares the message's memory (read-only); ONNX Runtime only reads its inputs.
    return np.frombuffer(raw, dtype=dtype).reshape(dims)


def array_from_contents(datatype: str, shape: Sequence[int], contents: pb.InferTensorContents,
                        what: str = "tensor") -> np.ndarray:
    """Decode typed InferTensorContents; the element count must match the shape exactly."""
    dtype = numpy_dtype(datatype, what)
    dims = check_shape(shape, what)
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise TensorError(f"{what}: datatype {datatype} can only be sent as raw contents")
    values = getattr(contents, field)
    count = math.prod(dims)
    if len(values) != count:
        raise TensorError(f"{what}: {len(values)} values in {field}, but shape {list(dims)} needs {count}")
    others = [f.name for f, v in contents.ListFields() if f.name != field and len(v)]
    if others:
        raise TensorError(f"{what}: datatype {datatype} belongs in {field}, but {', '.join(others)} is set")
    if dtype.kind in "iu" and count:
        # Typed contents are wider than the datatype (INT8 travels in int_contents, an int32): a value out of
        # the datatype's range is the client's error, not a wrap-around or numpy's OverflowError.
        wide = np.asarray(values, dtype=np.uint64 if field == "uint64_contents" else np.int64)
        info = np.iinfo(dtype)
        low, high = int(wide.min()), int(wide.max())
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise TensorError(f"{what}: value {bad} in {field} is out of the range of {datatype} "
                              f"[{info.min}, {info.max}]")
        return wide.astype(dtype).reshape(dims)
    return np.asarray(values, dtype=dtype).reshape(dims)


def raw_bytes(array: np.ndarray) -> bytes:
    """The protocol's raw encoding of an array: little-endian, row-major (C order)."""
    dtype = DATATYPES[datatype_of(array.dtype)]
    if array.dtype == dtype:
        return array.tobytes(order="C")  # one copy, also of a view (a band's rows): no ascontiguousarray first
    return array.astype(dtype, order="C").tobytes()


def bytes_raw(items: Sequence[bytes]) -> bytes:
    """The protocol's raw encoding of a BYTES tensor: each element as a 4-byte little-endian length, then
    its bytes, in row-major order."""
    return b"".join(len(item).to_bytes(4, "little") + item for item in items)


def decode_inputs(request: pb.ModelInferRequest) -> dict[str, np.ndarray]:
    """The input tensors of an inference request, by name, from raw or typed contents."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise TensorError(f"request has {len(request.inputs)} inputs but {len(raw)} raw_input_contents "
                          "entries (there must be one per input, in order)")
    arrays: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        what = f"input {tensor.name!r}"
        if tensor.name in arrays:
            raise TensorError(f"{what}: given twice")
        if raw:
            if tensor.HasField("contents"):
                raise TensorError(f"{what}: has both contents and raw_input_contents")
            arrays[tensor.name] = array_from_raw(tensor.datatype, tensor.shape, raw[i], what)
        else:
            arrays[tensor.name] = array_from_contents(tensor.datatype, tensor.shape, tensor.contents, what)
    return arrays


def encode_request(model_name: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] = (),
                   model_version: str = "", request_id: str = "") -> pb.ModelInferRequest:
    """A ModelInferRequest carrying ``inputs`` as raw contents; ``outputs`` empty asks for all outputs."""
    request = pb.ModelInferRequest(model_name=model_name, model_version=model_version, id=request_id)
    for name, array in inputs.items():
        array = np.asarray(array)
        request.inputs.add(name=name, datatype=datatype_of(array.dtype), shape=array.shape)
        request.raw_input_contents.append(raw_bytes(array))
    for name in outputs:
        request.outputs.add(name=name)
    return request


def add_output(response: pb.ModelInferResponse, name: str, array: np.ndarray) -> None:
    """Append one output tensor to a response as raw contents."""
    array = np.asarray(array)
    response.outputs.add(name=name, datatype=datatype_of(array.dtype), shape=array.shape)
    response.raw_output_contents.append(raw_bytes(array))


def decode_outputs(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """The output tensors of an inference response, by name, from raw or typed contents."""
    raw = response.raw_output_contents
    if raw and len(raw) != len(response.outputs):
        raise TensorError(f"response has {len(response.outputs)} outputs but {len(raw)} raw_output_contents")
    arrays: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(response.outputs):
        what = f"output {tensor.name!r}"
        if raw:
            arrays[tensor.name] = array_from_raw(tensor.datatype, tensor.shape, raw[i], what)
        else:
            arrays[tensor.name] = array_from_contents(tensor.datatype, tensor.shape, tensor.contents, what)
    return arrays
