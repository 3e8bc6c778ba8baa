"""Triton's own tooling against a `deepco serve` process: model configuration, statistics, classification,
UNIMPLEMENTED for the rest, and Triton's perf_analyzer measuring throughput at concurrency 1 and 2.

perf_analyzer is a C++ binary shipped in the tritonclient 2.41.0 wheel. That wheel pins clash with the
project's tritonclient 2.73, so it lives in its own virtual environment, .venv-perf (made by .ci/run; or
point DEEPCO_PERF_VENV at one). It also needs Debian's libb64-0d and the nvidia-cuda-runtime-cu12 wheel's
libcudart on LD_LIBRARY_PATH, even on a machine without a GPU.
"""

from __future__ import annotations

import csv
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
from onnx import TensorProto, helper
from test_server_support import ROOT, conv_model, serve_process
from tritonclient.utils import InferenceServerException

from deepco.wire.client import InferenceClient

PERF_VENV = Path(os.environ.get("DEEPCO_PERF_VENV", ROOT / ".venv-perf"))


def scores_model() -> bytes:
    """x FP32 [1, 6] -> scores = x (FP32 [1, 6]), best = argmax (INT64 [1]), positive = x > 0 (BOOL [1, 6])."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6])
    outputs = [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 6]),
               helper.make_tensor_value_info("best", TensorProto.INT64, [1]),
               helper.make_tensor_value_info("positive", TensorProto.BOOL, [1, 6])]
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
    nodes = [helper.make_node("Identity", ["x"], ["scores"]),
             helper.make_node("ArgMax", ["x"], ["best"], axis=1, keepdims=0),
             helper.make_node("Greater", ["x", "zero"], ["positive"])]
    graph = helper.make_graph(nodes, "scores", [x], outputs, initializer=[zero])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serve_process("--threads", "1") as srv:
        yield srv.address


@pytest.fixture()
def client(server: str) -> Iterator[tc.InferenceServerClient]:
    c = tc.InferenceServerClient(url=server)
    yield c
    for m in c.get_model_repository_index().models:
        c.unload_model(m.name)
    c.close()


def _infer(c: tc.InferenceServerClient, model: str, name: str, x: np.ndarray, outputs) -> tc.InferResult:
    inp = tc.InferInput(name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return c.infer(model, [inp], outputs=outputs)


def test_server_metadata_advertises_the_extensions(client: tc.InferenceServerClient) -> None:
    extensions = client.get_server_metadata().extensions
    for name in ("model_repository", "model_configuration", "statistics", "classification"):
        assert name in extensions


def test_model_config_is_derived_from_the_onnx_model(client: tc.InferenceServerClient) -> None:
    client.load_model("conv", files={"file:1/model.onnx": conv_model()})
    client.load_model("scores", files={"file:1/model.onnx": scores_model()})
    config = client.get_model_config("conv").config
    assert (config.name, config.platform, config.backend, config.max_batch_size) == (
        "conv", "onnxruntime_onnx", "onnxruntime", 0)
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [("input", 11, [-1, 3, -1, -1])]
    assert [(t.name, t.data_type, list(t.dims)) for t in config.output] == [("output", 11, [-1, 4, -1, -1])]
    as_json = client.get_model_config("scores", as_json=True)["config"]
    assert [(t["name"], t["data_type"], t["dims"]) for t in as_json["output"]] == [
        ("scores", "TYPE_FP32", ["1", "6"]), ("best", "TYPE_INT64", ["1"]), ("positive", "TYPE_BOOL", ["1", "6"])]
    with pytest.raises(InferenceServerException) as missing:
        client.get_model_config("nope")
    assert missing.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as version:
        client.get_model_config("conv", model_version="2")
    assert version.value.status() == "StatusCode.NOT_FOUND"


def test_class_count_returns_top_classes_as_value_index_strings(client: tc.InferenceServerClient) -> None:
    client.load_model("scores", files={"file:1/model.onnx": scores_model()})
    x = np.array([[0.5, 2.25, -1.0, 0.75, 3.5, 0.0]], np.float32)
    result = _infer(client, "scores", "x", x, [tc.InferRequestedOutput("scores", class_count=3),
                                               tc.InferRequestedOutput("best")])
    # Triton's format: "<value>:<index>", highest first, value printed like C++'s std::to_string.
    assert result.as_numpy("scores").tolist() == [b"3.500000:4", b"2.250000:1", b"0.750000:3"]
    assert result.get_output("scores").datatype == "BYTES"
    assert result.as_numpy("best").tolist() == [4]  # an output without class_count comes back as a tensor
    # An integer output, and a count above the number of elements (Triton answers them all).
    result = _infer(client, "scores", "x", x, [tc.InferRequestedOutput("best", class_count=5)])
    assert result.as_numpy("best").tolist() == [b"4:0"]
    with pytest.raises(InferenceServerException) as boolean:
        _infer(client, "scores", "x", x, [tc.InferRequestedOutput("positive", class_count=2)])
    assert boolean.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "classification is not available for datatype BOOL" in boolean.value.message()


def test_statistics_count_successes_failures_and_phases(server: str, client: tc.InferenceServerClient) -> None:
    client.load_model("conv", files={"file:1/model.onnx": conv_model()})
    before = client.get_inference_statistics("conv").model_stats[0]
    assert (before.name, before.version, before.inference_count, before.last_inference) == ("conv", "1", 0, 0)
    x = np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)
    for _ in range(3):
        _infer(client, "conv", "input", x, [tc.InferRequestedOutput("output")])
    with pytest.raises(InferenceServerException):  # reaches the model, then fails: counted as a failure
        _infer(client, "conv", "input", x[:, :2], [tc.InferRequestedOutput("output")])
    with InferenceClient(server) as ours:  # DeepcoService.Run counts as an inference of the model too
        ours.start_run("conv", {"input": x}).result()
    stats = client.get_inference_statistics("conv").model_stats[0]
    s = stats.inference_stats
    assert (stats.inference_count, stats.execution_count) == (4, 4)
    assert (s.success.count, s.fail.count) == (4, 1)
    assert stats.last_inference > 0
    phases = (s.queue, s.compute_input, s.compute_infer, s.compute_output)
    assert all(p.count == 4 for p in phases)
    assert s.compute_infer.ns > 0 and s.success.ns >= sum(p.ns for p in phases)
    everything = client.get_inference_statistics()  # empty name: every loaded model
    assert [m.name for m in everything.model_stats] == ["conv"]
    with pytest.raises(InferenceServerException) as missing:
        client.get_inference_statistics("nope")
    assert missing.value.status() == "StatusCode.NOT_FOUND"
    # A model loaded again starts from zero, as in Triton.
    client.unload_model("conv")
    client.load_model("conv", files={"file:1/model.onnx": conv_model()})
    assert client.get_inference_statistics("conv").model_stats[0].inference_count == 0


def test_calls_not_served_answer_unimplemented_and_the_client_goes_on(client: tc.InferenceServerClient) -> None:
    client.load_model("conv", files={"file:1/model.onnx": conv_model()})
    for call in (client.get_system_shared_memory_status, client.get_cuda_shared_memory_status,
                 client.get_trace_settings, client.get_log_settings):
        with pytest.raises(InferenceServerException) as info:
            call()
        assert info.value.status() == "StatusCode.UNIMPLEMENTED"
    x = np.ones((1, 3, 4, 4), np.float32)
    assert _infer(client, "conv", "input", x, None).as_numpy("output").shape == (1, 4, 4, 4)


def _perf_analyzer() -> tuple[Path, dict[str, str]]:
    """perf_analyzer and the environment it runs in, or a skip saying why it cannot be had here."""
    binary = PERF_VENV / "bin" / "perf_analyzer"
    if not binary.exists():
        pytest.skip(f"Triton's perf_analyzer is not installed: {binary} is missing; .ci/run makes it "
                    "(python3 -m venv .venv-perf && .venv-perf/bin/pip install tritonclient==2.41.0 "
                    "nvidia-cuda-runtime-cu12)")
    cudart = sorted(PERF_VENV.glob("lib/python*/site-packages/nvidia/cuda_runtime/lib"))
    if not cudart:
        pytest.skip(f"perf_analyzer needs libcudart from the nvidia-cuda-runtime-cu12 wheel in {PERF_VENV}")
    paths = [str(cudart[0]), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(paths))
    missing = [line.split()[0] for line in subprocess.run(["ldd", str(binary)], env=env, capture_output=True,
                                                          text=True).stdout.splitlines() if "not found" in line]
    if missing:
        pytest.skip(f"perf_analyzer cannot load {', '.join(missing)} (libb64.so.0d: apt-get install libb64-0d)")
    return binary, env


def test_perf_analyzer_measures_throughput_at_concurrency_1_and_2(server: str, client: tc.InferenceServerClient,
                                                                  tmp_path: Path) -> None:
    binary, env = _perf_analyzer()
    client.load_model("conv", files={"file:1/model.onnx": conv_model()})
    report = tmp_path / "perf.csv"
    run = subprocess.run([str(binary), "-m", "conv", "-u", server, "-i", "grpc", "--shape", "input:1,3,32,32",
                          "--concurrency-range", "1:2", "--measurement-interval", "500", "--max-trials", "10",
                          "--stability-percentage", "1000",
                          "-f", str(report)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = list(csv.DictReader(report.open()))
    # perf_analyzer writes its CSV rows sorted by throughput, not by concurrency: concurrency 2 comes first
    # when a neighbouring process makes it the faster level.
    assert sorted(row["Concurrency"] for row in rows) == ["1", "2"], run.stdout
    assert all(float(row["Inferences/Second"]) > 0 for row in rows)
    # perf_analyzer read the server's side from ModelStatistics: it printed a server section per level.
    assert run.stdout.count("  Server: ") == 2, run.stdout
    counted = [int(line.split(":")[1]) for line in run.stdout.splitlines() if "Successful request count" in line]
    assert len(counted) == 2 and all(n > 0 for n in counted), run.stdout
    total = client.get_inference_statistics("conv").model_stats[0]
    assert total.inference_count >= sum(counted) and total.inference_stats.fail.count == 0
