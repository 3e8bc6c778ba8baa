"""Exact row dependencies of rescaling operators, checked against ONNX Runtime band by band.

For a one- or few-node model, a random output band [a, b) is computed from the input window the row
analysis gives (backward need, start aligned, forward exactness check), and must equal the same rows of
the whole output: Resize (nearest, every nearest_mode; linear; half_pixel, pytorch_half_pixel,
asymmetric), Resize by constant sizes, ConvTranspose, pooling with ceil_mode, per-pixel Softmax, and
branches at different strides joined by Concat and Add.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from deepco.partition import Partitioner, PartitionError
from deepco.partition.graph import RowGraph

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
C = 2


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], out: str) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, "h", "w"])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _band_equals_whole(model: onnx.ModelProto, height: int, width: int, data: st.DataObject) -> None:
    """A random band of the output, computed from its window, equals the same rows of the whole output."""
    g = RowGraph(model, height, width)
    assert g.stop is None, g.stop
    target = g.outputs[0]
    nodes = sorted(g.rules)
    rows = g.hw[target][0]
    a = data.draw(st.integers(0, rows - 1), label="a")
    b = data.draw(st.integers(a + 1, rows), label="b")
    align = g.alignment(nodes)
    flops = [0] * len(g.nodes)
    start, stop, crop, _ = g.exact_window(nodes, g.input_name, target, a, b, align, flops)
    x = np.random.default_rng(a * 131 + b).standard_normal((1, C, height, width)).astype(np.float32)
    whole = _run(g.model, x)
    band = _run(g.model, x[:, :, start:stop])
    got = band[:, :, crop[0] : crop[1]]
    np.testing.assert_allclose(got, whole[:, :, a:b], rtol=1e-5, atol=1e-5)


def _resize(mode: str, transform: str, nearest: str, factor: int, by_sizes: bool = False,
            height: int = 0, width: int = 0) -> onnx.ModelProto:
    attrs = {"mode": mode, "coordinate_transformation_mode": transform}
    if mode == "nearest":
        attrs["nearest_mode"] = nearest
    if by_sizes:
        sizes = numpy_helper.from_array(np.array([1, C, height * factor, width * factor], np.int64), "sizes")
        node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], **attrs)
        return _model([node], [sizes], "y")
    scales = numpy_helper.from_array(np.array([1, 1, factor, factor], np.float32), "scales")
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], **attrs)
    return _model([node], [scales], "y")


@SETTINGS
@given(
    mode=st.sampled_from(["nearest", "linear"]),
    transform=st.sampled_from(["half_pixel", "pytorch_half_pixel", "asymmetric"]),
    nearest=st.sampled_from(["floor", "ceil", "round_prefer_floor", "round_prefer_ceil"]),
    factor=st.integers(1, 4),
    height=st.integers(1, 23),
    by_sizes=st.booleans(),
    data=st.data(),
)
def test_resize_band_equals_whole(mode, transform, nearest, factor, height, by_sizes, data):
    _band_equals_whole(_resize(mode, transform, nearest, factor, by_sizes, height, 5), height, 5, data)


def test_resize_align_corners_is_refused_with_its_reason():
    g = RowGraph(_resize("linear", "align_corners", "", 2), 8, 8)
    assert g.stop is not None and "align_corners" in g.stop.reason


@SETTINGS
@given(
    kernel=st.integers(1, 5),
    up=st.integers(1, 3),
    dilation=st.integers(1, 2),
    pads=st.tuples(st.integers(0, 4), st.integers(0, 4)),
    extra=st.integers(0, 2),
    height=st.integers(1, 17),
    data=st.data(),
)
def test_conv_transpose_band_equals_whole(kernel, up, dilation, pads, extra, height, data):
    reach = (kernel - 1) * dilation
    top, bottom = min(pads[0], reach), min(pads[1], reach)
    extra = min(extra, up - 1)  # ONNX Runtime wants output_padding below the stride
    if (height - 1) * up + extra + reach + 1 - top - bottom <= 0:
        return
    w = numpy_helper.from_array(
        np.random.default_rng(kernel).standard_normal((C, 3, kernel, kernel)).astype(np.float32), "w")
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], kernel_shape=[kernel, kernel], strides=[up, up],
                            dilations=[dilation, dilation], pads=[top, 0, bottom, 0], output_padding=[extra, 0])
    _band_equals_whole(_model([node], [w], "y"), height, 6, data)


@SETTINGS
@given(
    op=st.sampled_from(["MaxPool", "AveragePool"]),
    kernel=st.integers(2, 4),
    stride=st.integers(1, 3),
    pad=st.integers(0, 1),
    include=st.booleans(),
    height=st.integers(4, 21),
    data=st.data(),
)
def test_pooling_with_ceil_mode_band_equals_whole(op, kernel, stride, pad, include, height, data):
    attrs = {"kernel_shape": [kernel, kernel], "strides": [stride, stride], "pads": [pad] * 4, "ceil_mode": 1}
    if op == "AveragePool":
        attrs["count_include_pad"] = int(include)
    for size in (height, 7):
        # ONNX's shape inference (not ONNX Runtime) counts a last window that starts in the bottom padding;
        # the row analysis refuses that disagreement, so keep to sizes where the two agree
        span = size + 2 * pad - kernel
        assume((-(-span // stride)) * stride < size + pad)
    node = helper.make_node(op, ["x"], ["y"], **attrs)
    _band_equals_whole(_model([node], [], "y"), height, 7, data)


def _branches(join: str, mode: str) -> onnx.ModelProto:
    """x -> 3x3 s2 conv -> upsample x2 -> join with a 3x3 conv of x -> per-pixel Softmax over channels."""
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(rng.standard_normal((C, C, 3, 3)).astype(np.float32), n) for n in "ab"]
    inits.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "s"))
    nodes = [
        helper.make_node("Conv", ["x", "a"], ["d"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Resize", ["d", "", "s"], ["u"], mode=mode,
                         coordinate_transformation_mode="asymmetric" if mode == "nearest" else "half_pixel",
                         nearest_mode="floor"),
        helper.make_node("Conv", ["x", "b"], ["k"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node(join, ["u", "k"], ["j"], **({"axis": 1} if join == "Concat" else {})),
        helper.make_node("Softmax", ["j"], ["y"], axis=1),
    ]
    return _model(nodes, inits, "y")


@SETTINGS
@given(join=st.sampled_from(["Concat", "Add"]), mode=st.sampled_from(["nearest", "linear"]),
       half=st.integers(1, 12), data=st.data())
def test_branches_at_two_strides_band_equals_whole(join, mode, half, data):
    _band_equals_whole(_branches(join, mode), 2 * half, 6, data)


def test_shape_fed_resize_is_folded_not_a_stop():
    """F.interpolate(size=skip.shape[2:]) exports as Shape -> Slice -> Concat -> Resize: before the fold the
    partitioner stopped at the Shape ('mixes all rows'), which reads no rows."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((C, C, 3, 3)).astype(np.float32), "w")
    consts = [numpy_helper.from_array(np.array(v, np.int64), n)
              for n, v in (("s0", [2]), ("s1", [4]), ("nc", [1, C]))]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["d"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Slice", ["shape", "s0", "s1"], ["hw"]),
        helper.make_node("Concat", ["nc", "hw"], ["sizes"], axis=0),
        helper.make_node("Resize", ["d", "", "", "sizes"], ["u"], mode="linear",
                         coordinate_transformation_mode="pytorch_half_pixel"),
        helper.make_node("Add", ["u", "x"], ["j"]),
        helper.make_node("Relu", ["j"], ["y"]),
    ]
    model = _model(nodes, [w, *consts], "y")
    part = Partitioner(model, 16, 10)
    assert part.stop is None
    assert "j" in [c.tensor for c in part.cuts] or part.cut("j")
    x = np.random.default_rng(2).standard_normal((1, C, 16, 10)).astype(np.float32)
    head, tail = part.split("j")
    pieces = []
    for s in part.slices("j", [0, 5, 11, 16]):
        (y,) = ort.InferenceSession(head.SerializeToString()).run(None, {"x": x[:, :, s.input_rows[0]:s.input_rows[1]]})
        pieces.append(y[:, :, s.crop[0]:s.crop[1]])
    got = _run(tail, np.concatenate(pieces, axis=2)) if tail.graph.input[0].name == "x" else ort.InferenceSession(
        tail.SerializeToString()).run(None, {tail.graph.input[0].name: np.concatenate(pieces, axis=2)})[0]
    np.testing.assert_allclose(got, _run(model, x), rtol=1e-5, atol=1e-5)


def test_size_the_model_cannot_run_at_is_refused_with_the_nearest_valid_sizes():
    """A stride-2 branch upsampled and added to the full-resolution one runs only at even heights."""
    with pytest.raises(PartitionError, match=r"multiples of 2: nearest 12x6 below, 14x6 above"):
        Partitioner(_branches("Add", "nearest"), 13, 6)


@SETTINGS
@given(height=st.integers(1, 19), data=st.data())
def test_split_of_the_channels_band_equals_whole(height, data):
    """torch's chunk exports as Split (Ultralytics' C2f): each output keeps the rows of the input."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal((4, C, 3, 3)).astype(np.float32), "a"),
             numpy_helper.from_array(rng.standard_normal((2, 2, 3, 3)).astype(np.float32), "b"),
             numpy_helper.from_array(np.array([2, 2], np.int64), "parts")]
    nodes = [
        helper.make_node("Conv", ["x", "a"], ["d"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Split", ["d", "parts"], ["p", "q"], axis=1),
        helper.make_node("Conv", ["q", "b"], ["r"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Concat", ["p", "q", "r"], ["y"], axis=1),
    ]
    _band_equals_whole(_model(nodes, inits, "y"), height, 5, data)
