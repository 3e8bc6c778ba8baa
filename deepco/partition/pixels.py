"""Camera pixels in, model out: the model's normalisation moved into its graph, so the device sends uint8.

A CNN trained on normalised float input x = (p * scale - mean_c) / std_c (p the 0..255 pixel of channel c)
gets a new input ``pixels`` (uint8, 1xCxHxW: grey, or 3 channels in the model's colour order) and three nodes
in front:
Cast to float, Mul by scale / std_c and Add -mean_c / std_c (per-channel constants). The first stage then
receives a quarter of the bytes a float32 tensor takes, and every later tensor is unchanged. The device
still resizes and reorders channels (one copy it makes anyway when it turns HWC into CHW).

Exactness: the fused affine (p * a_c + b_c) differs from the reference ((p * scale - mean) / std in
float32) by float rounding only (about 1e-7 relative), far inside the project's 1e-4.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from deepco.partition.graph import PartitionError

PIXELS = "pixels"


def with_pixel_input(model: onnx.ModelProto, mean: Sequence[float], std: Sequence[float],
                     scale: float = 1.0 / 255.0) -> onnx.ModelProto:
    """A copy of ``model`` whose one image input is replaced by uint8 ``pixels`` plus the normalisation."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = {t.name for t in g.initializer}
    inputs = [i for i in g.input if i.name not in inits]
    if len(inputs) != 1:
        raise PartitionError(f"the model must have exactly one image input, it has {len(inputs)}")
    old = inputs[0]
    if old.type.tensor_type.elem_type != TensorProto.FLOAT:
        raise PartitionError(f"input {old.name!r} is not float32: it cannot take normalised pixels")
    dims = old.type.tensor_type.shape.dim
    channels = dims[1].dim_value if len(dims) == 4 and dims[1].HasField("dim_value") else len(mean)
    if len(mean) != channels or len(std) != channels:
        raise PartitionError(f"normalisation has {len(mean)} means and {len(std)} stds for {channels} channels")
    a = (np.float32(scale) / np.asarray(std, np.float32)).reshape(1, channels, 1, 1).astype(np.float32)
    b = (-np.asarray(mean, np.float32) / np.asarray(std, np.float32)).reshape(1, channels, 1, 1).astype(np.float32)
    prefix = f"{PIXELS}_"
    g.initializer.extend([numpy_helper.from_array(a, prefix + "gain"), numpy_helper.from_array(b, prefix + "bias")])
    nodes = [helper.make_node("Cast", [PIXELS], [prefix + "float"], to=TensorProto.FLOAT, name=prefix + "cast"),
             helper.make_node("Mul", [prefix + "float", prefix + "gain"], [prefix + "scaled"], name=prefix + "mul"),
             helper.make_node("Add", [prefix + "scaled", prefix + "bias"], [old.name], name=prefix + "add")]
    new_input = helper.make_tensor_value_info(PIXELS, TensorProto.UINT8, None)
    new_input.type.tensor_type.shape.CopyFrom(old.type.tensor_type.shape)
    position = list(g.input).index(old)
    g.input.remove(old)
    g.input.insert(position, new_input)
    rest = list(g.node)
    del g.node[:]
    g.node.extend(nodes + rest)
    onnx.checker.check_model(out)
    return out
