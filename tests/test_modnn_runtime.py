"""MoDNN as a distributed runtime on real `deepco serve` processes on loopback: exact output, direct
server-to-server exchanges (the device sends only disjoint bands), and clear failures."""

from __future__ import annotations

import contextlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from deepco_device.modnn import ModnnRunner
from deepco_device.preprocess import normalise
from deepco_device.session import Device
from test_server_support import serve_process

from deepco.cluster import parse_cluster
from deepco.errors import UserError
from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire.client import InferenceClient, ServerError


@pytest.fixture(scope="module")
def servers():
    with contextlib.ExitStack() as stack:
        # MoDNN loads one model per segment (14 for EfficientNet-Lite0 at _blocks.5): room for them
        yield [stack.enter_context(serve_process("--threads", "1", "--max-models", "40")) for _ in range(3)]


def make_device(servers, count: int, antennas: int, model: str, h: int, w: int, cut: str, *, pace: bool = False,
                mbps: float = 100.0) -> Device:
    data = {"device": {"antennas": antennas, "bandwidth": mbps},
            "servers": [{"name": f"s{i}", "capacity": 1.0, "address": s.address}
                        for i, s in enumerate(servers[:count])]}
    dev = Device(parse_cluster(data), model, h, w, cut=cut, pace=pace, log=lambda _: None)
    dev.setup()
    return dev


def whole(dev: Device, x: np.ndarray) -> np.ndarray:
    """The unpartitioned model (without the device's pixel prefix) on the reference preprocessing of x."""
    session = ort.InferenceSession(dev.reference_model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: normalise(x, dev.preprocessing)})[0]


CASES = [  # model, size, cut, servers, antennas, algorithm
    ("resnet18", (128, 160), "layer2", 2, 1, "modnn-sa"),
    ("resnet18", (97, 131), "layer3", 3, 2, "modnn-ma"),  # 7-row levels: halos span several bands
    ("efficientnet-lite0", (224, 224), "_blocks.5", 3, 2, "modnn-ma"),
    ("efficientnet-lite0", (224, 224), "_blocks.5", 2, 1, "modnn-sa"),
]


@pytest.mark.parametrize(("model", "size", "cut", "count", "antennas", "algorithm"), CASES)
def test_modnn_equals_the_whole_model_and_servers_exchange_directly(servers, model, size, cut, count, antennas,
                                                                   algorithm):
    h, w = size
    # MoDNN-MA spreads the servers over antennas of equal bandwidth; measured loopback "antennas" can differ
    # twofold on a busy machine, and then one antenna for all is the right association: pace them at 100 Mbit/s
    with make_device(servers, count, antennas, model, h, w, cut, pace=algorithm == "modnn-ma") as dev:
        runner = ModnnRunner(dev, algorithm)
        used = [a for a, g in enumerate(runner.groups) if g]
        assert sorted(i for g in runner.groups for i in g) == list(range(count))
        if algorithm == "modnn-sa" or count == 1:
            assert len(used) == 1
        else:  # spread over the antennas (footnote vii)
            assert len(used) == min(count, antennas)
        # the device sends each server only its own band: disjoint, covering the image, no halo
        job = uuid.uuid4().hex
        x = np.random.default_rng(7).integers(0, 256, (1, 3, h, w), dtype=np.uint8)
        rows = []
        for i in range(count):
            request = runner.request(job, i, x)
            a, b = request.input.start, request.input.start + request.input.shape[2]
            np.testing.assert_array_equal(np.frombuffer(request.input.data, np.uint8).reshape(request.input.shape),
                                          x[:, :, a:b])
            rows.append((a, b))
        assert rows[0][0] == 0 and rows[-1][1] == h
        assert all(r0[1] == r1[0] for r0, r1 in zip(rows, rows[1:], strict=False))
        assert runner.predicted > 0 and runner.predicted == pytest.approx(
            runner.prediction["transfer"] + sum(runner.prediction["levels"]) + runner.prediction["return"]
            + runner.prediction["tail"])

        want = whole(dev, x)
        scale = np.abs(want).max()
        expected = runner.exchanges()
        for _ in range(2):
            outputs, timing = runner.run_frame(x)
            (out,) = outputs.values()
            assert out.shape == want.shape
            assert np.abs(out - want).max() <= 1e-4 * scale
            for i, s in enumerate(timing.servers):
                # the servers' own counts of rows they received from peers, against the tables
                incoming = sum(1 for level in expected for (_, r) in level if r == i)
                outgoing = sum(1 for level in expected for (snd, _) in level if snd == i)
                assert s.messages_received == incoming > 0
                assert s.messages_sent == outgoing > 0
                assert s.bytes_received > 0 and s.compute > 0 and s.exchange_wait >= 0
            assert timing.latency >= max(s.finish for s in timing.servers)
        runner.unload()
        for i in range(count):
            assert not any("modnn" in n for n in dev.client(i, 0).loaded_models())


