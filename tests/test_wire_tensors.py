"""numpy <-> Open Inference Protocol tensors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from deepco.wire import inference_pb2 as pb
from deepco.wire.tensors import (
    DATATYPES,
    TensorError,
    add_output,
    array_from_contents,
    array_from_raw,
    datatype_of,
    decode_inputs,
    decode_outputs,
    encode_request,
)

DTYPES = [np.dtype(d) for d in ("bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32",
                                "int64", "float16", "float32", "float64")]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(DTYPES).flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))))
def test_raw_round_trip_is_exact(array: np.ndarray) -> None:
    request = pb.ModelInferRequest.FromString(encode_request("m", {"x": array}).SerializeToString())
    back = decode_inputs(request)["x"]
    assert back.dtype == array.dtype.newbyteorder("<") and back.shape == array.shape
    assert back.tobytes() == array.astype(array.dtype.newbyteorder("<")).tobytes()  # bit-exact, NaNs too


def test_raw_is_little_endian_row_major() -> None:
    big_endian = np.arange(6, dtype=">i4").reshape(2, 3).T  # neither little-endian nor C-contiguous
    request = encode_request("m", {"x": big_endian})
    assert request.inputs[0].datatype == "INT32" and list(request.inputs[0].shape) == [3, 2]
    assert request.raw_input_contents[0] == np.array([0, 3, 1, 4, 2, 5], "<i4").tobytes()


def test_responses_round_trip() -> None:
    response = pb.ModelInferResponse()
    add_output(response, "a", np.ones((2, 2), np.float32))
    add_output(response, "b", np.arange(3, dtype=np.int64))
    out = decode_outputs(pb.ModelInferResponse.FromString(response.SerializeToString()))
    assert out["a"].tolist() == [[1, 1], [1, 1]] and out["b"].tolist() == [0, 1, 2]
    assert [o.datatype for o in response.outputs] == ["FP32", "INT64"]


@pytest.mark.parametrize(("datatype", "field", "values"), [
    ("FP32", "fp32_contents", [1.5, -2.0]), ("FP64", "fp64_contents", [1.5, -2.0]),
    ("INT8", "int_contents", [-3, 4]), ("UINT16", "uint_contents", [3, 60000]),
    ("INT64", "int64_contents", [-(2**40), 5]), ("UINT64", "uint64_contents", [2**63, 1]),
    ("BOOL", "bool_contents", [True, False]),
])
def test_typed_contents(datatype: str, field: str, values: list) -> None:
    contents = pb.InferTensorContents()
    getattr(contents, field).extend(values)
    array = array_from_contents(datatype, [2, 1], contents)
    assert array.dtype == DATATYPES[datatype] and array.ravel().tolist() == values


def test_errors_name_the_tensor_and_the_problem() -> None:
    with pytest.raises(TensorError, match=r"input 'x': 7 bytes of raw data, but shape \[2\] of FP32 needs 8"):
        array_from_raw("FP32", [2], b"\x00" * 7, "input 'x'")
    with pytest.raises(TensorError, match="unsupported datatype 'BYTES'"):
        array_from_raw("BYTES", [1], b"\x00")
    with pytest.raises(TensorError, match="negative dimension"):
        array_from_raw("FP32", [-1, 2], b"")
    contents = pb.InferTensorContents(fp32_contents=[1.0])
    with pytest.raises(TensorError, match="1 values in fp32_contents, but shape \\[2\\] needs 2"):
        array_from_contents("FP32", [2], contents)
    with pytest.raises(TensorError, match="belongs in int64_contents, but fp32_contents is set"):
        array_from_contents("INT64", [0], contents)
    with pytest.raises(TensorError, match="FP16 can only be sent as raw contents"):
        array_from_contents("FP16", [1], contents)
    with pytest.raises(TensorError, match="has no Open Inference Protocol data type"):
        datatype_of(np.complex64)
    doubled = encode_request("m", {"x": np.zeros(1, np.float32)})
    doubled.inputs.add(name="x", datatype="FP32", shape=[1])
    doubled.raw_input_contents.append(b"\x00" * 4)
    with pytest.raises(TensorError, match="input 'x': given twice"):
        decode_inputs(doubled)
