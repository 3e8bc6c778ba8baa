"""A real third-party segmenter whose weights ship inside a PyPI wheel, partitioned on real servers (issue 29,
item 6): PaddleOCR's PP-OCRv6 small text detector (a DB text-probability map, exported from Paddle by
paddle2onnx) as the `rapidocr` wheel ships it (the `test` extra pins it; nothing is fetched at run time).

Its model card says what a user's would (PaddleOCR's preprocessing, a one-channel mask). Plans forced with
`deepco run --plan` (a split over both servers, lookahead, the tail on the device; a split in two stages
exchanging halo rows, the tail on a server)
give every output of every frame within 1e-4 of ONNX Runtime on the whole model, and the frame line is the
mask's share of text pixels. (The detector's prefix up to its first row-mixing ReduceMean is about 14% of
its FLOPs at this size: one stage across scales has nothing to add there, so it is not among the plans.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import plan_support
import pytest
from deepco_bench.third_party import wheel_file
from deepco_device.answers import relative_error

from deepco.cli import main
from deepco.planning.staged import split_plan

H, W = 96, 128  # the detector runs at multiples of 32
PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"
CARD = """[input]
order = "bgr"
mean = [0.5]
std = [0.5]
resize = "stretch"

[output]
kind = "mask"
class_names = ["background", "text"]
"""


def shipped(package: str, *parts: str) -> Path:
    """A file inside an installed wheel, found without importing the package."""
    path = wheel_file(package, *parts)
    if path is None:
        pytest.skip(f"{package} is not installed (pip install -e '.[test]')")
    return path


@pytest.fixture(scope="module")
def detector(tmp_path_factory) -> str:
    """The wheel's detector, copied beside its model card."""
    folder = tmp_path_factory.mktemp("ppocr")
    path = folder / "det.onnx"
    shutil.copyfile(shipped("rapidocr", "models", "PP-OCRv6_det_small.onnx"), path)
    (folder / "det.toml").write_text(CARD)
    return str(path)


@pytest.fixture(scope="module")
def plans(two_servers, detector, tmp_path_factory) -> dict[str, Path]:
    def make(planner, both: list[str]) -> dict:
        costs, rates = planner.costs, planner.rates()
        cuts = [c.name for c in costs.cuts]
        made = {"split": split_plan(costs, rates, both, [cuts[-1]], True, None),
                "halo exchange": split_plan(costs, rates, both, [cuts[0], cuts[-1]], False, "s0")}
        assert all(p is not None and len(p.servers) == 2 for p in made.values()), made
        return made

    return plan_support.saved_plans(two_servers, detector, H, W, tmp_path_factory.mktemp("plans"), make)


@pytest.mark.parametrize("what", ["split", "halo exchange"])
def test_the_paddle_text_detector_partitioned_equals_the_whole_model(two_servers_cluster, detector, plans, what,
                                                                     tmp_path, capsys):
    saved = tmp_path / "out.npz"
    code = main(["run", "--cluster", str(two_servers_cluster), "--model", detector, "--input-size", f"{H}x{W}",
                 "--source", str(PHOTO), "--frames", "2", "--plan", str(plans[what]), "--save-outputs", str(saved)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "0 failed" in out and "split" in out, out
    lines = [line for line in out.splitlines() if line.startswith("frame ")]
    assert len(lines) == 2 and all(f"mask {H}x{W}: " in line and "background" in line for line in lines), out
    data = np.load(saved)
    session = ort.InferenceSession(detector, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    inputs = data["inputs"].astype(np.float32)
    assert len(inputs) == 2
    for i in range(len(inputs)):
        want = dict(zip(names, session.run(None, {"x": inputs[i:i + 1]}), strict=True))
        got = {names[0]: data["outputs"][i:i + 1]}
        error = relative_error(got, want)
        assert error <= 1e-4, f"{what}: frame {i}: relative error {error:.2e}"
