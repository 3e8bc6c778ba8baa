"""The hostile test of issue 13, replayed: each attack on `deepco serve` is refused with the right status, and
the server stays up and answers ServerReady within 1 s during and after it.

File reads through external data, model poisoning (replacing or unloading a name, other clients' models),
thread exhaustion by idle streams, memory bombs (value-dependent shapes, nested subgraphs), and the small
items (1 MB names, split-job peers outside the allow-list, metrics without a token).
"""

from __future__ import annotations

import collections
import contextlib
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from deepco_server.app import ServeConfig, Server
from deepco_server.security import ServerSecurity
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnx import TensorProto, helper, numpy_helper
from test_server_support import ROOT, conv_model, reference, serve_process, stalled_upload, wait_until
from tls_support import Certs, make_certs

from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire import inference_pb2 as pb
from deepco.wire.client import InferenceClient, ServerError
from deepco.wire.rows import encode_rows
from deepco.wire.security import ChannelSecurity
from deepco.wire.tensors import encode_request

MODEL = conv_model(channels=(3, 4))
POISON = conv_model(channels=(3, 4), seed=7)
SECRET = bytes(range(64))  # 16 float32s a model must never read from the server's directory
X = np.random.default_rng(0).standard_normal((1, 3, 6, 5)).astype(np.float32)


