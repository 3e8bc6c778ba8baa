"""Row rules of single ONNX operators: which input rows an output row reads.

Every operator the partitioner supports reads, for output row I, the input rows of one *window*
``[I*stride - pad_top, I*stride - pad_top + extent)``: a convolution or pooling (extent
(k-1)*dilation+1), a Pad (extent 1, stride 1, its own top padding; negative pads crop), and every
element-wise operator, BatchNormalization and channel Concat (extent 1, stride 1, no padding). Rows of
the window outside the tensor are padding. Dilation reads a sparse subset of the window, but its two
end taps are always real, so the window is also exactly the dependency hull. Width gets the same
treatment for shape bookkeeping only: slices never split the width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

# Operators that compute each output element from the element at the same position (and broadcast
# constants): one output row depends on the same input row only.
ELEMENTWISE = frozenset(
    {
        "Relu",
        "LeakyRelu",
        "PRelu",
        "Clip",
        "Sigmoid",
        "HardSigmoid",
        "HardSwish",
        "Tanh",
        "Elu",
        "Selu",
        "Celu",
        "Softplus",
        "Softsign",
        "Exp",
        "Log",
        "Neg",
        "Abs",
        "Sqrt",
        "Reciprocal",
        "Erf",
        "Gelu",
        "Mish",
        "ThresholdedRelu",
        "Floor",
        "Ceil",
        "Round",
        "Sign",
        "Sin",
        "Cos",
        "Identity",
        "Dropout",
        "Cast",
        "BatchNormalization",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Pow",
        "Max",
        "Min",
        "Sum",
        "Mean",
        "LRN",
        "Not",
        "Equal",
        "Less",
        "Greater",
        "Where",
    }
)
WINDOWED = frozenset({"Conv", "MaxPool", "AveragePool", "LpPool"})
# Operators known to mix all rows of their input: where the partitionable prefix normally ends.
GLOBAL = frozenset(
    {
        "GlobalAveragePool",
        "GlobalMaxPool",
        "GlobalLpPool",
        "Flatten",
        "Reshape",
        "Gemm",
        "MatMul",
        "ReduceMean",
        "ReduceMax",
        "ReduceMin",
        "ReduceSum",
        "ReduceProd",
        "ReduceL2",
        "Shape",
        "Size",
        "Transpose",
        "Softmax",
        "LogSoftmax",
        "Resize",
        "Upsample",
        "InstanceNormalization",
        "LayerNormalization",
        "GroupNormalization",
        "SpaceToDepth",
        "DepthToSpace",
        "Squeeze",
        "Unsqueeze",
    }
)


class Unsupported(Exception):
    """A node the row analysis cannot map exactly; the message says why."""


@dataclass(frozen=True)
class Window:
    """Output row I reads input rows [I*stride - pad_top, I*stride - pad_top + extent)."""

    extent: int = 1
    stride: int = 1
    pad_top: int = 0
    pad_bottom: int = 0
    ceil_mode: bool = False

    def out_size(self, size: int) -> int:
        """Output rows for ``size`` input rows (ONNX / ONNX Runtime's rule, ceil_mode included)."""
        span = size + self.pad_top + self.pad_bottom - self.extent
        if not self.ceil_mode:
            return span // self.stride + 1
        out = -(-span // self.stride) + 1
        # ceil_mode never starts a window in the bottom padding (the ONNX spec, as in PyTorch)
        if (out - 1) * self.stride >= size + self.pad_top:
            out -= 1
        return out

    def need(self, a: int, b: int) -> tuple[int, int]:
        """Input rows [lo, hi) that output rows [a, b) read, before clipping to the tensor."""
        return a * self.stride - self.pad_top, (b - 1) * self.stride - self.pad_top + self.extent


POINTWISE = Window()


@dataclass(frozen=True)
class Rule:
    """How one node maps rows (and, for shapes only, columns); ``pads`` rewrites an auto_pad node."""

    rows: Window
    cols: Window
    pads: list[int] | None = None  # explicit [top, left, bottom, right] replacing auto_pad


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _same_pads(size: int, stride: int, extent: int, upper: bool) -> tuple[int, int]:
    total = max((-(-size // stride) - 1) * stride + extent - size, 0)
    small = total // 2
    return (small, total - small) if upper else (total - small, small)


def _windowed(node: onnx.NodeProto, kernel: list[int], hw: tuple[int, int]) -> Rule:
    if len(kernel) != 2:
        raise Unsupported(f"{node.op_type} with a {len(kernel)}-d kernel (only 2-d is supported)")
    strides = list(_attr(node, "strides", [1, 1]))
    dil = list(_attr(node, "dilations", [1, 1]))
    ext = [(k - 1) * d + 1 for k, d in zip(kernel, dil, strict=True)]
    ceil = bool(_attr(node, "ceil_mode", 0))
    auto = _attr(node, "auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    new_pads = None
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        # the padding depends on the input size: fix it to the full image's so that a head run on a
        # slice pads exactly like the whole model does at the image border
        (t, b), (left, r) = (_same_pads(hw[i], strides[i], ext[i], auto == "SAME_UPPER") for i in (0, 1))
        pads = new_pads = [t, left, b, r]
    elif auto == "VALID":
        pads = new_pads = [0, 0, 0, 0]
    elif auto == "NOTSET":
        pads = list(_attr(node, "pads", [0, 0, 0, 0]))
    else:
        raise Unsupported(f"{node.op_type} with auto_pad={auto!r}")
    rows = Window(ext[0], strides[0], pads[0], pads[2], ceil)
    cols = Window(ext[1], strides[1], pads[1], pads[3], ceil)
    return Rule(rows, cols, new_pads)


def rule_for(
    node: onnx.NodeProto,
    spatial: list[bool],
    const: Callable[[str], np.ndarray | None],
    const_shape: Callable[[str], list[int] | None],
    hw: tuple[int, int],
) -> Rule:
    """The row rule of ``node``, or Unsupported naming why it cannot be mapped exactly.

    ``spatial[i]`` tells whether input i depends on the image; ``const``/``const_shape`` give the value
    and shape of a constant input; ``hw`` is the (height, width) of the node's first spatial input.
    """
    op = node.op_type
    if node.domain not in ("", "ai.onnx"):
        raise Unsupported(f"operator {node.domain}.{op} is not supported by the row analysis")
    if op in GLOBAL:
        raise Unsupported(f"{op} mixes all rows of its input")
    if op == "Conv":
        if not spatial[0] or any(spatial[1:]):
            raise Unsupported("Conv whose weights depend on the image")
        kernel = _attr(node, "kernel_shape") or (const_shape(node.input[1]) or [])[2:]
        return _windowed(node, list(kernel), hw)
    if op in WINDOWED:
        if len(node.output) > 1 and node.output[1]:
            raise Unsupported(f"{op} with an Indices output (indices are positions in the whole image)")
        return _windowed(node, list(_attr(node, "kernel_shape", [])), hw)
    if op == "Pad":
        return _pad_rule(node, spatial, const)
    if op == "Concat":
        axis = _attr(node, "axis")
        if axis in (2, -2):
            raise Unsupported("Concat along the height axis")
        return Rule(POINTWISE, POINTWISE)
    if op in ELEMENTWISE:
        if op == "BatchNormalization" and _attr(node, "training_mode", 0):
            raise Unsupported("BatchNormalization in training mode (batch statistics mix rows)")
        for name, is_spatial in zip(node.input, spatial, strict=True):
            shape = None if is_spatial or not name else const_shape(name)
            # a constant broadcast with several rows would be cut wrongly by a slice
            if shape is not None and len(shape) >= 2 and shape[-2] != 1:
                raise Unsupported(f"{op} with a constant operand of {shape[-2]} rows")
        return Rule(POINTWISE, POINTWISE)
    raise Unsupported(f"operator {op} is not supported by the row analysis")


def _pad_rule(node: onnx.NodeProto, spatial: list[bool], const: Callable[[str], np.ndarray | None]) -> Rule:
    mode = _attr(node, "mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode != "constant":
        raise Unsupported(f"Pad in mode {mode!r} (only constant padding keeps slice borders exact)")
    if any(spatial[1:]):
        raise Unsupported("Pad whose pads depend on the image")
    if len(node.input) > 1 and node.input[1]:
        value = const(node.input[1])
        if value is None:
            raise Unsupported("Pad with pads that are not a constant")
        pads = [int(v) for v in value]
    else:
        pads = [int(v) for v in _attr(node, "pads", [])]
    axes = list(range(len(pads) // 2))
    if len(node.input) > 3 and node.input[3]:
        value = const(node.input[3])
        if value is None:
            raise Unsupported("Pad with axes that are not a constant")
        axes = [int(v) % 4 for v in value]
    begin = dict(zip(axes, pads[: len(axes)], strict=True))
    end = dict(zip(axes, pads[len(axes) :], strict=True))
    return Rule(Window(1, 1, begin.get(2, 0), end.get(2, 0)), Window(1, 1, begin.get(3, 0), end.get(3, 0)))


def to_array(tensor: onnx.TensorProto) -> np.ndarray:
    """A TensorProto as numpy (external data already loaded)."""
    return numpy_helper.to_array(tensor)
