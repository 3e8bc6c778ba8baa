"""Cuts across scales: levels of several tensors alive at once, and the stages between them.

A single-tensor cut (`Cut`) needs a point where one tensor carries all rows; in a U-Net or an FPN/PAN
detector the encoder's scales stay alive until the neck reads them, so such points end at the first
skip. A *level* is instead the set of tensors alive after a prefix of the graph (topological order)
whose nodes are all row-local: the image before anything runs, then e.g. {P3, P4, SPPF output} in a
detector's neck. A *stage* maps one level to the next: its nodes are the ones between them, its inputs
the tensors of the earlier level that they read, its outputs the tensors of the later level that they
make; the others are skip connections the band keeps until a stage uses them.

Bands line up across scales: a band is a range of *image* rows [top, bottom), both multiples of the
stage's alignment (every tensor's stride, and what its strided nodes need), and tensor t of stride s gets
rows [top / s, bottom / s). For a band's output rows, the backward rules give every input's needed rows;
all inputs are then read from one common image-row window (aligned start, length a multiple of the
alignment, so that upsampled and skip branches meet with the same rows, as the whole model's valid sizes
make them meet), and a forward simulation checks that the band's rows of every output are exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np
import onnx

from deepco.partition.derive import Dims, extract
from deepco.partition.graph import PartitionError
from deepco.partition.segments import _row_bytes  # one home for a tensor row's bytes

if TYPE_CHECKING:
    from deepco.partition.partitioner import Partitioner

Interval = tuple[int, int]
# a level boundary is placed just before these: where a band needs its neighbours' rows (MoDNN's exchange)
_WINDOWED = frozenset({"Conv", "ConvTranspose", "MaxPool", "AveragePool", "LpPool", "Resize", "Upsample"})


@dataclass(frozen=True)
class Level:
    """The tensors alive after the first ``position`` nodes (all row-local); ``head_flops`` are those nodes'."""

    index: int
    name: str
    position: int
    tensors: tuple[str, ...]
    strides: tuple[int, ...]
    heights: tuple[int, ...]
    head_flops: int

    @property
    def align(self) -> int:
        """Image rows a band boundary at this level must be a multiple of (every tensor's stride)."""
        return math.lcm(*self.strides)


@dataclass(frozen=True)
class StageWindow:
    """Stage run for image rows [top, bottom): input rows per input tensor, output rows and crop per output."""

    image_rows: Interval
    input_rows: dict[str, Interval]
    output_rows: dict[str, Interval]
    crop: dict[str, Interval]
    input_bytes: int
    output_bytes: int
    flops: int