def _status(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(ServerError) as info:
        call(*args, **kwargs)
    return info.value.code, info.value.details


def _ready_within_one_second(address: str) -> None:
    with InferenceClient(address, timeout=1.0) as c:
        start = time.perf_counter()
        assert c.server_ready(timeout=1.0)
        assert time.perf_counter() - start < 1.0


def _model(nodes, inputs, outputs, initializers=(), sparse=(), opset: int = 17) -> bytes:
    graph = helper.make_graph(nodes, "attack", inputs, outputs, initializer=list(initializers),
                              sparse_initializer=list(sparse))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model.SerializeToString()


def _external(tensor: TensorProto, location: str = "secret.bin") -> TensorProto:
    """Point ``tensor`` at ``location`` as ONNX external data (what the attacker uploaded)."""
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(len(SECRET)))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def reader_models() -> dict[str, bytes]:
    """Models that would read secret.bin from the server's working directory, each hiding it elsewhere."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [16])
    w = _external(numpy_helper.from_array(np.zeros(16, np.float32), "w"))
    models = {"initializer": _model([helper.make_node("Add", ["x", "w"], ["y"])], [x], [y], [w])}
    constant = helper.make_node("Constant", [], ["c"], value=_external(numpy_helper.from_array(np.zeros(16, np.float32),
                                                                                             "c")))
    models["attribute"] = _model([constant, helper.make_node("Add", ["x", "c"], ["y"])], [x], [y])
    values = _external(numpy_helper.from_array(np.zeros(16, np.float32), "s"))
    sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(np.arange(16, dtype=np.int64), "i"), [16])
    models["sparse"] = _model([helper.make_node("Add", ["x", "s"], ["y"])], [x], [y], sparse=[sparse])
    cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
    branch = helper.make_graph([helper.make_node("Constant", [], ["b"], value=_external(
        numpy_helper.from_array(np.zeros(16, np.float32), "b")))], "branch", [],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [16])])
    models["subgraph"] = _model([helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)],
                                [cond], [y])
    return models


def test_models_with_external_data_are_refused_before_they_read_a_file(tmp_path: Path) -> None:
    (tmp_path / "secret.bin").write_bytes(SECRET)
    with serve_process("--device", "cpu", "--threads", "1", cwd=tmp_path) as server:
        with InferenceClient(server.address, timeout=10) as c:
            for where, model in reader_models().items():
                code, message = _status(c.load_model, model, f"reader-{where}")
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (where, code, message)
                assert "external data" in message, (where, message)
                assert "secret.bin" not in message and "64" not in message.replace("sha256", ""), message
            assert c.loaded_models() == []  # nothing was loaded, so nothing can be run to read the file
        _ready_within_one_second(server.address)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server(ServeConfig(port=0, device="cpu", threads=1, max_inflight=4, max_request_bytes=16 << 20))
    yield srv
    srv.stop(grace=1)


def test_a_loaded_name_cannot_be_replaced_and_unload_drops_one_reference(server: Server) -> None:
    with InferenceClient(server.address) as device, InferenceClient(server.address) as other, \
            InferenceClient(server.address) as attacker:
        device.load_model(MODEL, "head")
        code, message = _status(attacker.load_model, POISON, "head")
        assert code == grpc.StatusCode.ALREADY_EXISTS and "cannot be replaced" in message
        np.testing.assert_allclose(device.infer("head", X), reference(MODEL, X), rtol=0, atol=1e-5)
        other.load_model(MODEL, "head")  # the same file: a second reference, not a replacement
        other.unload_model("head")
        np.testing.assert_allclose(device.infer("head", X), reference(MODEL, X), rtol=0, atol=1e-5)
        device.unload_model("head")
        assert "head" not in device.loaded_models()


def test_content_addressed_names_only_take_their_own_bytes(server: Server) -> None:
    import hashlib

    name = f"head-sha256-{hashlib.sha256(MODEL).hexdigest()[:16]}"
    with InferenceClient(server.address) as attacker, InferenceClient(server.address) as device:
        code, message = _status(attacker.load_model, POISON, name)  # pre-loading poison under the device's name
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "content-addressed" in message
        device.load_model(MODEL, name)
        np.testing.assert_allclose(device.infer(name, X), reference(MODEL, X), rtol=0, atol=1e-5)
        device.unload_model(name)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_mutual_tls_clients_see_only_their_own_models(certs: Certs) -> None:
    security = ServerSecurity(cert=certs.server_cert, key=certs.server_key, ca=certs.ca)
    srv = Server(ServeConfig(port=0, device="cpu", threads=1, security=security))
    # Two identities from the same CA: "deepco client" and "deepco server" (its certificate allows clientAuth).
    alice = ChannelSecurity(ca=certs.ca, cert=certs.client_cert, key=certs.client_key)
    mallory = ChannelSecurity(ca=certs.ca, cert=certs.server_cert, key=certs.server_key)
    try:
        with InferenceClient(f"localhost:{srv.port}", security=alice) as a, \
                InferenceClient(f"localhost:{srv.port}", security=mallory) as m:
            a.load_model(MODEL, "head")
            assert m.loaded_models() == []
            assert _status(m.unload_model, "head")[0] == grpc.StatusCode.NOT_FOUND
            assert _status(m.infer, "head", X)[0] == grpc.StatusCode.NOT_FOUND
            m.load_model(POISON, "head")  # its own namespace: allowed, and invisible to alice
            np.testing.assert_allclose(a.infer("head", X), reference(MODEL, X), rtol=0, atol=1e-5)
            np.testing.assert_allclose(m.infer("head", X), reference(POISON, X), rtol=0, atol=1e-5)
            assert a.loaded_models() == ["head"] and m.loaded_models() == ["head"]
    finally:
        srv.stop(grace=1)


def test_an_unused_model_expires_after_its_lease_and_use_renews_it() -> None:
    srv = Server(ServeConfig(port=0, device="cpu", threads=1, model_lease=1.5))
    try:
        with InferenceClient(srv.address) as c:
            c.load_model(MODEL, "used")
            c.load_model(MODEL, "forgotten")
            for _ in range(6):  # 3 s of use every 0.5 s
                time.sleep(0.5)
                c.infer("used", X)
            assert c.loaded_models() == ["used"]
    finally:
        srv.stop(grace=1)


def _idle_streams(address: str, model: str, count: int) -> tuple[list, list]:
    """``count`` idle streams of each kind that once held every worker thread: (calls, channels)."""
    calls, channels = [], []
    big = np.zeros((1, 3, 256, 512), np.float32)  # its 2 MB result fills the flow-control window unread
    for _ in range(count):
        channel = grpc.insecure_channel(address)  # one connection each, as independent attackers
        channels.append(channel)
        calls.append(health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""),
                                                               timeout=60))
        never = iter(lambda: time.sleep(60), 0)  # a client stream that sends nothing
        calls.append(channel.stream_unary("/deepco.DeepcoService/SplitExchange",
                                          request_serializer=dpb.RowsMessage.SerializeToString,
                                          response_deserializer=dpb.ExchangeAck.FromString).future(never, timeout=60))
        run = channel.unary_stream("/deepco.DeepcoService/Run",
                                   request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=dpb.RunEvent.FromString)
        calls.append(run(encode_request(model, {"input": big}), timeout=60))  # never read
    return calls, channels


def _finished_calls(server: Server) -> float:
    """Calls the server has ended (answered or refused), from its own request counter."""
    return sum(sample.value for metric in server.metrics.registry.collect() if metric.name == "deepco_grpc_requests"
               for sample in metric.samples if sample.name.endswith("_total"))


def test_idle_streams_cannot_starve_readiness(server: Server) -> None:
    with InferenceClient(server.address) as c:
        c.load_model(MODEL, "conv")
    before = _finished_calls(server)
    calls, channels = _idle_streams(server.address, "conv", 16)
    try:
        wait_until(lambda: server.budgets.open_calls + _finished_calls(server) - before >= len(calls), 10,
                   "every idle stream holding a slot, refused, or answered (its reply left unread)")
        for _ in range(3):
            _ready_within_one_second(server.address)
        with InferenceClient(server.address, timeout=5) as c:  # and real work is still served
            np.testing.assert_allclose(c.infer("conv", X), reference(MODEL, X), rtol=0, atol=1e-5)
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()
        with InferenceClient(server.address) as c:
            c.unload_model("conv")
    _ready_within_one_second(server.address)


def test_idle_streams_are_cancelled_and_watch_needs_the_token() -> None:
    token = "t0ken-for-tests"
    srv = Server(ServeConfig(port=0, device="cpu", threads=1, stream_idle_seconds=1.0,
                             security=ServerSecurity(token=token)))
    try:
        with grpc.insecure_channel(srv.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                next(stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30,
                               metadata=[("authorization", f"Bearer {token}")])
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                next(watch)  # nothing changes: the server ends the idle stream
            assert info.value.code() == grpc.StatusCode.CANCELLED
            assert time.monotonic() - start < 5
            assert stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status \
                == health_pb2.HealthCheckResponse.SERVING  # the unary probe stays open to all
    finally:
        srv.stop(grace=1)


def bombs() -> dict[str, tuple[bytes, dict[str, np.ndarray]]]:
    """Tiny models whose output size follows an input's values, and the request that would blow them up."""
    shape = helper.make_tensor_value_info("shape", TensorProto.INT64, [None])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    x1 = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    huge = np.array([1 << 20, 1 << 20], np.int64)
    found = {"ConstantOfShape": (_model([helper.make_node("ConstantOfShape", ["shape"], ["y"])], [shape], [y]),
                                 {"shape": huge}),
             "Expand": (_model([helper.make_node("Expand", ["x", "shape"], ["y"])], [x1, shape], [y]),
                        {"x": np.ones(1, np.float32), "shape": huge}),
             "Tile": (_model([helper.make_node("Tile", ["x", "shape"], ["y"])], [x1, shape], [y]),
                      {"x": np.ones(1, np.float32), "shape": huge[:1] << 20})}
    scalars = [helper.make_tensor_value_info(n, TensorProto.FLOAT, []) for n in ("a", "b", "d")]
    found["Range"] = (_model([helper.make_node("Range", ["a", "b", "d"], ["y"])], scalars, [y]),
                      {"a": np.float32(0), "b": np.float32(1e12), "d": np.float32(1)})
    return found


