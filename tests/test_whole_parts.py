"""Models cross the radio once (issue 27): a device with several antennas sends its whole model in parts, one over
each antenna at once, as RepositoryModelLoads of their own (`deepco_part`: "OFFSET/TOTAL"; server/whole_parts.py),
and the server holds the joined bytes as an uploaded whole model. Real `deepco serve` servers on loopback; each
malformed or hostile part is refused with its status, the parts pending stay within --max-model-bytes and expire,
and the server answers its health checks throughout."""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time

import grpc
import numpy as np
import pytest
from deepco_server import whole_parts
from deepco_server.app import ServeConfig, Server
from deepco_server.models import Registry, choose_runtime
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_server_support import wait_until, whole_bytes

from deepco.partition.derive import Dims
from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire import inference_pb2 as pb
from deepco.wire import inference_pb2_grpc as pb_grpc
from deepco.wire.client import InferenceClient, ServerError, content_name_of
from deepco.wire.security import make_channel

WHOLE = whole_bytes(channels=(3, 16, 16, 4))
DIGEST = hashlib.sha256(WHOLE).hexdigest()
NAME = content_name_of("net-whole", DIGEST)
T = len(WHOLE)
HALF = T // 2
OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@contextlib.contextmanager
def server(**changes):
    srv = Server(ServeConfig(**({"port": 0, "device": "cpu", "threads": 1} | changes)))
    try:
        yield srv, f"127.0.0.1:{srv.port}"
    finally:
        srv.stop(0)


def part(offset: int, data: bytes, total: int = T, sha256: str = DIGEST,
         name: str = NAME) -> pb.RepositoryModelLoadRequest:
    """A part's load as the device sends it."""
    request = pb.RepositoryModelLoadRequest(model_name=name)
    request.parameters["deepco_whole"].bool_param = True
    request.parameters["sha256"].string_param = sha256
    request.parameters["deepco_part"].string_param = f"{offset}/{total}"
    request.parameters["config"].string_param = '{"backend": "onnxruntime"}'
    request.parameters["file:1/model.onnx"].bytes_param = data
    return request


