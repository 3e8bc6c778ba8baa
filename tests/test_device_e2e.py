"""The engine end to end: real `deepco serve` processes on loopback, `deepco run` as a user runs it, and its
saved outputs checked against ONNX Runtime on the whole exported model."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from deepco_device.sources import make_pan_zoom_clip
from test_server_support import ROOT, serve_process

from deepco.wire.client import InferenceClient

FRAMES = 3
PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"


def deepco(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepco", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.fixture(scope="module")
def servers():
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(serve_process("--threads", "1")) for _ in range(3)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def clip(workdir) -> Path:
    return make_pan_zoom_clip(PHOTO, workdir / "clip.avi", frames=FRAMES)


@pytest.fixture(scope="module")
def exported(workdir):
    """Whole models exported once by `deepco export`: the reference, and the model `deepco run` gets."""
    cache: dict[tuple[str, str], Path] = {}

    def get(model: str, size: str) -> Path:
        if (model, size) not in cache:
            out = workdir / f"{model}-{size}.onnx"
            result = deepco("export", "--model", model, "--input-size", size, "--output", str(out))
            assert result.returncode == 0, result.stderr
            cache[(model, size)] = out
        return cache[(model, size)]

    return get


def cluster_file(path: Path, servers, count: int, antennas: int) -> Path:
    lines = ["[device]", f"antennas = {antennas}", "bandwidth = 100.0"]
    for i, s in enumerate(servers[:count]):
        lines += ["[[servers]]", f'name = "s{i}"', "capacity = 1.0", f'address = "{s.address}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def whole_model(onnx_path: Path, inputs: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: inputs[i:i + 1]})[0] for i in range(len(inputs))])


CASES = [  # model, input size, servers, antennas, algorithm
    ("resnet18", "128x160", 1, 1, "thread"),
    ("resnet18", "128x160", 2, 1, "equal"),
    ("resnet18", "97x131", 3, 2, "equal"),
    ("efficientnet-lite0", "224x224", 1, 2, "thread"),
    ("efficientnet-lite0", "224x224", 2, 2, "equal"),
    ("efficientnet-lite0", "224x224", 3, 1, "equal"),
]


@pytest.mark.parametrize(("model", "size", "count", "antennas", "algorithm"), CASES)
def test_run_on_a_video_equals_the_whole_model(servers, workdir, clip, exported, model, size, count, antennas,
                                               algorithm):
    onnx_path = exported(model, size)
    tag = f"{model}-{size}-{count}-{antennas}-{algorithm}"
    cluster = cluster_file(workdir / f"{tag}.toml", servers, count, antennas)
    saved, log = workdir / f"{tag}.npz", workdir / f"{tag}.jsonl"
    cut = [] if algorithm == "thread" else ["--cut", "layer2" if model == "resnet18" else "_blocks.5"]
    result = deepco("run", "--cluster", str(cluster), "--model", str(onnx_path), "--input-size", size,
                    "--source", str(clip), "--frames", str(FRAMES), "--algorithm", algorithm,
                    "--save-outputs", str(saved), "--json-log", str(log), "--quiet", *cut)
    assert result.returncode == 0, result.stderr + result.stdout
    data = np.load(saved)
    h, w = (int(v) for v in size.split("x"))
    assert data["inputs"].shape == (FRAMES, 3, h, w)
    want = whole_model(onnx_path, data["inputs"])
    assert data["outputs"].shape == want.shape
    scale = np.abs(want).max()
    assert np.abs(data["outputs"] - want).max() <= 1e-4 * scale

    records = [r for line in log.read_text().splitlines() if "frame" in (r := json.loads(line))]  # no events
    assert [r["frame"] for r in records] == list(range(FRAMES))  # a file drops no frame by default
    assert "predicted with 2 frame(s) in flight:" in result.stdout and "0 dropped; 0 failed" in result.stdout
    # captured after the run started, in order; each result came no sooner than its own compute
    assert [r["captured"] for r in records] == sorted(r["captured"] for r in records)
    for r in records:
        assert r["error"] is None
        assert r["captured"] >= 0 and r["capture_to_result"] >= r["latency"] > 0
        if algorithm == "equal":  # really partitioned: every server computed a slice of every frame
            assert len({s["name"] for s in r["servers"]}) == count
            assert {s["antenna"] for s in r["servers"]} == set(range(min(count, antennas)))
        for s in r["servers"]:
            parts = [s["transfer"], s["queue"], s["compute"], s["return"]]
            assert min(parts) >= 0
            assert s["send_start"] + sum(parts) == pytest.approx(s["finish"], abs=1e-6)
        critical = max(s["finish"] for s in r["servers"])
        # the breakdown adds up: the last slice back, the hand-over, the stitch and the tail make the latency
        assert r["dispatch"] >= 0
        assert critical + r["dispatch"] + r["stitch"] + r["tail"] == pytest.approx(r["latency"], rel=1e-3)


def test_bad_sources_fail_in_one_line_and_leave_the_servers_healthy(servers, workdir, exported):
    cluster = cluster_file(workdir / "bad.toml", servers, 2, 1)
    model = str(exported("resnet18", "128x160"))
    for source, message in [(str(workdir / "absent.mp4"), "no such file"),
                            ("97", "cannot open camera 97"),
                            ("http://127.0.0.1:9/stream.mjpg", "cannot open URL"),
                            (str(workdir), "holds no image files")]:
        result = deepco("run", "--cluster", str(cluster), "--model", model, "--input-size", "128x160",
                        "--source", source, "--frames", "1", timeout=120)
        assert result.returncode != 0, source
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (source, result.stderr)
    for s in servers:
        with InferenceClient(s.address) as c:
            assert c.server_ready()


def test_unreachable_server_and_unloadable_model_fail_clearly(servers, workdir, exported, clip):
    model = str(exported("resnet18", "128x160"))
    unreachable = workdir / "unreachable.toml"
    unreachable.write_text('[device]\nantennas = 1\nbandwidth = 10.0\n[[servers]]\nname = "gone"\n'
                           'capacity = 1.0\naddress = "127.0.0.1:9"\n')
    result = deepco("run", "--cluster", str(unreachable), "--model", model, "--input-size", "128x160",
                    "--source", str(clip), "--frames", "1", timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    # issue 31: one line naming the address and what happened there, in words
    assert "no server is reachable: 127.0.0.1:9: connection refused" in result.stderr

    with serve_process("--max-models", "1") as full:
        with InferenceClient(full.address) as c:
            c.load_model(Path(model).read_bytes(), "occupant")
        one = workdir / "full.toml"
        one.write_text(f'[device]\nantennas = 1\nbandwidth = 10.0\n[[servers]]\nname = "full"\n'
                       f'capacity = 1.0\naddress = "{full.address}"\n')
        began = time.monotonic()
        result = deepco("run", "--cluster", str(one), "--model", model, "--input-size", "128x160",
                        "--source", str(clip), "--frames", "1", timeout=120)
        assert result.returncode != 0
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "no room" in lines[0] and "--max-models" in lines[0] and full.address in lines[0]
        assert time.monotonic() - began < 50  # said at once, not after waiting a minute as for a busy server
        with InferenceClient(full.address) as c:
            assert c.server_ready() and c.loaded_models() == ["occupant"]


def test_demo_compares_local_offload_and_auto_exactly_and_draws_the_plan(workdir):
    plot, report = workdir / "demo.png", workdir / "demo.json"
    # Two servers and EfficientNet-Lite0's own 224x224 rather than the demo's 3 and 288x288: the camera's search
    # (on its 0.2-core quota, the longest step) has about 380 candidate plans rather than 580, and each frame is
    # smaller; nothing asserted here depends on either (CI runs the default `deepco demo` before the suite).
    result = deepco("demo", "--frames", "4", "--servers", "2", "--input-size", "224x224", "--plot", str(plot),
                    "--json", str(report), timeout=300)
    assert result.returncode == 0, result.stderr + result.stdout
    out = result.stdout
    assert "EMULATED" in out and "servers stopped" in out
    assert not [line for line in out.splitlines() if line.startswith("demo: error")]  # the legend is no error
    assert "weak camera: the device process runs under a cgroup CPU quota" in out or "cannot emulate" in out
    rows = {r["plan"]: r for r in json.loads(report.read_text())["rows"]}
    assert set(rows) == {"local", "offload", "auto"}
    for name, r in rows.items():
        assert r["max_rel_error"] <= 1e-4, name
        assert len(r["latencies_ms"]) == 4 and r["p50_ms"] > 0 and r["fps"] > 0
        assert any(line.startswith(f"{name} ") and f"{r['p50_ms']:.1f}" in line for line in out.splitlines())
        # the photo shows Grace Hopper in her navy uniform: ImageNet-1k class 652, "military uniform"
        assert r["top1"] == 652, name
    assert "frame 0 (the unmoved photo) under auto: military uniform" in out
    picture = __import__("matplotlib.image").image.imread(plot)
    assert picture.ndim == 3 and picture.shape[0] > 300 and picture.shape[1] > 600
    made = re.search(r"cgroup CPU quota of [\d.]+ core \(v\d, (\S+)\)", out)
    if made:  # the camera's cgroup is gone (other sessions' demos may have their own meanwhile)
        assert not Path(made.group(1)).exists()
