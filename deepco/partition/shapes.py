"""Shapes at one input size: fold the shape subgraphs, and check that the whole model runs at that size.

Exporters compute sizes in the graph: PyTorch's ``F.interpolate(x, size=skip.shape[2:])`` becomes
Shape -> Slice -> Concat -> Resize. Once the input size is fixed those are constants; `fold_shapes`
replaces every Shape/Size whose input shape ONNX shape inference knows by its value, so the chains they
feed become image-independent (and `RowGraph` folds them into initializers) and the partitioner no longer
stops at a Shape, which reads no rows.

`check_size` runs ONNX shape inference on the whole graph at the size, in strict mode: a stride-32
detector asked for 720 rows fails in its neck (an upsampled 23 rows beside 45), and the one-line error
names the constraint and the nearest sizes above and below that do run.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable

import numpy as np
import onnx
from onnx import numpy_helper, shape_inference
from onnx.reference import ReferenceEvaluator

from deepco.errors import UserError


class SizeError(UserError):
    """The model does not run at the asked input size (the message names the nearest sizes that do)."""


def _image_input(model: onnx.ModelProto, name: str | None = None) -> onnx.ValueInfoProto:
    """The model's one image input (or its input called ``name``)."""
    if name is not None:
        return next(i for i in model.graph.input if i.name == name)
    inits = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    if len(inputs) != 1:
        raise UserError(f"the model must have exactly one image input, it has {len(inputs)}")
    return inputs[0]


def inference_skeleton(model: onnx.ModelProto, small_bytes: int = 4096) -> onnx.ModelProto:
    """The model for shape inference: initializers over ``small_bytes`` become graph inputs of the same type
    and shape (shape inference needs their shapes, not their values; shapes, pads and axes live in the small
    ones), so inferring is cheap for a model of any size. Built field by field: copying the whole model first
    would copy every weight."""
    skeleton = onnx.ModelProto()
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
        if init.ByteSize() <= small_bytes:
            graph.initializer.append(init)
        elif init.name not in known:
            graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    return skeleton


def with_static_size(model: onnx.ModelProto, height: int, width: int, image: str | None = None) -> onnx.ModelProto:
    """A copy with the image input (the one input that is no initializer, or the input called ``image``) fixed
    to batch 1 and ``height`` x ``width`` (value_info dropped)."""
    static = copy.deepcopy(model)
    del static.graph.value_info[:]
    vi = _image_input(static, image)
    dims = vi.type.tensor_type.shape.dim
    if len(dims) != 4:
        raise UserError(f"input {vi.name!r} must be 4-d NCHW, it has {len(dims)} dimensions")
    for d, value in zip(dims, (1, None, height, width), strict=True):
        if value is None:
            if not d.HasField("dim_value"):
                d.Clear()
                d.dim_value = 3
            continue
        d.Clear()
        d.dim_value = value
    return static


def _infer(model: onnx.ModelProto, strict: bool) -> onnx.ModelProto:
    return shape_inference.infer_shapes(model, strict_mode=strict, data_prop=True)


def static_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    """Fully known shapes of the tensors of an inferred model."""
    shapes = {}
    g = model.graph
    for vi in [*g.input, *g.value_info, *g.output]:
        tt = vi.type.tensor_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            shapes[vi.name] = [d.dim_value for d in tt.shape.dim]
    for t in g.initializer:
        shapes[t.name] = list(t.dims)
    return shapes


def fold_shapes(model: onnx.ModelProto, height: int, width: int, rounds: int = 16) -> onnx.ModelProto:
    """A copy of ``model`` in which every Shape/Size node whose input's shape is known at ``height`` x
    ``width`` is an initializer holding that shape (the model's inputs keep their dynamic dimensions).

    ONNX's data propagation stops at some operators (torch's ``chunk`` computes its split points with a
    Div), so shapes further on are unknown until the constants before them are evaluated: fold, evaluate
    the constant nodes, infer again, for up to ``rounds`` rounds.
    """
    return _fold(model, lambda m: with_static_size(m, height, width), rounds)


