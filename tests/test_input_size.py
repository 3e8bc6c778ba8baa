"""--input-size: a fixed-size model's own size is the default (run, plan, partition, export); a model of dynamic
size needs the flag, and says so; an error about the size names the model's own input and the flag that fixes it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from test_server_support import ROOT, child_env, serve_process

from deepco.cli import main

PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"
H, W = 48, 64


def _conv_model(path: Path, height: int | str, width: int | str) -> Path:
    """Two 3x3 convolutions and a global pool, input 'image' of 1x3xHxW (a dim_param where not fixed)."""
    x = helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, height, width])
    y = helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 4, 1, 1])
    rng = np.random.default_rng(0)
    w1 = helper.make_tensor("w1", TensorProto.FLOAT, [8, 3, 3, 3], rng.normal(0, 0.2, 216).tolist())
    w2 = helper.make_tensor("w2", TensorProto.FLOAT, [4, 8, 3, 3], rng.normal(0, 0.2, 288).tolist())
    nodes = [helper.make_node("Conv", ["image", "w1"], ["a"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["a"], ["b"], name="relu1"),
             helper.make_node("Conv", ["b", "w2"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv2"),
             helper.make_node("GlobalAveragePool", ["c"], ["scores"], name="pool")]
    model = helper.make_model(helper.make_graph(nodes, "small", [x], [y], [w1, w2]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def fixed(tmp_path_factory) -> Path:
    return _conv_model(tmp_path_factory.mktemp("fixed") / "fixed.onnx", H, W)


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory) -> Path:
    return _conv_model(tmp_path_factory.mktemp("dynamic") / "dynamic.onnx", "height", "width")


def _one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_partition_and_export_default_to_a_fixed_models_own_size(fixed, tmp_path, capsys):
    assert main(["partition", "--model", str(fixed), "--slices", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["input_size"] == [H, W]
    out = tmp_path / "out.onnx"
    assert main(["export", "--model", str(fixed), "--output", str(out)]) == 0
    assert f"runs at {H}x{W}, fixed height and width" in capsys.readouterr().out and out.exists()


@pytest.mark.parametrize("command", ["partition", "export"])
def test_a_dynamic_model_without_the_flag_is_one_line_naming_its_input_and_the_flag(dynamic, tmp_path, capsys,
                                                                                    command):
    extra = ["--slices", "2"] if command == "partition" else ["--output", str(tmp_path / "out.onnx")]
    assert main([command, "--model", str(dynamic), *extra]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "'image' has no fixed height and width" in err and "give --input-size HxW" in err


def test_a_zoo_model_without_the_flag_is_told_to_give_it(tmp_path, capsys):
    assert main(["export", "--model", "resnet18", "--output", str(tmp_path / "r.onnx")]) == 2
    assert _one_line(capsys.readouterr().err) == ("deepco export: error: resnet18 takes any input size: give "
                                                  "--input-size HxW, e.g. --input-size 224x224")


@pytest.mark.parametrize("command", [["run"], ["plan"], ["export"], ["partition"]])
def test_help_says_the_default_is_a_fixed_models_own_size(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    said = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps after a hyphen
    assert "default: a fixed-size model's own size" in said


def _deepco(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepco", *args], capture_output=True, text=True, cwd=ROOT,
                          env=child_env(), timeout=300)


def test_run_and_plan_take_a_fixed_models_own_size_and_name_its_input_at_another(fixed, tmp_path):
    with serve_process("--threads", "1") as server:
        cluster = tmp_path / "cluster.toml"
        cluster.write_text(f'[[servers]]\naddress = "{server.address}"\n')
        saved = tmp_path / "out.npz"
        ran = _deepco("run", "--cluster", str(cluster), "--model", str(fixed), "--source", str(PHOTO),
                      "--frames", "1", "--algorithm", "offload", "--save-outputs", str(saved), "--quiet")
        assert ran.returncode == 0, ran.stderr
        assert np.load(saved)["inputs"].shape == (1, 3, H, W)
        planned = _deepco("plan", "--cluster", str(cluster), "--model", str(fixed), "--algorithm", "offload",
                          "--json")
        assert planned.returncode == 0, planned.stderr
        assert json.loads(planned.stdout)["input_size"] == [H, W]
        # the user's input name, not the uint8 'pixels' input the device puts in front of it
        wrong = _deepco("run", "--cluster", str(cluster), "--model", str(fixed), "--source", str(PHOTO),
                        "--frames", "1", "--input-size", "32x32")
        assert wrong.returncode == 2
        err = _one_line(wrong.stderr)
        assert f"input 'image' is fixed at {H}x{W}, not 32x32: give --input-size {H}x{W}" in err, err
