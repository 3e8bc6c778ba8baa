"""`deepco export` refuses a size a fixed-size model does not have, and says what it wrote."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from deepco.cli import main


def _fixed_model(path, height: int, width: int) -> None:
    x = helper.make_tensor_value_info("pixels", TensorProto.FLOAT, [1, 3, height, width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, height, width])
    w = helper.make_tensor("w", TensorProto.FLOAT, [2, 3, 3, 3], [0.01] * 54)
    conv = helper.make_node("Conv", ["pixels", "w"], ["y"], pads=[1, 1, 1, 1])
    model = helper.make_model(helper.make_graph([conv], "fixed", [x], [y], [w]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_a_fixed_size_model_is_refused_at_another_size_naming_its_input_and_the_flag(tmp_path, capsys) -> None:
    model = tmp_path / "fixed.onnx"
    _fixed_model(model, 128, 160)
    out = tmp_path / "out.onnx"
    assert main(["export", "--model", str(model), "--input-size", "64x64", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "'pixels' is fixed at 128x160, not 64x64" in err and "--input-size 128x160" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    assert main(["export", "--model", str(model), "--input-size", "128x160", "--output", str(out)]) == 0
    said = capsys.readouterr().out
    assert "runs at 128x160, fixed height and width" in said and out.exists()