def fold_request_shapes(model: onnx.ModelProto, max_elements: int = 4096, rounds: int = 16) -> onnx.ModelProto:
    """`fold_shapes` for a model whose inputs all have concrete shapes already (a server bounding one
    request's memory): a Resize or Reshape whose size PyTorch computed from a tensor's shape then has a
    static output shape. Only what ONNX shape inference derives from those inputs is trusted (the model's
    own ``value_info`` and output shapes are set aside while folding), and only shape arithmetic
    (`SHAPE_ARITHMETIC`) with outputs of at most ``max_elements`` elements is evaluated: an uploaded model
    must not make the folding itself allocate or compute much. A model without Shape or Size nodes comes back
    as it is (not copied: a plain CNN's request bound pays nothing for this)."""
    if not any(n.op_type in ("Shape", "Size") for n in model.graph.node):
        return model
    return _fold(model, _undeclared, rounds, max_elements)


# What computes sizes from shapes in exported graphs; a request bound evaluates nothing else.
SHAPE_ARITHMETIC = frozenset({"Constant", "Identity", "Cast", "Slice", "Gather", "Concat", "Unsqueeze", "Squeeze",
                              "Reshape", "Transpose", "ConstantOfShape", "Expand", "Range", "Add", "Sub", "Mul", "Div",
                              "Mod", "Floor", "Ceil", "Neg", "Abs", "Max", "Min", "Equal", "Less", "Greater", "Not",
                              "Where", "ReduceProd"})


