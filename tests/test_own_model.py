"""Your own model, your own preprocessing: a torchvision-style CNN that is not in the zoo, built and exported
here with torch (nothing downloaded), taking 1-channel input with non-ImageNet normalisation, runs exact end
to end through `deepco run` on real `deepco serve` processes. The reference preprocessing is written out here
(OpenCV grey, area resize, (p / 255 - mean) / std), not taken from the code under test."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import onnxruntime as ort
import pytest
import torch
from deepco_device.sources import make_pan_zoom_clip
from test_server_support import ROOT, serve_process
from torch import nn

FRAMES = 3
H, W = 96, 128
MEAN, STD = 0.2, 0.35  # not ImageNet's
PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"


def deepco(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepco", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


class Block(nn.Module):
    """torchvision's BasicBlock: conv-bn-relu-conv-bn plus the (downsampled) identity."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + identity)


class GreyNet(nn.Module):
    """A small ResNet-like classifier of grey images (10 classes)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 5, 2, 2, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.layer1 = Block(16, 16, 1)
        self.layer2 = Block(16, 32, 2)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("own-model")


@pytest.fixture(scope="module")
def model(workdir) -> Path:
    """GreyNet with random weights and non-trivial BatchNorm statistics, exported as a user would."""
    torch.manual_seed(0)
    net = GreyNet()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    net.eval()
    path = workdir / "greynet.onnx"
    torch.onnx.export(net, (torch.zeros(1, 1, H, W),), str(path), dynamo=False, opset_version=17,
                      input_names=["image"], output_names=["scores"])
    (workdir / "greynet.toml").write_text(
        f'[input]\nchannels = 1\nmean = [{MEAN}]\nstd = [{STD}]\nresize = "stretch"\n')
    return path


@pytest.fixture(scope="module")
def servers():
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(serve_process("--threads", "1")) for _ in range(2)]


@pytest.fixture(scope="module")
def cluster(workdir, servers) -> Path:
    path = workdir / "cluster.toml"  # addresses only: run measures the rest
    path.write_text("".join(f'[[servers]]\nname = "s{i}"\naddress = "{s.address}"\n' for i, s in enumerate(servers)))
    return path


@pytest.fixture(scope="module")
def clip(workdir) -> Path:
    return make_pan_zoom_clip(PHOTO, workdir / "clip.avi", frames=FRAMES)


def reference_inputs(clip: Path) -> np.ndarray:
    """The model's float input for each frame of the clip: grey, stretched, (p / 255 - MEAN) / STD."""
    capture = cv2.VideoCapture(str(clip))
    frames = []
    while len(frames) < FRAMES:
        ok, frame = capture.read()
        assert ok
        grey = cv2.resize(cv2.cvtColor(frame, cv2.COLOR_BGR2GRAY), (W, H), interpolation=cv2.INTER_AREA)
        frames.append(((grey.astype(np.float32) / 255 - MEAN) / STD)[None, None])
    capture.release()
    return np.concatenate(frames)


def whole_model(path: Path, inputs: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, {"image": x[None]})[0] for x in inputs])


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("algorithm", ["thread", "auto"])
def test_own_grey_model_with_its_card_runs_exact(workdir, model, cluster, clip, algorithm):
    saved, log, raw = workdir / f"{algorithm}.npz", workdir / f"{algorithm}.jsonl", workdir / f"raw-{algorithm}"
    output = ["--output", "raw", "--output-dir", str(raw)] if algorithm == "thread" else []
    result = deepco("run", "--cluster", str(cluster), "--model", str(model), "--input-size", f"{H}x{W}",
                    "--source", str(clip), "--frames", str(FRAMES), "--algorithm", algorithm,
                    "--save-outputs", str(saved), "--json-log", str(log), *output)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "preprocessing: 1-channel grey" in result.stdout and "greynet.toml" in result.stdout
    data = np.load(saved)
    want_inputs = reference_inputs(clip)
    assert data["inputs"].shape == (FRAMES, 1, H, W)
    np.testing.assert_allclose(data["inputs"], want_inputs, rtol=0, atol=1e-5)
    want = whole_model(model, want_inputs)
    assert_close(data["outputs"], want)
    frame_lines = [line for line in result.stdout.splitlines() if line.startswith("frame ")]
    assert len(frame_lines) == FRAMES and not any("class " in line for line in frame_lines)
    records = [r for line in log.read_text().splitlines() if "frame" in (r := json.loads(line))]  # no events
    assert [r["error"] for r in records] == [None] * FRAMES
    if algorithm == "thread":  # really partitioned: servers computed slices; raw tensors saved per frame
        assert all(r["servers"] for r in records)
        for k in range(FRAMES):
            assert_close(np.load(raw / f"frame-{k:06d}.npy")[0], want[k])
            assert str(raw / f"frame-{k:06d}.npy") in frame_lines[k]
    else:
        assert all("output 1x10 float32" in line for line in frame_lines)


