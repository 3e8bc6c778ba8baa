"""The second hostile review of `deepco serve`, replayed in seconds: nine ways a client grew the server past its
budgets or froze its probes, each now refused or bounded (tests/attack_support.py holds the attacks;
bench/attacks.py holds each for 30 s).

A server with small budgets (16 MiB per request, 32 MiB held, 2 in flight) is probed with ServerReady every
100 ms with a 1 s deadline during each attack; no probe may fail, its peak RSS must stay under idle RSS +
inflight x request bound + held bytes + 256 MB, and its log must carry no traceback.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from attack_support import (
    TYPED_CASES,
    Prober,
    answer_within,
    compressed_echo,
    headers_only,
    identity_model,
    made_up_exchanges,
    peak_mb,
    repeated_outputs_request,
    reset_peak,
    rss_mb,
    string_doubling_model,
    typed_request,
    unread_replies,
    wide_conv_transpose_model,
)
from deepco_server import budgets, window_buffers
from deepco_server.app import ServeConfig, Server
from deepco_server.errors import ResourceExhausted
from deepco_server.model_checks import SizeBound, check_fixed_size_elements, parse_model
from deepco_server.security import ServerSecurity
from deepco_server.split_jobs import Mailboxes
from onnx import TensorProto, helper
from test_server_support import conv_model, metric_sum, reference, scrape, serve_process, wait_until

from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire import deepco_service_pb2_grpc as dpb_grpc
from deepco.wire import inference_pb2 as pb
from deepco.wire.client import InferenceClient, ServerError
from deepco.wire.rows import encode_rows
from deepco.wire.security import make_channel

MIB = 1 << 20
REQUEST, HELD, INFLIGHT = 16 * MIB, 32 * MIB, 2
MODEL = conv_model(channels=(3, 4))
X = np.random.default_rng(0).standard_normal((1, 3, 6, 5)).astype(np.float32)


class Attacked:
    """The server under attack, its idle RSS, and the bound its peak must stay under."""

    def __init__(self, process):
        self.process, self.address, self.pid = process, process.address, process.proc.pid
        self.idle_mb = rss_mb(self.pid)

    @property
    def limit_mb(self) -> float:
        return self.idle_mb + (INFLIGHT * REQUEST + HELD) / MIB + 256

    @property
    def log(self) -> str:
        return "".join(self.process.stderr_lines)

    def check(self, prober: Prober) -> None:
        """No probe failed, the peak stayed in bounds, the server is up and logged no traceback."""
        assert len(prober.results) >= 3, prober.results
        assert not prober.failed, prober.failed
        assert peak_mb(self.pid) < self.limit_mb, (peak_mb(self.pid), self.limit_mb)
        assert self.process.proc.poll() is None
        assert "Traceback" not in self.log, self.log[-3000:]


@pytest.fixture(scope="module")
def attacked() -> Iterator[Attacked]:
    with serve_process("--device", "cpu", "--threads", "1", "--max-request-bytes", str(REQUEST),
                       "--max-held-bytes", str(HELD), "--max-inflight", str(INFLIGHT),
                       "--stream-idle-timeout", "2", "--metrics-port", "0") as process:
        with InferenceClient(process.address, timeout=10) as c:
            c.load_model(MODEL, "conv")
            c.infer("conv", X)
        yield Attacked(process)


@pytest.fixture()
def probed(attacked: Attacked) -> Iterator[Prober]:
    reset_peak(attacked.pid)
    with Prober(attacked.address) as prober:
        yield prober
        while len(prober.results) < 3:  # at least a few probes, however short the attack
            time.sleep(0.05)
    attacked.check(prober)


def _metrics_port(attacked: Attacked) -> int:
    return int(re.search(r"http://127\.0\.0\.1:(\d+)/metrics", attacked.log).group(1))


def _status(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(ServerError) as info:
        call(*args, **kwargs)
    return info.value.code, info.value.details


# 1 -------------------------------------------------------------------------------------------------------------

def test_string_elements_are_refused_at_load_naming_the_node(attacked: Attacked, probed: Prober) -> None:
    """A 925-byte model cast its input to STRING and doubled it 27 times: 2.5 GB from a 4-byte request, as
    the bound counted a string as 8 bytes."""
    model = string_doubling_model(27)
    assert len(model) < 1200
    with InferenceClient(attacked.address, timeout=10) as c:
        code, message = _status(c.load_model, model, "strings")
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, message)
        assert "'to_string' (Cast)" in message and "STRING" in message, message
        # A string constant, without a Cast: refused too.
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
        const = helper.make_node("Constant", [], ["c"], name="words",
                                 value=helper.make_tensor("v", TensorProto.STRING, [1], [b"ab"]))
        graph = helper.make_graph([const, helper.make_node("Identity", ["x"], ["y"])], "g", [x],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
        code, message = _status(c.load_model, helper.make_model(graph).SerializeToString(), "constant")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "'words' (Constant)" in message, message
        assert sorted(c.loaded_models()) == ["conv"]


def test_the_request_bound_never_counts_a_string() -> None:
    """Below the load check: a value of STRING elements has no size the bound can count, so it is unbounded."""
    model = parse_model(string_doubling_model(2), "s")
    with pytest.raises(Exception) as info:
        check_fixed_size_elements(model, "s")
    assert "STRING" in str(info.value)
    bound = SizeBound(model, "s", 1 << 30, ["x"])
    with pytest.raises(Exception) as info:
        bound.check({"x": (1,)})
    assert "cannot bound" in str(info.value)


# 2 -------------------------------------------------------------------------------------------------------------

def test_repeated_output_names_are_invalid_argument(attacked: Attacked, probed: Prober) -> None:
    """A 1 MiB ModelInfer asking for one output 1000 times made the server build 1000 copies (4.2 GB)."""
    x = np.zeros((1, 3, 256, 341), np.float32)
    request = repeated_outputs_request("conv", x, "output", 1000)
    with grpc.insecure_channel(attacked.address) as channel:
        for method, response in (("/inference.GRPCInferenceService/ModelInfer", pb.ModelInferResponse),
                                 ("/deepco.DeepcoService/Run", dpb.RunEvent)):
            call = (channel.unary_unary if response is pb.ModelInferResponse else channel.unary_stream)(
                method, request_serializer=pb.ModelInferRequest.SerializeToString,
                response_deserializer=response.FromString)
            with pytest.raises(grpc.RpcError) as info:
                reply = call(request, timeout=10)
                if response is dpb.RunEvent:
                    list(reply)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value.details())
            assert "more than once" in info.value.details()
    with InferenceClient(attacked.address, timeout=10) as c:
        np.testing.assert_allclose(c.infer("conv", X), reference(MODEL, X), rtol=0, atol=1e-5)


# 6 -------------------------------------------------------------------------------------------------------------

def test_compressed_requests_are_refused_before_they_inflate(attacked: Attacked, probed: Prober) -> None:
    """249 KiB of gzip inflated to 250 MiB before --max-held-bytes saw it (peak 4.1 GB). Here: 48 MiB (over
    the 32 MiB held-bytes budget) in 48 KiB, twice."""
    outcomes = [compressed_echo(attacked.address, 48 * MIB) for _ in range(2)]
    assert outcomes == ["UNIMPLEMENTED"] * 2, outcomes
    with InferenceClient(attacked.address, timeout=10) as c:  # uncompressed clients are served as before
        np.testing.assert_allclose(c.infer("conv", X), reference(MODEL, X), rtol=0, atol=1e-5)


# 9 -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("datatype", sorted(TYPED_CASES))
def test_out_of_range_typed_contents_are_invalid_argument(attacked: Attacked, probed: Prober, datatype: str) -> None:
    """INT8 1000, UINT8 300, UINT16 70000 in typed contents answered INTERNAL: OverflowError, with a traceback."""
    field, value = TYPED_CASES[datatype]
    elem = getattr(TensorProto, datatype)
    name = f"identity-{datatype.lower()}"
    with InferenceClient(attacked.address, timeout=10) as c:
        c.load_model(identity_model(elem), name)
        try:
            with grpc.insecure_channel(attacked.address) as channel:
                infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                            request_serializer=pb.ModelInferRequest.SerializeToString,
                                            response_deserializer=pb.ModelInferResponse.FromString)
                with pytest.raises(grpc.RpcError) as info:
                    infer(typed_request(name, datatype, field, value), timeout=10)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
                assert "out of the range" in info.value.details() and str(value) in info.value.details()
                reply = infer(typed_request(name, datatype, field, 7), timeout=10)  # in range: served
                assert reply.outputs[0].datatype == datatype
        finally:
            c.unload_model(name)


# 3 -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["/inference.GRPCInferenceService/ServerReady",
                                    "/inference.GRPCInferenceService/ServerLive", "/grpc.health.v1.Health/Check"])
def test_headers_only_probes_do_not_freeze_the_probes(attacked: Attacked, probed: Prober, method: str) -> None:
    """Two probe calls that sent their headers and never their body held both probe threads: every probe timed
    out for as long as their connection stayed open."""
    with headers_only(attacked.address, method, 4) as stalled:
        # a probe is answered without its body, so the stalled ones end: they reached the server
        wait_until(lambda: all(call.done() for call in stalled), 10, "the headers-only probes answered")
        outcomes = answer_within(attacked.address)
    assert all(o.startswith(("OK", "NOT_FOUND")) for o in outcomes.values()), outcomes


# 8 -------------------------------------------------------------------------------------------------------------

def test_headers_only_control_calls_do_not_freeze_control_calls() -> None:
    """Four headers-only RepositoryIndex calls (with the token) left ServerMetadata, index, unload and
    ModelReady unanswered despite --stream-idle-timeout: a control call's body now has 2 s to come."""
    token = "t0ken-for-tests"
    auth = (("authorization", f"Bearer {token}"),)
    srv = Server(ServeConfig(port=0, device="cpu", threads=1, metrics_port=0, security=ServerSecurity(token=token)))
    try:
        with Prober(srv.address) as prober, headers_only(
                srv.address, "/inference.GRPCInferenceService/RepositoryIndex", 8, metadata=auth) as stalled:
            wait_until(lambda: srv.budgets.open_calls >= 8, 10, "the 8 headers-only control calls admitted")
            outcomes = answer_within(srv.address, metadata=auth)
            assert all(o.startswith(("OK", "NOT_FOUND")) for o in outcomes.values()), outcomes
            for call in stalled:  # and the stalled ones are cancelled once their body is 2 s late
                with pytest.raises(grpc.RpcError) as info:
                    call.result(timeout=10)
                assert info.value.code() == grpc.StatusCode.CANCELLED
        assert not prober.failed, prober.failed
        assert metric_sum(scrape(srv.metrics_port), "deepco_refusals_total", reason="body_deadline") >= 8
    finally:
        srv.stop(grace=1)


