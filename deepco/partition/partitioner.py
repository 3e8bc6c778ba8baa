"""The partitioner: candidate cuts of a CNN, exact per-slice rows, bytes and FLOPs, and head/tail models.

For output rows [a, b) of the tensor at a cut, the input rows the head needs come from backward
interval propagation through the DAG (union over consumers, clipped to each tensor). The slice start is
then aligned down to the head's total stride, so that each of the head's strided nodes sees its input
at an offset it divides; a forward simulation of the head on those rows gives, for every tensor, which
rows the slice run computes and which of them are exact (rows next to an interior slice border that
were computed from the head's zero padding are not). The crop is where rows [a, b) sit in the head's
output; the forward check guarantees they are all exact, so a sliced run equals the whole model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import onnx

from deepco.partition.derive import Dims, extract, finish, with_input_dims
from deepco.partition.flops import node_flops
from deepco.partition.graph import PartitionError, RowGraph, Stop
from deepco.partition.levels import Level, Runner, Stage, make_levels, make_stages, run_stages, tail_model
from deepco.partition.ops import ELEMENTWISE
from deepco.partition.segments import Segment, make_segments

Interval = tuple[int, int]


@dataclass(frozen=True)
class Cut:
    """A point where one tensor carries all rows: the head computes it, the tail needs nothing else.

    ``halo_top``/``halo_bottom`` are the exact extra input rows an interior slice needs above row
    a*stride and below row b*stride for its output rows [a, b); ``paper_halo`` is the paper's
    o(M) = 2 * sum(floor(f/2)) over the head's convolutions, for comparison.
    """

    name: str
    tensor: str
    height: int
    width: int
    channels: int
    stride: int
    halo_top: int
    halo_bottom: int
    paper_halo: int
    head_flops: int
    tail_flops: int

    @property
    def halo(self) -> int:
        """Exact halo rows of an interior slice (top + bottom)."""
        return self.halo_top + self.halo_bottom


@dataclass(frozen=True)
class SliceCost:
    """One slice at a cut: run the head on ``input_rows``, keep ``crop`` of its output = ``output_rows``.

    Bytes assume the input's element type; ``output_bytes`` is the cropped part a server returns;
    ``flops`` is everything the head computes on the slice, redundant halo work included.
    """

    output_rows: Interval
    input_rows: Interval
    crop: Interval
    input_bytes: int
    output_bytes: int
    flops: int

    def to_dict(self) -> dict:
        """JSON form: intervals as two-element lists."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def _readable_names(graph: RowGraph, tensors: list[str]) -> dict[str, str]:
    """Module-like names for cut tensors: the outermost exporter scope ("/layer1/layer1.0/...") that the
    tensor's producer closes, e.g. "layer1.0" for a block's output and "layer1" for a stage's."""
    last: dict[tuple[str, ...], int] = {}
    for i, node in enumerate(graph.nodes):
        scopes = node.name.split("/")[1:-1] if node.name.startswith("/") else []
        for depth in range(1, len(scopes) + 1):
            last[tuple(scopes[:depth])] = i
    names: dict[str, str] = {}
    taken: set[str] = set()
    for tensor in tensors:
        i = graph.producer[tensor]
        node = graph.nodes[i]
        scopes = node.name.split("/")[1:-1] if node.name.startswith("/") else []
        depth = next((d for d in range(1, len(scopes) + 1) if last[tuple(scopes[:d])] == i), 0)
        name = _qualified(scopes[:depth]) if depth else tensor
        if name in taken:
            name = tensor
        taken.add(name)
        names[tensor] = name
    return names


def _qualified(scopes: list[str]) -> str:
    """Exporter scopes as a module path: ["layer1", "layer1.0"] -> "layer1.0", ["_blocks.1", "_swish"] ->
    "_blocks.1._swish" (torch names nested modules in full, but repeated calls only by their own name)."""
    name = scopes[0]
    for part in scopes[1:]:
        name = part if part.startswith(name + ".") else f"{name}.{part}"
    return name


