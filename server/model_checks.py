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
  93-byte model cannot ask for 14 GB. Sizes computed from input *shapes* are folded to constants first
  (deepco.partition.shapes.fold_request_shapes), so a PyTorch U-Net's shape-derived Pad or Resize passes.
- Fixed-size elements only (:func:`check_fixed_size_elements`): a string (or a sequence, map or optional)
  has no size its shape gives, so the bound cannot count it (a 925-byte model cast its input to STRING and
  doubled it with StringConcat 27 times: 2.5 GB from a 4-byte request). Such a model is refused at load,
  naming the node.
- Kernel workspaces (:func:`workspace_bytes`): a convolution runs as a matrix product over a column buffer
  (im2col for Conv, col2im for ConvTranspose) that is no tensor of the graph; the bound adds it at its node
  (a ConvTranspose of kernel 32 kept its input's size but took a 4.4 GB column buffer for a 4 MiB input).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping

import onnx
from deepco_server.errors import InvalidArgument, ResourceExhausted, invalid
from google.protobuf.message import DecodeError
from onnx import AttributeProto, GraphProto, ModelProto, TensorProto, helper, shape_inference

from deepco.partition.shapes import fold_request_shapes, inference_skeleton

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


# Element types whose size a tensor's shape does not give: a string is as long as its value.
VARIABLE_SIZE_TYPES = frozenset({TensorProto.STRING})


def _variable_type(type_proto: onnx.TypeProto) -> str | None:
    """What makes a value of this type variable in size ("STRING", "a sequence", ...), or None if fixed."""
    which = type_proto.WhichOneof("value")
    if which == "tensor_type":
        elem = type_proto.tensor_type.elem_type
        return TensorProto.DataType.Name(elem) if elem in VARIABLE_SIZE_TYPES else None
    if which is None:  # not inferred (an operator shape inference does not know): the request bound decides
        return None
    return {"sequence_type": "a sequence", "map_type": "a map", "optional_type": "an optional",
            "sparse_tensor_type": "a sparse tensor"}.get(which, which)


def _node_label(node: onnx.NodeProto) -> str:
    return f"node {(node.name or node.output[0] if node.output else node.name)[:80]!r} ({node.op_type})"


def check_fixed_size_elements(model: ModelProto, name: str) -> None:
    """Refuse a model any of whose values has elements of no fixed size (module doc), naming the node.

    What the file declares is checked (inputs, outputs, initializers, constants, a Cast's target type), then
    what ONNX type inference derives for every node's outputs (StringConcat, CastLike, ...).
    """
    graph = model.graph

    def refuse(where: str, what: str) -> InvalidArgument:
        return invalid(f"model {name!r}: {where} makes {what}, whose memory this server cannot bound (it counts "
                       "tensors of fixed-size elements only); it does not load models with string, sequence or "
                       "map values")

    producers = {o: node for node in graph.node for o in node.output}
    for node in [*graph.node, *(n for f in model.functions for n in f.node)]:
        for attr in node.attribute:
            if attr.name == "to" and attr.type == AttributeProto.INT and attr.i in VARIABLE_SIZE_TYPES:
                raise refuse(_node_label(node), TensorProto.DataType.Name(attr.i))
        for tensor in _attribute_tensors(node):
            if tensor.data_type in VARIABLE_SIZE_TYPES:
                raise refuse(_node_label(node), TensorProto.DataType.Name(tensor.data_type))
    for tensor in graph.initializer:
        if tensor.data_type in VARIABLE_SIZE_TYPES:
            raise refuse(f"initializer {tensor.name[:80]!r}", TensorProto.DataType.Name(tensor.data_type))
    for value in [*graph.input, *graph.value_info, *graph.output]:
        what = _variable_type(value.type)
        if what is not None:
            node = producers.get(value.name)
            raise refuse(_node_label(node) if node is not None else f"tensor {value.name[:80]!r}", what)
    try:
        skeleton = inference_skeleton(model, SMALL_INITIALIZER_BYTES)
        inferred = shape_inference.infer_shapes(skeleton, strict_mode=False).graph
    except Exception:  # an invalid graph: ONNX Runtime and the request bound refuse it with their reasons
        return
    types = {v.name: v.type for v in [*inferred.value_info, *inferred.output]}
    for node in inferred.node:
        for output in node.output:
            what = _variable_type(types[output]) if output in types else None
            if what is not None:
                raise refuse(_node_label(node), what)


def _value_bytes(value: onnx.ValueInfoProto) -> int | None:
    """Bytes of a value of static shape and known element type, else None."""
    if not value.type.HasField("tensor_type"):
        return None
    tensor = value.type.tensor_type
    if tensor.elem_type in (TensorProto.UNDEFINED, *VARIABLE_SIZE_TYPES) or not tensor.HasField("shape"):
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
        self._skeleton = inference_skeleton(model, SMALL_INITIALIZER_BYTES).SerializeToString()
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
        # At these input shapes, sizes computed from shapes are constants (a PyTorch U-Net's F.pad by the size
        # difference: Shape -> Gather -> Sub -> Div -> ... -> Pad, whose Div ONNX's data propagation does not
        # follow): folded, such a Pad or Resize has a static output. A graph the folding cannot read is left as
        # it is: the inference below says why.
        with contextlib.suppress(Exception):
            model = fold_request_shapes(model)
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
        dims = {name: _dims(v) for name, v in values.items()
                if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")}
        dims.update({i.name: tuple(i.dims) for i in graph.initializer})  # small weights stay initializers
        itemsizes = {name: size // max(math.prod(dims.get(name, ())), 1) for name, size in sizes.items()}
        workspaces = [workspace_bytes(node, dims, itemsizes) for node in graph.node]
        return _peak_bytes(graph, sizes, self._inputs, workspaces)


def _dims(value: onnx.ValueInfoProto) -> tuple[int, ...]:
    return tuple(d.dim_value for d in value.type.tensor_type.shape.dim)


# The convolutions whose kernels work on a column buffer, and where their weight is among the inputs.
_CONV_WEIGHT = {"Conv": 1, "ConvInteger": 1, "QLinearConv": 3, "ConvTranspose": 1}


def workspace_bytes(node: onnx.NodeProto, dims: Mapping[str, tuple[int, ...]],
                    itemsizes: Mapping[str, int] | None = None) -> int:
    """Bytes of the column buffer a convolution node works on while it runs, beyond its input and output.

    ONNX Runtime's CPU kernels (and most GPU ones) compute a convolution as a matrix product over a column
    buffer of ``(channels / group) x prod(kernel) x prod(spatial)`` elements of 4 bytes (the float the
    kernels compute in; 8 for doubles):

    - ConvTranspose (col2im): the weight is ``(C_in, C_out/group, k...)``, the buffer ``C_out/group x prod(k)
      x prod(input spatial)``: a stride-1 ConvTranspose of kernel 32 with pads 31 keeps its input's size
      but needs 1024 times it;
    - Conv (im2col): the weight is ``(C_out, C_in/group, k...)``, the buffer ``C_in/group x prod(k) x
      prod(output spatial)``, none for a 1x1 kernel of stride 1 without pads (a plain matrix product).

    An upper bound: ORT splits some Conv buffers in segments, or runs them in a blocked layout without one.
    """
    itemsizes = itemsizes or {}
    where = _CONV_WEIGHT.get(node.op_type)
    if where is None or len(node.input) <= where:
        return 0
    weight = dims.get(node.input[where])
    x, y = dims.get(node.input[0]), dims.get(node.output[0]) if node.output else None
    if weight is None or x is None or y is None or len(weight) < 3:
        return 0
    kernel = math.prod(weight[2:])
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    itemsize = 8 if itemsizes.get(node.output[0], 4) == 8 else 4
    if node.op_type == "ConvTranspose":
        return int(weight[1]) * kernel * math.prod(x[2:]) * itemsize
    plain = kernel == 1 and all(s == 1 for s in attrs.get("strides", [1])) and not any(attrs.get("pads", [0]))
    return 0 if plain else int(weight[1]) * kernel * math.prod(y[2:]) * itemsize


def _peak_bytes(graph: GraphProto, sizes: dict[str, int], inputs: list[str],
                workspaces: list[int] | None = None) -> int:
    """The most bytes of tensors alive at once when the nodes run in graph order (ONNX keeps them
    topologically sorted): a tensor lives from its producer (or the start, for inputs) to its last consumer
    (or the end, for graph outputs), and a node's workspace (:func:`workspace_bytes`) while it runs. This is
    what a memory planner like ORT's needs, not the sum of all."""
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
        peak = max(peak, live + (workspaces[step] if workspaces else 0))
        live -= sum(sizes[name] for name in dying.get(step, ()) if name in sizes)
    return peak


def _shapes(key: tuple) -> str:
    return ", ".join(f"{n[:40]} {list(s)}" for n, s in key)
