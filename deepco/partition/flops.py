"""FLOP counts of ONNX nodes from static shapes.

Convention: a multiply-add is 2 FLOPs (Conv, Gemm, MatMul); a pooling output costs one FLOP per
window element; every other computing operator one FLOP per output element (BatchNormalization two);
pure data movement (Reshape, Flatten, Identity, Dropout, Pad, Concat, Cast, Shape, ...) costs nothing.
"""

from __future__ import annotations

import math

import onnx

MOVES = frozenset(
    {
        "Reshape",
        "Flatten",
        "Identity",
        "Dropout",
        "Pad",
        "Concat",
        "Cast",
        "Shape",
        "Squeeze",
        "Unsqueeze",
        "Transpose",
        "Slice",
        "Gather",
        "Constant",
        "ConstantOfShape",
        "Split",
    }
)


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def node_flops(node: onnx.NodeProto, shapes: dict[str, list[int]]) -> int:
    """FLOPs of one node given the static shapes of its tensors (0 where a shape is unknown)."""
    op = node.op_type
    out = shapes.get(node.output[0]) if node.output else None
    if op in MOVES or out is None:
        return 0
    numel = math.prod(out)
    if op == "Conv":
        w = shapes.get(node.input[1])
        if w is None:
            return 0
        flops = 2 * numel * math.prod(w[1:])  # w = [Cout, Cin/groups, kh, kw]
        return flops + (numel if len(node.input) > 2 and node.input[2] else 0)
    if op in ("MaxPool", "AveragePool", "LpPool"):
        return numel * math.prod(_attr(node, "kernel_shape", [1]))
    if op in ("Gemm", "MatMul"):
        a = shapes.get(node.input[0])
        if a is None:
            return 0
        k = a[0] if op == "Gemm" and _attr(node, "transA", 0) else a[-1]
        return 2 * numel * k + (numel if op == "Gemm" and len(node.input) > 2 and node.input[2] else 0)
    if op.startswith("Global") or op.startswith("Reduce"):
        src = shapes.get(node.input[0])
        return math.prod(src) if src else numel
    if op == "BatchNormalization":
        return 2 * numel
    return numel
