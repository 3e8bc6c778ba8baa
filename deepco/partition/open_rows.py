"""Segments run on the rows they need, and no more: a window's *open* sides.

A segment (deepco.partition.segments) runs on a window of rows of its input level: the rows its band needs,
halo included. Run as the whole model's own nodes, every convolution and pooling pads the window's top and
bottom as if they were the image's borders and computes rows there that read the padding. Those rows are not
the model's; the run crops them away (`Window.crop`). On a ResNet-18 split over four servers at 720x1280 they
were 16% of the servers' work, most of it on the last levels, whose bands are a few rows thick.

A side of a window that is not at the image's border is *open*: the segment's nodes do not pad there, so each
tensor holds only the rows the window determines (its exact rows), and the run computes nothing it crops. The
rewritten segment (`open_model`) differs from the model's only in:

- the top and bottom pads of every convolution and pooling on an open side: 0;
- a Slice of a convolution's or pooling's input where the window's first row is not on the node's stride grid
  (the rows above the first one the node's output can use);
- at a node that merges several tensors (a residual Add, a Concat), a Slice of each input to the rows they
  all hold.

Which rows each tensor holds is `held`, the one home of this arithmetic: the device's planner sizes crops,
FLOPs and bytes with it, and the rewrite takes its constants from it. Every window of an open top starts on
a multiple of the segment's stride (`Segment.stride`, as every window does), so the rows a top Slice drops
are the same for every window: the rewrite is one model per segment and pair of sides, whatever the rows.
Where the bottom is open, how many rows an input of a merge holds past the others may depend on where the
window ends; the rewrite cuts them with a constant where it does not, and with the shortest input's height
otherwise.

Nodes the rewrite knows: convolution and max/average pooling (2-d, explicit pads, no ceil_mode: its last row
over a partial window would not be the model's where nothing pads), and every row-for-row
node the row analysis knows (deepco.partition.ops: element-wise, channel Concat and Split). A segment with
any other node (a Resize, a ConvTranspose, a Pad or a Slice of rows) has no open form (`steps_of` is None)
and runs as the model's nodes, its garbage rows cropped as before.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from deepco.partition.graph import PartitionError
from deepco.partition.ops import ELEMENTWISE, Window

Interval = tuple[int, int]
Sides = tuple[bool, bool]  # (top open, bottom open)
CLOSED: Sides = (False, False)
END = 2**62  # a Slice end past any height: "to the end"
# A representative window's height for the rewrite's constants: thick enough for every node of any segment.
SPAN = 1 << 14
# The largest stride a segment's windows may be aligned to (a ResNet's deepest is 32): the rewrite simulates a
# window ending at each residue of it, and a model from anyone must not make that a long loop.
MAX_ALIGN = 256


@dataclass(frozen=True)
class Step:
    """One node of a segment as rows go: its position in the node list, its inputs that carry rows (the
    others are constants), its outputs, and its row window (None: row for row)."""

    index: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    rows: Window | None


def sides_bits(sides: Sides) -> int:
    """The wire form of ``sides`` (StageDescription.open_rows): 1 the top is open, 2 the bottom."""
    return int(sides[0]) | 2 * int(sides[1])


def sides_of_bits(bits: int) -> Sides:
    """Inverse of `sides_bits` (bits 0-3)."""
    if not 0 <= bits <= 3:
        raise PartitionError(f"open_rows is 0 to 3 (1: the top is open, 2: the bottom), got {bits}")
    return bool(bits & 1), bool(bits & 2)


def sides_for(window: Interval, height: int) -> Sides:
    """The sides of a window of rows [lo, hi) of a level ``height`` rows tall that are open: those not at the
    level's border."""
    return window[0] > 0, window[1] < height


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _window_rows(node: onnx.NodeProto, spatial: list[str]) -> Window | None:
    """A convolution's or pooling's row window, or None where the rewrite does not know the node's form."""
    if spatial != [node.input[0]] or (len(node.output) > 1 and node.output[1]):
        return None
    auto = _attr(node, "auto_pad", b"NOTSET")
    kernel = list(_attr(node, "kernel_shape", []))
    if (auto.decode() if isinstance(auto, bytes) else auto) != "NOTSET" or len(kernel) != 2:
        return None
    pads = list(_attr(node, "pads", [0, 0, 0, 0]))
    stride = list(_attr(node, "strides", [1, 1]))[0]
    dilation = list(_attr(node, "dilations", [1, 1]))[0]
    if len(pads) != 4 or stride < 1 or dilation < 1 or min(pads) < 0:
        return None
    if _attr(node, "ceil_mode", 0):  # a last output row over a partial window: with no padding, not the model's
        return None
    return Window((kernel[0] - 1) * dilation + 1, stride, pads[0], pads[2])