# 7 -------------------------------------------------------------------------------------------------------------

def _one_stage_job(job_id: str, address: str) -> dpb.SplitRequest:
    """A one-stage lookahead split (one 3x3 conv) that talks to no peer: it needs only its mailbox here."""
    level0 = dpb.SplitLevel(owned=[dpb.RowRange(start=0, stop=4), dpb.RowRange(start=4, stop=8)])
    level1 = dpb.SplitLevel(owned=[dpb.RowRange(start=0, stop=4), dpb.RowRange(start=4, stop=8)],
                            window=[dpb.RowRange(start=0, stop=5), dpb.RowRange(start=3, stop=8)], crop=[0, 1])
    window = np.zeros((1, 3, 5, 8), np.float32)
    return dpb.SplitRequest(job_id=job_id, peers=[address, "127.0.0.1:9"], server_index=0, segment_models=["conv"],
                            levels=[level0, level1], input=encode_rows(window, 0), lookahead=True)


def test_made_up_exchange_jobs_do_not_block_split_jobs(attacked: Attacked, probed: Prober) -> None:
    """17 exchange messages with made-up job ids filled the 16 global mailboxes: every split job failed
    RESOURCE_EXHAUSTED for 60 s, renewably. Now they fill only their sender's share."""
    ended = made_up_exchanges(attacked.address, 40)
    assert ended.get("RESOURCE_EXHAUSTED", 0) >= 30, ended  # past the sender's share
    with grpc.insecure_channel(attacked.address) as channel:  # a victim's split job runs
        run = channel.unary_stream("/deepco.DeepcoService/SplitRun",
                                   request_serializer=dpb.SplitRequest.SerializeToString,
                                   response_deserializer=dpb.RunEvent.FromString)
        events = list(run(_one_stage_job("victim", attacked.address), timeout=10))
    assert events[-1].HasField("split_result"), events
    assert made_up_exchanges(attacked.address, 1, prefix="early") == {"OK": 1}  # another sender's early rows
    assert metric_sum(scrape(_metrics_port(attacked)), "deepco_refusals_total", reason="mailbox") >= 30