def test_flags_instead_of_a_card_and_a_clear_error_without_them(workdir, model, cluster, clip):
    bare = workdir / "bare" / "greynet.onnx"  # the same model without its card
    bare.parent.mkdir()
    shutil.copy(model, bare)
    common = ["run", "--cluster", str(cluster), "--model", str(bare), "--input-size", f"{H}x{W}",
              "--source", str(clip), "--frames", str(FRAMES)]
    result = deepco(*common)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "takes 1 channel(s)" in lines[0] and "--channels 1" in lines[0], result.stderr

    result = deepco(*common, "--channels", "1")
    assert result.returncode == 2 and "needs its own mean and std" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1

    saved = workdir / "flags.npz"
    result = deepco(*common, "--channels", "1", "--mean", str(MEAN), "--std", str(STD), "--resize", "stretch",
                    "--algorithm", "offload", "--save-outputs", str(saved), "--quiet")
    assert result.returncode == 0, result.stderr + result.stdout
    assert_close(np.load(saved)["outputs"], whole_model(model, reference_inputs(clip)))


def test_bad_model_cards_fail_in_one_line(workdir, model, cluster, clip):
    for text, message in [('[input]\nchannels = 2\n', "channels must be 1 or 3"),
                          ('[input]\nchannels = 1\nmean = [0.1, 0.2]\nstd = [0.3]\n', "mean has 2 values"),
                          ('[input]\nresize = "squash"\n', "resize must be crop or stretch"),
                          ('[input]\nmeans = [0.1]\n', "unknown key(s) input.means"),
                          ('[input\n', "is not valid TOML")]:
        card = workdir / "bad.toml"
        card.write_text(text)
        result = deepco("run", "--cluster", str(cluster), "--model", str(model), "--model-card", str(card),
                        "--input-size", f"{H}x{W}", "--source", str(clip), "--frames", "1")
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and message in lines[0], (text, result.stderr)


def test_zoo_labels_say_random_weights_and_a_state_dict_gives_real_ones(workdir, cluster):
    from deepco.zoo import build

    image = workdir / "photo.png"
    cv2.imwrite(str(image), cv2.imread(str(PHOTO)))
    common = ["run", "--cluster", str(cluster), "--model", "resnet18", "--input-size", "64x64",
              "--source", str(image), "--frames", "1", "--algorithm", "local"]
    result = deepco(*common)
    assert result.returncode == 0, result.stderr
    assert "seeded random weights" in result.stdout
    assert "random weights:" in next(line for line in result.stdout.splitlines() if line.startswith("frame 0:"))

    net = build("resnet18", seed=7)  # any state dict with torchvision's names: here, other weights than the zoo's
    weights = workdir / "resnet18.pt"
    torch.save(net.state_dict(), weights)
    saved = workdir / "weights.npz"
    result = deepco(*common, "--weights", str(weights), "--save-outputs", str(saved))
    assert result.returncode == 0, result.stderr
    assert "random weights" not in result.stdout
    data = np.load(saved)
    with torch.no_grad():
        want = net(torch.from_numpy(data["inputs"])).numpy()
    assert_close(data["outputs"], want)
