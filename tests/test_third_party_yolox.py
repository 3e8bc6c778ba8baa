"""A real third-party detector from the PyTorch exporter whose weights ship inside a PyPI wheel (issue 29,
item 6): ddddocr's YOLOX detector (`common_det.onnx`, exported by PyTorch 1.9 at 416x416: a Focus layer of
strided Slices, a CSP backbone with SPP, a PAN neck with nearest upsampling and Concat, decoupled heads at
strides 8/16/32 flattened into one (1, N, 6) output). The `test` extra pins the wheel; nothing is fetched.

As it comes, the file is fixed at 416x416; the whole network but its final Reshape/Concat/Transpose runs on
row bands across scales. The suite runs it at its own size (the search's chain) and, as a user's dynamic
export of the same weights made with onnx's own `update_model_dims`, at 128x160 under every plan kind forced
with `deepco run --plan`: every output of every frame within 1e-4 of ONNX Runtime on the whole model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import plan_support
import pytest
from deepco_bench.third_party import dynamic_yolox
from deepco_device.answers import relative_error
from test_third_party_models import shipped

from deepco.cli import main
from deepco.partition import Partitioner
from deepco.planning.staged import StagedPlan, scales_chain, scales_plan, split_shares

H, W = 128, 160  # the detector runs at multiples of 32
PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"
CARD = """[input]
order = "bgr"
mean = [0.0]
std = [1.0]
scale = 1.0
resize = "stretch"
"""


def fixed_file() -> Path:
    return shipped("ddddocr", "common_det.onnx")


@pytest.fixture(scope="module")
def detector(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("yolox")
    path = folder / "det.onnx"
    onnx.save(dynamic_yolox(onnx.load(fixed_file())), path)
    (folder / "det.toml").write_text(CARD)
    return str(path)


def test_almost_all_of_its_flops_split_across_scales_at_its_own_size_and_at_736x1280(detector):
    """Before strided row Slices were banded, the prefix stopped at the Focus layer's first Slice (0%)."""
    fixed = onnx.load(fixed_file())
    for model, (height, width) in ((fixed, (416, 416)), (onnx.load(detector), (736, 1280))):
        part = Partitioner(model, height, width)
        assert part.stop is not None and part.stop.op_type == "Reshape", part.stop
        share = part.levels[-1].head_flops / part.total_flops
        assert share >= 0.85, f"{height}x{width}: {share:.1%}"
        assert set(part.levels[-1].strides) == {8, 16, 32}


@pytest.fixture(scope="module")
def plans(two_servers, detector, tmp_path_factory) -> dict[str, Path]:
    def make(planner, both: list[str]) -> dict[str, StagedPlan]:
        costs, rates = planner.costs, planner.rates()
        names = [lv.name for lv in costs.p.levels[1:]]
        chain = scales_chain(costs, rates, both, True)
        made = {
            "local": planner.named("local"),
            "offload": planner.named("offload"),
            "round-robin": planner.named("round-robin"),
            "split, lookahead, tail on the device": scales_plan(costs, rates, both, [1.0, 2.0], levels=chain),
            "split in stages, halo exchanges, tail on a server": scales_plan(
                costs, rates, both, [2.0, 1.0], levels=names[len(names) // 3::len(names) // 3], lookahead=False,
                tail="s0"),
        }
        split = [made["split, lookahead, tail on the device"],
                 made["split in stages, halo exchanges, tail on a server"]]
        assert [(p.lookahead, p.tail, len(p.servers)) for p in split] == [(True, None, 2), (False, "s0", 2)]
        assert len(split[1].levels) >= 3, split[1].describe()  # stages that exchange halos between them
        return made

    return plan_support.saved_plans(two_servers, detector, H, W, tmp_path_factory.mktemp("plans"), make)


@pytest.mark.parametrize("what", ["local", "offload", "split, lookahead, tail on the device",
                                  "split in stages, halo exchanges, tail on a server", "round-robin"])
def test_the_pytorch_yolox_detector_partitioned_equals_the_whole_model(two_servers_cluster, detector, plans, what,
                                                                       tmp_path, capsys):
    saved = tmp_path / "out.npz"
    code = main(["run", "--cluster", str(two_servers_cluster), "--model", detector, "--input-size", f"{H}x{W}",
                 "--source", str(PHOTO), "--frames", "2", "--plan", str(plans[what]),
                 "--save-outputs", str(saved), "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "0 failed" in out, out
    data = np.load(saved)
    session = ort.InferenceSession(detector, providers=["CPUExecutionProvider"])
    inputs = data["inputs"].astype(np.float32)
    assert len(inputs) == 2
    for i in range(len(inputs)):
        (want,) = session.run(None, {"images": inputs[i:i + 1]})
        assert want.shape == (1, (H // 8) * (W // 8) + (H // 16) * (W // 16) + (H // 32) * (W // 32), 6)
        error = relative_error({"output": data["outputs"][i:i + 1]}, {"output": want})
        assert error <= 1e-4, f"{what}: frame {i}: relative error {error:.2e}"


def test_at_its_own_size_the_chain_the_planner_picks_runs_exactly(two_servers, two_servers_cluster, tmp_path):
    """The file as the wheel ships it (416x416, no dynamic axes), on the planner's own chain of stages."""
    path = tmp_path / "det.onnx"
    shutil.copyfile(fixed_file(), path)
    (tmp_path / "det.toml").write_text(CARD)

    def make(planner, both):
        costs, rates = planner.costs, planner.rates()
        plan = scales_plan(costs, rates, both, levels=scales_chain(costs, rates, both, True))
        assert split_shares(plan, costs)["plan"] >= 0.85
        return {"chain": plan}

    saved = plan_support.saved_plans(two_servers, str(path), 416, 416, tmp_path, make)
    out_file = tmp_path / "out.npz"
    code = main(["run", "--cluster", str(two_servers_cluster), "--model", str(path), "--source", str(PHOTO),
                 "--frames", "1", "--plan", str(saved["chain"]), "--quiet", "--save-outputs", str(out_file)])
    assert code == 0
    data = np.load(out_file)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, {"images": data["inputs"].astype(np.float32)})
    assert relative_error({"output": data["outputs"]}, {"output": want}) <= 1e-4


def test_every_plan_kind_of_both_third_party_models_is_exact_with_deepco_run(tmp_path):
    """bench/exact_plans.py at a small size, as CI can afford: both real third-party models (Paddle, PyTorch)
    under every plan kind the planner makes for them, each saved and forced with `deepco run --plan` on three
    real `deepco serve` processes, every output within 1e-4 of the whole model; a kind it cannot make is
    reported with why and never counted as passed."""
    import json
    import subprocess
    import sys

    bench = Path(__file__).resolve().parents[1] / "bench"
    out = tmp_path / "exact.json"
    done = subprocess.run([sys.executable, "exact_plans.py", "--input-size", "128x160", "--models", "ppocr,yolox",
                           "--json", str(out)], cwd=bench, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    records = json.loads(out.read_text())["records"]
    ran = [r for r in records if "skipped" not in r]
    assert {r["model"] for r in ran} == {"ppocr", "yolox"}
    assert all(r["outputs"] and r["max_error"] <= 1e-4 for r in ran), ran
    kinds = {r["kind"] for r in ran if r["model"] == "yolox"}
    assert {"local", "offload", "round-robin", "split, lookahead, tail on the device",
            "split, no lookahead, tail on a server", "split in parts (overlap)",
            "stages across scales, halo exchanges, tail on a server"} <= kinds, kinds
    assert any(r["overlap"] for r in ran)
