"""Eight devices at once against two servers: back-pressure, never a lost frame."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from deepco_device.backpressure import while_busy
from deepco_device.lifecycle import Uploads
from deepco_device.measuring import median_seconds
from test_server_support import conv_model, serve_process, stalled_upload

from deepco.wire.client import InferenceClient, ServerError, WrongAnswer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from load_test import load_test  # noqa: E402 - bench/ is not a package


def test_eight_concurrent_devices_lose_no_frame(tmp_path):
    result = load_test(devices=8, frames=6, input_size="64x80", time_limit=240, workdir=tmp_path)
    assert result["errors"] == [] and result["lost_frames"] == 0
    assert result["frames_out"] == 8 * 6


def test_setup_waits_for_a_busy_server_and_times_only_the_call_that_got_through():
    """CI found it: with eight devices setting up at once, a server refused one device's Echo probe with
    RESOURCE_EXHAUSTED ("retry later") and the device exited. Here the server's work slots (--max-inflight 1:
    three) are held by uploads whose body has not come yet; setup's probe and upload must wait and then work,
    and the probe's time must not include the wait."""
    release = threading.Event()

    with serve_process("--device", "cpu", "--threads", "1", "--max-inflight", "1") as server:
        def hold() -> None:
            # A holder refused while an Echo of the polling loop held a slot tries again, or the three
            # slots might never all be held (CI saw it).
            with grpc.insecure_channel(server.address) as channel:
                while not release.is_set():
                    if stalled_upload(channel, release, timeout=30) != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        return
                    time.sleep(0.02)

        holders = [threading.Thread(target=hold, daemon=True) for _ in range(3)]
        for t in holders:
            t.start()
        with InferenceClient(server.address, timeout=10) as client:
            deadline = time.monotonic() + 10
            while True:  # until all three slots are held
                try:
                    client.echo(1)
                except ServerError as exc:
                    assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    break
                assert time.monotonic() < deadline, "the holders never filled the work slots"
                time.sleep(0.05)
            threading.Timer(1.0, release.set).start()
            started = time.monotonic()
            probe = median_seconds(lambda: client.echo(1), runs=3)
            waited = time.monotonic() - started
            assert waited >= 0.8, "the probe got through while every slot was held"
            assert probe < 0.5 * waited, (probe, waited)
            name = Uploads().upload("s", client, conv_model(channels=(3, 4)), "conv")
            assert name in client.loaded_models()
        for t in holders:
            t.join(timeout=30)



def test_a_wait_for_a_busy_server_ends_when_the_run_stops_and_never_retries_a_wrong_answer():
    """The frame path's wait (`while_busy` with the run's stop event): a refusal is retried until the run
    stops, then raised at once, not after the patience; a wrong answer is never asked again."""
    calls = []

    def refused():
        calls.append(time.monotonic())
        raise ServerError("s:1", grpc.StatusCode.RESOURCE_EXHAUSTED, "server busy")

    stop = threading.Event()
    started = time.monotonic()  # before the timer starts: it sets ``stop`` 0.3 s after its own start
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(ServerError, match="RESOURCE_EXHAUSTED"):
        while_busy(refused, patience=30.0, stop=stop)
    assert 0.3 <= time.monotonic() - started < 2.0 and len(calls) >= 3

    def lied():
        calls.append(time.monotonic())
        raise WrongAnswer("s:1", "rows 0-4 instead of 0-8")

    calls.clear()
    with pytest.raises(WrongAnswer):
        while_busy(lied, patience=30.0)
    assert len(calls) == 1
