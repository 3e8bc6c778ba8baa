"""Graph analysis: which nodes of an ONNX model are row-local, their row rules, and the valid cuts.

``RowGraph`` normalises a copy of the model (Shape/Size of tensors whose shape is known at this size
folded to constants, then every image-independent subgraph folded into initializers, auto_pad turned into
the explicit pads of the full image, a Resize's constant sizes turned into the scales that give them so a
band resamples by the same factor, a static input shape for shape inference, which must succeed on the
whole graph in strict mode: see deepco.partition.shapes), then walks the nodes
in topological order. Nodes whose row mapping is known and whose image-dependent inputs are all
row-local form the *partitionable prefix*; the first node that reads a row-local tensor but is not
itself row-local is where that prefix stops. A *cut* is a row-local tensor that carries all rows:
nothing after it reads any other image-dependent tensor of its head. Tensors have rational strides
(image rows per tensor row): upsampling divides them. Levels of several tensors (skip connections)
are built on top of this analysis in deepco.partition.levels.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import onnx
from onnx import shape_inference
from onnx.reference import ReferenceEvaluator

from deepco.errors import UserError
from deepco.partition.ops import Rule, Unsupported, Window, rule_for, to_array
from deepco.partition.shapes import SizeError, check_size, fold_shapes


class PartitionError(UserError):
    """The model cannot be partitioned as asked (unsupported operator, bad cut, bad slicing)."""


@dataclass(frozen=True)
class Stop:
    """The node where the partitionable prefix ends, and why."""

    node: str
    op_type: str
    reason: str

    def describe(self) -> str:
        """One line: node, operator and reason."""
        return f"node {self.node!r} ({self.op_type}): {self.reason}"


@dataclass(frozen=True)
class Rows:
    """A tensor computed on a slice: global rows [offset, offset+size); [valid_lo, valid_hi) are exact."""

    offset: int
    size: int
    valid_lo: int
    valid_hi: int


def _node_name(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"{node.op_type}_{index}"


def _dims(value_info: onnx.ValueInfoProto) -> list[int | str | None]:
    shape = value_info.type.tensor_type.shape
    if not value_info.type.tensor_type.HasField("shape"):
        return []
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in shape.dim]


def fixed_size_problem(image_input: onnx.ValueInfoProto, height: int, width: int) -> str | None:
    """Why a model whose image input has a fixed height or width cannot take ``height`` x ``width`` (naming the
    input and the flag that fixes it), or None."""
    dims = _dims(image_input)
    if len(dims) != 4:
        return None
    clash = [(want, dims[axis]) for axis, want in ((2, height), (3, width))
             if isinstance(dims[axis], int) and dims[axis] > 0 and dims[axis] != want]
    if not clash:
        return None
    fixed = f"{dims[2] if isinstance(dims[2], int) and dims[2] > 0 else height}x" \
            f"{dims[3] if isinstance(dims[3], int) and dims[3] > 0 else width}"
    return (f"the model's input {image_input.name!r} is fixed at {dims[2]}x{dims[3]}, not {height}x{width}: "
            f"give --input-size {fixed}")


def model_size_problem(model: onnx.ModelProto, height: int, width: int) -> str | None:
    """`fixed_size_problem` for ``model``'s one image input (None when it has not exactly one): checked on the
    model as the user gave it, so the message names their input, not the device's added uint8 one."""
    init = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in init]
    return fixed_size_problem(inputs[0], height, width) if len(inputs) == 1 else None


