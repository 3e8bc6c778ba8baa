"""`deepco serve` as a real process: stock tritonclient against it, SIGTERM drain, CLI errors."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from test_server_support import (
    HEAVY_SHAPE,
    ROOT,
    ServeProcess,
    child_env,
    conv_model,
    metric_sum,
    reference,
    scrape,
    serve_process,
    wait_until,
)
from tritonclient.utils import InferenceServerException

from deepco.wire.client import InferenceClient, ServerError


def _triton_infer(client: tc.InferenceServerClient, model: str, x: np.ndarray) -> np.ndarray:
    inp = tc.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer(model, [inp], outputs=[tc.InferRequestedOutput("output")])
    return result.as_numpy("output")


def test_tritonclient_loads_checks_and_infers_like_local_ort() -> None:
    model = conv_model(strides=(1, 2, 1))
    rng = np.random.default_rng(7)
    with serve_process("--threads", "1") as server:
        client = tc.InferenceServerClient(url=server.address)
        assert client.is_server_live()
        assert client.is_server_ready()
        meta = client.get_server_metadata()
        assert meta.name == "deepco"
        assert "model_repository" in meta.extensions
        assert "deepco_execution_provider=CPUExecutionProvider" in meta.extensions  # no GPU on this machine

        assert not client.is_model_ready("conv")
        # Exactly what Triton users do: a JSON config plus the model directory's files as bytes.
        config = json.dumps({"name": "conv", "backend": "onnxruntime", "max_batch_size": 0})
        client.load_model("conv", config=config, files={"file:1/model.onnx": model})
        assert client.is_model_ready("conv")
        assert client.is_model_ready("conv", "1")
        assert not client.is_model_ready("conv", "2")
        index = client.get_model_repository_index()
        assert [(m.name, m.version, m.state) for m in index.models] == [("conv", "1", "READY")]
        model_meta = client.get_model_metadata("conv")
        assert model_meta.platform == "onnxruntime_onnx"
        assert [(t.name, t.datatype, list(t.shape)) for t in model_meta.inputs] == [("input", "FP32", [-1, 3, -1, -1])]

        # One loaded model answers different heights and widths (dynamic H/W), each equal to local ORT.
        for h, w in ((32, 32), (45, 17), (8, 64)):
            x = rng.standard_normal((1, 3, h, w)).astype(np.float32)
            got = _triton_infer(client, "conv", x)
            want = reference(model, x)
            assert got.shape == want.shape == (1, 4, (h + 1) // 2, (w + 1) // 2)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)

        with pytest.raises(InferenceServerException) as missing:
            _triton_infer(client, "nope", x)
        assert missing.value.status() == "StatusCode.NOT_FOUND"
        with pytest.raises(InferenceServerException) as garbage:
            client.load_model("bad", config="{}", files={"file:1/model.onnx": b"not an onnx file"})
        assert garbage.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "not a valid ONNX model" in garbage.value.message()

        client.unload_model("conv")
        assert not client.is_model_ready("conv")
        client.close()
        assert server.sigterm() == 0


def _metrics_port(server: ServeProcess) -> int:
    """The /metrics port a server started with ``--metrics-port 0`` logged (its start-up line)."""
    found: list[int] = []

    def logged() -> bool:
        found.extend(int(m.group(1)) for line in list(server.stderr_lines)
                     if (m := re.search(r"metrics http://[^ ]+:(\d+)/metrics", line)))
        return bool(found)

    wait_until(logged, 30, "the server logs its metrics address")
    return found[0]


def _refused(address: str) -> bool:
    """Whether a new call to ``address`` is refused UNAVAILABLE now (a server that drains takes none)."""
    try:
        with InferenceClient(address, timeout=2) as probe:
            probe.server_live()
    except ServerError as exc:
        # A call that arrives while gRPC starts its shutdown is CANCELLED: not yet the drained state; ask again.
        assert exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), exc
        return exc.code == grpc.StatusCode.UNAVAILABLE
    return False


def test_sigterm_finishes_in_flight_request_then_exits_zero() -> None:
    # Three times the heavy model's depth: the request must still run after the refusal of new calls is seen
    # and the gauge scraped, which on a loaded 2-core machine took longer than the heavy model's run once.
    model = conv_model(channels=(3, *[64] * 16, 4))
    x = np.random.default_rng(3).standard_normal(HEAVY_SHAPE).astype(np.float32)
    with serve_process("--threads", "1", "--metrics-port", "0") as server:
        metrics_port = _metrics_port(server)
        client = InferenceClient(server.address)
        client.load_model(model, "big")
        client.model_metadata("big")
        result: dict[str, object] = {}

        def call() -> None:
            try:
                result["y"] = client.infer("big", x)
            except ServerError as exc:
                result["error"] = exc
            result["done"] = time.perf_counter()

        worker = threading.Thread(target=call)
        worker.start()
        # The server counts the call in flight once it runs on a worker thread (scrapes are HTTP, not RPCs).
        wait_until(lambda: metric_sum(scrape(metrics_port), "deepco_grpc_inflight") >= 1, 30,
                   "the request runs on the server")
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.perf_counter()
        wait_until(lambda: _refused(server.address), 30, "draining: new requests are no longer accepted")
        # ... while the old one still runs: it has not answered. Checked on the client, at once: a scrape of the
        # in-flight gauge here raced the request's end and the server's exit on a loaded CI run (ConnectionReset).
        assert "done" not in result
        worker.join(timeout=60)
        code = server.proc.wait(timeout=60)
        assert "error" not in result, result.get("error")
        assert result["done"] > signalled  # the answer came after SIGTERM: it was in flight
        np.testing.assert_allclose(result["y"], reference(model, x), rtol=0, atol=1e-4)
        assert code == 0
        assert any("SIGTERM: draining" in line for line in server.stderr_lines)
        # After the drain nothing listens any more.
        with pytest.raises(ServerError) as after:
            InferenceClient(server.address, timeout=2).server_live()
        assert after.value.code == grpc.StatusCode.UNAVAILABLE
        client.close()


def _deepco(*args: str) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run([sys.executable, "-m", "deepco", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


def test_port_in_use_is_a_one_line_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _deepco("serve", "--port", str(port))
    assert done.returncode == 2
    assert done.stderr.strip() == f"deepco serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert "Traceback" not in done.stderr


def test_device_cuda_without_cuda_is_a_one_line_error() -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA")
    done = _deepco("serve", "--port", "0", "--device", "cuda")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deepco serve: error: --device cuda: ")


def test_bad_flags_are_usage_errors() -> None:
    done = _deepco("serve", "--port", "70000")
    assert done.returncode == 2
    assert "--port: must be in 0..65535, got 70000" in done.stderr
    assert "Traceback" not in done.stderr