class Partitioner:
    """Exact data-lookahead partitioning of one ONNX model at one input size.

    >>> p = Partitioner(model, 224, 224)
    >>> [c.name for c in p.cuts]            # candidate cuts in topological order
    >>> p.slices("layer2", [0, 10, 28])     # per-slice rows, crop, bytes, FLOPs
    >>> p.cost("layer2", 0, 10)             # one slice: output rows [0, 10) at the cut
    >>> head, tail = p.split("layer2")      # ONNX models: head on any slice, tail on the stitched cut
    >>> p.segments("layer2")                # the head cut at every cut before it (MoDNN's levels)

    ``name`` is how errors name the model (its path or zoo name where the caller has one).
    """

    def __init__(self, model: onnx.ModelProto, height: int, width: int, name: str = "the model"):
        if height <= 0 or width <= 0:
            raise PartitionError(f"input size must be positive, got {height}x{width}")
        self.height, self.width = height, width
        self.graph = RowGraph(model, height, width, name)
        g = self.graph
        self.stop: Stop | None = g.stop
        self._flops = [node_flops(node, g.shapes) for node in g.nodes]
        self.total_flops = sum(self._flops)
        self._levels: list[Level] | None = None
        tensors = self._maximal(g.cut_tensors)
        names = _readable_names(g, tensors)
        self._heads = {t: g.ancestors(t) for t in g.cut_tensors}
        self.cuts = [self._make_cut(names[t], t) for t in tensors]
        self._by_name = {c.name: c for c in self.cuts} | {c.tensor: c for c in self.cuts}
        self._by_name |= {g.nodes[g.producer[c.tensor]].name: c for c in self.cuts}
        if not self.cuts:
            where = f"; it stops at {self.stop.describe()}" if self.stop else ""
            raise PartitionError(f"the model has no partitionable prefix{where}")

    def _maximal(self, tensors: list[str]) -> list[str]:
        """Drop a cut whose only reader is a row-for-row node producing the next cut (a Conv's output
        before its Relu, an Add before the block's Relu): the later one needs the same rows, does more."""
        g = self.graph
        keep = []
        for t in tensors:
            if g.nodes[g.producer[t]].op_type == "Pad":
                continue  # the same rows as the Pad's input, shifted: never a better cut
            if all(g.nodes[i].op_type in ELEMENTWISE for i in g.ancestors(t)):
                continue  # the image, point by point (e.g. the pixel normalisation): the image is the better cut
            readers = g.consumers.get(t, [])
            if len(readers) == 1 and g.nodes[readers[0]].output[0] in tensors:
                reader = g.nodes[readers[0]]
                # element-wise only: a 1x1 Conv maps rows one to one too, but changes the bytes sent back
                if reader.op_type in ELEMENTWISE and len(g.spatial_inputs(readers[0])) == 1:
                    continue
            keep.append(t)
        return keep

    def _make_cut(self, name: str, tensor: str) -> Cut:
        g = self.graph
        head = self._heads[tensor]
        stride = g.alignment(head)
        lo, hi = g.backward(head, tensor, 0, 1, clip=False)[g.input_name]
        h, w = g.hw[tensor]
        shape = g.shapes.get(tensor)
        paper = 0
        for i in head:
            if g.nodes[i].op_type == "Conv":
                weight = g.shapes.get(g.nodes[i].input[1])
                paper += 2 * (weight[2] // 2) if weight else 0
        head_flops = sum(self._flops[i] for i in head)
        return Cut(
            name=name,
            tensor=tensor,
            height=h,
            width=w,
            channels=shape[1] if shape else 0,
            stride=stride,
            halo_top=-lo,
            halo_bottom=hi - stride,
            paper_halo=paper,
            head_flops=head_flops,
            tail_flops=self.total_flops - head_flops,
        )

    # ---- look-ups ------------------------------------------------------------------------------

    def cut(self, name: str | Cut) -> Cut:
        """The cut called ``name`` (readable name, tensor name or producing node name)."""
        if isinstance(name, Cut):
            return name
        if name in self._by_name:
            return self._by_name[name]
        g = self.graph
        by_node = {node.name: node.output[0] for node in g.nodes if node.name and node.output}
        name = by_node.get(name, name)
        if name in self._heads:  # a valid cut that is not listed (its reader does the same rows, more work)
            self._by_name[name] = self._make_cut(name, name)
            return self._by_name[name]
        if name in g.producer or name == g.input_name:
            if name not in g.hw and self.stop is not None:
                raise PartitionError(
                    f"cut {name!r} lies past where the partitionable prefix stops: {self.stop.describe()}"
                )
            raise PartitionError(
                f"tensor {name!r} is not a cut: other tensors before it are read after it "
                f"(cuts: {', '.join(c.name for c in self.cuts)})"
            )
        raise PartitionError(f"unknown cut {name!r} (cuts: {', '.join(c.name for c in self.cuts)})")

    def head_output_rows(self, cut: str | Cut) -> int:
        """Rows of the cut tensor for the whole image."""
        return self.cut(cut).height

    # ---- rows and costs ------------------------------------------------------------------------

    def needed_input_rows(self, cut: str | Cut, a: int, b: int) -> Interval:
        """The exact input rows [lo, hi) that output rows [a, b) at ``cut`` depend on (not yet aligned)."""
        c = self.cut(cut)
        self._check_rows(c, a, b)
        return self.graph.backward(self._heads[c.tensor], c.tensor, a, b)[self.graph.input_name]

    def cost(self, cut: str | Cut, a: int, b: int) -> SliceCost:
        """Rows, crop, bytes and FLOPs of the slice yielding output rows [a, b) at ``cut``."""
        c = self.cut(cut)
        self._check_rows(c, a, b)
        g = self.graph
        start, hi, crop, flops = g.exact_window(self._heads[c.tensor], g.input_name, c.tensor, a, b, c.stride,
                                                self._flops)
        row_in = g.channels * self.width * g.itemsize
        row_out = c.channels * c.width * g.feature_itemsize
        return SliceCost(
            output_rows=(a, b),
            input_rows=(start, hi),
            crop=crop,
            input_bytes=(hi - start) * row_in,
            output_bytes=(b - a) * row_out,
            flops=flops,
        )

    def computed_rows(self, cut: str | Cut, a: int, b: int) -> int:
        """Rows of the cut tensor the head yields on the input rows of the slice giving [a, b): the rows a
        server returns for it, exact ones (``crop``) and halo around them."""
        c = self.cut(cut)
        start, hi = self.cost(c, a, b).input_rows
        return self.graph.forward(self._heads[c.tensor], start, hi)[c.tensor].size

    def slices(self, cut: str | Cut, boundaries: list[int]) -> list[SliceCost]:
        """One SliceCost per interval of ``boundaries`` = [0, r1, ..., height of the cut], strictly rising."""
        c = self.cut(cut)
        if len(boundaries) < 2 or boundaries[0] != 0 or boundaries[-1] != c.height:
            raise PartitionError(
                f"row boundaries must start at 0 and end at {c.height} (the rows of "
                f"{c.name!r}), got {','.join(map(str, boundaries))}"
            )
        if any(b <= a for a, b in zip(boundaries, boundaries[1:], strict=False)):
            raise PartitionError(f"row boundaries must rise strictly, got {','.join(map(str, boundaries))}")
        return [self.cost(c, a, b) for a, b in zip(boundaries, boundaries[1:], strict=False)]

    def equal_boundaries(self, cut: str | Cut, k: int) -> list[int]:
        """Boundaries of ``k`` slices of (nearly) equal output rows at ``cut``."""
        c = self.cut(cut)
        if not 1 <= k <= c.height:
            raise PartitionError(f"cannot cut the {c.height} rows of {c.name!r} into {k} slices")
        return [round(i * c.height / k) for i in range(k + 1)]

    def _check_rows(self, c: Cut, a: int, b: int) -> None:
        if not 0 <= a < b <= c.height:
            raise PartitionError(
                f"output rows [{a}, {b}) are not a non-empty part of [0, {c.height}) at {c.name!r}"
            )

    # ---- head / tail ---------------------------------------------------------------------------

    def split(self, cut: str | Cut) -> tuple[onnx.ModelProto, onnx.ModelProto]:
        """(head, tail): the head maps image rows to cut rows on any height and width; the tail maps the
        whole cut tensor to the model's outputs. Both extracted with onnx.utils.Extractor and checked."""
        c = self.cut(cut)
        g = self.graph
        head = extract(onnx.utils.Extractor(self._with_input_dims(("height", "width"))), [g.input_name], [c.tensor],
                       Dims.ROWS, f"{c.name}-head")
        static = onnx.utils.Extractor(self._with_input_dims((self.height, self.width)))
        return head, extract(static, [c.tensor], list(g.outputs), Dims.STATIC, f"{c.name}-tail")

    def whole(self) -> onnx.ModelProto:
        """The whole model at this input size with the image-independent subgraphs folded to constants: what a
        server runs for an offload (an exported Pad whose pads are computed from the input's shape would
        otherwise make its output size depend on values, and a server cannot bound such a request's memory)."""
        return finish(self._with_input_dims((self.height, self.width)), "whole")

    def _with_input_dims(self, hw: tuple[int | str, int | str]) -> onnx.ModelProto:
        return with_input_dims(self.graph.model, self.graph.input_name, hw)

    def segments(self, cut: str | Cut, models: bool = True, through: list[str] | None = None) -> list[Segment]:
        """The head of ``cut`` as consecutive segments between the cuts before it (MoDNN's levels; see
        deepco.partition.segments), or only between the cuts ``through``: segment j maps level j-1 to level
        j, level 0 being the image."""
        return make_segments(self, cut, models=models, through=through)

    @property
    def levels(self) -> list[Level]:
        """Multi-tensor cuts: the tensors alive at points of the row-local prefix (deepco.partition.levels)."""
        if self._levels is None:
            self._levels = make_levels(self)
        return self._levels

    def level(self, name: str | int | Level) -> Level:
        """The level called ``name`` (or of that index)."""
        if isinstance(name, Level):
            return name
        for lv in self.levels:
            if name in (lv.name, lv.index):
                return lv
        raise PartitionError(f"unknown level {name!r} (levels: {', '.join(lv.name for lv in self.levels)})")

    def stages(self, through: list[str | int | Level], models: bool = True) -> list[Stage]:
        """The stages from the image through the levels ``through`` (in order): a staged plan across scales."""
        return make_stages(self, [self.levels[0], *(self.level(x) for x in through)], models=models)

    def level_tail(self, level: str | int | Level) -> onnx.ModelProto | None:
        """The model's outputs from the whole tensors of ``level`` (None when the level holds them all)."""
        return tail_model(self, self.level(level))

    def run_stages(self, through: list[str | int | Level], bands: list[list[int]], image, run: Runner) -> list:
        """Staged execution in one process (see deepco.partition.levels.run_stages): the model's outputs."""
        return run_stages(self, through, bands, image, run)

    def split_share(self) -> float:
        """Share of the model's FLOPs that stages on row bands can run: the row-local prefix's (0..1)."""
        return self.levels[-1].head_flops / self.total_flops if self.total_flops else 0.0

    def tail_flops(self, cut: str | Cut) -> int:
        """FLOPs of everything after ``cut`` (run once, on the stitched cut tensor)."""
        return self.cut(cut).tail_flops
