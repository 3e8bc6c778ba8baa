"""Row rules of single ONNX operators: which input rows an output row reads.

Every operator the partitioner supports reads, for output row I, the input rows of one *window*
``[I*stride - pad_top, I*stride - pad_top + extent)``: a convolution or pooling (extent
(k-1)*dilation+1), a Pad (extent 1, stride 1, its own top padding; negative pads crop), a Slice of every
k-th row from a start s below k to the end (YOLOX's Focus: extent 1, stride k, top padding -s), and every
element-wise operator, BatchNormalization and channel Concat (extent 1, stride 1, no padding). Rows of
the window outside the tensor are padding. Dilation reads a sparse subset of the window, but its two
end taps are always real, so the window is also exactly the dependency hull. Width gets the same
treatment for shape bookkeeping only: slices never split the width.

Rescaling operators have their own maps, each translation invariant so that a band run on a slice equals
the same rows of the whole run: `Upsample` (Resize/Upsample by an integer factor f, nearest with every
nearest_mode or linear, with the half_pixel / pytorch_half_pixel / asymmetric coordinate maps: output row
J reads the rows around x = (J + 0.5) / f - 0.5 or J / f) and `Transposed` (ConvTranspose: output row J
gets a tap from input row I when I * stride + k * dilation - pad_top = J). align_corners is not banded:
its map x = J * (n - 1) / (f n - 1) depends on the whole height n, so a slice would resample differently.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

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
        "Transpose",
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

    @property
    def scale(self) -> Fraction:
        """Output rows per input row."""
        return Fraction(1, self.stride)

    def out_offset(self, offset: int) -> int:
        """The output row a slice starting at input row ``offset`` (a multiple of ``stride``) starts at."""
        return offset // self.stride

    def exact(self, offset: int, size: int, valid: tuple[int, int], top: bool, bottom: bool) -> tuple[int, int]:
        """Exact output rows [lo, hi) of a slice run on input rows [offset, offset+size) whose exact rows are
        ``valid``; ``top``/``bottom`` say the slice border is the tensor's border there (padding is the
        model's own)."""
        lo, hi = self.out_offset(offset), self.out_offset(offset) + self.out_size(size)
        if not top:
            lo = max(lo, -(-(valid[0] + self.pad_top) // self.stride))
        if not bottom:
            hi = min(hi, (valid[1] - self.extent + self.pad_top) // self.stride + 1)
        return lo, hi


POINTWISE = Window()


class _Monotone:
    """A row map whose need(J, J+1) bounds never decrease with J: exact rows by bisection on them."""

    stride = 1

    def need(self, a: int, b: int) -> tuple[int, int]:  # pragma: no cover - overridden
        raise NotImplementedError

    def out_size(self, size: int) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    def out_offset(self, offset: int) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    def exact(self, offset: int, size: int, valid: tuple[int, int], top: bool, bottom: bool) -> tuple[int, int]:
        """As `Window.exact`: the rows whose whole need lies in ``valid`` (or past a border that is the model's)."""
        lo, hi = self.out_offset(offset), self.out_offset(offset) + self.out_size(size)
        if not top:  # first J whose need starts at valid[0] or later
            a, b = lo, hi
            while a < b:
                m = (a + b) // 2
                if self.need(m, m + 1)[0] >= valid[0]:
                    b = m
                else:
                    a = m + 1
            lo = a
        if not bottom:  # first J whose need ends past valid[1]
            a, b = lo, hi
            while a < b:
                m = (a + b) // 2
                if self.need(m, m + 1)[1] > valid[1]:
                    b = m
                else:
                    a = m + 1
            hi = a
        return lo, max(lo, hi)


@dataclass(frozen=True)
class Upsample(_Monotone):
    """Resize by an integer factor ``factor`` (see the module docstring for the coordinate maps)."""

    factor: int
    mode: str = "nearest"  # "nearest" or "linear"
    transform: str = "asymmetric"  # half_pixel, pytorch_half_pixel or asymmetric
    nearest_mode: str = "round_prefer_floor"

    def _x(self, j: int) -> Fraction:
        if self.transform == "asymmetric":
            return Fraction(j, self.factor)
        return Fraction(2 * j + 1, 2 * self.factor) - Fraction(1, 2)

    def _nearest(self, x: Fraction) -> int:
        if self.nearest_mode == "floor":
            return math.floor(x)
        if self.nearest_mode == "ceil":
            return math.ceil(x)
        if self.nearest_mode == "round_prefer_ceil":
            return math.floor(x + Fraction(1, 2))
        return math.ceil(x - Fraction(1, 2))  # round_prefer_floor

    def need(self, a: int, b: int) -> tuple[int, int]:
        """Input rows that output rows [a, b) read, unclipped (a row past the border is the clamped one),
        widened to the rows a slice must span to produce output rows [a, b) at all (f per input row)."""
        if self.mode == "nearest":
            lo, hi = self._nearest(self._x(a)), self._nearest(self._x(b - 1)) + 1
        else:  # linear: the two rows around x; the upper one even at weight 0 (a wrong one could be NaN)
            lo, hi = math.floor(self._x(a)), math.floor(self._x(b - 1)) + 2
        return min(lo, a // self.factor), max(hi, -(-b // self.factor))

    @property
    def scale(self) -> Fraction:
        """Output rows per input row."""
        return Fraction(self.factor)

    def out_size(self, size: int) -> int:
        """Output rows for ``size`` input rows."""
        return size * self.factor

    def out_offset(self, offset: int) -> int:
        """The output row a slice starting at input row ``offset`` starts at."""
        return offset * self.factor


@dataclass(frozen=True)
class Transposed(_Monotone):
    """ConvTranspose along rows: input row I, tap k feed output row I*stride + k*dilation - pad_top."""

    kernel: int
    up: int = 1
    dilation: int = 1
    pad_top: int = 0
    pad_bottom: int = 0
    output_padding: int = 0

    def need(self, a: int, b: int) -> tuple[int, int]:
        """Input rows with a tap into output rows [a, b), unclipped (rows outside the input add nothing)."""
        reach = (self.kernel - 1) * self.dilation
        lo, hi = -(-(a + self.pad_top - reach) // self.up), (b - 1 + self.pad_top) // self.up + 1
        # a slice must also span the rows that produce [a, b) at all (its output starts at offset*up and
        # loses pad_bottom rows at its end)
        def made(j: int) -> int:
            return -(-(j + self.pad_top + self.pad_bottom - self.output_padding - reach) // self.up) + 1

        # rows made of output_padding alone read nothing, but exist only below the last input row
        return min(lo, a // self.up, made(a) - 1), max(hi, made(b - 1))

    @property
    def scale(self) -> Fraction:
        """Output rows per input row."""
        return Fraction(self.up)

    def out_size(self, size: int) -> int:
        """Output rows for ``size`` input rows (the ONNX formula)."""
        return ((size - 1) * self.up + self.output_padding + (self.kernel - 1) * self.dilation + 1
                - self.pad_top - self.pad_bottom)

    def out_offset(self, offset: int) -> int:
        """The output row a slice starting at input row ``offset`` starts at."""
        return offset * self.up


RowMap = Window | Upsample | Transposed


@dataclass(frozen=True)
class Rule:
    """How one node maps rows (and, for shapes only, columns); ``pads`` rewrites an auto_pad node."""

    rows: RowMap
    cols: RowMap
    pads: list[int] | None = None  # explicit [top, left, bottom, right] replacing auto_pad
    scales: list[float] | None = None  # a Resize's constant sizes, rewritten as the scales that give them


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
    opset: int = 17,
) -> Rule:
    """The row rule of ``node``, or Unsupported naming why it cannot be mapped exactly.

    ``spatial[i]`` tells whether input i depends on the image; ``const``/``const_shape`` give the value
    and shape of a constant input; ``hw`` is the (height, width) of the node's first spatial input;
    ``opset`` the model's default-domain opset (Softmax's meaning changed at 13).
    """
    op = node.op_type
    if node.domain not in ("", "ai.onnx"):
        raise Unsupported(f"operator {node.domain}.{op} is not supported by the row analysis")
    if op in ("Shape", "Size"):
        raise Unsupported(f"{op} of a tensor whose shape is not known for this input size")
    if op in GLOBAL:
        raise Unsupported(f"{op} mixes all rows of its input")
    if op in ("Resize", "Upsample"):
        return _resize_rule(node, spatial, const, hw)
    if op == "ConvTranspose":
        if not spatial[0] or any(spatial[1:]):
            raise Unsupported("ConvTranspose whose weights depend on the image")
        return _transposed_rule(node, const_shape)
    if op in ("Softmax", "LogSoftmax", "Hardmax"):
        axis = _attr(node, "axis", -1 if opset >= 13 else 1)
        # before opset 13 the axis flattens everything after it: over channels that is C*H*W, all rows
        if opset < 13 or axis not in (1, -3):
            raise Unsupported(f"{op} over axis {axis} (only over the channels, opset 13 or later, is per pixel)")
        return Rule(POINTWISE, POINTWISE)
    if op == "Slice":
        return _slice_rule(node, spatial, const, hw)
    if op == "Split":
        # torch's chunk (C2f in Ultralytics' exports) splits channels: every output maps rows one to one
        axis = _attr(node, "axis", 0)
        if axis % 4 != 1 or any(spatial[1:]):
            raise Unsupported(f"Split along axis {axis} (only a split of the channels is row for row)")
        return Rule(POINTWISE, POINTWISE)
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


def _resize_rule(node: onnx.NodeProto, spatial: list[bool], const: Callable[[str], np.ndarray | None],
                 hw: tuple[int, int]) -> Rule:
    if any(spatial[1:]):
        raise Unsupported(f"{node.op_type} whose scales or sizes depend on the image")
    mode = _attr(node, "mode", b"nearest")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    transform = _attr(node, "coordinate_transformation_mode", b"half_pixel")
    transform = transform.decode() if isinstance(transform, bytes) else transform
    nearest = _attr(node, "nearest_mode", b"round_prefer_floor")
    nearest = nearest.decode() if isinstance(nearest, bytes) else nearest
    if node.op_type == "Upsample":
        transform = "asymmetric"  # Upsample (opset 7-9) maps x = J / scale
        nearest = "floor"
    if mode not in ("nearest", "linear", "bilinear"):
        raise Unsupported(f"{node.op_type} in mode {mode!r} (nearest and linear are banded)")
    if transform not in ("half_pixel", "pytorch_half_pixel", "asymmetric"):
        raise Unsupported(
            f"{node.op_type} with coordinate_transformation_mode={transform!r} (its coordinate map depends on "
            "the whole height, so a band would resample differently)"
        )
    if _attr(node, "antialias", 0) or _attr(node, "axes") is not None:
        raise Unsupported(f"{node.op_type} with antialias or axes")
    names = list(node.input) + [""] * 4
    scales_name = names[1] if node.op_type == "Upsample" else names[2]
    sizes_name = "" if node.op_type == "Upsample" else names[3]
    factors: list[float] = []
    rewrite = None
    if scales_name and (value := const(scales_name)) is not None and value.size:
        factors = [float(v) for v in value.reshape(-1)]
    elif sizes_name and (value := const(sizes_name)) is not None and value.size:
        sizes = [int(v) for v in value.reshape(-1)]
        if len(sizes) != 4 or any(s % n for s, n in zip(sizes[2:], hw, strict=True)):
            raise Unsupported(
                f"{node.op_type} to {sizes[2:]} from {list(hw)}: not an integer factor (bands need one)"
            )
        factors = [1.0, 1.0, sizes[2] / hw[0], sizes[3] / hw[1]]
        rewrite = factors
    else:
        raise Unsupported(f"{node.op_type} whose scales and sizes are not constants")
    if len(factors) != 4 or factors[:2] != [1.0, 1.0]:
        raise Unsupported(f"{node.op_type} with scales {factors} (only height and width may change)")
    if any(f < 1 or f != int(f) for f in factors[2:]):
        raise Unsupported(f"{node.op_type} by {factors[2:]}: only integer upsampling factors are banded")
    maps = [Upsample(int(f), "nearest" if mode == "nearest" else "linear", transform, nearest) for f in factors[2:]]
    return Rule(maps[0], maps[1], scales=rewrite)


def _transposed_rule(node: onnx.NodeProto, const_shape: Callable[[str], list[int] | None]) -> Rule:
    kernel = list(_attr(node, "kernel_shape") or (const_shape(node.input[1]) or [])[2:])
    if len(kernel) != 2:
        raise Unsupported("ConvTranspose with a kernel that is not 2-d and constant")
    auto = _attr(node, "auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto != "NOTSET" or _attr(node, "output_shape") is not None:
        raise Unsupported("ConvTranspose with auto_pad or output_shape (its padding depends on the size)")
    strides = list(_attr(node, "strides", [1, 1]))
    dil = list(_attr(node, "dilations", [1, 1]))
    pads = list(_attr(node, "pads", [0, 0, 0, 0]))
    extra = list(_attr(node, "output_padding", [0, 0]))
    maps = [Transposed(kernel[i], strides[i], dil[i], pads[i], pads[i + 2], extra[i]) for i in (0, 1)]
    return Rule(maps[0], maps[1])


def _slice_rule(node: onnx.NodeProto, spatial: list[bool], const: Callable[[str], np.ndarray | None],
                hw: tuple[int, int]) -> Rule:
    if any(spatial[1:]):
        raise Unsupported("Slice whose bounds depend on the image")
    values = []
    for k in range(1, 5):
        name = node.input[k] if len(node.input) > k else ""
        value = const(name) if name else None
        if name and value is None:
            raise Unsupported("Slice with bounds that are not constants")
        values.append(None if value is None else [int(v) for v in value.reshape(-1)])
    starts, ends, axes, steps = values
    axes = axes or list(range(len(starts)))
    steps = steps or [1] * len(starts)
    maps = {2: POINTWISE, 3: POINTWISE}
    for axis, start, end, step in zip(axes, starts, ends, steps, strict=True):
        if axis % 4 == 0:
            raise Unsupported("Slice along the batch axis")
        if axis % 4 == 1:  # a slice of the channels (C2f's split) is row for row
            continue
        # every step-th row from a fixed start to the end (YOLOX's Focus: x[..., ::2, ::2], a space-to-depth)
        # is the window of one row at stride `step`, cropped by `start` rows; the same slice of a band whose
        # offset is a multiple of the step picks the same rows. An end short of the border would crop
        # differently in a band, and a start past the first step leaves rows no band owns.
        if step < 1 or not 0 <= start < step or end < hw[axis % 4 - 2]:
            raise Unsupported(
                f"Slice along axis {axis} from {start} to {end} by {step} (only every step-th row or column "
                "from a start below the step to the end is banded)"
            )
        maps[axis % 4] = Window(1, step, -start, 0)
    return Rule(maps[2], maps[3])


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
