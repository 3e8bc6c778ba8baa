"""What an uploaded model may be, checked before ONNX Runtime sees it, and how much memory a request on it
may take, checked before it runs.

- No file references (:func:`check_no_external_data`): a model arrives as bytes over the wire, so nothing
  it names on disk is legitimate. ONNX Runtime resolves an external-data ``location`` against the server's
  working directory, so a model naming a file there would read that file into a tensor.
- No subgraphs (:func:`check_no_subgraphs`): If/Loop/Scan bodies are invisible to ONNX shape inference, so
  neither their memory at load (nested Ifs: a 2 MB upload took 920 MiB) nor per request can be bounded.
- Bounded requests (:class:`SizeBound`): ONNX shape inference against a request's concrete input shapes
  must give every tensor of the graph a static shape, and the bytes of the tensors alive at once (running
  the nodes in order) must stay under the ``--max-request-bytes`` budget. A tensor whose size depends on
  input *values* (ConstantOfShape, Expand, Tile, Range, Resize fed by an input) has no static shape, so a
  93-byte model cannot ask for 14 GB.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping

import onnx
from deepco_server.errors import ResourceExhausted, invalid
from google.protobuf.message import DecodeError
from onnx import AttributeProto, GraphProto, ModelProto, TensorProto, helper, shape_inference

DEFAULT_MAX_REQUEST_BYTES = 4 << 30  # tensors of one request alive at once (inputs, intermediates, outputs)
SMALL_INITIALIZER_BYTES = 4096  # kept in the shape-inference skeleton: shapes, pads, axes live in these
SHAPE_CACHE_SIZE = 64  # input shapes remembered per model (a device sends a handful of slice heights)


def parse_model(model_bytes: bytes, name: str) -> ModelProto:
    """The ModelProto of uploaded bytes (INVALID_ARGUMENT if they do not parse as one)."""
    model = ModelProto()
    try:
        model.ParseFromString(model_bytes)
    except (DecodeError, RuntimeError, ValueError):
        raise invalid(f"model {name!r} is not a valid ONNX model (its bytes do not parse as an ONNX "
                      "ModelProto)") from None
    return model


def _graphs(model: ModelProto) -> Iterator[GraphProto]:
    """The main graph, every subgraph of any node attribute (recursively), functions' and training graphs."""
    stack: list[GraphProto] = [model.graph]
    stack += [info.algorithm for info in model.training_info] + [info.initialization for info in model.training_info]
    function_nodes = [node for function in model.functions for node in function.node]
    for node in function_nodes:
        stack += _attribute_graphs(node)
    while stack:
        graph = stack.pop()
        yield graph
        for node in graph.node:
            stack += _attribute_graphs(node)


def _attribute_graphs(node: onnx.NodeProto) -> list[GraphProto]:
    out: list[GraphProto] = []
    for attr in node.attribute:
        if attr.HasField("g"):
            out.append(attr.g)
        out += list(attr.graphs)
    return out


def _attribute_tensors(node: onnx.NodeProto) -> Iterator[TensorProto]:
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        if attr.HasField("sparse_tensor"):
            yield attr.sparse_tensor.values
            yield attr.sparse_tensor.indices
        for sparse in attr.sparse_tensors:
            yield sparse.values
            yield sparse.indices


def _tensors(model: ModelProto) -> Iterator[TensorProto]:
    """Every tensor stored anywhere in the model: initializers (dense and sparse) and attribute tensors of
    every graph, subgraph and function."""
    for graph in _graphs(model):
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in graph.node:
            yield from _attribute_tensors(node)
    for function in model.functions:
        for node in function.node:
            yield from _attribute_tensors(node)


def check_no_external_data(model: ModelProto, name: str) -> None:
    """Refuse a model any of whose tensors is stored outside it (``external_data`` / ``data_location``).

    The message names the tensor but never the file it points at, nor anything about that file.
    """
    for tensor in _tensors(model):
        if tensor.data_location == TensorProto.EXTERNAL or len(tensor.external_data) > 0:
            raise invalid(f"model {name!r}: tensor {tensor.name[:80]!r} is stored as external data (a file "
                          "reference); this server only loads self-contained models: embed the weights "
                          "(onnx.save_model(..., save_as_external_data=False))")


def check_no_subgraphs(model: ModelProto, name: str) -> None:
    """Refuse a model with control flow (a node with a graph attribute: If, Loop, Scan, ...)."""
    for graph in _graphs(model):
        for node in graph.node:
            if any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for a in node.attribute):
                raise ResourceExhausted(f"model {name!r}: node {node.name[:80] or node.op_type!r} ({node.op_type}) has "
                                        "subgraphs, whose memory this server cannot bound; it runs models without "
                                        "control flow (If, Loop, Scan) only")


