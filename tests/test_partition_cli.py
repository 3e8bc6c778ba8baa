"""`deepco export` and `deepco partition`: saved head/tail/slices.json reproduce the exported model; bad input
gets one clear line and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from test_partition_ops import se_net

from deepco.cli import main

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "paper-example1.toml"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "resnet18-97x131.onnx"
    assert main(["export", "--model", "resnet18", "--input-size", "97x131", "--output", str(path)]) == 0
    return path


def _replay(save_dir, image: np.ndarray, partition_ort) -> np.ndarray:
    """Run the saved head per slice exactly as slices.json says, stitch, run the saved tail."""
    doc = json.loads((save_dir / "slices.json").read_text())
    head, tail = onnx.load(str(save_dir / "head.onnx")), onnx.load(str(save_dir / "tail.onnx"))
    pieces = []
    for s in doc["slices"]:
        (ia, ib), (c0, c1) = s["input_rows"], s["crop"]
        (y,) = partition_ort(head, {head.graph.input[0].name: image[:, :, ia:ib]})
        pieces.append(y[:, :, c0:c1])
        assert c1 - c0 == s["output_rows"][1] - s["output_rows"][0]
    stitched = np.concatenate(pieces, axis=2)
    assert stitched.shape[2] == doc["head_output_rows"]
    return partition_ort(tail, {tail.graph.input[0].name: stitched})[0]


@pytest.mark.parametrize("rows_args", [("--slices", "5"), ("--rows", "0,1,7,13")])
def test_saved_partition_equals_exported_model(capsys, tmp_path, exported, partition_ort, rows_args):
    from conftest import partition_rel_error

    save = tmp_path / "parts"
    code, out, err = _run(
        capsys,
        "partition",
        "--model",
        str(exported),
        "--input-size",
        "97x131",
        *rows_args,
        "--cut",
        "layer2",
        "--save",
        str(save),
        "--json",
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc == json.loads((save / "slices.json").read_text())
    assert doc["cut"] == "layer2" and doc["head_output_rows"] == 13
    image = np.random.default_rng(5).standard_normal((1, 3, 97, 131)).astype(np.float32)
    (want,) = partition_ort(onnx.load(str(exported)), {"input": image})
    assert partition_rel_error(_replay(save, image, partition_ort), want) <= 1e-4


def test_zoo_name_auto_cut_prints_why(capsys, tmp_path, partition_ort):
    code, out, err = _run(
        capsys,
        "partition",
        "--model",
        "efficientnet-lite0",
        "--input-size",
        "64x80",
        "--slices",
        "3",
        "--save",
        str(tmp_path),
    )
    assert code == 0, err
    assert "auto cut: deepest cut whose halo" in out and "GlobalAveragePool" in out
    doc = json.loads((tmp_path / "slices.json").read_text())
    assert len(doc["slices"]) == 3 and doc["auto_reason"]


def test_auto_cut_with_cluster(capsys):
    code, out, err = _run(
        capsys,
        "partition",
        "--model",
        "resnet18",
        "--input-size",
        "64x64",
        "--slices",
        "2",
        "--cluster",
        str(EXAMPLE),
        "--json",
    )
    assert code == 0, err
    assert "least predicted completion time" in json.loads(out)["auto_reason"]


def _error(capsys, *argv: str) -> str:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_clear_one_line_errors(capsys, tmp_path, exported):
    se = tmp_path / "se.onnx"
    onnx.save(se_net(), str(se))
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a model\n")
    base = ["partition", "--input-size", "64x64", "--slices", "2"]
    assert "past where the partitionable prefix stops: node 'se_pool' (GlobalAveragePool)" in _error(
        capsys, *base, "--model", str(se), "--cut", "relu_b"
    )
    assert "does not exist" in _error(capsys, *base, "--model", str(tmp_path / "missing.onnx"))
    assert "is not an ONNX model" in _error(capsys, *base, "--model", str(text))
    assert "unknown model 'resnet19'" in _error(capsys, *base, "--model", "resnet19")
    assert "--input-size must be HxW" in _error(
        capsys, "partition", "--model", "resnet18", "--input-size", "224", "--slices", "2"
    )
    assert "unknown cut 'layer9'" in _error(capsys, *base, "--model", str(exported), "--cut", "layer9")
    assert "cannot cut the 2 rows of 'layer4' into 3 slices" in _error(
        capsys,
        "partition",
        "--input-size",
        "64x64",
        "--slices",
        "3",
        "--model",
        str(exported),
        "--cut",
        "layer4",
    )
    assert "must start at 0 and end at 8" in _error(
        capsys,
        "partition",
        "--input-size",
        "64x64",
        "--model",
        str(exported),
        "--cut",
        "layer2",
        "--rows",
        "0,4",
    )
    assert "comma-separated integers" in _error(
        capsys,
        "partition",
        "--input-size",
        "64x64",
        "--model",
        str(exported),
        "--cut",
        "layer2",
        "--rows",
        "0,a,8",
    )
    # the SE model still partitions before its gate, and says where the prefix stops
    code, out, _ = _run(capsys, *base, "--model", str(se))
    assert code == 0 and "cut: relu_a" in out and "stops at node 'se_pool'" in out


def test_process_exit_status_and_message(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\x01garbage")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepco",
            "partition",
            "--model",
            str(bad),
            "--input-size",
            "32x32",
            "--slices",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("deepco partition: error: ") and len(proc.stderr.strip().splitlines()) == 1


def test_export_writes_a_checked_dynamic_model(exported, partition_ort):
    model = onnx.load(str(exported))
    onnx.checker.check_model(model, full_check=True)
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims[2:]] == ["height", "width"]
    (y,) = partition_ort(model, {"input": np.zeros((1, 3, 50, 70), np.float32)})
    assert y.shape == (1, 1000)
