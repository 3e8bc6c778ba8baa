"""`deepco serve --device cuda` on a real GPU: its answers are the CPU's to 1e-4 of the largest output.

Skipped unless this onnxruntime lists CUDAExecutionProvider and a CUDA session really gets it (CI has no GPU;
bench/gpu_verify.sh runs this file on a lent GPU machine). ORT's CUDA provider computes convolutions in TF32 by
default on Ampere and later GPUs, which put a served ResNet-18 1.06e-4 away from the CPU on an H100;
deepco_server.models.CUDA_OPTIONS turns that off.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from test_server_support import ROOT, child_env, conv_model, serve_process

from deepco.wire.client import InferenceClient

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
FRAMES = 3
SIZE = "224x224"
PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"


def _no_cuda_reason() -> str | None:
    """Why this machine cannot run these tests (None where it can)."""
    available = ort.get_available_providers()
    if CUDA not in available:
        return f"this onnxruntime has no {CUDA} (providers: {', '.join(available)})"
    from deepco_server.models import CUDA_OPTIONS

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # ORT prints its fallback to the CPU on stdout
            got = ort.InferenceSession(conv_model(), providers=[(CUDA, CUDA_OPTIONS), CPU]).get_providers()
    except Exception as exc:  # noqa: BLE001 - any failure to make a CUDA session means: no GPU here
        return f"a CUDA session could not be made: {exc!r}"[:300]
    if CUDA not in got:
        return f"a CUDA session fell back to {got} (no usable GPU?)"
    return None


@pytest.fixture(scope="module")
def gpu() -> None:
    reason = _no_cuda_reason()
    if reason is not None:
        pytest.skip(reason)


def deepco(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepco", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env or child_env(), timeout=timeout)


def whole_model_on_cpu(onnx_path: Path, inputs: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(onnx_path), providers=[CPU])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: inputs[i:i + 1]})[0] for i in range(len(inputs))])


def test_served_on_the_gpu_equals_the_cpu(gpu, tmp_path):
    model = tmp_path / f"resnet18-{SIZE}.onnx"
    exported = deepco("export", "--model", "resnet18", "--input-size", SIZE, "--output", str(model))
    assert exported.returncode == 0, exported.stderr
    with serve_process("--device", "cuda", startup_timeout=120) as srv:
        with InferenceClient(srv.address, timeout=120) as client:
            meta = client.server_metadata()
        assert meta.get("deepco_device") == "cuda", meta
        assert meta.get("deepco_execution_provider") == CUDA, meta

        cluster = tmp_path / "cluster.toml"
        cluster.write_text(f'[[servers]]\nname = "gpu"\naddress = "{srv.address}"\n')
        saved = tmp_path / "saved.npz"
        result = deepco("run", "--cluster", str(cluster), "--model", str(model), "--input-size", SIZE,
                        "--source", str(PHOTO), "--frames", str(FRAMES), "--algorithm", "offload",
                        "--save-outputs", str(saved), "--no-plan-cache", "--quiet")
        assert result.returncode == 0, result.stderr + result.stdout
        assert srv.sigterm() == 0, "".join(srv.stderr_lines)
    data = np.load(saved)
    h, w = (int(v) for v in SIZE.split("x"))
    assert data["inputs"].shape == (FRAMES, 3, h, w)
    want = whole_model_on_cpu(model, data["inputs"])
    assert data["outputs"].shape == want.shape
    err, scale = float(np.abs(data["outputs"] - want).max()), float(np.abs(want).max())
    print(f"served on the GPU vs ORT CPU: max abs error {err:.3g}, relative to the largest output {err / scale:.3g}")
    assert err <= 1e-4 * scale


def test_cuda_without_a_visible_gpu_fails_in_one_line(gpu):
    env = dict(child_env(), CUDA_VISIBLE_DEVICES="")
    result = deepco("serve", "--device", "cuda", "--port", "0", env=env, timeout=60)
    assert result.returncode != 0
    assert result.stdout == "", result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--device cuda" in lines[0], lines


def test_auto_without_a_visible_gpu_serves_on_the_cpu(gpu, monkeypatch):
    monkeypatch.setitem(os.environ, "CUDA_VISIBLE_DEVICES", "")
    # serve_process asserts that the first stdout line is "deepco serve: listening on ..."
    with serve_process("--device", "auto", startup_timeout=60) as srv:
        with InferenceClient(srv.address, timeout=60) as client:
            meta = client.server_metadata()
        assert meta.get("deepco_device") == "cpu", meta
        assert srv.sigterm() == 0
