"""Stage models derived from the whole model: the one extraction the device and the servers share.

A stage model (a split's segment, its tail, a stage across scales) is the part of the whole model between
some tensors, extracted with `onnx.utils.Extractor` and given symbolic row dimensions where it runs on bands.
The device's partitioner extracts them this way, and a server derives the same model, byte for byte, from the
whole model it holds and a small description (`deepco.wire` `StageDescription`), so that a new plan sends
a few hundred bytes per stage instead of the stage's weights (issue 27: models cross the radio once).

How a stage's dimensions are set (`Dims`):
- ``ROWS``: one input and one output whose height and width are any size (``height``/``width`` in,
  ``out_height``/``out_width`` out): a split's segment or head, run on a window of rows;
- ``TENSOR_ROWS``: every input and output's height and width are any size, named after the tensor: a stage
  across scales (deepco.partition.levels);
- ``STATIC``: the whole model's own size: a tail, run on the stitched tensors;
- ``WHOLE``: the whole model itself (an offload), as it is.
"""

from __future__ import annotations

import copy
import enum

import onnx
from onnx import shape_inference

from deepco.partition.graph import PartitionError
from deepco.partition.open_rows import CLOSED, Sides, open_model, sides_bits, sides_of_bits

MAX_TENSORS = 256  # a stage's inputs or outputs: a level of a U-Net or a detector has a handful
MAX_NAME_CHARS = 128


class Dims(enum.IntEnum):
    """How a derived stage's spatial dimensions are set (the values are `StageDescription.Dims`'s)."""

    ROWS = 0
    TENSOR_ROWS = 1
    STATIC = 2
    WHOLE = 3


def with_input_dims(model: onnx.ModelProto, image: str, hw: tuple[int | str, int | str]) -> onnx.ModelProto:
    """A copy of ``model`` whose input ``image`` has height and width ``hw`` (ints, or names: any size), its
    shapes inferred again (Extractor reads a cut tensor's type from value_info)."""
    model = copy.deepcopy(model)
    del model.graph.value_info[:]
    for vi in model.graph.input:
        if vi.name == image:
            for d, value in zip(vi.type.tensor_type.shape.dim[2:], hw, strict=True):
                d.Clear()
                if isinstance(value, int):
                    d.dim_value = value
                else:
                    d.dim_param = value
    return shape_inference.infer_shapes(model)


def finish(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """``model`` named ``name``, its shapes inferred strictly and checked in full (raises if it is invalid)."""
    model.graph.name = name
    del model.graph.value_info[:]
    model = shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model, full_check=True)
    return model


def extract(extractor: onnx.utils.Extractor, inputs: list[str], outputs: list[str], dims: Dims,
            name: str) -> onnx.ModelProto:
    """The stage from tensors ``inputs`` to ``outputs`` of ``extractor``'s model (which must have the image's
    height and width symbolic for ``ROWS`` and ``TENSOR_ROWS``, and static for ``STATIC``), its dimensions set
    as ``dims`` says, named ``name`` and checked."""
    model = extractor.extract_model(list(inputs), list(outputs))
    if dims == Dims.ROWS:
        for vi, params in ((model.graph.input[0], ("height", "width")),
                           (model.graph.output[0], ("out_height", "out_width"))):
            for d, param in zip(vi.type.tensor_type.shape.dim[2:], params, strict=False):
                d.Clear()
                d.dim_param = param
    elif dims == Dims.TENSOR_ROWS:
        for vi in [*model.graph.input, *model.graph.output]:
            for d, axis in zip(vi.type.tensor_type.shape.dim[2:], ("rows", "cols"), strict=False):
                d.Clear()
                d.dim_param = f"{vi.name}_{axis}"
    return finish(model, name)


def open_name(name: str, sides: Sides) -> str:
    """The graph name of segment ``name`` on open ``sides``."""
    return name if sides == CLOSED else f"{name}-open{sides_bits(sides)}"


def open_segment(model: onnx.ModelProto, sides: Sides, name: str | None = None) -> onnx.ModelProto:
    """The segment ``model`` on windows with open ``sides`` (deepco.partition.open_rows), named ``name``
    (default `open_name`) and checked; ``model`` itself where both sides are closed."""
    if sides == CLOSED:
        return model
    return finish(open_model(model, sides), name or open_name(model.graph.name, sides))