def steps_of(nodes: Sequence[onnx.NodeProto], source: str) -> list[Step] | None:
    """The row steps of a segment's ``nodes`` (topological order) from tensor ``source``, or None where a node
    has no open form (see the module doc) or its windows' stride would be over MAX_ALIGN. Nodes that read no
    rows (constants) are left out."""
    spatial = {source}
    out = []
    for k, node in enumerate(nodes):
        ins = [n for n in node.input if n in spatial]
        if not ins:
            continue
        if node.domain not in ("", "ai.onnx"):
            return None
        op = node.op_type
        rows = None
        if op in ("Conv", "MaxPool", "AveragePool"):
            rows = _window_rows(node, ins)
            if rows is None:
                return None
        elif op == "Concat":
            if _attr(node, "axis") not in (1, -3):
                return None
        elif op == "Split":
            if _attr(node, "axis", 0) not in (1, -3) or len(ins) != 1 or ins[0] != node.input[0]:
                return None
        elif op not in ELEMENTWISE:
            return None
        outputs = tuple(o for o in node.output if o)
        spatial.update(outputs)
        out.append(Step(k, tuple(dict.fromkeys(ins)), outputs, rows))
    return out if align_of(out, source) <= MAX_ALIGN else None


def align_of(steps: Sequence[Step], source: str) -> int:
    """The stride every window of an open top starts on a multiple of: the least common multiple of every
    windowed node's stride times its input's stride from ``source``."""
    stride = {source: 1}
    align = 1
    for step in steps:
        s = stride[step.inputs[0]]
        if step.rows is not None:
            align = math.lcm(align, s * step.rows.stride)
            s *= step.rows.stride
        for o in step.outputs:
            stride[o] = s
    return align


@dataclass(frozen=True)
class Held:
    """What a run of a segment on a window holds: rows [lo, hi) of each tensor, the rows each windowed node
    drops from the top of its input (``drops[step index]``), and each merge's inputs' rows from the top and
    past the shortest (``merges[step index]``: per input, (top, excess))."""

    rows: dict[str, Interval]
    drops: dict[int, int]
    merges: dict[int, list[Interval]]


