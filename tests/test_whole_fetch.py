"""Models cross the radio once (issue 27 item 3): a server fetches a whole model another server holds over their LAN
(RepositoryModelLoad's `deepco_peer`, DeepcoService.FetchWhole; server/whole_fetch.py), and the device asks it to
instead of sending the bytes again. Real `deepco serve` servers on loopback; each attack on the fetch is refused
with its status, nothing is loaded, and the server answers ServerReady after it."""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time

import grpc
import numpy as np
import pytest
from deepco_server import whole_fetch
from deepco_server.app import ServeConfig, Server
from deepco_server.security import ServerSecurity
from test_derived_stages import device, offload, pixels, plan_of, reference, run_once, servers
from test_server_support import wait_until, whole_bytes
from tls_support import Certs, make_certs

from deepco.partition.derive import Dims
from deepco.wire import GRPC_MESSAGE_OPTIONS
from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire import deepco_service_pb2_grpc as dpb_grpc
from deepco.wire.client import InferenceClient, ServerError, content_name_of
from deepco.wire.security import ChannelSecurity, make_channel

FOREIGN = "192.0.2.1:50051"  # TEST-NET-1: nothing answers there, and it is neither loopback nor in --peers


WHOLE = whole_bytes()
DIGEST = hashlib.sha256(WHOLE).hexdigest()
NAME = content_name_of("net-whole", DIGEST)


def _config(**changes) -> ServeConfig:
    return ServeConfig(**({"port": 0, "device": "cpu", "threads": 1} | changes))


@contextlib.contextmanager
def pair(a: ServeConfig | None = None, b: ServeConfig | None = None):
    """Servers A (holds the whole model) and B (fetches it), on loopback."""
    srv_a, srv_b = Server(a or _config()), Server(b or _config())
    try:
        yield srv_a, srv_b
    finally:
        srv_a.stop(0)
        srv_b.stop(0)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(ServerError) as info:
        call()
    return info.value.code, info.value.details


def _ready(address: str, security: ChannelSecurity | None = None) -> None:
    with InferenceClient(address, timeout=1.0, security=security) as c:
        start = time.perf_counter()
        assert c.server_ready(timeout=1.0) and time.perf_counter() - start < 1.0


def pull(address: str, sha256: str, security: ChannelSecurity | None = None, identity: str = "") -> bytes:
    """FetchWhole, called directly as a peer would."""
    with make_channel(address, security) as channel:
        chunks = dpb_grpc.DeepcoServiceStub(channel).FetchWhole(
            dpb.FetchWholeRequest(sha256=sha256, identity=identity), timeout=10)
        return b"".join(chunk.data for chunk in chunks)


def _whole_description() -> bytes:
    return dpb.StageDescription(whole_sha256=DIGEST, inputs=["input"], outputs=["output"], dims=Dims.WHOLE,
                                name="run", height=8, width=8).SerializeToString()


def holds_nothing(srv: Server) -> None:
    """Nothing was loaded: no bytes held, and no whole model to derive from."""
    assert srv.state.registry.held_bytes() == 0
    with InferenceClient(f"127.0.0.1:{srv.port}") as c:
        assert _code(lambda: c.derive_model(_whole_description(), "run"))[0] == grpc.StatusCode.NOT_FOUND


# -- the device ---------------------------------------------------------------------------------------------------


def test_a_device_split_over_two_servers_sends_the_whole_model_once():
    """The whole model crosses the radio to the first server only: the second fetches it from the first over their
    LAN (the radio carries the request), derives its stages, and the split's output equals the whole model's; an
    offload to the second server then sends nothing more. The device's sent-bytes counter shows one whole model."""
    with servers(2) as srvs, device(srvs) as dev:
        lines: list[str] = []
        dev.uploads.log = lines.append
        before = dev.uploads.sent_bytes
        offload(dev, "s0")
        whole = dev.stage_models[("whole",)]["bytes"]
        got = run_once(dev, plan_of(dev, ["s0", "s1"], ["layer1", "layer3"], tail=True), seed=4)
        offload(dev, "s1")
        sent = dev.uploads.sent_bytes - before
        assert len(whole) < sent < len(whole) + 10 * 1000, (sent, len(whole))  # one whole model, not two
        assert lines == []
        assert pull(f"127.0.0.1:{srvs[1].port}", dev.uploads.digest(whole)) == whole  # s1 holds it: fetched
        want = reference(dev, pixels(4))
        assert float(np.abs(got - want).max()) / float(np.abs(want).max()) <= 1e-4