@dataclass
class Stage:
    """The nodes between level ``index``-1 and level ``index`` (see the module docstring)."""

    index: int
    name: str
    inputs: list[str]
    outputs: list[str]
    carried: list[str]
    align: int
    nodes: list[int] = field(repr=False)
    partitioner: Partitioner = field(repr=False)
    model: onnx.ModelProto | None = field(default=None, repr=False)

    def window(self, top: int, bottom: int) -> StageWindow:
        """Rows of every input to run the stage on for image rows [top, bottom) of its outputs (checked exact)."""
        p = self.partitioner
        g = p.graph
        if not (0 <= top < bottom <= p.height) or top % self.align or (bottom % self.align and bottom != p.height):
            raise PartitionError(
                f"image rows [{top}, {bottom}) are not a band of stage {self.name!r}: both ends must be "
                f"multiples of {self.align} (or the image height {p.height})"
            )
        targets = {}
        for t in self.outputs:
            s, rows = g.stride[t], g.hw[t][0]
            targets[t] = (_rows(top, s, t), rows if bottom == p.height else _rows(bottom, s, t))
            if targets[t][0] >= targets[t][1]:
                raise PartitionError(f"image rows [{top}, {bottom}) hold no rows of {t!r} (stride {s})")
        need = g.backward_all(self.nodes, targets)
        start = min(need[t][0] * g.stride[t] for t in self.inputs)
        stop = max(need[t][1] * g.stride[t] for t in self.inputs)
        start = math.floor(start) // self.align * self.align
        stop = min(p.height, start + -(-math.ceil(stop - start) // self.align) * self.align)
        windows = {t: (_rows(start, g.stride[t], t), min(g.hw[t][0], math.ceil(stop / g.stride[t])))
                   for t in self.inputs}
        rows = g.forward(self.nodes, start, stop, windows=windows)
        crop = {}
        for t, (a, b) in targets.items():
            r = rows[t]
            if not (r.valid_lo <= a and b <= r.valid_hi):
                raise PartitionError(
                    f"internal: image rows [{start}, {stop}) do not give rows [{a}, {b}) of {t!r} exactly "
                    f"(exact rows [{r.valid_lo}, {r.valid_hi}))"
                )
            crop[t] = (a - r.offset, b - r.offset)
        flops = sum(p._flops[i] * rows[g.nodes[i].output[0]].size // max(g.hw[g.nodes[i].output[0]][0], 1)
                    for i in self.nodes)
        return StageWindow(
            image_rows=(top, bottom),
            input_rows=windows,
            output_rows=targets,
            crop=crop,
            input_bytes=sum((hi - lo) * _row_bytes(p, t) for t, (lo, hi) in windows.items()),
            output_bytes=sum((b - a) * _row_bytes(p, t) for t, (a, b) in targets.items()),
            flops=flops,
        )

    def bands(self, boundaries: list[int]) -> list[StageWindow]:
        """One window per band of image rows ``boundaries`` = [0, ..., image height]."""
        return [self.window(a, b) for a, b in zip(boundaries, boundaries[1:], strict=False)]


def _rows(image_row: int, stride: Fraction, tensor: str) -> int:
    value = Fraction(image_row) / stride
    if value.denominator != 1:
        raise PartitionError(f"image row {image_row} is not a whole row of {tensor!r} (stride {stride})")
    return int(value)


def make_levels(p: Partitioner) -> list[Level]:
    """Level 0 (the image), then one level before every windowed node of the row-local prefix and one at
    its end: each the tensors alive there. Empty beyond level 0 if the first node is not row-local."""
    from deepco.partition.partitioner import _readable_names

    g = p.graph
    n = len(g.nodes)
    end = 0
    while end < n and end in g.rules:
        end += 1
    last_use: dict[str, int] = {}
    for i, node in enumerate(g.nodes):
        for name in node.input:
            last_use[name] = i
    for name in g.outputs:
        last_use[name] = n
    positions = [q for q in range(1, end) if g.nodes[q].op_type in _WINDOWED] + ([end] if end else [])
    raw = []
    for q in sorted(set(positions)):
        made = [g.input_name] + [o for i in range(q) for o in g.nodes[i].output if o]
        alive = tuple(t for t in made if last_use.get(t, -1) >= q)
        if not alive or any(t not in g.hw for t in alive):
            continue
        if raw and raw[-1][1] == alive:
            continue
        raw.append((q, alive))
    names = _readable_names(g, [g.nodes[q - 1].output[0] for q, _ in raw])
    flops = [0, *p._flops]
    prefix = [sum(flops[: q + 1]) for q in range(n + 1)]
    levels = [Level(0, "image", 0, (g.input_name,), (1,), (p.height,), 0)]
    for q, alive in raw:
        strides = tuple(int(g.stride[t]) if g.stride[t].denominator == 1 else 0 for t in alive)
        if 0 in strides:
            break  # a tensor finer than the image has no whole rows per image row: no level from here
        levels.append(Level(len(levels), names[g.nodes[q - 1].output[0]], q, alive, strides,
                            tuple(g.hw[t][0] for t in alive), prefix[q]))
    return levels


def make_stages(p: Partitioner, levels: list[Level], models: bool = False) -> list[Stage]:
    """The stages between consecutive ``levels`` (increasing positions, the first being the image)."""
    g = p.graph
    if not levels or levels[0].position != 0:
        raise PartitionError("a staged plan starts at the image (level 0)")
    if any(b.position <= a.position for a, b in zip(levels, levels[1:], strict=False)):
        raise PartitionError(f"levels {[x.name for x in levels]} are not in order")
    extractor = onnx.utils.Extractor(p._with_input_dims(("height", "width"))) if models else None
    stages = []
    for j in range(1, len(levels)):
        src, dst = levels[j - 1], levels[j]
        nodes = list(range(src.position, dst.position))
        made = {o for i in nodes for o in g.nodes[i].output if o}
        reads = {name for i in nodes for name in g.spatial_inputs(i)}
        inputs = [t for t in src.tensors if t in reads]
        outputs = [t for t in dst.tensors if t in made]
        carried = [t for t in dst.tensors if t not in made]
        align = math.lcm(g.alignment(nodes), *(int(g.stride[t]) for t in inputs + outputs))
        model = None
        if extractor is not None:
            model = extract(extractor, inputs, outputs, Dims.TENSOR_ROWS, f"{dst.name}-stage")
        stages.append(Stage(j, dst.name, inputs, outputs, carried, align, nodes, p, model))
    return stages


def tail_model(p: Partitioner, level: Level) -> onnx.ModelProto | None:
    """What runs after ``level`` on its whole tensors: the model's outputs from them (None if all are there)."""
    g = p.graph
    if all(o in level.tensors for o in g.outputs):
        return None
    static = p._with_input_dims((p.height, p.width))
    return extract(onnx.utils.Extractor(static), list(level.tensors), list(g.outputs), Dims.STATIC,
                   f"{level.name}-tail")


Runner = Callable[[onnx.ModelProto, dict[str, np.ndarray]], Sequence[np.ndarray]]


def run_stages(p: Partitioner, through: list[str | int | Level], bands: list[list[int]], image: np.ndarray,
               run: Runner) -> list[np.ndarray]:
    """The reference staged execution, in one process: stage j on the image-row bands ``bands[j]`` (0, ...,
    height), every band reading its inputs' windows from the stitched tensors of the level before and
    returning its cropped rows of every output; then the tail on the whole tensors of the last level.
    ``run(model, feeds)`` runs one ONNX model (e.g. an ONNX Runtime session). Returns the model's outputs."""
    stages = p.stages(through)
    if len(bands) != len(stages):
        raise PartitionError(f"{len(stages)} stages but {len(bands)} lists of band boundaries")
    tensors = {p.graph.input_name: image}
    for stage, bounds in zip(stages, bands, strict=True):
        names = [o.name for o in stage.model.graph.output]
        pieces: dict[str, list[np.ndarray]] = {t: [] for t in names}
        for w in stage.bands(bounds):
            feeds = {t: tensors[t][:, :, lo:hi] for t, (lo, hi) in w.input_rows.items()}
            for t, y in zip(names, run(stage.model, feeds), strict=True):
                pieces[t].append(y[:, :, w.crop[t][0] : w.crop[t][1]])
        for t, parts in pieces.items():
            tensors[t] = np.concatenate(parts, axis=2)
    tail = tail_model(p, p.level(through[-1]))
    if tail is None:
        return [tensors[o] for o in p.graph.outputs]
    return list(run(tail, {i.name: tensors[i.name] for i in tail.graph.input}))
