"""DeepcoService.Run (received, then result) and Echo, on a real loopback server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from deepco_server.app import ServeConfig, Server
from test_server_support import HEAVY_SHAPE, conv_model, heavy_model, reference

from deepco.wire.client import InferenceClient, ServerError

MODEL = conv_model()


@pytest.fixture(scope="module")
def client() -> Iterator[InferenceClient]:
    srv = Server(ServeConfig(port=0, device="cpu", threads=1, max_models=2, max_inflight=1))
    with InferenceClient(srv.address) as c:
        c.load_model(MODEL, "conv")
        c.load_model(heavy_model(), "heavy")
        yield c
    srv.stop(grace=1)


def test_run_returns_the_model_output_and_the_server_compute_time(client):
    x = np.random.default_rng(1).standard_normal((1, 3, 37, 23)).astype(np.float32)
    outputs, times = client.start_run("conv", {"input": x}).result()
    compute, queued = times.compute_seconds, times.queue_seconds
    np.testing.assert_allclose(next(iter(outputs.values())), reference(MODEL, x), rtol=1e-5, atol=1e-5)
    assert 0 < compute < 5 and queued >= 0
    # the step's other parts are the server's own measurements too: decoding its input, encoding its answer
    assert times.input_seconds > 0 and times.encode_seconds > 0 and times.halo_seconds == times.send_seconds == 0


def test_received_comes_before_the_compute_is_done(client):
    x = np.zeros(HEAVY_SHAPE, np.float32)
    start = time.perf_counter()
    handle = client.start_run("heavy", {"input": x})
    received = time.perf_counter() - start
    compute = handle.result()[1].compute_seconds
    total = time.perf_counter() - start
    assert compute > 0.3  # the heavy model really computes for a while ...
    assert received < total - 0.8 * compute  # ... and the device heard "received" before it was done


def test_a_pipelined_slice_waits_for_the_compute_slot_instead_of_failing(client):
    x = np.zeros(HEAVY_SHAPE, np.float32)
    first = client.start_run("heavy", {"input": x})
    second = client.start_run("heavy", {"input": x})  # max_inflight=1: must queue, not be refused
    compute1 = first.result()[1].compute_seconds
    queued2 = second.result()[1].queue_seconds
    assert queued2 > 0.5 * compute1


def test_run_errors_have_the_right_status(client):
    with pytest.raises(ServerError) as err:
        client.start_run("absent", {"input": np.zeros((1, 3, 8, 8), np.float32)})
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(ServerError) as err:
        client.start_run("conv", {"input": np.zeros((1, 5, 8, 8), np.float32)})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_echo_moves_the_bytes_asked_for(client):
    assert client.echo(1000, 10) > 0
    with pytest.raises(ServerError) as err:
        client.echo(0, 1 << 30)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_concurrent_runs_from_threads_all_complete(client):
    x = np.random.default_rng(2).standard_normal((1, 3, 16, 16)).astype(np.float32)
    want = reference(MODEL, x)
    errors: list[BaseException] = []

    def go():
        try:
            out, _ = client.start_run("conv", {"input": x}).result()
            np.testing.assert_allclose(next(iter(out.values())), want, rtol=1e-5, atol=1e-5)
        except BaseException as exc:  # collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(6)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors


@pytest.mark.parametrize("runs", [1, 2])
def test_admitted_runs_take_turns_unless_told_to_run_together(runs):
    # Four may be admitted; by default one runs at a time (the second waits its turn, counted as queue time),
    # and --concurrent-runs 2 lets two run at once.
    srv = Server(ServeConfig(port=0, device="cpu", threads=1, max_inflight=4, concurrent_runs=runs))
    try:
        with InferenceClient(srv.address) as c:
            c.load_model(heavy_model(), "heavy")
            assert c.server_metadata()["deepco_concurrent_runs"] == str(runs)
            x = np.zeros(HEAVY_SHAPE, np.float32)
            first, second = c.start_run("heavy", {"input": x}), c.start_run("heavy", {"input": x})
            (out1, times1), (out2, times2) = first.result(), second.result()
            np.testing.assert_array_equal(next(iter(out1.values())), next(iter(out2.values())))
            waited = max(times1.queue_seconds, times2.queue_seconds)
            if runs == 1:
                assert waited > 0.5 * min(times1.compute_seconds, times2.compute_seconds)
            else:
                assert waited < 0.5 * min(times1.compute_seconds, times2.compute_seconds)
    finally:
        srv.stop(grace=1)


def test_a_run_starts_no_thread_of_its_own(client, monkeypatch):
    """A thread start is dear on a weak camera (on the testbed's 0.1-core camera an offloaded frame spent 2.9 ms of
    its CPU, 1.5-2.0 ms without them), and every Run started two from the caller's thread: gRPC's channel poller,
    since none was polling between frames, and a Timer for its watchdog. Now the caller's thread reads the
    answers (gRPC's single-threaded unary-stream option) and one shared thread keeps the deadlines."""
    x = np.zeros((1, 3, 37, 23), np.float32)
    client.start_run("conv", {"input": x}).result()  # the shared watchdog thread, once per process
    started: list[str] = []
    start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        if threading.current_thread() is threading.main_thread():  # not the server's own workers
            started.append(thread.name)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", counted)
    for _ in range(5):
        outputs, _ = client.start_run("conv", {"input": x}).result()
        np.testing.assert_allclose(next(iter(outputs.values())), reference(MODEL, x), rtol=1e-5, atol=1e-5)
    assert started == []