def test_a_fetch_that_fails_costs_one_warning_and_the_bytes_are_sent():
    """The server the device loaded the whole model on lost it: the second server's fetch is refused, the device
    says so in one line (no traceback) and sends the whole model itself; the run goes on."""
    with servers(2) as srvs, device(srvs) as dev:
        lines: list[str] = []
        dev.uploads.log = lines.append
        offload(dev, "s0")
        whole = dev.stage_models[("whole",)]["bytes"]
        dev.client(0, 0).unload_model(content_name_of(f"{dev.tag}-whole", dev.uploads.digest(whole)), force=True)
        before = dev.uploads.sent_bytes
        offload(dev, "s1")
        assert len(whole) < dev.uploads.sent_bytes - before < len(whole) + 3 * 1000
        assert len(lines) == 1 and lines[0].startswith("warning: ") and "NOT_FOUND" in lines[0], lines
        assert "\n" not in lines[0] and "Traceback" not in lines[0]


# -- the server: the fetch and its attacks -------------------------------------------------------------------------


def test_a_server_fetches_a_whole_model_its_peer_holds_and_derives_from_it():
    """B loads A's whole model by digest from A, without the file; it then derives and runs as if uploaded, and
    a second load of the same name is one more reference, not another fetch."""
    with pair() as (a, b), InferenceClient(f"127.0.0.1:{a.port}") as ca, InferenceClient(f"127.0.0.1:{b.port}") as cb:
        ca.load_model(WHOLE, NAME, whole=True)
        cb.fetch_whole_model(NAME, DIGEST, f"127.0.0.1:{a.port}")
        assert b.state.registry.held_bytes() == len(WHOLE)
        cb.fetch_whole_model(NAME, DIGEST, "127.0.0.1:9")  # held already: nothing dialled (nothing listens)
        cb.derive_model(_whole_description(), "run")
        x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
        ca.derive_model(_whole_description(), "run")
        assert np.array_equal(cb.infer("run", x), ca.infer("run", x))


def test_fetches_at_once_share_one_copy_of_the_bytes_and_let_it_go():
    """A serves a whole model from one copy of its bytes however many fetches are under way (16 streams left
    unread must not cost 16 copies), and drops that copy once the last fetch ends, a cancelled one too."""
    big = whole_bytes(channels=(3, 512, 512, 4))  # about 9.5 MB: more than the client's windows take unread
    digest = hashlib.sha256(big).hexdigest()
    with pair() as (a, _), InferenceClient(f"127.0.0.1:{a.port}") as ca, make_channel(f"127.0.0.1:{a.port}") as ch:
        ca.load_model(big, "big", whole=True)
        stub = dpb_grpc.DeepcoServiceStub(ch)
        calls = [stub.FetchWhole(dpb.FetchWholeRequest(sha256=digest), timeout=10) for _ in range(4)]
        assert all(next(call).size == len(big) for call in calls)
        whole = a.state.registry.whole_to_serve(digest)
        assert whole._borrowers >= 2 and len(whole._lent) == len(big)  # fetches at once, one copy
        for call in calls:
            call.cancel()
        wait_until(lambda: whole._lent is None, 5, "the lent bytes dropped after the fetches ended")
        assert pull(f"127.0.0.1:{a.port}", digest) == big
        assert whole._lent is None
        _ready(f"127.0.0.1:{a.port}")