def held(steps: Sequence[Step], source: str, window: Interval, sides: Sides) -> Held:
    """The rows every tensor holds when the segment runs on rows ``window`` of ``source`` with open ``sides``
    (a closed side pads as the model does: at the level's border the model's own padding, elsewhere rows that
    read it, which the run crops). PartitionError where the window is too thin for a node or, on a closed top,
    not on a node's stride grid."""
    top, bottom = sides
    rows: dict[str, Interval] = {source: window}
    drops: dict[int, int] = {}
    merges: dict[int, list[Interval]] = {}
    for step in steps:
        ins = [rows[n] for n in step.inputs]
        w = step.rows
        if w is None:
            lo, hi = max(r[0] for r in ins), min(r[1] for r in ins)
            if len(ins) > 1:
                merges[step.index] = [(lo - r[0], r[1] - hi) for r in ins]
        else:
            x0, x1 = ins[0]
            if top:
                lo = -(-(x0 + w.pad_top) // w.stride)
                drop = lo * w.stride - w.pad_top - x0
            else:
                if x0 % w.stride:
                    raise PartitionError(f"a window's rows from {x0} are not on the stride grid of node {step.index}")
                lo, drop = x0 // w.stride, 0
            used = Window(w.extent, w.stride, 0 if top else w.pad_top, 0 if bottom else w.pad_bottom)
            hi = lo + used.out_size(x1 - x0 - drop)
            drops[step.index] = drop
        if hi <= lo:
            raise PartitionError(f"window [{window[0]}, {window[1]}) is too thin for node {step.index} of its segment")
        for o in step.outputs:
            rows[o] = (lo, hi)
    return Held(rows, drops, merges)


def _constant(graph: onnx.GraphProto, name: str, values: list[int]) -> str:
    graph.initializer.append(numpy_helper.from_array(np.array(values, dtype=np.int64), name))
    return name


def open_model(model: onnx.ModelProto, sides: Sides) -> onnx.ModelProto:
    """The segment ``model`` (one input and one output, of any height: deepco.partition.derive's ``ROWS``)
    rewritten to run on windows with open ``sides`` (see the module doc); ``model`` itself where both are
    closed. Not yet checked: `deepco.partition.derive.finish` it. PartitionError where it has no open form."""
    if sides == CLOSED:
        return model
    initializers = {t.name for t in model.graph.initializer}
    source = next(vi.name for vi in model.graph.input if vi.name not in initializers)
    steps = steps_of(model.graph.node, source)
    if steps is None:
        raise PartitionError(f"segment {model.graph.name!r} has a node that cannot run on open rows")
    align = align_of(steps, source)
    start = 2 * align if sides[0] else 0
    # The top's constants from one window; the bottom's from a window ending at every residue of the stride.
    runs = [held(steps, source, (start, start + SPAN + r), sides) for r in range(align if sides[1] else 1)]
    first = runs[0]
    model = copy.deepcopy(model)
    graph = model.graph
    nodes = list(graph.node)
    del graph.node[:]
    by_index = {s.index: s for s in steps}
    fresh = iter(range(1 << 30))
    axes = "open_rows/axes"

    def cut(tensor: str, top: int, bottom: int | str) -> str:
        """``tensor``'s rows from ``top`` to ``bottom`` rows from its end (or to the height named ``bottom``)."""
        if not any(t.name == axes for t in graph.initializer):
            _constant(graph, axes, [2])
        k = next(fresh)
        out = f"{tensor}/open_rows/{k}"
        begin = _constant(graph, f"open_rows/{k}/starts", [top])
        if isinstance(bottom, str):
            end = f"open_rows/{k}/ends"
            graph.node.append(helper.make_node("Add", [bottom, begin], [end], name=f"open_rows/{k}/end"))
        else:
            end = _constant(graph, f"open_rows/{k}/ends", [-bottom if bottom else END])
        graph.node.append(helper.make_node("Slice", [tensor, begin, end, axes], [out], name=f"open_rows/{k}/slice"))
        return out

    for k, node in enumerate(nodes):
        step = by_index.get(k)
        if step is not None and step.rows is not None:
            node = copy.deepcopy(node)
            drop = first.drops[k]
            if drop:
                node.input[0] = cut(node.input[0], drop, 0)
            pads = list(_attr(node, "pads", [0, 0, 0, 0]))
            if sides[0]:
                pads[0] = 0
            if sides[1]:
                pads[2] = 0
            keep = [a for a in node.attribute if a.name != "pads"]
            del node.attribute[:]
            node.attribute.extend(keep)
            node.attribute.append(helper.make_attribute("pads", pads))
        elif step is not None and k in first.merges:
            node = copy.deepcopy(node)
            excess = list(zip(*(run.merges[k] for run in runs), strict=True))  # per input, over the runs
            tops = [pair[0] for pair in first.merges[k]]
            varies = any(len({e for _, e in per}) > 1 for per in excess)
            height = None
            if varies:  # the shortest input's height, after its top rows
                q = next(fresh)
                lens = []
                for i, name in enumerate(step.inputs):
                    shape = f"open_rows/{q}/shape{i}"
                    graph.node.append(helper.make_node("Shape", [name], [shape], name=f"open_rows/{q}/shape{i}"))
                    rows = f"open_rows/{q}/rows{i}"
                    index = _constant(graph, f"open_rows/{q}/index{i}", [2])
                    graph.node.append(helper.make_node("Gather", [shape, index], [rows + "/all"], axis=0,
                                                       name=f"open_rows/{q}/gather{i}"))
                    minus = _constant(graph, f"open_rows/{q}/top{i}", [-tops[i]])
                    graph.node.append(helper.make_node("Add", [rows + "/all", minus], [rows],
                                                       name=f"open_rows/{q}/rows{i}"))
                    lens.append(rows)
                height = f"open_rows/{q}/height"
                graph.node.append(helper.make_node("Min", lens, [height], name=f"open_rows/{q}/height"))
            renamed = {}
            for i, name in enumerate(step.inputs):
                bottom = height if varies else excess[i][0][1]
                if tops[i] or (bottom if isinstance(bottom, str) else bottom > 0):
                    renamed[name] = cut(name, tops[i], bottom)
            node.input[:] = [renamed.get(n, n) for n in node.input]
        graph.node.append(node)
    return model

