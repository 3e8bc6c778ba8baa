"""Exactness on hand-made ONNX networks covering every supported operator and padding form."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from deepco.partition import Partitioner, PartitionError

RNG = np.random.default_rng(42)


class Net:
    """A tiny ONNX graph builder with random weights (NCHW float32, opset 17)."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def _name(self, op: str) -> str:
        self.count += 1
        return f"{op.lower()}{self.count}"

    def const(self, value: np.ndarray, name: str | None = None) -> str:
        name = name or self._name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op: str, inputs: list[str], name: str | None = None, **attrs) -> str:
        name = name or self._name(op)
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def conv(
        self,
        x: str,
        cin: int,
        cout: int,
        k: tuple[int, int],
        groups: int = 1,
        name: str | None = None,
        **attrs,
    ) -> str:
        w = self.const(
            (RNG.standard_normal((cout, cin // groups, *k)) / np.sqrt(cin * k[0] * k[1] / groups)).astype(
                np.float32
            )
        )
        b = self.const(RNG.standard_normal(cout).astype(np.float32) * 0.1)
        return self.op("Conv", [x, w, b], name=name, kernel_shape=list(k), group=groups, **attrs)

    def bn(self, x: str, c: int) -> str:
        params = [
            RNG.uniform(0.5, 1.5, c),
            RNG.uniform(-0.2, 0.2, c),
            RNG.uniform(-0.2, 0.2, c),
            RNG.uniform(0.5, 1.5, c),
        ]
        return self.op("BatchNormalization", [x, *(self.const(p.astype(np.float32)) for p in params)])

    def classifier(self, x: str, c: int) -> str:
        g = self.op("Flatten", [self.op("GlobalAveragePool", [x])])
        w = self.const(RNG.standard_normal((5, c)).astype(np.float32))
        return self.op("Gemm", [g, w, self.const(np.zeros(5, np.float32))], name="logits", transB=1)

    def model(self, out: str, dims: tuple = ("N", 3, "H", "W")) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            "hand-made",
            [helper.make_tensor_value_info("input", TensorProto.FLOAT, list(dims))],
            [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["N", 5])],
            self.inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        onnx.checker.check_model(model)
        return model


def kitchen_sink() -> onnx.ModelProto:
    """Stride 3 with asymmetric pads, dilation, depthwise with SAME_UPPER, concat branches, ceil-mode
    pooling, explicit Pad, residual Add, swish Mul, Identity, Dropout, SAME_LOWER, VALID, Clip, ..."""
    n = Net()
    x = n.conv("input", 3, 8, (5, 3), strides=[3, 1], pads=[2, 1, 1, 1], name="stem")
    a = n.op("Relu", [n.bn(x, 8)], name="stem_relu")
    b1 = n.op("LeakyRelu", [n.conv(a, 8, 8, (3, 3), dilations=[2, 2], pads=[2, 2, 2, 2])], alpha=0.1)
    b2 = n.op("HardSwish", [n.conv(a, 8, 8, (3, 3), groups=8, auto_pad="SAME_UPPER")])
    c = n.op("Concat", [b1, b2], name="branches", axis=1)
    d = n.op(
        "MaxPool", [c], name="pool_ceil", kernel_shape=[3, 3], strides=[2, 2], pads=[0, 0, 1, 1], ceil_mode=1
    )
    p = n.op("Pad", [d, n.const(np.array([0, 0, 1, 0, 0, 0, 2, 1], np.int64))], mode="constant")
    e = n.op(
        "Clip",
        [
            n.conv(p, 16, 16, (4, 3), strides=[2, 2]),
            n.const(np.array(0, np.float32)),
            n.const(np.array(6, np.float32)),
        ],
        name="clip",
    )
    f = n.op("AveragePool", [e], kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1)
    h = n.op("Add", [f, n.op("Identity", [e])], name="residual")
    m = n.op("Mul", [h, n.op("Sigmoid", [h])], name="swish")
    q = n.op(
        "AveragePool",
        [n.op("Dropout", [m])],
        name="avg_ceil",
        kernel_shape=[2, 2],
        strides=[2, 2],
        ceil_mode=1,
        count_include_pad=0,
    )
    r = n.op("Relu", [n.conv(q, 16, 8, (3, 3), strides=[2, 2], auto_pad="SAME_LOWER")], name="lower")
    s = n.op("MaxPool", [r], name="valid_pool", kernel_shape=[2, 2], strides=[1, 1], auto_pad="VALID")
    s = n.op("Add", [s, n.const(RNG.standard_normal((8, 1, 1)).astype(np.float32))], name="bias")
    return n.model(n.classifier(s, 8))


def se_net() -> onnx.ModelProto:
    """A squeeze-excitation gate (GlobalAveragePool) inside the convolution stack."""
    n = Net()
    x = n.op("Relu", [n.conv("input", 3, 8, (3, 3), pads=[1, 1, 1, 1], name="conv_a")], name="relu_a")
    gate = n.op("Sigmoid", [n.op("GlobalAveragePool", [x], name="se_pool")])
    y = n.op("Mul", [x, gate], name="se_mul")
    z = n.op("Relu", [n.conv(y, 8, 8, (3, 3), pads=[1, 1, 1, 1], name="conv_b")], name="relu_b")
    return n.model(n.classifier(z, 8))


SINK = kitchen_sink()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(height=st.integers(100, 260), width=st.integers(24, 64), data=st.data())
def test_kitchen_sink_exact(partition_compare, height, width, data):
    part = Partitioner(SINK, height, width)
    cut = data.draw(st.sampled_from(part.cuts))
    k = data.draw(st.integers(1, min(8, cut.height)))
    inner = (
        data.draw(st.lists(st.integers(1, cut.height - 1), min_size=k - 1, max_size=k - 1, unique=True))
        if cut.height > 1
        else []
    )
    image = np.random.default_rng(height).standard_normal((1, 3, height, width)).astype(np.float32)
    partition_compare(SINK, part, cut, [0, *sorted(inner), cut.height], image)


def test_kitchen_sink_every_cut_one_row_slices(partition_compare):
    """The thinnest slices (one output row each) at every cut, on an odd height."""
    part = Partitioner(SINK, 211, 33)
    image = np.random.default_rng(0).standard_normal((1, 3, 211, 33)).astype(np.float32)
    names = [c.name for c in part.cuts]
    for expected in ("stem_relu", "branches", "pool_ceil", "clip", "residual", "avg_ceil", "lower", "bias"):
        assert expected in names
    for cut in part.cuts:
        partition_compare(SINK, part, cut, list(range(cut.height + 1)), image)


def test_residual_and_branch_tensors_are_not_cuts():
    part = Partitioner(SINK, 150, 32)
    tensors = {c.tensor for c in part.cuts}
    # inside the concat's branches and the residual block, two tensors carry the rows
    assert not any(
        t.startswith(("leakyrelu", "hardswish", "averagepool", "identity", "sigmoid")) for t in tensors
    )
    with pytest.raises(PartitionError, match="is not a cut"):
        part.cut(next(node.output[0] for node in SINK.graph.node if node.op_type == "Identity"))


def test_hand_computed_halo():
    """stem: 5 rows, stride 3, pad top 2. [a, b) at the stem reads [3a - 2, 3(b-1) - 2 + 5) = [3a-2, 3b)."""
    part = Partitioner(SINK, 150, 32)
    stem = part.cut("stem_relu")
    assert (stem.stride, stem.halo_top, stem.halo_bottom) == (3, 2, 0)
    assert part.needed_input_rows(stem, 10, 20) == (28, 60)
    assert part.needed_input_rows(stem, 0, 1) == (0, 3)
    s = part.cost(stem, 10, 20)
    assert s.input_rows == (27, 60)  # start aligned down to the stride 3
    assert s.crop == (1, 11)
    # branches: dilation 2 (extent 5, pad 2) and depthwise SAME_UPPER (pad 1): the union reads stem rows
    # [a-2, b+2) = [8, 22), which read input rows [3*8 - 2, 3*21 - 2 + 5)
    br = part.cut("branches")
    assert part.needed_input_rows(br, 10, 20) == (22, 66)


def test_se_gate_stops_the_prefix():
    part = Partitioner(se_net(), 64, 64)
    assert part.stop is not None and part.stop.op_type == "GlobalAveragePool"
    assert [c.name for c in part.cuts] == ["relu_a"]
    with pytest.raises(PartitionError, match="past where the partitionable prefix stops.*se_pool"):
        part.cut("relu_b")


def test_unsupported_operator_first_is_a_clear_error():
    n = Net()
    # cubic: nearest and linear Resize are banded now (tests/test_partition_rescale.py), cubic is not
    x = n.op("Resize", ["input", "", n.const(np.array([1, 1, 2, 2], np.float32))], name="upsample", mode="cubic")
    part_model = n.model(n.classifier(n.conv(x, 3, 4, (3, 3)), 4))
    with pytest.raises(PartitionError, match="no partitionable prefix.*'upsample' \\(Resize\\)"):
        Partitioner(part_model, 32, 32)


@pytest.mark.parametrize(
    ("op", "attrs", "why"),
    [
        ("Pad", {"mode": "reflect"}, "mode 'reflect'"),
        ("Concat", {"axis": 2}, "height axis"),
    ],
)
def test_row_mixing_variants_are_refused(op, attrs, why):
    n = Net()
    x = n.op("Relu", [n.conv("input", 3, 4, (3, 3), pads=[1, 1, 1, 1])], name="ok")
    if op == "Pad":
        y = n.op("Pad", [x, n.const(np.array([0, 0, 1, 0, 0, 0, 1, 0], np.int64))], name="bad", **attrs)
    else:
        y = n.op("Concat", [x, x], name="bad", **attrs)
    part = Partitioner(n.model(n.classifier(n.conv(y, 4, 4, (3, 3)), 4)), 32, 32)
    assert part.stop is not None and part.stop.node == "bad" and why in part.stop.reason
    assert [c.name for c in part.cuts] == ["ok"]


def test_flops_and_bytes_are_consistent():
    part = Partitioner(SINK, 150, 32)
    cut = part.cut("stem_relu")
    whole = part.cost(cut, 0, cut.height)
    # one slice = the whole image: no redundant work, FLOPs equal the head's
    assert whole.input_rows == (0, 150) and whole.flops == cut.head_flops
    # stem conv alone: 2 * Cout * Hout * Wout * Cin * kh * kw + bias, counted by hand
    conv = 2 * 8 * cut.height * 32 * 3 * 5 * 3 + 8 * cut.height * 32
    assert cut.head_flops == conv + 2 * 8 * cut.height * 32 + 8 * cut.height * 32  # + BN + Relu
    slices = part.slices(cut, part.equal_boundaries(cut, 4))
    assert sum(s.flops for s in slices) >= cut.head_flops
    assert all(s.input_bytes == (s.input_rows[1] - s.input_rows[0]) * 3 * 32 * 4 for s in slices)
    assert all(s.output_bytes == (s.output_rows[1] - s.output_rows[0]) * 8 * 32 * 4 for s in slices)


def test_bad_boundaries_are_clear_errors():
    part = Partitioner(SINK, 150, 32)
    cut = part.cut("stem_relu")
    with pytest.raises(PartitionError, match="must start at 0 and end at 50"):
        part.slices(cut, [0, 10])
    with pytest.raises(PartitionError, match="rise strictly"):
        part.slices(cut, [0, 10, 10, 50])
    with pytest.raises(PartitionError, match="into 51 slices"):
        part.equal_boundaries(cut, 51)


def test_unlisted_cuts_still_resolve_and_are_exact(partition_compare):
    """A Conv output read only by its BatchNormalization is a valid cut, just not a listed one."""
    part = Partitioner(SINK, 120, 24)
    assert "stem" not in [c.name for c in part.cuts]
    cut = part.cut("stem")
    assert (cut.stride, cut.halo_top, cut.halo_bottom) == (3, 2, 0)
    image = np.random.default_rng(1).standard_normal((1, 3, 120, 24)).astype(np.float32)
    partition_compare(SINK, part, cut, [0, 7, 19, cut.height], image)


def test_model_flops_match_published_resnet_counts(partition_zoo):
    """torchvision documents 1.81 GMACs (ResNet-18) and 4.09 GMACs (ResNet-50) at 224x224."""
    from deepco.partition import model_flops

    for name, gmacs in (("resnet18", 1.814), ("resnet50", 4.089)):
        model, _ = partition_zoo(name, 224, 224)
        assert abs(model_flops(model, 224, 224) / 2e9 / gmacs - 1) < 0.01


def test_static_input_model_gets_a_dynamic_head(partition_compare):
    """An ONNX file fixed at one size: the head is made dynamic, the slices still run, exactly."""
    n = Net()
    x = n.op("Relu", [n.conv("input", 3, 6, (3, 3), strides=[2, 2], pads=[1, 1, 1, 1])], name="a")
    y = n.op("Relu", [n.conv(x, 6, 6, (5, 5), pads=[2, 2, 2, 2])], name="b")
    model = n.model(n.classifier(y, 6), dims=(1, 3, 71, 40))
    part = Partitioner(model, 71, 40)
    image = np.random.default_rng(2).standard_normal((1, 3, 71, 40)).astype(np.float32)
    partition_compare(model, part, "b", [0, 5, 9, 30, 36], image)
    with pytest.raises(PartitionError, match="fixed at 71x40, not 64x40"):
        Partitioner(model, 64, 40)


def focus_net(step: int = 2) -> onnx.ModelProto:
    """YOLOX's Focus: every ``step``-th row and column from each start below the step, concatenated on the
    channels (a space-to-depth written as strided Slices, as PyTorch exports ``x[..., ::2, 1::2]``), then a
    strided convolution and a second Focus of its output."""
    n = Net()

    def focus(x: str, name: str) -> str:
        parts = []
        for r in range(step):
            for c in range(step):
                rows = n.op("Slice", [x, n.const(np.array([r])), n.const(np.array([2**63 - 1])),
                                      n.const(np.array([2])), n.const(np.array([step]))])
                parts.append(n.op("Slice", [rows, n.const(np.array([c])), n.const(np.array([2**63 - 1])),
                                            n.const(np.array([3])), n.const(np.array([step]))]))
        return n.op("Concat", parts, name=name, axis=1)

    x = n.op("Relu", [n.conv(focus("input", "focus"), 3 * step * step, 8, (3, 3), pads=[1, 1, 1, 1])], name="a")
    y = n.op("Relu", [n.conv(x, 8, 8, (3, 3), strides=[2, 2], pads=[1, 1, 1, 1])], name="b")
    z = n.op("Relu", [n.conv(focus(y, "focus2"), 8 * step * step, 8, (3, 3), pads=[1, 1, 1, 1])], name="c")
    return n.model(n.classifier(z, 8))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(step=st.sampled_from([2, 3]), rows=st.integers(6, 30), data=st.data())
def test_strided_slices_of_rows_are_banded_exactly(partition_compare, step, rows, data):
    """Focus (YOLOX, ddddocr's detector): a Slice taking every step-th row from a start below the step is a
    one-row window at that stride, cropped by the start; bands at every cut equal the whole model."""
    model = focus_net(step)
    height, width = rows * step * step * 2, 8 * step * step * 2  # sizes the two Focus layers divide
    part = Partitioner(model, height, width)
    assert part.stop is not None and part.stop.op_type == "GlobalAveragePool"
    cut = data.draw(st.sampled_from(part.cuts))
    inner = data.draw(st.lists(st.integers(1, cut.height - 1), max_size=4, unique=True)) if cut.height > 1 else []
    image = np.random.default_rng(rows).standard_normal((1, 3, height, width)).astype(np.float32)
    partition_compare(model, part, cut, [0, *sorted(inner), cut.height], image)


@pytest.mark.parametrize(("start", "end", "step", "why"), [
    (0, 10, 1, "from 0 to 10 by 1"),  # a crop short of the border
    (2, 2**63 - 1, 2, "from 2 to"),  # a start past the first step
])
def test_slices_of_rows_that_a_band_would_cut_differently_are_refused(start, end, step, why):
    n = Net()
    x = n.op("Relu", [n.conv("input", 3, 4, (3, 3), pads=[1, 1, 1, 1])], name="ok")
    y = n.op("Slice", [x, n.const(np.array([start])), n.const(np.array([end])), n.const(np.array([2])),
                       n.const(np.array([step]))], name="bad")
    part = Partitioner(n.model(n.classifier(n.conv(y, 4, 4, (3, 3)), 4)), 32, 32)
    assert part.stop is not None and part.stop.node == "bad" and why in part.stop.reason
    assert [c.name for c in part.cuts] == ["ok"]