def test_a_fetch_from_an_address_not_allowed_is_refused_before_any_dial():
    """B dials only loopback and --peers: any other peer is PERMISSION_DENIED and no channel is ever opened."""
    with pair() as (a, b):
        dials: list[str] = []
        opener = b.state.peer_channels.open_channel
        b.state.peer_channels.open_channel = lambda address, options: dials.append(address) or opener(address, options)
        with InferenceClient(f"127.0.0.1:{b.port}") as cb:
            for peer in (FOREIGN, "10.0.0.7:50051", "example.com:443"):
                code, details = _code(lambda p=peer: cb.fetch_whole_model(NAME, DIGEST, p))
                assert code == grpc.StatusCode.PERMISSION_DENIED and "--peers" in details, (peer, details)
            assert _code(lambda: cb.fetch_whole_model(NAME, DIGEST, "no-port"))[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert dials == []
        _ready(f"127.0.0.1:{b.port}")
        holds_nothing(b)


def test_a_fetch_by_a_digest_the_peer_does_not_hold_is_refused():
    """A serves only by exact digest: another digest is NOT_FOUND, whose words say nothing of what A holds; a
    load without a proper digest, with a file as well, or not of a whole model is INVALID_ARGUMENT."""
    other = hashlib.sha256(b"another model").hexdigest()
    with pair() as (a, b):
        address = f"127.0.0.1:{a.port}"
        with InferenceClient(address) as ca, InferenceClient(f"127.0.0.1:{b.port}") as cb:
            ca.load_model(WHOLE, NAME, whole=True)
            code, details = _code(lambda: cb.fetch_whole_model("w", other, address))
            assert code == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError) as info:
                pull(address, other)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert DIGEST[:12] not in details + info.value.details() and NAME not in info.value.details()
            for digest in ("", "abc", DIGEST[:-1] + "g"):
                assert _code(lambda d=digest: cb.fetch_whole_model("w", d, address))[0] == \
                    grpc.StatusCode.INVALID_ARGUMENT, digest
            with pytest.raises(grpc.RpcError) as info:
                pull(address, "abc")
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            request = _peer_load(address)
            del request.parameters["deepco_whole"]
            assert _code(lambda: cb._call(cb.inference.RepositoryModelLoad, request))[0] == \
                grpc.StatusCode.INVALID_ARGUMENT
            request = _peer_load(address)
            request.parameters["file:1/model.onnx"].bytes_param = WHOLE
            assert _code(lambda: cb._call(cb.inference.RepositoryModelLoad, request))[0] == \
                grpc.StatusCode.INVALID_ARGUMENT
        _ready(f"127.0.0.1:{b.port}")
        holds_nothing(b)


def _peer_load(address: str):
    from deepco.wire import inference_pb2 as pb

    request = pb.RepositoryModelLoadRequest(model_name="w")
    request.parameters["deepco_whole"].bool_param = True
    request.parameters["deepco_peer"].string_param = address
    request.parameters["sha256"].string_param = DIGEST
    return request


def test_a_fetch_larger_than_max_model_bytes_is_refused():
    """The fetched bytes count against B's --max-model-bytes as an upload's do: refused RESOURCE_EXHAUSTED on the
    size A declares, before its bytes are taken."""
    with pair(b=_config(max_model_bytes=len(WHOLE) - 1)) as (a, b):
        with InferenceClient(f"127.0.0.1:{a.port}") as ca, InferenceClient(f"127.0.0.1:{b.port}") as cb:
            ca.load_model(WHOLE, NAME, whole=True)
            code, details = _code(lambda: cb.fetch_whole_model(NAME, DIGEST, f"127.0.0.1:{a.port}"))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-model-bytes" in details
        _ready(f"127.0.0.1:{b.port}")
        holds_nothing(b)


class LyingPeer(dpb_grpc.DeepcoServiceServicer):
    """A peer whose FetchWhole answers as ``lie`` says, whatever digest it is asked for."""

    def __init__(self) -> None:
        self.lie = ""
        self.release = threading.Event()

    def FetchWhole(self, request, context):
        data = {"other bytes": whole_bytes(seed=7), "one huge chunk": WHOLE + bytes(4 << 20)}.get(self.lie, WHOLE)
        declared = {"declares less": len(WHOLE) // 2, "declares more": len(WHOLE) + 1, "declares a terabyte": 1 << 40,
                    "one huge chunk": len(data)}.get(self.lie, len(data))
        if self.lie == "one huge chunk":
            yield dpb.WholeChunk(size=declared, data=data)
            return
        yield dpb.WholeChunk(size=declared, data=data[:100])
        if self.lie == "stalls":
            self.release.wait(30)
            return
        yield dpb.WholeChunk(data=data[100:])