def _undeclared(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy without the shapes the file declares beyond its inputs (value_info, outputs' dimensions)."""
    bare = copy.deepcopy(model)
    del bare.graph.value_info[:]
    for vi in bare.graph.output:
        vi.type.tensor_type.ClearField("shape")
    return bare


def _fold(model: onnx.ModelProto, static: Callable[[onnx.ModelProto], onnx.ModelProto], rounds: int,
          max_elements: int | None = None) -> onnx.ModelProto:
    """Fold Shape/Size nodes whose input shape inference knows on ``static(model)``, then evaluate the
    constants that makes, for up to ``rounds`` rounds (``max_elements``: evaluate only outputs that small)."""
    out = copy.deepcopy(model)
    for _ in range(rounds):
        if not any(n.op_type in ("Shape", "Size") for n in out.graph.node):
            break
        try:
            shapes = static_shapes(_infer(static(out), strict=False))
        except Exception:  # a model inference cannot read is reported by check_size, not here
            break
        kept = []
        for node in out.graph.node:
            shape = shapes.get(node.input[0]) if node.op_type in ("Shape", "Size") and node.input else None
            if shape is None:
                kept.append(node)
                continue
            if node.op_type == "Size":
                value = np.asarray(int(np.prod(shape)), dtype=np.int64)
            else:
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                start, end = attrs.get("start", 0), attrs.get("end", len(shape))
                value = np.asarray(shape[start:end] if end is not None else shape[start:], dtype=np.int64)
            out.graph.initializer.append(numpy_helper.from_array(value, node.output[0]))
        if len(kept) == len(out.graph.node):
            break
        del out.graph.node[:]
        out.graph.node.extend(kept)
        _evaluate_constants(out, None if max_elements is None else (shapes, max_elements))
    return out


def _evaluate_constants(model: onnx.ModelProto, small: tuple[dict[str, list[int]], int] | None = None) -> None:
    """Replace every node whose inputs are all initializers by initializers holding its outputs; with
    ``small`` = (inferred shapes, limit), only shape arithmetic whose outputs are known to hold at most ``limit``
    elements."""
    known = {t.name: t for t in model.graph.initializer}
    kept = []
    for node in model.graph.node:
        ins = [name for name in node.input if name]
        foreign = node.domain not in ("", "ai.onnx")
        big = small is not None and (node.op_type not in SHAPE_ARITHMETIC or any(
            o not in small[0] or int(np.prod(small[0][o])) > small[1] for o in node.output if o))
        if foreign or big or node.op_type.startswith("Random") or any(name not in known for name in ins):
            kept.append(node)
            continue
        graph = onnx.helper.make_graph(
            [node], "constant", [],
            [onnx.helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output if o],
            [known[name] for name in dict.fromkeys(ins)],
        )
        try:
            values = ReferenceEvaluator(onnx.helper.make_model(graph, opset_imports=model.opset_import)).run(None, {})
        except Exception:  # left in the graph: RowGraph's own folding reports what it cannot evaluate
            kept.append(node)
            continue
        for name, value in zip([o for o in node.output if o], values, strict=True):
            tensor = numpy_helper.from_array(np.asarray(value), name)
            model.graph.initializer.append(tensor)
            known[name] = tensor
    del model.graph.node[:]
    model.graph.node.extend(kept)


def size_problem(model: onnx.ModelProto, height: int, width: int, image: str | None = None) -> str | None:
    """Why the whole model cannot run at ``height`` x ``width`` (strict shape inference), or None if it can
    (``image``: the image input's name, where the model has other inputs, as `inference_skeleton`'s)."""
    if height <= 0 or width <= 0:
        return f"the size {height}x{width} is not positive"
    try:
        _infer(with_static_size(model, height, width, image), strict=True)
    except UserError:
        raise
    except Exception as exc:  # InferenceError, ValidationError, ...: the message says which node
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None


STEPS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # the strides models have: powers of two


def _up(value: int, step: int) -> int:
    return -(-value // step) * step


def _steps(runs: Callable[[int, int], bool], height: int, width: int) -> tuple[int, int] | None:
    """The smallest (height step, width step) of `STEPS` at which the model runs near ``height`` x ``width``,
    or None. A step counts only where two consecutive multiples run (the one at or above the size and the
    next): 32x32 runs for a stride-32 model, so one multiple alone would call 31x31's constraint "multiples
    of 2". Found together first (both axes on one step), then each axis with the other on that step."""
    both = next((m for m in STEPS if runs(_up(height, m), _up(width, m)) and
                 runs(_up(height, m) + m, _up(width, m) + m)), None)
    if both is None:
        return None
    fixed_w, fixed_h = _up(width, both), _up(height, both)
    step_h = next((s for s in STEPS if runs(_up(height, s), fixed_w) and runs(_up(height, s) + s, fixed_w)), both)
    step_w = next((s for s in STEPS if runs(fixed_h, _up(width, s)) and runs(fixed_h, _up(width, s) + s)), both)
    return step_h, step_w


def _rule(step_h: int, step_w: int) -> str:
    """The size rule in words: "multiples of 32", or each axis's where they differ."""
    if step_h == step_w:
        return f"multiples of {step_h}"
    rows = "any height" if step_h == 1 else f"heights that are multiples of {step_h}"
    cols = "any width" if step_w == 1 else f"widths that are multiples of {step_w}"
    return f"{rows} and {cols}"


def _short(problem: str) -> str:
    """ONNX's inference error cut to the node and the clash, e.g. "node '/Concat' (Concat): 45 vs 46 rows"."""
    node = re.search(r"op_type:(\w+)(?:, node name: ([^)]*))?\)", problem)
    clash = re.search(r"Inferred=(\d+) Declared=(\d+) Dimension=(\d+)", problem)
    if not node:
        return problem.rstrip(".")
    where = f"node {node.group(2)!r} ({node.group(1)})" if node.group(2) else f"a {node.group(1)} node"
    if clash:
        axis = {"2": "rows", "3": "columns"}.get(clash.group(3), f"entries along axis {clash.group(3)}")
        return f"{where} joins tensors of {clash.group(1)} and {clash.group(2)} {axis}"
    detail = problem.rsplit("] ", 1)[-1].rstrip(".")  # ONNX's own words, e.g. "Incompatible dimensions"
    return f"{where}: {detail[:1].lower()}{detail[1:]}"


def check_size(model: onnx.ModelProto, height: int, width: int, name: str = "the model") -> None:
    """Raise SizeError (one line) unless the whole model runs at ``height`` x ``width``.

    The line names the failing node and its clash (from ONNX shape inference), the sizes the model runs at
    near the asked one (`_steps`: e.g. multiples of 32 for a stride-32 detector) and the nearest of those
    below and above (704x1280 and 736x1280 for 720x1280). Sizes are tried on the model's `inference_skeleton`
    (no weights copied: a ResNet-152 is checked in milliseconds), each once.
    """
    skeleton, image = inference_skeleton(model), _image_input(model).name
    problem = size_problem(skeleton, height, width, image)
    if problem is None:
        return
    head = f"{name} does not run at {height}x{width}: {_short(problem)}"
    runs = functools.cache(lambda h, w: size_problem(skeleton, h, w, image) is None)
    steps = _steps(runs, height, width)
    if steps is None:
        raise SizeError(f"{head}; no nearby size runs either")
    below = (height // steps[0] * steps[0], width // steps[1] * steps[1])
    above = (_up(height, steps[0]), _up(width, steps[1]))
    shown = [f"{h}x{w}" if min(h, w) > 0 and runs(h, w) else "none" for h, w in (below, above)]
    raise SizeError(f"{head}; it runs at {_rule(*steps)}: nearest {shown[0]} below, {shown[1]} above")
