"""A head cut into segments at every cut before it: the layer-by-layer view that MoDNN runs.

MoDNN (Mao et al., DATE'17) gives each server a disjoint band of rows and, before each layer, lets the
servers exchange the boundary rows a neighbour's band needs. DeepCo's row analysis is exact only between
*cuts* (tensors that carry all rows): inside a residual block two tensors are live at once (the branch and
the shortcut), so a band of one of them alone is not enough to go on. The segments are therefore the
stretches between consecutive cuts: level 0 is the image, levels 1..n are the cut tensors in topological
order up to the chosen cut, and segment j maps level j-1 to level j. For a ResNet the cuts are the stem's
Relu, the max-pool and every residual block's output, so the servers synchronise once per block, not once
per convolution: fewer exchanges than the per-layer original, which favours MoDNN in a comparison.

For owned rows [a, b) of level j, `Segment.window(a, b)` gives the rows [lo, hi) of level j-1 to run the
segment on (the exact backward need, its start aligned down to the segment's stride) and where rows
[a, b) sit in the segment's output (the crop), checked exact by a forward simulation as `Partitioner.cost`
checks whole heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING

import onnx

from deepco.partition.derive import Dims, extract
from deepco.partition.graph import PartitionError
from deepco.partition.open_rows import CLOSED, Step, held, sides_for, steps_of

if TYPE_CHECKING:
    from deepco.partition.partitioner import Cut, Partitioner

Interval = tuple[int, int]


@dataclass(frozen=True)
class Window:
    """Segment j on rows ``input_rows`` of level j-1 yields ``output_rows`` of level j at ``crop`` of its output."""

    output_rows: Interval
    input_rows: Interval
    crop: Interval
    input_bytes: int
    output_bytes: int
    flops: int


@dataclass
class Segment:
    """Segment ``index`` (1-based): the nodes between level ``index``-1 (tensor ``source``) and level ``index``.

    ``in_height``/``height`` are the rows of its input and output level at the partitioner's image size;
    ``model`` (from `Partitioner.segments(..., models=True)`) runs on any height and width.
    """

    index: int
    name: str
    source: str
    target: str
    in_height: int
    height: int
    in_row_bytes: int
    row_bytes: int
    stride: int
    nodes: list[int] = field(repr=False)
    partitioner: Partitioner = field(repr=False)
    model: onnx.ModelProto | None = field(default=None, repr=False)

    def needed(self, a: int, b: int) -> Interval:
        """Rows [lo, hi) of level index-1 to run the segment on for its output rows [a, b) (lo aligned)."""
        return self.window(a, b).input_rows

    def crop(self, a: int, b: int) -> Interval:
        """Where output rows [a, b) sit in the segment's output when it runs on `needed(a, b)`."""
        return self.window(a, b).crop

    @cached_property
    def steps(self) -> list[Step] | None:
        """The segment's row steps for runs on open rows (deepco.partition.open_rows), None where it has no open
        form."""
        g = self.partitioner.graph
        return steps_of([g.nodes[i] for i in self.nodes], self.source)

    def open_window(self, a: int, b: int, within: Interval | None = None) -> Window:
        """`window`, run on open rows (deepco.partition.open_rows): the sides of its window that are not at the
        level's border are open, or those of ``within`` (a participant's window of the level: its runs of the
        level share one model); crop and FLOPs are then those of the open run. The padded `window` where the
        segment has no open form."""
        padded = self.window(a, b)
        steps = self.steps
        sides = sides_for(within or padded.input_rows, self.in_height)
        if steps is None or sides == CLOSED:
            return padded
        run = held(steps, self.source, padded.input_rows, sides)
        lo, hi = run.rows[self.target]
        if not (lo <= a and b <= hi):
            raise PartitionError(f"internal: an open run of segment {self.name!r} on rows {padded.input_rows} holds "
                                 f"rows [{lo}, {hi}), not [{a}, {b})")
        g, flops = self.partitioner.graph, self.partitioner._flops
        computed = sum(flops[self.nodes[s.index]] * (run.rows[s.outputs[0]][1] - run.rows[s.outputs[0]][0])
                       // max(g.hw[s.outputs[0]][0], 1) for s in steps)
        return replace(padded, crop=(a - lo, b - lo), flops=computed)

    def window(self, a: int, b: int) -> Window:
        """Rows, crop, bytes and FLOPs of the segment run that yields output rows [a, b) (checked exact)."""
        if not 0 <= a < b <= self.height:
            raise PartitionError(
                f"output rows [{a}, {b}) are not a non-empty part of [0, {self.height}) at segment {self.name!r}"
            )
        p = self.partitioner
        start, hi, crop, flops = p.graph.exact_window(self.nodes, self.source, self.target, a, b, self.stride,
                                                      p._flops)
        return Window(output_rows=(a, b), input_rows=(start, hi), crop=crop,
                      input_bytes=(hi - start) * self.in_row_bytes, output_bytes=(b - a) * self.row_bytes,
                      flops=flops)


def _row_bytes(p: Partitioner, tensor: str) -> int:
    g = p.graph
    if tensor == g.input_name:
        return g.channels * p.width * g.itemsize
    shape = g.shapes.get(tensor)
    if not shape or len(shape) != 4:
        raise PartitionError(f"tensor {tensor!r} has no static 4-d shape")
    return shape[1] * shape[3] * g.feature_itemsize


def make_segments(p: Partitioner, cut: str | Cut, models: bool = False,
                  through: list[str] | None = None) -> list[Segment]:
    """The segments of the head of ``cut``: one per listed cut up to and including it (see the module doc),
    or, with ``through`` (cut names before ``cut``, in order), one per stretch between those cuts only: a
    fused stage of several blocks is one segment."""
    c = p.cut(cut)
    g = p.graph
    position = g.producer[c.tensor]
    if through is None:
        chosen = [x for x in p.cuts if g.producer[x.tensor] < position]
    else:
        chosen = [p.cut(name) for name in through]
        order = [g.producer[x.tensor] for x in chosen]
        if order != sorted(set(order)) or (order and order[-1] >= position):
            raise PartitionError(f"stage boundaries {through} are not distinct cuts in order before {c.name!r}")
    tensors = [x.tensor for x in chosen] + [c.tensor]
    names = [x.name for x in chosen] + [c.name]
    levels = [g.input_name, *tensors]
    extractor = None
    if models:
        extractor = onnx.utils.Extractor(p._with_input_dims(("height", "width")))
    out: list[Segment] = []
    done: set[int] = set()
    for j in range(1, len(levels)):
        source, target = levels[j - 1], levels[j]
        head = p._heads[target]
        if not done <= set(head):
            raise PartitionError(f"internal: cut {names[j - 1]!r} does not lie on every path to the image")
        nodes = [i for i in head if i not in done]
        done |= set(nodes)
        for i in nodes:  # a segment reads only its source level (and its own tensors): cuts guarantee it
            for name in g.spatial_inputs(i):
                if name != source and g.producer.get(name) not in nodes:
                    raise PartitionError(f"internal: segment {names[j - 1]!r} reads {name!r} from before its level")
        align = 1
        for i in nodes:
            first = g.spatial_inputs(i)[0]
            ratio, rest = divmod(g.stride[first], g.stride[source])
            if rest:
                raise PartitionError(f"internal: stride of {first!r} is not a multiple of {source!r}'s")
            align = math.lcm(align, ratio * g.rules[i].rows.stride)
        model = None
        if extractor is not None:
            model = extract(extractor, [source], [target], Dims.ROWS, f"{names[j - 1]}-segment")
        out.append(Segment(index=j, name=names[j - 1], source=source, target=target, in_height=g.hw[source][0],
                           height=g.hw[target][0], in_row_bytes=_row_bytes(p, source),
                           row_bytes=_row_bytes(p, target), stride=align, nodes=nodes, partitioner=p, model=model))
    return out