def parts_of(data: bytes, count: int, **kw) -> list[pb.RepositoryModelLoadRequest]:
    cuts = [len(data) * i // count for i in range(count + 1)]
    return [part(a, data[a:b], total=len(data), sha256=hashlib.sha256(data).hexdigest(), **kw)
            for a, b in zip(cuts, cuts[1:], strict=False)]


def send(address: str, request: pb.RepositoryModelLoadRequest) -> tuple[grpc.StatusCode, str]:
    """(status, details) of a load, on a channel of its own (an antenna's)."""
    with make_channel(address) as channel:
        try:
            pb_grpc.GRPCInferenceServiceStub(channel).RepositoryModelLoad(request, timeout=10)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    return OK, ""


def send_all(address: str, requests: list[pb.RepositoryModelLoadRequest]) -> None:
    """Send each load in turn; each is answered OK."""
    for request in requests:
        code, details = send(address, request)
        assert code == OK, details


def ready(address: str) -> None:
    """ServerReady and Health/Check answer within a second."""
    with make_channel(address) as channel:
        start = time.perf_counter()
        assert pb_grpc.GRPCInferenceServiceStub(channel).ServerReady(pb.ServerReadyRequest(), timeout=1.0).ready
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        assert time.perf_counter() - start < 1.0


def description(digest: str = DIGEST) -> bytes:
    return dpb.StageDescription(whole_sha256=digest, inputs=["input"], outputs=["output"], dims=Dims.WHOLE,
                                name="run", height=8, width=8).SerializeToString()


def holds(srv: Server, name: str = NAME) -> bool:
    return any(k == ("", name) for k in srv.state.registry._wholes)


def pending(srv: Server) -> int:
    return len(srv.state.parts._assemblies)


# -- a whole model in parts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [2, 3])
def test_a_whole_model_sent_in_parts_at_once_is_held_as_if_uploaded(count):
    """The parts, in a random order, each over a channel of its own and all at once, are each answered OK; the server
    then holds the whole model, derives a stage from it, and that stage answers as the one derived from a plain
    whole upload on another server."""
    order = np.random.default_rng(count).permutation(count)
    requests = parts_of(WHOLE, count, name=NAME)
    with server() as (srv, address), server() as (plain, plain_address):
        start = threading.Barrier(count)
        codes: list[tuple[grpc.StatusCode, str]] = [None] * count  # type: ignore[list-item]

        def antenna(i: int) -> None:
            start.wait()
            codes[i] = send(address, requests[order[i]])

        threads = [threading.Thread(target=antenna, args=(i,)) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert codes == [(OK, "")] * count
        assert holds(srv) and pending(srv) == 0 and srv.state.registry.held_bytes() == T
        x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
        with InferenceClient(address) as c, InferenceClient(plain_address) as p:
            p.load_model(WHOLE, NAME, whole=True)
            c.derive_model(description(), "run")
            p.derive_model(description(), "run")
            assert np.array_equal(c.infer("run", x), p.infer("run", x))


def test_parts_of_a_whole_model_held_already_are_ok_at_once_and_add_one_reference():
    """A whole model held under that name and digest: every part is answered at once and nothing is stored; the part
    at offset 0 counts as the load (one reference more, as a plain upload of the same bytes), so one unload
    per load sending it drops it. A retried part (an exact repeat) is stored once."""
    with server() as (srv, address):
        first, second = parts_of(WHOLE, 2)
        send_all(address, [first, first])  # a retry of the same part: fine
        assert pending(srv) == 1 and srv.state.registry.held_bytes() == HALF
        send_all(address, [second])
        whole = srv.state.registry._wholes[("", NAME)]
        assert whole.refs == 1
        send_all(address, [second, first])
        assert whole.refs == 2 and pending(srv) == 0 and srv.state.registry.held_bytes() == T
        with InferenceClient(address) as c:
            c.unload_model(NAME)
            assert holds(srv)
            c.unload_model(NAME)
        assert not holds(srv)


# -- refusals -------------------------------------------------------------------------------------------------------


def _without(request: pb.RepositoryModelLoadRequest, *keys: str) -> pb.RepositoryModelLoadRequest:
    for key in keys:
        del request.parameters[key]
    return request


def _with(request: pb.RepositoryModelLoadRequest, key: str, **value) -> pb.RepositoryModelLoadRequest:
    request.parameters[key].Clear()
    for field, v in value.items():
        setattr(request.parameters[key], field, v)
    return request


MALFORMED = {  # what is wrong -> (the request, words its refusal says)
    "not two integers": (_with(part(0, WHOLE[:HALF]), "deepco_part", string_param="0x10/99"), "OFFSET/TOTAL"),
    "three numbers": (_with(part(0, WHOLE[:HALF]), "deepco_part", string_param="0/1/2"), "OFFSET/TOTAL"),
    "no numbers": (_with(part(0, WHOLE[:HALF]), "deepco_part", string_param=""), "OFFSET/TOTAL"),
    "not ascii digits": (_with(part(0, WHOLE[:HALF]), "deepco_part", string_param="\u0663/10"), "OFFSET/TOTAL"),
    "not a string": (_with(part(0, WHOLE[:HALF]), "deepco_part", int64_param=0), "must be a string"),
    "total 0": (part(0, b"x", total=0), ">= 1"),
    "negative offset": (part(-1, WHOLE[:HALF]), ">= 0"),
    "past the end": (part(HALF + 1, WHOLE[HALF:]), "past the whole model"),
    "empty": (part(0, b""), "empty"),
    "no deepco_whole": (_without(part(0, WHOLE[:HALF]), "deepco_whole"), "deepco_whole"),
    "deepco_whole false": (_with(part(0, WHOLE[:HALF]), "deepco_whole", bool_param=False), "deepco_whole"),
    "no sha256": (_without(part(0, WHOLE[:HALF]), "sha256"), "exact 'sha256'"),
    "a short sha256": (part(0, WHOLE[:HALF], sha256=DIGEST[:-1]), "exact 'sha256'"),
    "a sha256 not hex": (part(0, WHOLE[:HALF], sha256=DIGEST[:-1] + "g"), "exact 'sha256'"),
    "a peer too": (_with(part(0, WHOLE[:HALF]), "deepco_peer", string_param="127.0.0.1:9"), "deepco_peer"),
    "no file": (_without(part(0, WHOLE[:HALF]), "file:1/model.onnx"), "no model file"),
    "a name of another digest": (part(0, WHOLE[:HALF], name=content_name_of("net", "ab" * 32)), "content-addressed"),
}


def test_malformed_parts_are_refused_and_nothing_is_stored():
    """Each malformed part is INVALID_ARGUMENT with words naming its problem; nothing is stored or held."""
    with server() as (srv, address):
        for what, (request, words) in MALFORMED.items():
            code, details = send(address, request)
            assert code == INVALID and words in details, (what, code, details)
            assert pending(srv) == 0 and srv.state.registry.held_bytes() == 0, what
        ready(address)


def test_parts_that_disagree_with_earlier_parts_are_refused():
    """Another TOTAL than an earlier part's, a part over an earlier part's bytes, or other bytes for an earlier part's
    range: INVALID_ARGUMENT, and the parts stored stay; the right parts then complete the whole model."""
    with server() as (srv, address):
        send_all(address, [part(0, WHOLE[:HALF])])
        cases = {"another total": (part(HALF, WHOLE[HALF:], total=T + 1), f"an earlier part {T}"),
                 "an overlap": (part(HALF - 10, WHOLE[HALF - 10:]), f"overlaps bytes 0-{HALF}"),
                 "other bytes, same range": (part(0, bytes(HALF)), "other bytes")}
        for what, (request, words) in cases.items():
            code, details = send(address, request)
            assert code == INVALID and words in details, (what, details)
            assert pending(srv) == 1 and srv.state.registry.held_bytes() == HALF, what
        send_all(address, [part(HALF, WHOLE[HALF:])])
        assert holds(srv)


def test_joined_bytes_of_another_digest_are_refused_and_the_parts_dropped():
    """The parts join to bytes whose SHA-256 is not the one they came with: the completing part is INVALID_ARGUMENT
    naming both digests, the parts are dropped and nothing is loaded. Bytes that are no ONNX model are refused as
    their upload would be."""
    other = hashlib.sha256(b"another model").hexdigest()
    with server() as (srv, address):
        first, second = part(0, WHOLE[:HALF], sha256=other, name="w"), part(HALF, WHOLE[HALF:], sha256=other, name="w")
        send_all(address, [second])
        code, details = send(address, first)
        assert code == INVALID and DIGEST[:16] in details and other[:16] in details and "nothing loaded" in details
        assert pending(srv) == 0 and srv.state.registry.held_bytes() == 0 and not holds(srv, "w")
        junk = bytes(range(256)) * 8
        *rest, last = parts_of(junk, 2, name="junk")
        send_all(address, rest)
        code, details = send(address, last)
        assert code == INVALID and "not a valid ONNX model" in details, details
        assert pending(srv) == 0 and srv.state.registry.held_bytes() == 0
        ready(address)


def test_parts_pending_count_against_max_model_bytes():
    """A TOTAL over the room --max-model-bytes leaves is RESOURCE_EXHAUSTED on its first part; the parts pending
    take room as held models do, so that half-sent whole models never hold more than the limit, nor let another
    load take it; the whole model they complete then fits."""
    others = [whole_bytes(seed, channels=(3, 16, 16, 4)) for seed in (1, 2)]
    limit = T + max(len(o) for o in others) // 2 + HALF // 2
    with server(max_model_bytes=limit) as (srv, address):
        code, details = send(address, part(0, b"x", total=limit + 1, name="big", sha256="ab" * 32))
        assert code == EXHAUSTED and "--max-model-bytes" in details
        send_all(address, [part(0, WHOLE[:HALF])])
        send_all(address, parts_of(others[0], 2, name="o1")[:1])  # a half of another: both fit
        held = srv.state.registry.held_bytes()
        assert held == HALF + len(others[0]) // 2 <= limit
        code, details = send(address, parts_of(others[1], 2, name="o2")[0])  # its TOTAL does not fit what is left
        assert code == EXHAUSTED and "--max-model-bytes" in details, details
        with InferenceClient(address) as c, pytest.raises(ServerError) as info:
            c.load_model(others[1], "plain", whole=True)
        assert info.value.code == EXHAUSTED
        assert srv.state.registry.held_bytes() == held
        send_all(address, [part(HALF, WHOLE[HALF:])])  # completes: the parts' room is the whole's
        assert holds(srv) and srv.state.registry.held_bytes() == T + len(others[0]) // 2 <= limit


def test_at_most_a_few_whole_models_are_pending_per_caller():
    """The MAX_PENDING + 1-th whole model being sent in parts at once is RESOURCE_EXHAUSTED; one more part of one
    pending is not."""
    with server() as (srv, address):
        for i in range(whole_parts.MAX_PENDING):
            send_all(address, [part(0, WHOLE[:HALF], name=f"w{i}")])
        code, details = send(address, part(0, WHOLE[:HALF], name="one-more"))
        assert code == EXHAUSTED and f"{whole_parts.MAX_PENDING} whole models" in details, details
        send_all(address, [part(HALF, WHOLE[HALF:], name="w0")])
        assert holds(srv, "w0") and pending(srv) == whole_parts.MAX_PENDING - 1


def test_a_whole_model_in_too_many_parts_is_refused(monkeypatch):
    monkeypatch.setattr(whole_parts, "MAX_PARTS", 3)
    with server() as (srv, address):
        requests = parts_of(WHOLE, 4)
        send_all(address, requests[:3])
        code, details = send(address, requests[3])
        assert code == INVALID and "at most 3 parts" in details
        assert pending(srv) == 1


def test_parts_pending_expire(monkeypatch):
    """A whole model that got no new part for PART_SECONDS is dropped at the next load, whatever it loads: its room
    is free again, and a late part starts over (a retried part is no new part: it keeps nothing alive)."""
    monkeypatch.setattr(whole_parts, "PART_SECONDS", 1.0)
    other = whole_bytes(seed=3, channels=(3, 16, 16, 4))
    with server(max_model_bytes=len(other) + HALF - 1) as (srv, address), InferenceClient(address) as c:
        first, second = parts_of(WHOLE, 2)
        send_all(address, [first])
        with pytest.raises(ServerError) as info:  # the half pending leaves no room for it
            c.load_model(other, "plain", whole=True)
        assert info.value.code == EXHAUSTED
        time.sleep(0.3)
        send_all(address, [first])
        time.sleep(0.9)
        c.load_model(other, "plain", whole=True)  # the half pending expired: room again
        assert pending(srv) == 0 and srv.state.registry.held_bytes() == len(other)
        c.unload_model("plain")
        send_all(address, [second])
        assert pending(srv) == 1 and not holds(srv) and srv.state.registry.held_bytes() == T - HALF


def test_the_joined_bytes_count_against_max_held_bytes():
    """Each part's call holds its request's bytes as any load does (a part over --max-held-bytes is refused), and the
    joined whole model's bytes count too: a whole model larger than the budget lets a call hold is refused
    RESOURCE_EXHAUSTED (as its upload would be), its parts kept; a retry of a part joins them once there is room."""
    with server(max_held_bytes=T) as (srv, address):
        code, details = send(address, part(0, WHOLE + bytes(T), total=2 * T + 1, name="big"))
        assert code == EXHAUSTED and "--max-held-bytes" in details, details
        first, second = parts_of(WHOLE, 2)
        send_all(address, [first])
        code, details = send(address, second)
        assert code == EXHAUSTED and "--max-held-bytes" in details, details
        assert not holds(srv) and pending(srv) == 1
        srv.budgets._held.limit = 4 * T
        send_all(address, [first])
        assert holds(srv) and pending(srv) == 0 and srv.state.registry.held_bytes() == T
        wait_until(lambda: srv.budgets.held_bytes == 0, 5, "the calls' bytes given back")


def test_a_draining_server_refuses_parts():
    with server() as (srv, address):
        srv.state.draining.set()
        code, details = send(address, part(0, WHOLE[:HALF]))
        assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
        assert pending(srv) == 0


def test_the_server_advertises_parts_only_where_it_holds_whole_models():
    with server() as (_, address), InferenceClient(address) as c:
        assert "deepco_whole_parts" in c.server_metadata()["extensions"]
    with server(derive_stages=False) as (srv, address), InferenceClient(address) as c:
        assert "deepco_whole_parts" not in c.server_metadata()["extensions"]
        code, details = send(address, part(0, WHOLE[:HALF]))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "--no-derive-stages" in details
        assert pending(srv) == 0


def test_an_attack_with_parts_leaves_the_server_up_and_within_its_bounds(monkeypatch):
    """Threads send parts of random offsets, sizes, totals, digests and names while the server is asked ServerReady
    and Health/Check: every refusal is a status, what is pending never passes --max-model-bytes nor MAX_PENDING
    whole models, and once the attack's parts expire a device's parts load."""
    monkeypatch.setattr(whole_parts, "PART_SECONDS", 0.5)
    limit = 4 * T
    with server(max_model_bytes=limit) as (srv, address):
        stop = threading.Event()
        seen: set[grpc.StatusCode] = set()
        worst: list[int] = [0, 0]

        def attack(seed: int) -> None:
            rng = np.random.default_rng(seed)
            with make_channel(address) as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                while not stop.is_set():
                    total = int(rng.choice([1, T, limit, 10 * limit, 1 << 62]))
                    offset = int(rng.integers(-2, min(total, T) + 2))
                    data = rng.bytes(int(rng.integers(0, T)))
                    request = part(offset, data, total=total, name=f"a{rng.integers(6)}",
                                   sha256=DIGEST if rng.random() < 0.5 else hashlib.sha256(data).hexdigest())
                    if rng.random() < 0.2:
                        request.parameters["deepco_part"].string_param = rng.choice(["", "1/", "/1", "1//2", "9" * 30])
                    try:
                        stub.RepositoryModelLoad(request, timeout=10)
                        seen.add(OK)
                    except grpc.RpcError as exc:
                        seen.add(exc.code())
                    worst[0] = max(worst[0], srv.state.registry.held_bytes())
                    worst[1] = max(worst[1], pending(srv))

        threads = [threading.Thread(target=attack, args=(seed,)) for seed in range(3)]
        for thread in threads:
            thread.start()
        try:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                ready(address)
                time.sleep(0.1)
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
        assert seen <= {OK, INVALID, EXHAUSTED}, seen
        assert INVALID in seen and EXHAUSTED in seen
        assert worst[0] <= limit and worst[1] <= whole_parts.MAX_PENDING
        time.sleep(0.6)
        ready(address)
        send_all(address, parts_of(WHOLE, 2))
        assert holds(srv)


# -- the parts' bookkeeping, without a server -------------------------------------------------------------------------


def test_parts_are_kept_per_identity():
    """Parts of the same whole model sent by two identities never join each other's; each joins its own."""
    registry = Registry(choose_runtime("cpu", 1), 8)
    parts = whole_parts.WholeParts(registry)
    first, second = (whole_parts.Part(DIGEST, 0, T, WHOLE[:HALF]), whole_parts.Part(DIGEST, HALF, T, WHOLE[HALF:]))
    parts.load(NAME, first, "alice")
    parts.load(NAME, second, "bob")
    assert registry.held_bytes() == T and not registry._wholes
    parts.load(NAME, second, "alice")
    assert set(registry._wholes) == {("alice", NAME)} and registry.held_bytes() == T + (T - HALF)
