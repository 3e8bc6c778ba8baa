"""A size the model cannot run at is refused in one line that names the sizes it does run at, truthfully
(issue 29, item 4): the constraint is the step at which consecutive sizes run, per axis, and the nearest
sizes below and above are ones that run. Models built with onnx.helper; shape inference only (milliseconds).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from deepco.partition import SizeError, check_size
from deepco.partition.shapes import size_problem


def _pooled_and_joined(kernel: tuple[int, int], times: int = 1) -> onnx.ModelProto:
    """``times`` max-pools of ``kernel`` (stride = kernel), upsampled back by the product and added to the
    image: it runs where both sides agree, at multiples of kernel**times per axis."""
    nodes, last = [], "x"
    for i in range(times):
        nodes.append(helper.make_node("MaxPool", [last], [f"p{i}"], kernel_shape=list(kernel), strides=list(kernel)))
        last = f"p{i}"
    scales = numpy_helper.from_array(np.array([1, 1, kernel[0] ** times, kernel[1] ** times], np.float32), "scales")
    nodes += [helper.make_node("Resize", [last, "", "scales"], ["u"], mode="nearest"),
              helper.make_node("Add", ["u", "x"], ["y"], name="join")]
    x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2, "h", "w"]) for n in ("x", "y"))
    graph = helper.make_graph(nodes, "pooled", [x], [y], [scales])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


STRIDE_32 = _pooled_and_joined((2, 2), times=5)


@pytest.mark.parametrize(("size", "said"), [
    ((720, 1280), "multiples of 32: nearest 704x1280 below, 736x1280 above"),
    # before: "multiples of 16: nearest none below, 736x1280 above" (1264 columns at the step of 16 fail)
    ((736, 1270), "multiples of 32: nearest 736x1248 below, 736x1280 above"),
    # before: "multiples of 2" (32x32 runs, but 34x34 does not)
    ((31, 31), "multiples of 32: nearest none below, 32x32 above"),
])
def test_a_stride_32_model_is_said_to_run_at_multiples_of_32(size, said):
    with pytest.raises(SizeError) as info:
        check_size(STRIDE_32, *size, "stride32.onnx")
    line = str(info.value)
    assert "\n" not in line, line
    assert line.startswith(f"stride32.onnx does not run at {size[0]}x{size[1]}: node 'join' (Add): "), line
    assert line.endswith(f"it runs at {said}"), line
    for shown in said.split("nearest ")[1].replace(" below", "").replace(" above", "").split(", "):
        if shown != "none":  # every size named runs
            assert size_problem(STRIDE_32, *map(int, shown.split("x"))) is None, shown


def test_each_axis_gets_its_own_step():
    model = _pooled_and_joined((4, 2))
    with pytest.raises(SizeError) as info:
        check_size(model, 30, 31)
    assert str(info.value).endswith("it runs at heights that are multiples of 4 and widths that are multiples of 2: "
                                    "nearest 28x30 below, 32x32 above"), info.value
    for h, w in ((28, 30), (32, 32)):
        assert size_problem(model, h, w) is None


def test_a_model_with_weights_passes_at_a_size_it_runs_at_and_is_refused_at_one_it_does_not():
    big = numpy_helper.from_array(np.ones((64, 2, 3, 3), np.float32), "w")  # a weight: checked by its shape
    model = _pooled_and_joined((2, 2), times=2)
    model.graph.initializer.append(big)
    model.graph.node.append(helper.make_node("Conv", ["y", "w"], ["z"], pads=[1, 1, 1, 1]))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 64, "h", "w"]))
    check_size(model, 64, 96)
    with pytest.raises(SizeError, match="multiples of 4: nearest 60x96 below, 64x96 above"):
        check_size(model, 62, 96)