def _skeleton(model: ModelProto) -> ModelProto:
    """The model for shape inference: big initializers become graph inputs of the same type and shape (shape
    inference needs their shapes, not their values), so inferring is cheap for a model of any size. Built
    field by field: copying the whole model first would copy every weight."""
    skeleton = ModelProto()
    for descriptor, value in model.ListFields():
        if descriptor.name == "graph":
            continue
        if descriptor.is_repeated:
            getattr(skeleton, descriptor.name).extend(value)
        elif descriptor.message_type is not None:
            getattr(skeleton, descriptor.name).CopyFrom(value)
        else:
            setattr(skeleton, descriptor.name, value)
    source, graph = model.graph, skeleton.graph
    graph.name = source.name
    graph.node.extend(source.node)
    graph.input.extend(source.input)
    graph.output.extend(source.output)
    graph.value_info.extend(source.value_info)
    graph.sparse_initializer.extend(source.sparse_initializer)
    known = {i.name for i in source.input}
    for init in source.initializer:
        if init.ByteSize() <= SMALL_INITIALIZER_BYTES:
            graph.initializer.append(init)
        elif init.name not in known:
            graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    return skeleton


def _value_bytes(value: onnx.ValueInfoProto) -> int | None:
    """Bytes of a value of static shape and known element type, else None."""
    if not value.type.HasField("tensor_type"):
        return None
    tensor = value.type.tensor_type
    if tensor.elem_type == TensorProto.UNDEFINED or not tensor.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim]
    if any(d < 0 for d in dims):
        return None
    try:
        itemsize = helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize
    except (KeyError, TypeError, ValueError):
        return None
    return math.prod(dims) * max(itemsize, 1)


class SizeBound:
    """Bytes one request on a model may need, from its input shapes; refuses what cannot be bounded."""

    def __init__(self, model: ModelProto, name: str, max_request_bytes: int, inputs: list[str]):
        self.name, self.limit = name, max_request_bytes
        self._skeleton = _skeleton(model).SerializeToString()
        self._inputs = inputs  # the model's real inputs (graph inputs that are not initializers)
        self._cache: OrderedDict[tuple, tuple[int, str] | int] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, shapes: Mapping[str, tuple[int, ...]]) -> int:
        """The bytes a request with these input shapes needs at most; RESOURCE_EXHAUSTED if unbounded or over
        the limit."""
        key = tuple((n, tuple(int(d) for d in shapes[n])) for n in self._inputs if n in shapes)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
        if found is None:
            found = self._infer(dict(key))
            with self._lock:
                self._cache[key] = found
                while len(self._cache) > SHAPE_CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(found, tuple):
            raise ResourceExhausted(found[1])
        if found > self.limit:
            raise ResourceExhausted(f"model {self.name!r}: on inputs of shape {_shapes(key)} its tensors take up to "
                                    f"{found} bytes at once, over the per-request limit (--max-request-bytes) of "
                                    f"{self.limit}")
        return found

    def _infer(self, shapes: dict[str, tuple[int, ...]]) -> tuple[int, str] | int:
        model = ModelProto()
        model.ParseFromString(self._skeleton)
        for value in model.graph.input:
            if value.name in shapes:
                dims = value.type.tensor_type.shape.dim
                for dim, size in zip(dims, shapes[value.name], strict=True):
                    dim.Clear()
                    dim.dim_value = size
        shown = _shapes(tuple(shapes.items()))
        try:
            inferred = shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
        except Exception as exc:  # onnx raises InferenceError and others; any of them: not boundable
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            return (0, f"model {self.name!r}: cannot bound its memory on inputs of shape {shown} "
                       f"(ONNX shape inference: {first})")
        graph = inferred.graph
        values = {v.name: v for v in [*graph.input, *graph.value_info, *graph.output]}
        sizes: dict[str, int] = {}
        for name in dict.fromkeys([*self._inputs, *(o for node in graph.node for o in node.output if o)]):
            value = values.get(name)
            size = _value_bytes(value) if value is not None else None
            if size is None:
                node = next((n for n in graph.node if name in n.output), None)
                where = f"output {name[:80]!r} of node {node.op_type}" if node is not None else f"tensor {name[:80]!r}"
                return (0, f"model {self.name!r}: the size of {where} depends on input values, not only on the "
                           f"input shapes {shown}, so this server cannot bound the request's memory and does not "
                           "run it")
            sizes[name] = size
        return _peak_bytes(graph, sizes, self._inputs)


def _peak_bytes(graph: GraphProto, sizes: dict[str, int], inputs: list[str]) -> int:
    """The most bytes of tensors alive at once when the nodes run in graph order (ONNX keeps them
    topologically sorted): a tensor lives from its producer (or the start, for inputs) to its last consumer
    (or the end, for graph outputs). This is what a memory planner like ORT's needs, not the sum of all."""
    last_use = {name: len(graph.node) for name in [*inputs, *(o.name for o in graph.output)]}
    for step, node in enumerate(graph.node):
        for name in node.input:
            if name in sizes:
                last_use[name] = max(last_use.get(name, step), step)
    live = sum(sizes.get(name, 0) for name in inputs)
    peak = live
    dying: dict[int, list[str]] = {}
    for name, step in last_use.items():
        dying.setdefault(step, []).append(name)
    for step, node in enumerate(graph.node):
        live += sum(sizes[o] for o in node.output if o in sizes)
        peak = max(peak, live)
        live -= sum(sizes[name] for name in dying.get(step, ()) if name in sizes)
    return peak


def _shapes(key: tuple) -> str:
    return ", ".join(f"{n[:40]} {list(s)}" for n, s in key)