def test_the_early_mailbox_pool_is_shared_between_senders() -> None:
    """Senders arriving one after another (fresh connections) each get a share, none evicts its own mailboxes,
    the pool never passes its size, and a job starting here always gets its mailbox."""
    boxes = Mailboxes(max_mailboxes=16, per_sender=4)
    for r in range(10):
        ok = 0
        for i in range(17):
            try:
                boxes.deliver(f"r{r}-{i}", 1, 1, np.zeros(4, np.float32), 0, who=f"sender{r}")
                ok += 1
            except ResourceExhausted:
                pass
        assert 1 <= ok <= 4, (r, ok)
        assert len(boxes.boxes) <= 16
    boxes.claim("victim")
    boxes.deliver("victim", 1, 1, np.zeros(4, np.float32), 0, who="sender0")
    assert boxes.take("victim", 1, 1, 0.1) is not None


# 4 -------------------------------------------------------------------------------------------------------------

def test_unread_replies_count_until_flushed_and_stall_out(attacked: Attacked, probed: Prober) -> None:
    """Echo replies on streams whose client never grants flow-control window piled up in gRPC's buffers once
    the handler returned (40 streams: 3.6 GB). Now a reply holds its slot and bytes until it is flushed: the
    excess is refused, the held ones are cancelled after --stream-idle-timeout (2 s here)."""
    ended = unread_replies(attacked.address, 24, 8 * MIB, seconds=10)
    assert len(ended) == 24, ended  # every stream ended, none waits for a window that never comes
    refused = sum(1 for v in ended.values() if v == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
    assert refused >= 24 - HELD // (8 * MIB), ended
    assert set(ended.values()) <= {grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], grpc.StatusCode.CANCELLED.value[0],
                                   "reset"}, ended
    # gRPC runs a call's end callbacks (which give its bytes back) just after it sends the status: a scrape at
    # once found 3 replies' bytes still held on a loaded CI run. They must go back, not leak.
    port = _metrics_port(attacked)
    wait_until(lambda: metric_sum(scrape(port), "deepco_request_bytes_held") == 0, 5,
               "every ended call gives its bytes back")
    assert metric_sum(scrape(port), "deepco_refusals_total", reason="write_stall") >= 1
    # A reply over the budget on its own is refused before its bytes exist (Echo reserves them first).
    ended = unread_replies(attacked.address, 8, 64 * MIB, seconds=10)
    assert list(ended.values()) == [grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]] * 8, ended