class WholeModel:
    """A whole model (one image input, of static height and width) from which stage models are derived; its
    two prepared copies (image size symbolic, and static) are made once, on first use, so that deriving a
    stage costs the stage's own extraction and check only."""

    def __init__(self, model: onnx.ModelProto):
        inputs = [vi for vi in model.graph.input if vi.name not in {t.name for t in model.graph.initializer}]
        if len(inputs) != 1:
            raise PartitionError(f"a whole model to derive stages from has one input (the image), this one has "
                                 f"{len(inputs)}")
        dims = inputs[0].type.tensor_type.shape.dim
        if len(dims) != 4 or not all(d.HasField("dim_value") and d.dim_value > 0 for d in dims[2:]):
            raise PartitionError("a whole model to derive stages from has a 4-d image input of fixed height and "
                                 "width")
        self.model, self.image = model, inputs[0].name
        self.height, self.width = dims[2].dim_value, dims[3].dim_value
        self.tensors = {self.image} | {o for node in model.graph.node for o in node.output if o}
        self.outputs = [o.name for o in model.graph.output]
        self._extractors: dict[bool, onnx.utils.Extractor] = {}

    def _extractor(self, static: bool) -> onnx.utils.Extractor:
        if static not in self._extractors:
            hw = (self.height, self.width) if static else ("height", "width")
            self._extractors[static] = onnx.utils.Extractor(with_input_dims(self.model, self.image, hw))
        return self._extractors[static]

    def stage(self, inputs: list[str], outputs: list[str], dims: Dims | int, name: str,
              open_rows: int = 0) -> onnx.ModelProto:
        """The stage from ``inputs`` to ``outputs`` (tensor names of the whole model), as the device's
        partitioner extracts it, and for a segment (``ROWS``) on windows whose sides ``open_rows`` are open
        (deepco.partition.open_rows), as the device opens it; PartitionError names what is wrong with a
        description."""
        problem = self.problem(inputs, outputs, dims, name, open_rows)
        if problem:
            raise PartitionError(problem)
        dims = Dims(dims)
        if dims == Dims.WHOLE:
            return self.model
        try:
            stage = extract(self._extractor(dims == Dims.STATIC), inputs, outputs, dims, name)
            if not open_rows:
                return stage
            return open_segment(stage, sides_of_bits(open_rows), name)
        except PartitionError:
            raise
        except Exception as exc:  # onnx's checker and shape inference raise their own types, all about the stage
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise PartitionError(f"stage {name!r} from {inputs[:4]} to {outputs[:4]} is not a valid model of its "
                                 f"own: {first[:300]}") from None

    def problem(self, inputs: list[str], outputs: list[str], dims: int, name: str, open_rows: int = 0) -> str | None:
        """Why the description cannot name a stage of this model (any bytes may arrive), or None."""
        if dims not in {d.value for d in Dims}:
            return f"unknown dims {dims} (expected one of {', '.join(f'{d.value} ({d.name})' for d in Dims)})"
        if not 0 <= open_rows <= 3 or (open_rows and dims != Dims.ROWS):
            return (f"open_rows is 0 to 3 (1: the top is open, 2: the bottom), and only for a stage on rows (ROWS); "
                    f"got {open_rows} with dims {dims}")
        if not inputs or not outputs or len(inputs) > MAX_TENSORS or len(outputs) > MAX_TENSORS:
            return f"a stage has 1 to {MAX_TENSORS} inputs and outputs, this one {len(inputs)} and {len(outputs)}"
        if dims == Dims.WHOLE and (list(inputs) != [self.image] or list(outputs) != self.outputs):
            return "the whole model (WHOLE) reads the image and computes every output of the model"
        if dims == Dims.ROWS and (len(inputs) != 1 or len(outputs) != 1):
            return "a stage on rows (ROWS) has exactly one input and one output"
        if not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
            return f"a stage's name is 1 to {MAX_NAME_CHARS} printable characters, got {name[:40]!r}"
        unknown = [t for t in [*inputs, *outputs] if t not in self.tensors]
        if unknown:
            return f"the whole model has no tensor {unknown[0][:80]!r}"
        if len(set(inputs)) != len(inputs) or len(set(outputs)) != len(outputs):
            return "a stage's inputs, and its outputs, are distinct tensors"
        return None
