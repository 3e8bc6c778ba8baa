"""The Prometheus endpoint and the JSON log lines count what really happened."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from deepco_server.app import ServeConfig, Server
from test_server_support import conv_model, metric_sum, scrape, serve_process, wait_until

from deepco.wire.client import InferenceClient, ServerError

MODEL = conv_model(channels=(3, 4))
SERVICE = "inference.GRPCInferenceService"


def test_metrics_count_inferences_failures_and_latency() -> None:
    n, m = 7, 5
    srv = Server(ServeConfig(port=0, device="cpu", threads=1, metrics_port=0))
    try:
        assert srv.metrics_port
        with InferenceClient(srv.address, timeout=10) as c:
            c.load_model(MODEL, "conv")
            x = np.zeros((1, 3, 4, 4), np.float32)
            for _ in range(n):
                c.infer_many("conv", {"input": x})
            failures = [("nope", {"input": x}), ("conv", {"input": x.astype(np.float64)}),
                        ("conv", {"input": np.zeros((1, 3, 4), np.float32)}), ("conv", {}), ("gone", {})]
            assert len(failures) == m
            for name, inputs in failures:
                with pytest.raises(ServerError):
                    c.infer_many(name, inputs)
            raw = c.channel.unary_unary("/inference.GRPCInferenceService/NoSuchMethod")
            with pytest.raises(grpc.RpcError) as info:
                raw(b"", timeout=10)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        samples = scrape(srv.metrics_port)
    finally:
        srv.stop(grace=1)
    infer = {"service": SERVICE, "method": "ModelInfer"}
    assert metric_sum(samples, "deepco_grpc_requests_total", **infer, code="OK") == n
    assert metric_sum(samples, "deepco_grpc_requests_total", **infer, code="NOT_FOUND") == 2
    assert metric_sum(samples, "deepco_grpc_requests_total", **infer, code="INVALID_ARGUMENT") == 3
    assert metric_sum(samples, "deepco_grpc_errors_total", **infer) == m
    assert metric_sum(samples, "deepco_grpc_errors_total", **infer, code="OK") == 0
    assert metric_sum(samples, "deepco_grpc_request_seconds_count", **infer) == n + m
    assert metric_sum(samples, "deepco_grpc_request_seconds_bucket", **infer, le="+Inf") == n + m
    assert 0 < metric_sum(samples, "deepco_grpc_request_seconds_sum", **infer) < 30
    load = {"service": SERVICE, "method": "RepositoryModelLoad"}
    assert metric_sum(samples, "deepco_grpc_requests_total", **load, code="OK") == 1
    assert metric_sum(samples, "deepco_grpc_requests_total", method="unknown", code="UNIMPLEMENTED") == 1
    assert metric_sum(samples, "deepco_models_loaded") == 1
    assert metric_sum(samples, "deepco_model_bytes", model="conv") == len(MODEL)
    assert metric_sum(samples, "deepco_model_bytes_total") == len(MODEL)
    assert metric_sum(samples, "deepco_model_bytes_limit") == 1 << 30
    assert metric_sum(samples, "deepco_grpc_queued") == 0
    assert metric_sum(samples, "deepco_grpc_inflight") == 0  # the scrape is HTTP, not an RPC


def test_json_logs_and_metrics_endpoint_of_the_cli() -> None:
    with serve_process("--threads", "1", "--log-format", "json", "--metrics-port", "0") as server:
        with InferenceClient(server.address, timeout=10) as c:
            c.load_model(MODEL, "conv")
            c.infer_many("conv", {"input": np.zeros((1, 3, 4, 4), np.float32)})
            with pytest.raises(ServerError):
                c.infer_many("nope", {"input": np.zeros((1, 3, 4, 4), np.float32)})
        deadline = time.monotonic() + 10
        while sum('"rpc"' in line for line in server.stderr_lines) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = [json.loads(line) for line in list(server.stderr_lines)]  # every line is one JSON object
        assert all({"ts", "level", "event"} <= set(line) for line in lines)
        rpcs = [line for line in lines if line["event"] == "rpc"]
        infers = [line for line in rpcs if line["method"] == "ModelInfer"]
        assert [(r["code"], r["model"], r["level"]) for r in infers] == [("OK", "conv", "info"),
                                                                         ("NOT_FOUND", "nope", "warning")]
        assert all(isinstance(r["ms"], float) and r["ms"] >= 0 for r in infers)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", infers[0]["ts"])
        url = next(re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line["msg"]) for line in lines
                   if line["event"] == "log" and "/metrics" in line["msg"])
        samples = scrape(int(url.group(1)))
        assert metric_sum(samples, "deepco_grpc_requests_total", method="ModelInfer") == 2


def test_stream_budget_refuses_the_excess_at_once_and_control_calls_still_answer() -> None:
    # 3 stream slots (server.budgets), in a pool with threads beyond them for control calls. (Before the
    # budgets, five held streams took every worker thread and further calls queued.)
    srv = Server(ServeConfig(port=0, device="cpu", threads=1, max_inflight=1, max_queue=2, metrics_port=0,
                             max_streams=3))
    release = threading.Event()

    def held_stream() -> Iterator[bytes]:
        release.wait(30)  # a client stream that sends nothing yet: it holds a worker thread
        return
        yield b""

    try:
        with grpc.insecure_channel(srv.address) as channel:
            exchange = channel.stream_unary("/deepco.DeepcoService/SplitExchange")
            live = channel.unary_unary("/inference.GRPCInferenceService/ServerLive")
            holders = [exchange.future(held_stream(), timeout=30) for _ in range(3)]
            wait_until(lambda: metric_sum(scrape(srv.metrics_port), "deepco_grpc_inflight") >= 3, 10,
                       "3 streams in flight")
            assert metric_sum(scrape(srv.metrics_port), "deepco_grpc_inflight") == 3
            start = time.perf_counter()
            with pytest.raises(grpc.RpcError) as info:
                exchange(held_stream(), timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "stream" in info.value.details()
            assert time.perf_counter() - start < 2  # refused at once, not after a stream ended
            live(b"", timeout=2)  # control calls still find a thread
            assert metric_sum(scrape(srv.metrics_port), "deepco_grpc_queued") == 0
            samples = scrape(srv.metrics_port)
            assert any(n == "deepco_request_bytes_held" for n, _ in samples)
            assert metric_sum(samples, "deepco_request_bytes_held") == 0  # streamed messages are not counted
            release.set()
            for f in holders:
                with contextlib.suppress(grpc.RpcError):
                    f.result(timeout=10)
    finally:
        release.set()
        srv.stop(grace=1)