# 5 -------------------------------------------------------------------------------------------------------------

def test_convolution_workspaces_count_in_the_request_bound() -> None:
    """A stride-1 ConvTranspose of kernel 32 keeps its input's size, so the bound saw 2 x 4 MiB, while ORT's
    column buffer took 1024 x 4 MiB (4.4 GB under --max-request-bytes 16 MiB)."""
    model = parse_model(wide_conv_transpose_model(32), "wide")
    bound = SizeBound(model, "wide", REQUEST, ["input"])
    with pytest.raises(Exception) as info:
        bound.check({"input": (1, 1, 1024, 1024)})
    assert "--max-request-bytes" in str(info.value)
    assert SizeBound(model, "wide", 1 << 40, ["input"]).check({"input": (1, 1, 1024, 1024)}) >= 1024 * 4 * MIB


def test_a_wide_conv_transpose_is_refused_before_it_runs(attacked: Attacked, probed: Prober) -> None:
    with InferenceClient(attacked.address, timeout=10) as c:
        c.load_model(wide_conv_transpose_model(32), "wide")
        try:
            code, message = _status(c.infer, "wide", np.zeros((1, 1, 256, 256), np.float32))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-request-bytes" in message, message
            small = np.ones((1, 1, 8, 8), np.float32)
            assert c.infer("wide", small).shape == (1, 1, 8, 8)
        finally:
            c.unload_model("wide")