@pytest.fixture(scope="module")
def small(servers):
    """A 2-server resnet18 MoDNN set-up at 64x80 (cut layer1), shared by the failure tests."""
    with make_device(servers, 2, 1, "resnet18", 64, 80, "layer1") as dev:
        runner = ModnnRunner(dev, "modnn-sa", exchange_timeout=2.0)
        yield dev, runner
        runner.unload()


def modnn_run(address: str, request: dpb.SplitRequest, timeout: float = 30.0) -> list[dpb.RunEvent]:
    with InferenceClient(address) as c:
        return list(c.deepco.SplitRun(request, timeout=timeout))


def test_a_peer_that_is_down_fails_the_job_naming_it_and_the_servers_stay_healthy(servers, small):
    dev, runner = small
    x = np.zeros((1, 3, 64, 80), np.uint8)
    request = runner.request(uuid.uuid4().hex, 0, x)
    request.peers[1] = "127.0.0.1:9"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        modnn_run(servers[0].address, request)
    assert time.monotonic() - start < 10
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert "127.0.0.1:9" in info.value.details() and "peer 1" in info.value.details()
    (out,) = runner.run_frame(x)[0].values()  # both servers still work
    assert np.abs(out - whole(dev, x)).max() <= 1e-4 * max(np.abs(out).max(), 1e-12)


def test_a_peer_that_never_sends_times_out_naming_it(servers, small):
    _, runner = small
    x = np.zeros((1, 3, 64, 80), np.uint8)
    request = runner.request(uuid.uuid4().hex, 0, x)  # server 1 never gets its part of this job
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        modnn_run(servers[0].address, request)
    assert 1.5 < time.monotonic() - start < 10
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert servers[1].address in info.value.details() and "peer 1" in info.value.details()
    with InferenceClient(servers[0].address) as c:
        assert c.server_ready()


