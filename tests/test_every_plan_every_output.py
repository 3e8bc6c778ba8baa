"""Every plan kind, forced with `deepco run --plan`, delivers every output of a two-output model exactly, and
`plan`/`run` refuse a size the model cannot run at in one line (issue 29, items 2 and 4), on real in-process
servers on loopback.

The model is a tiny detector: a stem, a stride-4 branch with its own head ("boxes/p4") and a stride-2 head
fed by the stem plus the upsampled branch ("scores"): two outputs at two resolutions. Each plan is made by
the staged planner, saved as `deepco plan --save` saves it and run as a user runs it; every output of every
frame (``--save-outputs``) is judged on its own scale against ONNX Runtime on the whole model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import plan_support
import pytest
import torch
from deepco_device.answers import relative_error
from torch import nn
from torch.nn import functional as F  # noqa: N812 - torch's own spelling

from deepco.cli import main
from deepco.planning.staged import in_parts, scales_plan, split_plan

H, W = 32, 48  # multiples of the model's stride 4
PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"
OUTPUTS = ["boxes/p4", "scores"]


class TwoScales(nn.Module):
    """Two outputs at strides 4 and 2: a box head on the deep branch, a score head on the stem plus the
    deep branch upsampled (a one-level FPN)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.down2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.down4 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.box = nn.Conv2d(8, 4, 1)
        self.cls = nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x):
        s2 = torch.relu(self.down2(torch.relu(self.stem(x))))
        s4 = torch.relu(self.down4(s2))
        return self.box(s4), torch.sigmoid(self.cls(s2 + F.interpolate(s4, scale_factor=2.0, mode="nearest")))


class Stride32(nn.Module):
    """Five stride-2 convolutions, upsampled x32 and joined to the image: it runs at multiples of 32 only."""

    def __init__(self):
        super().__init__()
        self.downs = nn.ModuleList(nn.Conv2d(3 if i == 0 else 4, 4, 3, stride=2, padding=1) for i in range(5))
        self.out = nn.Conv2d(7, 2, 1)

    def forward(self, x):
        y = x
        for down in self.downs:
            y = torch.relu(down(y))
        return self.out(torch.cat([F.interpolate(y, scale_factor=32.0, mode="nearest"), x], 1))


def export(module: nn.Module, path: Path, outputs: list[str]) -> str:
    """``module`` (seeded weights) as ONNX with dynamic height and width."""
    torch.manual_seed(0)
    for p in module.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    axes = {name: {2: "height", 3: "width"} for name in ["image", *outputs]}
    torch.onnx.export(module.eval(), (torch.zeros(1, 3, 64, 64),), str(path), dynamo=False, opset_version=17,
                      input_names=["image"], output_names=outputs, dynamic_axes=axes)
    return str(path)


@pytest.fixture(scope="module")
def servers(two_servers):
    return two_servers


@pytest.fixture(scope="module")
def cluster(servers, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cluster") / "cluster.toml"
    path.write_text("".join(f'[[servers]]\nname = "s{i}"\naddress = "{s.address}"\n' for i, s in enumerate(servers)))
    return path


@pytest.fixture(scope="module")
def two_outputs(tmp_path_factory) -> str:
    return export(TwoScales(), tmp_path_factory.mktemp("model") / "two-scales.onnx", OUTPUTS)


@pytest.fixture(scope="module")
def saved_plans(servers, cluster, two_outputs, tmp_path_factory) -> dict[str, Path]:
    """Every plan kind for the two-output model, made by the staged planner and saved for `run --plan`."""

    def make(planner, both: list[str]) -> dict:
        costs, rates = planner.costs, planner.rates()
        cuts = [c.name for c in costs.cuts]
        assert len(cuts) >= 2, cuts
        plans = {
            "local": planner.named("local"),
            "offload": planner.named("offload"),
            "round-robin": planner.named("round-robin"),
            "split, lookahead, tail on the device": split_plan(costs, rates, both, [cuts[-1]], True, None),
            "split, lookahead, tail on a server": split_plan(costs, rates, both, [cuts[-1]], True, "s1"),
            "split, no lookahead, tail on the device": split_plan(costs, rates, both, cuts, False, None),
            "split, no lookahead, tail on a server": split_plan(costs, rates, both, [cuts[0], cuts[-1]], False, "s0"),
            "split in parts (overlap)": in_parts(split_plan(costs, rates, both, [cuts[0], cuts[-1]], True, None),
                                                 costs),
            "one stage across scales": scales_plan(costs, rates, both),
        }
        assert plans["split in parts (overlap)"].overlap, "no stage overlaps its halo: the kind is not exercised"
        return plans

    return plan_support.saved_plans(servers, two_outputs, H, W, tmp_path_factory.mktemp("plans"), make)


def whole_model(path: str, inputs: np.ndarray) -> dict[str, np.ndarray]:
    """ONNX Runtime on the unpartitioned model, one frame: every output by name."""
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {"image": inputs}), strict=True))