class RowGraph:
    """Row-level analysis of one ONNX model for one input size (see the module docstring)."""

    def __init__(self, model: onnx.ModelProto, height: int, width: int, name: str = "the model"):
        self.height, self.width, self.name = height, width, name
        # shapes are constants once the size is fixed: a Shape feeding a Resize's sizes reads no rows
        self.model = fold_shapes(model, height, width)
        graph = self.model.graph
        init_names = {t.name for t in graph.initializer}
        inputs = [i for i in graph.input if i.name not in init_names]
        if len(inputs) != 1:
            raise PartitionError(
                f"the model must have exactly one image input, it has {len(inputs)} "
                f"({', '.join(i.name for i in inputs) or 'none'})"
            )
        self.input = inputs[0]
        self.input_name = self.input.name
        dims = _dims(self.input)
        if len(dims) != 4:
            raise PartitionError(f"input {self.input_name!r} must be 4-d NCHW, it has shape {dims or '?'}")
        problem = fixed_size_problem(self.input, height, width)
        if problem:
            raise PartitionError(problem)
        self.channels = dims[1] if isinstance(dims[1], int) and dims[1] > 0 else 3
        # bytes of one element of the image input (1 for uint8 pixels) and of every tensor after it (float32)
        self.itemsize = onnx.helper.tensor_dtype_to_np_dtype(self.input.type.tensor_type.elem_type).itemsize
        self.feature_itemsize = 4
        self.nodes = list(graph.node)
        self.outputs = [o.name for o in graph.output]
        self._spatial = self._image_dependent()
        self._fold_constants()
        # each node's image-dependent inputs, once: row propagation asks for them hundreds of thousands of times
        # in a planner's search (a third of its time on a camera's CPU when it was computed on each call)
        self._spatial_in = [tuple(n for n in node.input if n in self._spatial) for node in self.nodes]
        self.initializers = {t.name: t for t in self.model.graph.initializer}
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = {}
        for i, node in enumerate(self.nodes):
            for name in node.output:
                self.producer[name] = i
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(i)
        self.rules: dict[int, Rule] = {}
        self.stop: Stop | None = None
        self.hw: dict[str, tuple[int, int]] = {self.input_name: (height, width)}
        # image rows per tensor row: a Fraction, since upsampling divides it (integers in practice)
        self.stride: dict[str, Fraction] = {self.input_name: Fraction(1)}
        self.opset = next((o.version for o in self.model.opset_import if o.domain in ("", "ai.onnx")), 17)
        self._analyse()
        self.shapes = self._static_shapes()
        self.cut_tensors = self._cuts()

    # ---- normalisation -------------------------------------------------------------------------

    def _image_dependent(self) -> set[str]:
        spatial = {self.input_name}
        for node in self.nodes:
            if any(name in spatial for name in node.input):
                spatial.update(n for n in node.output if n)
        return spatial

    def _fold_constants(self) -> None:
        """Evaluate every image-independent tensor that an image-dependent node reads, as an initializer.

        Exporters compute some attributes in the graph (e.g. a Pad's pads from ConstantOfShape, Concat,
        Reshape, ...); folding them gives the row rules plain numbers and shape inference static shapes.
        """
        const_nodes = [n for n in self.nodes if not any(o in self._spatial for o in n.output)]
        if not const_nodes:
            return
        produced = {o for n in const_nodes for o in n.output if o}
        wanted = sorted(
            {
                name
                for n in self.nodes
                if any(o in self._spatial for o in n.output)
                for name in n.input
                if name in produced
            }
            | (produced & set(self.outputs))
        )
        graph = self.model.graph
        needed_inits = {name for n in const_nodes for name in n.input}
        values: dict[str, np.ndarray] = {}
        if wanted:
            sub = onnx.helper.make_graph(
                const_nodes,
                "constants",
                [],
                [onnx.helper.make_tensor_value_info(w, onnx.TensorProto.UNDEFINED, None) for w in wanted],
                [t for t in graph.initializer if t.name in needed_inits],
            )
            sub_model = onnx.helper.make_model(sub, opset_imports=self.model.opset_import)
            try:
                results = ReferenceEvaluator(sub_model).run(None, {})
            except Exception as exc:  # the evaluator raises many types; the cause goes in the message
                raise PartitionError(
                    f"cannot evaluate the model's constant subgraph: {exc}".splitlines()[0]
                ) from None
            values = dict(zip(wanted, results, strict=True))
        kept = [n for n in self.nodes if any(o in self._spatial for o in n.output)]
        del graph.node[:]
        graph.node.extend(kept)
        for name, value in values.items():
            graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(value), name))
        used = {name for n in kept for name in n.input} | set(self.outputs)
        live = [t for t in graph.initializer if t.name in used]
        del graph.initializer[:]
        graph.initializer.extend(live)
        self.nodes = list(graph.node)

    def _const(self, name: str) -> np.ndarray | None:
        tensor = self.initializers.get(name)
        return None if tensor is None else to_array(tensor)

    def _const_shape(self, name: str) -> list[int] | None:
        tensor = self.initializers.get(name)
        return None if tensor is None else list(tensor.dims)

    def _analyse(self) -> None:
        """Classify nodes in topological order, fix auto_pad, and compute full-image sizes and strides."""
        for i, node in enumerate(self.nodes):
            spatial = [name in self._spatial for name in node.input]
            ins = [name for name, s in zip(node.input, spatial, strict=True) if s]
            if not ins:
                continue
            if not all(name in self.hw for name in ins):
                continue  # downstream of the stop: not part of the prefix
            try:
                rule = rule_for(node, spatial, self._const, self._const_shape, self.hw[ins[0]], self.opset)
                sizes = {self.hw[name] for name in ins}
                strides = {self.stride[name] for name in ins}
                if len(sizes) > 1 or len(strides) > 1:
                    raise Unsupported(
                        "merges tensors of different sizes or strides "
                        f"({', '.join(f'{h}x{w}' for h, w in sorted(sizes))})"
                    )
            except Unsupported as exc:
                if self.stop is None:
                    self.stop = Stop(_node_name(node, i), node.op_type, str(exc))
                continue
            if rule.pads is not None:
                self._set_pads(node, rule.pads)
            if rule.scales is not None:
                self._set_scales(node, rule.scales)
            ((h, w),) = sizes
            out_hw = (rule.rows.out_size(h), rule.cols.out_size(w))
            if min(out_hw) <= 0:
                raise PartitionError(
                    f"node {_node_name(node, i)!r} ({node.op_type}) has no output rows at "
                    f"{self.height}x{self.width}: the input is too small"
                )
            self.rules[i] = rule
            (stride,) = strides
            for out in node.output:  # several for a Split of the channels, each with the same rows
                if out:
                    self.hw[out] = out_hw
                    self.stride[out] = stride / rule.rows.scale

    def _set_scales(self, node: onnx.NodeProto, scales: list[float]) -> None:
        """Give a Resize the scales its constant sizes amount to: the same output at this size, and on a
        band the band's own size times the factor instead of the whole image's size."""
        name = f"{node.output[0]}_scales"
        self.model.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(scales, np.float32), name))
        self.initializers[name] = self.model.graph.initializer[-1]
        inputs = list(node.input) + [""] * (3 - len(node.input))
        inputs[2] = name
        del node.input[:]
        node.input.extend(inputs[:3])
        # drop the sizes constant if nothing else reads it (ONNX Runtime warns about unused initializers)
        used = {n for other in self.model.graph.node for n in other.input}
        keep = [t for t in self.model.graph.initializer if t.name in used or t.name in self.outputs]
        if len(keep) < len(self.model.graph.initializer):
            del self.model.graph.initializer[:]
            self.model.graph.initializer.extend(keep)
            self.initializers = {t.name: t for t in keep}

    @staticmethod
    def _set_pads(node: onnx.NodeProto, pads: list[int]) -> None:
        keep = [a for a in node.attribute if a.name not in ("auto_pad", "pads")]
        del node.attribute[:]
        node.attribute.extend(keep)
        node.attribute.append(onnx.helper.make_attribute("pads", pads))

    def _static_shapes(self) -> dict[str, list[int]]:
        """Shapes of all tensors at batch 1 and the full image size; row sizes checked against ours."""
        try:
            check_size(self.model, self.height, self.width, self.name)
        except SizeError as exc:  # one error type for every "cannot partition this" to the callers
            raise PartitionError(str(exc)) from None
        static = copy.deepcopy(self.model)
        shape = static.graph.input[
            [i.name for i in static.graph.input].index(self.input_name)
        ].type.tensor_type.shape
        for dim, value in zip(shape.dim, (1, self.channels, self.height, self.width), strict=True):
            dim.Clear()
            dim.dim_value = value
        del static.graph.value_info[:]
        try:
            inferred = shape_inference.infer_shapes(static, data_prop=True)
        except Exception as exc:  # onnx raises InferenceError and others; all mean a broken model
            raise PartitionError(f"ONNX shape inference failed: {exc}".splitlines()[0]) from None
        shapes = {}
        for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
            dims = _dims(vi)
            if dims and all(isinstance(d, int) for d in dims):
                shapes[vi.name] = dims
        for t in inferred.graph.initializer:
            shapes[t.name] = list(t.dims)
        for name, (h, w) in self.hw.items():
            dims = shapes.get(name)
            if dims is not None and len(dims) == 4 and (dims[2], dims[3]) != (h, w):
                raise PartitionError(
                    f"row analysis and ONNX shape inference disagree on {name!r}: "
                    f"{h}x{w} vs {dims[2]}x{dims[3]}"
                )
        return shapes

    # ---- cuts ----------------------------------------------------------------------------------

    def ancestors(self, tensor: str) -> list[int]:
        """Indices of the image-dependent nodes that ``tensor`` is computed from, in topological order."""
        seen: set[int] = set()
        stack = [tensor]
        while stack:
            i = self.producer.get(stack.pop())
            if i is None or i in seen:
                continue
            seen.add(i)
            stack.extend(name for name in self.nodes[i].input if name in self._spatial)
        return sorted(seen)

    def _cuts(self) -> list[str]:
        """Row-local tensors that carry all rows, in topological order."""
        cuts = []
        for i in sorted(self.rules):
            tensor = self.nodes[i].output[0]
            if tensor in self.outputs:
                continue
            head = set(self.ancestors(tensor))
            if not head <= self.rules.keys():
                continue
            inner = {self.input_name} | {o for j in head for o in self.nodes[j].output if o}
            inner.discard(tensor)
            leaks = any(j not in head for name in inner for j in self.consumers.get(name, ()))
            if not leaks and not (inner & set(self.outputs)):
                cuts.append(tensor)
        return cuts

    def alignment(self, head: Iterable[int], source: str | None = None) -> int:
        """The slice start (in rows of ``source``, default the image) must be a multiple of this: every
        strided node needs its input offset aligned, and every tensor's offset must be a whole row."""
        base = self.stride[source or self.input_name]
        align = 1
        for i in head:
            first = next(n for n in self.nodes[i].input if n in self._spatial)
            for need in (self.stride[first] * self.rules[i].rows.stride, self.stride[self.nodes[i].output[0]]):
                # a multiple of the fraction p/q (in lowest terms) in whole source rows: of p
                ratio = Fraction(need) / base
                align = math.lcm(align, ratio.numerator)
        return align

    def rescales(self, nodes: Iterable[int]) -> bool:
        """Whether any of ``nodes`` changes the row scale upwards (Resize, ConvTranspose) or takes every k-th
        row from a start past the first (YOLOX's Focus): branches then meet at different strides, or with
        one row fewer where a slice's length is not a multiple of k, and a slice lines them up only if its
        length is a multiple of the alignment, like the model's own valid sizes."""
        return any(not isinstance(rule := self.rules[i].rows, Window) or rule.pad_top < 0 for i in nodes)

    # ---- row propagation -----------------------------------------------------------------------

    def spatial_inputs(self, i: int) -> tuple[str, ...]:
        """The image-dependent inputs of node i."""
        return self._spatial_in[i]

    def backward(
        self, head: list[int], tensor: str, a: int, b: int, clip: bool = True
    ) -> dict[str, tuple[int, int]]:
        """Rows of every head tensor needed for rows [a, b) of ``tensor`` (union over consumers)."""
        return self.backward_all(head, {tensor: (a, b)}, clip)

    def backward_all(
        self, head: list[int], targets: dict[str, tuple[int, int]], clip: bool = True
    ) -> dict[str, tuple[int, int]]:
        """Rows of every tensor of ``head`` needed for rows ``targets[t]`` of each target t (union)."""
        need = dict(targets)
        for i in reversed(head):
            outs = [o for o in self.nodes[i].output if o in need]
            if not outs:
                continue
            oa, ob = min(need[o][0] for o in outs), max(need[o][1] for o in outs)
            lo, hi = self.rules[i].rows.need(oa, ob)
            for name in self.spatial_inputs(i):
                rlo, rhi = (max(lo, 0), min(hi, self.hw[name][0])) if clip else (lo, hi)
                if name in need:
                    rlo, rhi = min(rlo, need[name][0]), max(rhi, need[name][1])
                need[name] = (rlo, rhi)
        return need

    def exact_window(self, nodes: list[int], source: str, target: str, a: int, b: int, stride: int,
                     flops: list[int]) -> tuple[int, int, tuple[int, int], int]:
        """Running ``nodes`` on rows [start, stop) of ``source`` gives rows [a, b) of ``target`` exactly:
        (start, stop, crop of the output, FLOPs computed). ``start`` is aligned down to ``stride``;
        ``flops[i]`` is node i's FLOPs on the whole tensor. Checked by simulating the run forward: a window
        the backward rules got wrong is refused, never returned."""
        lo, hi = self.backward(nodes, target, a, b)[source]
        start = lo - lo % stride
        if self.rescales(nodes):
            hi = min(self.hw[source][0], start + -(-(hi - start) // stride) * stride)
        rows = self.forward(nodes, start, hi, source=source)
        out = rows[target]
        if not (out.valid_lo <= a and b <= out.valid_hi):
            raise PartitionError(
                f"internal: rows [{start}, {hi}) of {source!r} do not give rows [{a}, {b}) of {target!r} "
                f"exactly (exact rows [{out.valid_lo}, {out.valid_hi}))"
            )
        computed = 0
        for i in nodes:
            tensor = self.nodes[i].output[0]
            computed += flops[i] * rows[tensor].size // max(self.hw[tensor][0], 1)
        return start, hi, (a - out.offset, b - out.offset), computed

    def forward(self, head: list[int], start: int, stop: int, source: str | None = None,
                windows: dict[str, tuple[int, int]] | None = None) -> dict[str, Rows]:
        """Simulate running the head on image rows [start, stop): each tensor's rows and its exact part.

        A row is exact when every row it reads is an exact row, or lies outside the slice on a side
        where the slice border is the image border (the head's zero padding is then the model's own).
        ``source`` (default: the image) is the tensor the nodes of ``head`` start from, for a segment
        between two cuts whose input rows [start, stop) of that tensor are all exact. ``windows`` gives
        instead the exact rows of each of several source tensors (a multi-tensor level).
        """
        if windows is None:
            windows = {source or self.input_name: (start, stop)}
        rows = {name: Rows(lo, hi - lo, lo, hi) for name, (lo, hi) in windows.items()}
        for i in head:
            ins = [rows[n] for n in self.spatial_inputs(i)]
            win = self.rules[i].rows
            first = ins[0]
            if any((r.offset, r.size) != (first.offset, first.size) for r in ins):
                raise PartitionError(f"node {_node_name(self.nodes[i], i)!r} merges slices of different rows")
            if first.offset % win.stride:
                raise PartitionError(
                    f"slice start {start} is not aligned to the stride at node "
                    f"{_node_name(self.nodes[i], i)!r}"
                )
            full = self.hw[self.spatial_inputs(i)[0]][0]
            offset, size = win.out_offset(first.offset), win.out_size(first.size)
            if size <= 0:
                raise PartitionError(
                    f"slice [{start}, {stop}) is too thin for node {_node_name(self.nodes[i], i)!r}"
                )
            lo, hi = offset, offset + size
            for r in ins:
                if r.valid_lo >= r.valid_hi:
                    lo, hi = 0, 0
                    break
                top = r.offset == 0 and r.valid_lo == 0
                bottom = r.offset + r.size == full and r.valid_hi == full
                rlo, rhi = win.exact(r.offset, r.size, (r.valid_lo, r.valid_hi), top, bottom)
                lo, hi = max(lo, rlo), min(hi, rhi)
            for out in self.nodes[i].output:
                if out:
                    rows[out] = Rows(offset, size, lo, max(lo, hi))
        return rows