def test_bad_modnn_requests_get_the_right_status(servers, small):
    _, runner = small
    x = np.zeros((1, 3, 64, 80), np.uint8)

    def bad(edit, code, words):
        request = runner.request(uuid.uuid4().hex, 0, x)
        edit(request)
        with pytest.raises(grpc.RpcError) as info:
            modnn_run(servers[0].address, request)
        assert info.value.code() == code, info.value.details()
        assert words in info.value.details()

    bad(lambda r: r.segment_models.__setitem__(0, "absent"), grpc.StatusCode.NOT_FOUND, "'absent' is not loaded")
    bad(lambda r: setattr(r.input, "start", 3), grpc.StatusCode.INVALID_ARGUMENT, "owns [0,")
    bad(lambda r: setattr(r, "server_index", 5), grpc.StatusCode.INVALID_ARGUMENT, "server_index 5")
    bad(lambda r: setattr(r.levels[1].owned[0], "stop", 1), grpc.StatusCode.INVALID_ARGUMENT, "level 1")
    bad(lambda r: setattr(r.levels[1].window[0], "stop", 10**6), grpc.StatusCode.INVALID_ARGUMENT, "window 0")
    bad(lambda r: r.levels.pop(), grpc.StatusCode.INVALID_ARGUMENT, "levels")
    bad(lambda r: setattr(r, "job_id", ""), grpc.StatusCode.INVALID_ARGUMENT, "job_id")
    bad(lambda r: setattr(r.input, "data", b"123"), grpc.StatusCode.INVALID_ARGUMENT, "bytes of raw data")
    with InferenceClient(servers[0].address) as c, pytest.raises(grpc.RpcError) as info:
        flat = dpb.Rows(datatype="FP32", shape=[1, 2], data=b"\0" * 8)
        c.deepco.SplitExchange(iter([dpb.RowsMessage(job_id="j", rows=flat)]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not 4-d" in info.value.details()


def test_a_dead_server_fails_the_frame_naming_it(servers):
    with serve_process("--threads", "1") as doomed, \
            make_device([servers[0], doomed], 2, 1, "resnet18", 64, 80, "layer1") as dev:
        runner = ModnnRunner(dev, "modnn-sa", exchange_timeout=3.0)
        x = np.zeros((1, 3, 64, 80), np.uint8)
        runner.run_frame(x)
        doomed.proc.kill()
        doomed.proc.wait()
        start = time.monotonic()
        with pytest.raises(ServerError) as info:
            runner.run_frame(x)
        assert time.monotonic() - start < 15
        assert doomed.address in str(info.value)
        with InferenceClient(servers[0].address) as c:
            assert c.server_ready()


def test_too_few_model_slots_is_a_clear_error(servers):
    with serve_process("--threads", "1", "--max-models", "3") as cramped, \
            make_device([servers[0], cramped], 2, 1, "resnet18", 64, 80, "layer2") as dev:
        with pytest.raises(UserError) as info:
            ModnnRunner(dev, "modnn-ma")
        message = str(info.value)
        assert cramped.address in message and "--max-models" in message and "6 segment models" in message


def test_two_frames_at_once_stay_apart(servers, small):
    dev, runner = small
    rng = np.random.default_rng(11)
    xs = [rng.integers(0, 256, (1, 3, 64, 80), dtype=np.uint8) for _ in range(2)]
    with ThreadPoolExecutor(max_workers=2) as pool:  # two jobs on the same servers at the same time
        outs = [next(iter(o.values())) for o in pool.map(lambda x: runner.run_frame(x)[0], xs)]
    for x, out in zip(xs, outs, strict=True):
        want = whole(dev, x)
        assert np.abs(out - want).max() <= 1e-4 * np.abs(want).max()


def test_paced_sends_hold_each_antenna_for_its_bytes(servers):
    with make_device(servers, 2, 1, "resnet18", 64, 80, "layer1", pace=True, mbps=8.0) as dev:
        runner = ModnnRunner(dev, "modnn-sa")
        x = np.zeros((1, 3, 64, 80), np.uint8)
        _, timing = runner.run_frame(x)
        image_seconds = x.nbytes / (8.0 * 1e6 / 8)  # both bands over the one antenna: the whole image
        assert timing.sent >= 0.95 * image_seconds
        assert runner.prediction["transfer"] >= image_seconds
        runner.unload()


def test_a_paced_offload_sends_when_its_bytes_would_have_arrived(servers):
    """EMULATED bandwidth delays the send, it does not hold the antenna after it: the server cannot compute
    while its input is still "on the link", so a frame takes the transfer and the compute (it once took about
    the transfer alone, the compute hidden behind the pause, and offload measured faster than any link allows)."""
    from deepco_device.runners import StagedRunner

    from deepco.planning.staged import offload_plan_on

    with make_device(servers, 2, 1, "resnet18", 64, 80, "layer1", pace=True, mbps=8.0) as dev:
        runner = StagedRunner(dev, offload_plan_on("s0", 0))
        x = np.zeros((1, 3, 64, 80), np.uint8)
        try:
            runner.run_frame(x)  # the first run allocates
            _, timing = runner.run_frame(x)
        finally:
            runner.close()
        image_seconds = x.nbytes / (8.0 * 1e6 / 8)
        assert timing.sent >= 0.95 * image_seconds and timing.compute > 0
        assert timing.latency >= image_seconds + timing.compute