def test_the_probes_stayed_answering_after_every_attack(attacked: Attacked) -> None:
    outcomes = answer_within(attacked.address)
    assert all(o.startswith(("OK", "NOT_FOUND")) for o in outcomes.values()), outcomes
    assert "Traceback" not in attacked.log


def test_freed_memory_is_given_back_once_no_call_is_open_not_during_one(monkeypatch) -> None:
    """The server gives freed memory back when quiet, and the windows it keeps for the next frame once unused for
    KEEP_SECONDS; a call open for longer than the quiet time (a split job of a big frame) is not quiet: giving
    memory back under it made its next windows take fresh pages."""
    given: list[float] = []
    monkeypatch.setattr(budgets, "release_freed_memory", lambda: given.append(time.monotonic()) or True)
    monkeypatch.setattr(budgets, "QUIET_SECONDS", 0.3)
    monkeypatch.setattr(budgets, "SWEEP_SECONDS", 0.05)
    monkeypatch.setattr(window_buffers, "KEEP_SECONDS", 2.0)
    srv = Server(ServeConfig(port=0, device="cpu", threads=1))
    try:
        def rows_later():  # a peer's exchange stream, open 1.5 s before its only message
            time.sleep(1.5)
            yield dpb.RowsMessage(job_id="held-open", sender=0, level=0)

        with make_channel(srv.address) as channel:
            exchange = dpb_grpc.DeepcoServiceStub(channel).SplitExchange.future(rows_later(), timeout=10)
            wait_until(lambda: srv.budgets.open_calls == 1, 5, "the exchange stream open")
            given.clear()  # whatever the load of the server's start left
            opened = time.monotonic()
            with contextlib.suppress(grpc.RpcError):  # taken as a peer's early rows, or refused: either ends it
                exchange.result()
            closed = time.monotonic()
        assert closed - opened > 1.0 and not [t for t in given if t < closed - 0.1], (closed - opened, given)
        pool = srv.state.window_buffers
        pool.give(np.empty((1, 8, 16, 16), np.float32))  # the job's last window, kept for the next frame
        wait_until(lambda: given, 5, "memory given back once the call ended")
        assert pool.pooled_bytes > 0 and len(given) == 1  # kept through the quiet second
        wait_until(lambda: pool.pooled_bytes == 0, 10, "the windows dropped once unused for KEEP_SECONDS")
        wait_until(lambda: len(given) == 2, 5, "and given back to the system")
    finally:
        srv.stop(0)
