"""The request bound's new terms (no strings, convolution workspaces) still admit real models under default
flags: the zoo's ResNets and EfficientNet-Lite0, and a U-Net with ConvTranspose (k2 s2) and Resize, load and
pass the bound at 736x1280 (a camera frame); one small frame runs."""

from __future__ import annotations

import numpy as np
import pytest
from deepco_server.model_checks import DEFAULT_MAX_REQUEST_BYTES, SizeBound, workspace_bytes
from deepco_server.models import Registry, choose_runtime
from onnx import TensorProto, helper, numpy_helper

import deepco.zoo
from deepco.partition.partitioner import Partitioner

FRAME = (1, 3, 736, 1280)


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry(choose_runtime("cpu", 1), max_models=8)


def unet(channels: tuple[int, int, int] = (32, 64, 128), seed: int = 0) -> bytes:
    """A three-level U-Net: 3x3 convs, max-pooling down, a ConvTranspose (k2 s2) and a Resize (x2, nearest)
    up, skip connections by Concat."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def conv(x: str, cin: int, cout: int, name: str, k: int = 3) -> str:
        w = numpy_helper.from_array((rng.standard_normal((cout, cin, k, k)) * 0.1).astype(np.float32), f"{name}_w")
        inits.append(w)
        nodes.append(helper.make_node("Conv", [x, w.name], [f"{name}_c"], kernel_shape=[k, k], pads=[k // 2] * 4))
        nodes.append(helper.make_node("Relu", [f"{name}_c"], [name]))
        return name

    a, b, c = channels
    e1 = conv("input", 3, a, "e1")
    nodes.append(helper.make_node("MaxPool", [e1], ["p1"], kernel_shape=[2, 2], strides=[2, 2]))
    e2 = conv("p1", a, b, "e2")
    nodes.append(helper.make_node("MaxPool", [e2], ["p2"], kernel_shape=[2, 2], strides=[2, 2]))
    mid = conv("p2", b, c, "mid")
    up_w = numpy_helper.from_array((rng.standard_normal((c, b, 2, 2)) * 0.1).astype(np.float32), "up_w")
    inits.append(up_w)
    nodes.append(helper.make_node("ConvTranspose", [mid, "up_w"], ["u2"], kernel_shape=[2, 2], strides=[2, 2]))
    nodes.append(helper.make_node("Concat", ["u2", e2], ["cat2"], axis=1))
    d2 = conv("cat2", 2 * b, b, "d2")
    inits.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"))
    nodes.append(helper.make_node("Resize", [d2, "", "scales"], ["u1"], mode="nearest"))
    nodes.append(helper.make_node("Concat", ["u1", e1], ["cat1"], axis=1))
    d1 = conv("cat1", b + a, a, "d1")
    conv(d1, a, 2, "output", k=1)
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, "H", "W"])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 2, "H", "W"])
    model = helper.make_model(helper.make_graph(nodes, "unet", [x], [y], initializer=inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def test_a_unet_with_conv_transpose_and_resize_is_admitted_at_a_camera_frame(registry: Registry) -> None:
    model = registry.load("unet", "1", unet())
    need = model.bound.check({"input": FRAME})
    # The workspaces counted: e1's 3x3 im2col over the full frame (3 x 9 x 736 x 1280 floats) at least.
    assert 3 * 9 * 736 * 1280 * 4 < need < DEFAULT_MAX_REQUEST_BYTES, need
    out = model.run({"input": np.ones((1, 3, 64, 96), np.float32)}, ["output"])["output"]
    assert out.shape == (1, 2, 64, 96)


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "resnet152", "efficientnet-lite0"])
def test_zoo_models_are_admitted_at_a_camera_frame(registry: Registry, name: str) -> None:
    # What a device uploads for an offload: the whole model at the frame's size, its shape-only subgraphs
    # folded (EfficientNet's exported pads are computed from the input's shape).
    proto = Partitioner(deepco.zoo.export(name, FRAME[2], FRAME[3]), FRAME[2], FRAME[3]).whole()
    model = registry.load(name, "1", proto.SerializeToString())
    try:
        need = model.bound.check({"input": FRAME})
        assert need < DEFAULT_MAX_REQUEST_BYTES, need
    finally:
        registry.unload(name, force=True)


def test_workspace_formula() -> None:
    """ConvTranspose: C_out/group x prod(k) x input pixels; Conv: C_in/group x prod(k) x output pixels; none
    for a plain 1x1 Conv."""
    dims = {"x": (1, 8, 10, 20), "w": (8, 4, 3, 3), "y": (1, 4, 12, 22), "w1": (4, 8, 1, 1), "y1": (1, 4, 10, 20)}
    transpose = helper.make_node("ConvTranspose", ["x", "w"], ["y"])
    assert workspace_bytes(transpose, dims) == 4 * 9 * 10 * 20 * 4
    conv = helper.make_node("Conv", ["x", "w"], ["y"], group=2)
    dims["w"] = (8, 4, 3, 3)
    assert workspace_bytes(conv, dims) == 4 * 9 * 12 * 22 * 4
    assert workspace_bytes(helper.make_node("Conv", ["x", "w1"], ["y1"]), dims) == 0
    assert workspace_bytes(helper.make_node("Relu", ["x"], ["y"]), dims) == 0
    assert SizeBound  # the bound adds a node's workspace to the tensors alive while it runs