@pytest.fixture
def liar():
    from concurrent import futures

    peer = LyingPeer()
    server = grpc.server(futures.ThreadPoolExecutor(4), options=GRPC_MESSAGE_OPTIONS)  # sends any size it likes
    dpb_grpc.add_DeepcoServiceServicer_to_server(peer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield peer, f"127.0.0.1:{port}"
    peer.release.set()
    server.stop(0)


def _ready_meanwhile(address: str, call) -> tuple[grpc.StatusCode, str]:
    """The refusal of ``call``, made on a thread while the server at ``address`` is asked ServerReady."""
    done: list[tuple[grpc.StatusCode, str]] = []
    worker = threading.Thread(target=lambda: done.append(_code(call)))
    worker.start()
    time.sleep(0.3)
    _ready(address)
    worker.join(30)
    return done[0]


def test_a_peer_that_lies_or_stalls_is_refused_and_nothing_is_loaded(liar, monkeypatch):
    """Whatever the peer sends, B checks it before anything parses it: other bytes than the digest, or another size
    than declared, are DATA_LOSS; a size over --max-model-bytes RESOURCE_EXHAUSTED; one message over a chunk is
    refused by gRPC unread; a peer that stalls is cut off by the deadline while B answers ServerReady. Nothing is
    loaded, and B answers ServerReady after each."""
    peer, address = liar
    monkeypatch.setattr(whole_fetch, "STALL_SECONDS", 1.0)
    expected = {"other bytes": grpc.StatusCode.DATA_LOSS, "declares less": grpc.StatusCode.DATA_LOSS,
                "declares more": grpc.StatusCode.DATA_LOSS, "declares a terabyte": grpc.StatusCode.RESOURCE_EXHAUSTED,
                "one huge chunk": grpc.StatusCode.UNAVAILABLE, "stalls": grpc.StatusCode.DEADLINE_EXCEEDED}
    srv = Server(_config())
    try:
        with InferenceClient(f"127.0.0.1:{srv.port}") as cb:
            for lie, want in expected.items():
                peer.lie = lie
                start = time.monotonic()
                code, details = _ready_meanwhile(f"127.0.0.1:{srv.port}",
                                                 lambda: cb.fetch_whole_model(NAME, DIGEST, address))
                assert code == want, (lie, code, details)
                assert time.monotonic() - start < 10, lie
                _ready(f"127.0.0.1:{srv.port}")
                holds_nothing(srv)
            peer.lie = ""  # an honest answer loads
            cb.fetch_whole_model(NAME, DIGEST, address)
            assert srv.state.registry.held_bytes() == len(WHOLE)
    finally:
        srv.stop(0)


def test_a_caller_without_the_token_cannot_pull_a_whole_model():
    """FetchWhole is behind the token like any call: none is UNAUTHENTICATED, a wrong one PERMISSION_DENIED; B,
    which has the token, fetches."""
    security = ServerSecurity(token="s3cret")
    with pair(_config(security=security), _config(security=security)) as (a, b):
        address = f"127.0.0.1:{a.port}"
        holder = ChannelSecurity(token="s3cret")
        with InferenceClient(address, security=holder) as ca, \
                InferenceClient(f"127.0.0.1:{b.port}", security=holder) as cb:
            ca.load_model(WHOLE, NAME, whole=True)
            for who, want in ((None, grpc.StatusCode.UNAUTHENTICATED),
                              (ChannelSecurity(token="guess"), grpc.StatusCode.PERMISSION_DENIED)):
                with pytest.raises(grpc.RpcError) as info:
                    pull(address, DIGEST, who)
                assert info.value.code() == want
            _ready(address)
            cb.fetch_whole_model(NAME, DIGEST, address)
            assert pull(address, DIGEST, holder) == WHOLE


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_under_mutual_tls_models_stay_within_an_identity(certs: Certs):
    """B fetches with its own certificate and for its caller's identity; A serves only where the two are one: a
    client of its own identity cannot have B pull B's identity's model, nor its own, and another identity's model
    is NOT_FOUND. The servers' own identity fetches."""
    security = ServerSecurity(cert=certs.server_cert, key=certs.server_key, ca=certs.ca)
    alice = ChannelSecurity(ca=certs.ca, cert=certs.client_cert, key=certs.client_key)
    servers_id = ChannelSecurity(ca=certs.ca, cert=certs.server_cert, key=certs.server_key)
    with pair(_config(security=security), _config(security=security)) as (a, b):
        address = f"localhost:{a.port}"
        with InferenceClient(address, security=servers_id) as ca, \
                InferenceClient(f"localhost:{b.port}", security=alice) as alice_b, \
                InferenceClient(f"localhost:{b.port}", security=servers_id) as cb:
            ca.load_model(WHOLE, NAME, whole=True)  # held for the servers' identity
            assert _code(lambda: alice_b.fetch_whole_model(NAME, DIGEST, address))[0] == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as info:
                pull(address, DIGEST, alice, identity="cn:deepco client")
            assert info.value.code() == grpc.StatusCode.NOT_FOUND  # alice's own identity holds nothing there
            _ready(f"localhost:{b.port}", alice)
            assert b.state.registry.held_bytes() == 0
            cb.fetch_whole_model(NAME, DIGEST, address)
            assert b.state.registry.held_bytes() == len(WHOLE)