def test_value_dependent_sizes_are_refused_before_running_and_the_server_survives() -> None:
    cases = bombs()
    assert len(cases["ConstantOfShape"][0]) < 120  # the 93-byte kind of model
    with serve_process("--device", "cpu", "--threads", "1") as server:
        with InferenceClient(server.address, timeout=10) as c:
            for op, (model, inputs) in cases.items():
                c.load_model(model, op)
                code, message = _status(c.infer_many, op, inputs)
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (op, code, message)
                assert "depends on input values" in message, (op, message)
                _ready_within_one_second(server.address)
        rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines()
                      if line.startswith("VmRSS:"))
        assert rss_kb < 1 << 20, rss_kb  # under 1 GiB: nothing was allocated for the bombs
        assert server.proc.poll() is None


def nested_if(depth: int) -> bytes:
    """If inside If inside If ... ``depth`` deep, each branch passing x through."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
    out = helper.make_tensor_value_info("y0", TensorProto.FLOAT, [1])
    inner = helper.make_graph([helper.make_node("Identity", ["x"], [f"y{depth}"])], "leaf", [],
                              [helper.make_tensor_value_info(f"y{depth}", TensorProto.FLOAT, [1])])
    for level in range(depth - 1, -1, -1):
        node = helper.make_node("If", ["cond"], [f"y{level}"], then_branch=inner, else_branch=inner)
        inner = helper.make_graph([node], f"level{level}", [],
                                  [helper.make_tensor_value_info(f"y{level}", TensorProto.FLOAT, [1])])
    graph = helper.make_graph(list(inner.node), "nested", [x, cond], [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def test_models_with_subgraphs_and_requests_over_the_budget_are_refused(server: Server) -> None:
    with InferenceClient(server.address) as c:
        code, message = _status(c.load_model, nested_if(12), "nested")
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "subgraphs" in message
        c.load_model(MODEL, "conv")
        try:
            # 16 MiB per request on this server: a 1x3x1024x1024 input (12 MiB) and its output (16 MiB) are more.
            code, message = _status(c.infer, "conv", np.zeros((1, 3, 1024, 1024), np.float32))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-request-bytes" in message
            np.testing.assert_allclose(c.infer("conv", X), reference(MODEL, X), rtol=0, atol=1e-5)
        finally:
            c.unload_model("conv")
    _ready_within_one_second(server.address)


def test_a_megabyte_model_name_is_invalid_argument(server: Server) -> None:
    name = "n" * (1 << 20)
    with InferenceClient(server.address) as c:
        for call, args in ((c.infer, (name, X)), (c.load_model, (MODEL, name)), (c.unload_model, (name,)),
                           (c.model_metadata, (name,))):
            code, message = _status(call, *args)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "over the 128 limit" in message, (call, code)
            assert len(message) < 1000


def _one_stage_job(address: str, gather_to: int) -> dpb.SplitRequest:
    """Server 0's part of a one-stage lookahead split of an 8-row image (a 3x3 conv: one row of halo) with a
    peer at a documentation address (RFC 5737) that is neither loopback nor in --peers."""
    level0 = dpb.SplitLevel(owned=[dpb.RowRange(start=0, stop=4), dpb.RowRange(start=4, stop=8)])
    level1 = dpb.SplitLevel(owned=[dpb.RowRange(start=0, stop=4), dpb.RowRange(start=4, stop=8)],
                            window=[dpb.RowRange(start=0, stop=5), dpb.RowRange(start=3, stop=8)], crop=[0, 1])
    window = np.zeros((1, 3, 5, 8), np.float32)
    return dpb.SplitRequest(job_id=f"j{gather_to}", peers=[address, "192.0.2.1:50051"], server_index=0,
                            segment_models=["one-conv"], levels=[level0, level1], input=encode_rows(window, 0),
                            lookahead=True, gather_to=gather_to, tail_model="one-conv" if gather_to else "")


def test_modnn_peers_outside_the_allow_list_are_refused(server: Server) -> None:
    """A job that would make the server send rows to a peer outside loopback and --peers is refused; a job
    that talks to no peer (one lookahead stage, the tail on the device) does not need its peers allowed."""
    with InferenceClient(server.address) as c:
        c.load_model(conv_model((3, 4)), "one-conv")
    with grpc.insecure_channel(server.address) as channel:
        run = channel.unary_stream("/deepco.DeepcoService/SplitRun",
                                   request_serializer=dpb.SplitRequest.SerializeToString,
                                   response_deserializer=dpb.RunEvent.FromString)
        with pytest.raises(grpc.RpcError) as info:
            list(run(_one_stage_job(server.address, gather_to=2), timeout=10))  # gather on the foreign peer
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "--peers" in info.value.details()
        events = list(run(_one_stage_job(server.address, gather_to=0), timeout=10))
    assert events, "the lookahead job talks to no peer: it runs"


def test_probe_peer_dials_only_allowed_peers_with_bounded_work(server: Server) -> None:
    """ProbePeer makes the server dial an address with its own credentials: only loopback or --peers, a
    bounded payload, and a flood of them leaves readiness answering."""
    with InferenceClient(server.address, timeout=10) as c:
        for peer, size, code in (("192.0.2.1:50051", 1 << 20, grpc.StatusCode.PERMISSION_DENIED),
                                 ("nohost", 1 << 20, grpc.StatusCode.INVALID_ARGUMENT),
                                 (server.address, 0, grpc.StatusCode.INVALID_ARGUMENT),
                                 (server.address, 1 << 30, grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(ServerError) as info:
                c.probe_peer(peer, size)
            assert info.value.code == code, (peer, size, info.value.details)
        small, large = c.probe_peer(server.address, 1 << 20)  # itself, over loopback: allowed
        assert small > 0 and large > 0

        def flood() -> None:
            with contextlib.suppress(ServerError):
                c.probe_peer("127.0.0.1:9", 1 << 20, runs=10)  # nothing listens: refused at once, ten times

        threads = [threading.Thread(target=flood) for _ in range(32)]
        for t in threads:
            t.start()
        start = time.monotonic()
        assert c.server_ready(timeout=1.0) and time.monotonic() - start < 1.0
        for t in threads:
            t.join(timeout=30)
        assert c.server_ready(timeout=1.0)


def _rss_kb(pid: int) -> int:
    return next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("VmRSS:"))


def test_a_flood_of_requests_is_refused_unread_and_readiness_keeps_answering() -> None:
    """Issue 13: under a 200-thread flood of 8 MiB requests, ServerReady failed (gRPC's own concurrency cap
    refused it, and probes waited behind requests being read) and RSS stayed at 2.8 GB. Scaled down: on a
    server with 3 work slots, 96 clients send 1 MiB requests back to back and 32 more open requests whose
    body never comes (a slow upload at its limit). The excess is refused RESOURCE_EXHAUSTED without being
    read, a stalled request is cancelled, probes answer within 1 s during and after, memory stays bounded."""
    x = np.random.default_rng(0).standard_normal((1, 3, 256, 341)).astype(np.float32)  # 1 MiB
    payload = encode_request("conv", {"input": x}).SerializeToString()
    with serve_process("--device", "cpu", "--threads", "1", "--max-inflight", "1", "--stream-idle-timeout", "1",
                       "--max-held-bytes", str(5 << 19)) as server:
        with InferenceClient(server.address, timeout=10) as c:
            c.load_model(MODEL, "conv")
            # Over --max-held-bytes on its own: refused, and by the held-bytes budget.
            code, message = _status(c.infer, "conv", np.zeros((1, 3, 512, 512), np.float32))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-held-bytes" in message, message
        codes: collections.Counter = collections.Counter()
        stalled: collections.Counter = collections.Counter()
        probes: list[tuple[str, float]] = []
        rss_kb: list[int] = []
        stop = threading.Event()

        def flood() -> None:
            with grpc.insecure_channel(server.address) as channel:
                infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
                while not stop.is_set():
                    try:
                        infer(payload, timeout=30)
                        codes["OK"] += 1
                    except grpc.RpcError as exc:
                        codes[exc.code().name] += 1

        def stall() -> None:
            with grpc.insecure_channel(server.address) as channel:
                while not stop.is_set():
                    stalled[stalled_upload(channel, stop, timeout=5).name] += 1

        def probe(channel: grpc.Channel) -> None:
            ready = channel.unary_unary("/inference.GRPCInferenceService/ServerReady",
                                        request_serializer=pb.ServerReadyRequest.SerializeToString,
                                        response_deserializer=pb.ServerReadyResponse.FromString)
            check = health_pb2_grpc.HealthStub(channel).Check
            for call, request in ((ready, pb.ServerReadyRequest()), (check, health_pb2.HealthCheckRequest())):
                start = time.perf_counter()
                try:
                    call(request, timeout=1.0)
                    outcome = "OK"
                except grpc.RpcError as exc:
                    outcome = f"{exc.code().name}: {exc.details()}"
                probes.append((outcome, time.perf_counter() - start))
            rss_kb.append(_rss_kb(server.proc.pid))

        threads = [threading.Thread(target=flood, daemon=True) for _ in range(96)]
        threads += [threading.Thread(target=stall, daemon=True) for _ in range(32)]
        with grpc.insecure_channel(server.address) as channel:
            for t in threads:
                t.start()
            flood_end = time.monotonic() + 4.0
            while time.monotonic() < flood_end:
                probe(channel)
                time.sleep(0.25)
            during = len(probes)
            stop.set()
            for t in threads:
                t.join(timeout=30)
            assert not any(t.is_alive() for t in threads), "a flooding call hung"
            for _ in range(4):
                probe(channel)
                time.sleep(0.25)
        slow = [(outcome, round(seconds, 3)) for outcome, seconds in probes if outcome != "OK" or seconds >= 1.0]
        assert not slow, (slow, len(probes), codes, stalled)
        assert during >= 8, during  # the probes really ran during the flood
        assert codes["RESOURCE_EXHAUSTED"] > 0 and set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
        # Stalled uploads: refused, or cancelled once idle for a second (or, when the test ends them without a
        # message, INVALID_ARGUMENT); none ran into its 5 s deadline.
        assert stalled["RESOURCE_EXHAUSTED"] > 0 and stalled["CANCELLED"] > 0, stalled
        assert set(stalled) <= {"RESOURCE_EXHAUSTED", "CANCELLED", "INVALID_ARGUMENT"}, stalled
        assert max(rss_kb) < 1 << 20, rss_kb  # under 1 GiB: the refused requests were never held
        with InferenceClient(server.address, timeout=10) as c:  # and the server still serves
            np.testing.assert_allclose(c.infer("conv", X), reference(MODEL, X), rtol=0, atol=1e-5)
        assert server.proc.poll() is None


def test_metrics_token_and_warning() -> None:
    from deepco_server.security import metrics_warning

    assert metrics_warning(9090, "0.0.0.0", None) is not None
    assert metrics_warning(9090, "0.0.0.0", "secret") is None and metrics_warning(9090, "127.0.0.1", None) is None
    srv = Server(ServeConfig(port=0, device="cpu", threads=1, metrics_port=0, metrics_token="scrape-me"))
    try:
        url = f"http://127.0.0.1:{srv.metrics_port}/metrics"
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url, timeout=5)
        assert info.value.code == 401
        request = urllib.request.Request(url, headers={"Authorization": "Bearer scrape-me"})
        with contextlib.closing(urllib.request.urlopen(request, timeout=5)) as response:
            assert b"deepco_models_loaded" in response.read()
    finally:
        srv.stop(grace=1)


def test_serve_warns_about_open_metrics_and_checks_peers() -> None:
    with serve_process("--metrics-port", "0", "--metrics-host", "0.0.0.0") as server:
        deadline = time.monotonic() + 10
        while not any("without --metrics-token" in line for line in server.stderr_lines) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any("without --metrics-token" in line for line in server.stderr_lines), server.stderr_lines
    bad = subprocess.run([sys.executable, "-m", "deepco", "serve", "--port", "0", "--peers", "nohost"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "expected host:port" in bad.stderr and len(bad.stderr.splitlines()) == 1