@pytest.mark.parametrize("what", ["local", "offload", "round-robin", "split, lookahead, tail on the device",
                                  "split, lookahead, tail on a server", "split, no lookahead, tail on the device",
                                  "split, no lookahead, tail on a server", "split in parts (overlap)",
                                  "one stage across scales"])
def test_a_saved_plan_of_every_kind_delivers_every_output_exactly(cluster, two_outputs, saved_plans, what,
                                                                  tmp_path, capsys):
    saved = tmp_path / "out.npz"
    code = main(["run", "--cluster", str(cluster), "--model", two_outputs, "--input-size", f"{H}x{W}",
                 "--source", str(PHOTO), "--frames", "2", "--plan", str(saved_plans[what]), "--quiet",
                 "--save-outputs", str(saved)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "0 failed" in out, out
    data = np.load(saved)
    assert sorted(data.files) == sorted(["inputs", *(f"outputs/{n}" for n in OUTPUTS)])
    inputs = data["inputs"].astype(np.float32)
    assert len(inputs) == 2
    for i in range(len(inputs)):
        want = whole_model(two_outputs, inputs[i:i + 1])
        assert list(want) == OUTPUTS
        for name, ref in want.items():  # each output on its own scale
            error = relative_error({name: data[f"outputs/{name}"][i:i + 1]}, {name: ref})
            assert error <= 1e-4, f"{what}: frame {i}, output {name!r}: relative error {error:.2e}"


def test_a_one_output_model_keeps_one_raw_file_per_frame(cluster, tmp_path, capsys):
    model = export(Stride32(), tmp_path / "stride32.onnx", ["mask"])
    raw = tmp_path / "raw"
    code = main(["run", "--cluster", str(cluster), "--model", model, "--input-size", "64x96", "--source", str(PHOTO),
                 "--frames", "1", "--algorithm", "local", "--quiet", "--output", "raw", "--output-dir", str(raw)])
    assert code == 0, capsys.readouterr().err
    assert [p.name for p in raw.iterdir()] == ["frame-000000.npy"]
    assert np.load(raw / "frame-000000.npy").shape == (1, 2, 64, 96)


@pytest.mark.parametrize("command", ["plan", "run"])
def test_plan_and_run_refuse_a_size_the_model_cannot_run_at_naming_it(cluster, command, tmp_path, capsys):
    """A stride-32 model asked for 720x1280: one line naming the model, the clash and the nearest sizes it runs
    at, exit 2, before any server is asked to do anything."""
    model = export(Stride32(), tmp_path / "stride32.onnx", ["mask"])
    source = ["--source", str(PHOTO), "--frames", "1"] if command == "run" else []
    code = main([command, "--cluster", str(cluster), "--model", model, "--input-size", "720x1280", *source])
    out, err = capsys.readouterr()
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"{model} does not run at 720x1280" in lines[0], lines[0]
    assert "multiples of 32: nearest 704x1280 below, 736x1280 above" in lines[0], lines[0]
    onnx.checker.check_model(onnx.load(model))  # the model itself is fine: only the size is wrong


def test_the_scenario_bench_judges_every_output_of_every_saved_frame(two_outputs, tmp_path):
    """`deepco bench --scenario` reads the run's --save-outputs back (it read `outputs`, which a two-output
    model's file has not: a KeyError after the whole run); a failed frame is NaN, not exact."""
    from deepco_bench.scenarios import frame_errors
    from deepco_device.run_report import saved_outputs

    inputs = np.random.default_rng(4).standard_normal((3, 1, 3, H, W)).astype(np.float32)
    frames = [whole_model(two_outputs, x) for x in inputs]
    frames[1] = None  # failed
    saved = tmp_path / "scenario.npz"
    np.savez(saved, inputs=inputs[:, 0], **saved_outputs(frames))
    errors = frame_errors(saved, two_outputs, f"{H}x{W}")
    assert len(errors) == 3 and np.isnan(errors[1]) and max(errors[0], errors[2]) <= 1e-6, errors
    bad = saved_outputs([whole_model(two_outputs, x) for x in inputs])
    bad["outputs/scores"][2] += 0.01  # scores are in [0, 1]: a 1% error in the second output alone is seen
    np.savez(saved, inputs=inputs[:, 0], **bad)
    assert frame_errors(saved, two_outputs, f"{H}x{W}")[2] >= 0.005
