"""Zoo models are exported once and read back from the model cache, without torch."""

from __future__ import annotations

import subprocess
import sys

import onnx
import pytest
from onnx import TensorProto, helper
from test_server_support import ROOT

from deepco.errors import UserError
from deepco.model_cache import cached_export, export_key
from deepco.partition.source import load_model

READ_BACK = ("import sys; from deepco.partition.source import load_model; m = load_model('resnet18', 48, 64); "
             "print('torch' in sys.modules, m.SerializeToString() == open(sys.argv[1], 'rb').read())")


def _stand_in() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    return helper.make_model(graph)


def test_a_zoo_model_is_exported_once_then_read_back_without_torch(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DEEPCO_MODEL_CACHE", str(tmp_path / "cache"))
    fresh = tmp_path / "fresh.onnx"
    fresh.write_bytes(load_model("resnet18", 48, 64).SerializeToString())  # exported (torch), then kept
    assert len(list((tmp_path / "cache").glob("resnet18-48x64-*.onnx"))) == 1
    again = subprocess.run([sys.executable, "-c", READ_BACK, str(fresh)], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split() == ["False", "True"]  # the same model, and torch was never imported


def test_a_damaged_file_is_made_again_and_the_cache_can_be_turned_off(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DEEPCO_MODEL_CACHE", str(tmp_path))
    made = []

    def export() -> onnx.ModelProto:
        made.append(1)
        return _stand_in()

    assert cached_export("resnet18", 8, 8, None, export) == cached_export("resnet18", 8, 8, None, export)
    assert len(made) == 1
    [kept] = tmp_path.glob("resnet18-8x8-*.onnx")
    kept.write_bytes(b"not onnx")
    assert cached_export("resnet18", 8, 8, None, export) == _stand_in() and len(made) == 2
    assert onnx.load(str(kept)) == _stand_in()
    assert export_key("resnet18", 8, 8, None) != export_key("resnet18", 8, 16, None)
    weights = tmp_path / "w.pt"
    weights.write_bytes(b"1")
    assert export_key("resnet18", 8, 8, weights) != export_key("resnet18", 8, 8, None)
    cached_export("../evil", 8, 8, None, export)  # never a path: not kept
    assert len(made) == 3 and sorted(p.name for p in tmp_path.iterdir()) == sorted([kept.name, "w.pt"])
    monkeypatch.setenv("DEEPCO_MODEL_CACHE", "")
    cached_export("resnet34", 8, 8, None, export)
    assert len(made) == 4 and not list(tmp_path.glob("resnet34-*"))


def test_an_unknown_name_is_one_line() -> None:
    with pytest.raises(UserError, match="unknown model 'no-such-model'"):
        load_model("no-such-model", 32, 32)
