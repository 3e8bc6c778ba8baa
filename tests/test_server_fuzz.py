"""Fuzzing the server: thousands of malformed and invalid requests are each answered with an error status,
promptly; the server neither crashes nor grows, and still answers a valid request correctly afterwards.
Hostile and mutated model uploads (external data, nested subgraphs, value-dependent shapes, flipped bytes)
are refused with the right status, or served without a server error."""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from deepco_server.app import ServeConfig, Server
from deepco_server.budgets import PROBE_METHODS
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_server_attacks import bombs, nested_if, reader_models
from test_server_support import conv_model, reference, serve_process

from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire import inference_pb2 as pb
from deepco.wire.client import InferenceClient, ServerError
from deepco.wire.tensors import encode_request

MODEL = conv_model(channels=(3, 4))
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
REFUSED = {INVALID, NOT_FOUND}
CALL_TIMEOUT = 10.0  # per call: an answer that takes longer counts as a hang (DEADLINE_EXCEEDED fails the test)
FUZZ_REQUESTS = 10_000
THREADS = 4
# Allowed growth of the server's resident memory over the 10,000 requests, after a warm-up of 1,000. The
# requests are < 2 KB each: a leak of even one request per call would be > 20 MB; gRPC and the allocator
# settle within a few MB.
RSS_GROWTH_BOUND_KB = 16 * 1024
# A message that declares a 2**31-byte field and ends: never parses, whatever comes before it.
TRUNCATED_FIELD = b"\x0a\xff\xff\xff\x0f"


def _methods() -> list[tuple[str, type, bool]]:
    """(path, request class, client-streaming) of every method of both services, from their descriptors
    (so methods added later are fuzzed too)."""
    out = []
    for module in (pb, dpb):
        for service in module.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                cls = getattr(pb if m.input_type.file.name == pb.DESCRIPTOR.name else dpb, m.input_type.name)
                out.append((f"/{service.full_name}/{m.name}", cls, m.client_streaming))
    return out


METHODS = _methods()
X = np.random.default_rng(0).standard_normal((1, 3, 4, 4)).astype(np.float32)
VALID_INFER = encode_request("conv", {"input": X}).SerializeToString()


def _load_request(model_bytes: bytes, name: str = "fuzzed", path: str = "1/model.onnx",
                  sha256: str | None = None) -> bytes:
    request = pb.RepositoryModelLoadRequest(model_name=name)
    request.parameters[f"file:{path}"].bytes_param = model_bytes
    if sha256 is not None:
        request.parameters["sha256"].string_param = sha256
    return request.SerializeToString()


VALID_LOAD = _load_request(MODEL)


def _bad_tensor_request(rng: random.Random) -> bytes:
    """A well-formed ModelInferRequest that is wrong in one way the server must refuse."""
    request = encode_request("conv", {"input": X})
    tensor = request.inputs[0]
    fault = rng.randrange(9)
    if fault == 0:  # wrong or unknown datatype (with the byte length that datatype would need)
        tensor.datatype = rng.choice(["FP64", "INT32", "UINT8", "FP16", "BOOL", "BF16", "", "fp32", "STRING"])
        size = {"FP64": 8, "INT32": 4, "UINT8": 1, "FP16": 2, "BOOL": 1}.get(tensor.datatype, 4)
        request.raw_input_contents[0] = bytes(48 * size)
    elif fault == 1:  # absurd shape, tiny payload
        del tensor.shape[:]
        tensor.shape.extend(rng.choice([10**12, 2**62, 2**63 - 1, 2**32]) for _ in range(rng.randint(1, 6)))
        request.raw_input_contents[0] = bytes(rng.choice([0, 4, 16]))
    elif fault == 2:  # a huge declared size (a 4k x 4k frame of 1e6 channels) with a tiny payload
        del tensor.shape[:]
        tensor.shape.extend([1, 10**6, 4096, 4096])
        request.raw_input_contents[0] = bytes(16)
    elif fault == 3:  # byte length off by a little
        raw = request.raw_input_contents[0]
        request.raw_input_contents[0] = raw[:-rng.randint(1, 8)] if rng.random() < 0.5 else raw + bytes(4)
    elif fault == 4:  # unknown model or version
        if rng.random() < 0.5:
            request.model_name = "".join(rng.choices("abcxyz-_./ ", k=rng.randint(1, 40)))
        else:
            request.model_version = str(rng.randint(2, 10**6))
    elif fault == 5:  # rank too high or too low, or a negative dimension
        del tensor.shape[:]
        tensor.shape.extend(rng.choice([[1] * 40, [48], [1, 3, -4, -4], [1, 3, 4, 4, 1]]))
    elif fault == 6:  # raw contents count does not match the inputs
        request.raw_input_contents.append(bytes(rng.randint(0, 8)))
    elif fault == 7:  # typed contents with the wrong count
        del request.raw_input_contents[:]
        tensor.contents.fp32_contents.extend([0.5] * rng.randint(0, 47))
    else:  # an input or output the model does not have
        if rng.random() < 0.5:
            tensor.name = "image"
        else:
            request.outputs.add(name="logits")
    return request.SerializeToString()


def _bad_other_request(rng: random.Random) -> tuple[str, bytes]:
    """An invalid request to a method other than ModelInfer."""
    fault = rng.randrange(7)
    if fault == 0:
        shape = rng.choice([[10**12] * 4, [1, 3, 2**40, 2**40], [1, 3], [1] * 40, [1, 3, -1, 8]])
        return "/deepco.DeepcoService/Profile", dpb.ProfileRequest(model_name="conv", shape=shape,
                                                                   runs=1).SerializeToString()
    if fault == 1:
        return "/deepco.DeepcoService/Echo", dpb.EchoRequest(reply_bytes=2**32 - 1).SerializeToString()
    if fault == 2:
        return "/inference.GRPCInferenceService/ModelMetadata", pb.ModelMetadataRequest(
            name=f"missing{rng.randrange(10**6)}").SerializeToString()
    if fault == 3:
        return "/inference.GRPCInferenceService/RepositoryModelUnload", pb.RepositoryModelUnloadRequest(
            model_name=f"missing{rng.randrange(10**6)}").SerializeToString()
    if fault == 4:  # garbage ONNX, a wrong digest, or a bad file parameter
        choice = rng.randrange(3)
        if choice == 0:
            body = _load_request(rng.randbytes(rng.randint(0, 64)))
        elif choice == 1:
            body = _load_request(MODEL, sha256=hashlib.sha256(rng.randbytes(8)).hexdigest())
        else:
            body = _load_request(MODEL, path=rng.choice(["model.onnx", "x/model.onnx", "1/a/b.onnx", "1/model.pt"]))
        return "/inference.GRPCInferenceService/RepositoryModelLoad", body
    if fault == 5:  # a truncated valid load
        return "/inference.GRPCInferenceService/RepositoryModelLoad", VALID_LOAD[:rng.randrange(len(VALID_LOAD))]
    return "/deepco.DeepcoService/Run", _bad_tensor_request(rng)


def _garbage(rng: random.Random, cls: type) -> bytes:
    """Random bytes that do not parse as ``cls``."""
    while True:
        data = rng.randbytes(rng.randint(0, 48)) + (TRUNCATED_FIELD if rng.random() < 0.7 else b"")
        try:
            cls.FromString(data)
        except Exception:
            return data


def _fuzz_case(rng: random.Random) -> tuple[str, bytes, bool]:
    """(method path, request bytes, client-streaming) of one bad request."""
    roll = rng.random()
    if roll < 0.3:  # random bytes to every method
        path, cls, streaming = rng.choice(METHODS)
        return path, _garbage(rng, cls), streaming
    if roll < 0.45:  # a truncated valid request
        path = rng.choice(["/inference.GRPCInferenceService/ModelInfer", "/deepco.DeepcoService/Run"])
        return path, VALID_INFER[:rng.randrange(len(VALID_INFER))], False
    if roll < 0.8:
        return "/inference.GRPCInferenceService/ModelInfer", _bad_tensor_request(rng), False
    path, body = _bad_other_request(rng)
    return path, body, False


def _caller(channel: grpc.Channel) -> Callable[[str, bytes, bool], grpc.StatusCode]:
    """Send raw bytes to a method (identity serializers) and return the status it ends with."""
    calls: dict[str, Callable] = {}

    def call(path: str, body: bytes, client_streaming: bool) -> grpc.StatusCode:
        server_streaming = path.endswith(("/Run", "/SplitRun"))
        if path not in calls:
            make = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                    (True, False): channel.stream_unary, (True, True): channel.stream_stream}
            calls[path] = make[client_streaming, server_streaming](path)
        method = calls[path]
        try:
            result = method(iter([body]) if client_streaming else body, timeout=CALL_TIMEOUT)
            if server_streaming:
                for _ in result:
                    pass
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    return call


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _blast(address: str, count: int, seed: int) -> tuple[Counter, list[str]]:
    """Send ``count`` bad requests from THREADS threads; (status counts, descriptions of wrong answers)."""
    codes: Counter = Counter()
    wrong: list[str] = []
    lock = threading.Lock()

    def work(k: int) -> None:
        rng = random.Random(seed * 100 + k)
        try:
            with grpc.insecure_channel(address) as channel:
                call = _caller(channel)
                for _ in range(count // THREADS + (k < count % THREADS)):
                    path, body, streaming = _fuzz_case(rng)
                    code = call(path, body, streaming)
                    with lock:
                        codes[code] += 1
                        # Probes never read their body (server.budgets): whatever it holds, they answer.
                        if code not in REFUSED and not (path in PROBE_METHODS and code == grpc.StatusCode.OK):
                            wrong.append(f"{path} {code.name} {body[:60]!r}")
        except Exception as exc:  # a bug of the test itself must fail it, not vanish with the thread
            with lock:
                wrong.append(f"thread {k}: {exc!r}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes, wrong


def test_ten_thousand_bad_requests_are_refused_and_the_server_survives() -> None:
    with serve_process("--threads", "1", "--device", "cpu") as server:
        with InferenceClient(server.address, timeout=10) as c:
            c.load_model(MODEL, "conv")
        _blast(server.address, 1000, seed=1)  # warm-up: thread pools, gRPC buffers, allocator arenas
        rss_before = _rss_kb(server.proc.pid)
        start = time.perf_counter()
        codes, wrong = _blast(server.address, FUZZ_REQUESTS, seed=2)
        seconds = time.perf_counter() - start
        rss_after = _rss_kb(server.proc.pid)
        print(f"\nfuzz: {sum(codes.values())} bad requests in {seconds:.1f}s "
              f"({sum(codes.values()) / seconds:.0f}/s), codes {dict((k.name, v) for k, v in codes.items())}, "
              f"server RSS {rss_before} -> {rss_after} kB")
        assert server.proc.poll() is None, "the server died"
        assert sum(codes.values()) == FUZZ_REQUESTS
        assert not wrong, f"{len(wrong)} requests not refused as expected, e.g. {wrong[:5]}"
        assert rss_after - rss_before < RSS_GROWTH_BOUND_KB, (rss_before, rss_after)
        with InferenceClient(server.address, timeout=10) as c:  # and a valid request is still served right
            np.testing.assert_allclose(c.infer("conv", X), reference(MODEL, X), rtol=0, atol=1e-5)
            assert c.loaded_models() == ["conv"]  # no bad load slipped in


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server(ServeConfig(port=0, device="cpu", threads=1))
    with InferenceClient(srv.address, timeout=10) as c:
        c.load_model(MODEL, "conv")
    yield srv
    srv.stop(grace=1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(index=st.integers(0, len(METHODS) - 1), data=st.binary(max_size=120))
def test_hypothesis_raw_bytes_to_every_method(server: Server, index: int, data: bytes) -> None:
    path, cls, streaming = METHODS[index]
    with grpc.insecure_channel(server.address) as channel:
        code = _caller(channel)(path, data, streaming)
    if path in PROBE_METHODS:  # never read (server.budgets): a body that does not parse cannot hold a thread
        assert code == grpc.StatusCode.OK, (path, code, data)
        return
    try:
        cls.FromString(data)
    except Exception:
        assert code == INVALID, (path, code, data)  # unparsable: INVALID_ARGUMENT, never INTERNAL
        return
    # It parsed (random bytes often do): any answer but a server error, and no hang.
    assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED), \
        (path, code, data)


tensor_faults = st.fixed_dictionaries({
    "datatype": st.sampled_from(["FP32", "FP64", "INT64", "UINT8", "FP16", "BOOL", "X", ""]),
    "shape": st.lists(st.integers(-2, 2**63 - 1) | st.sampled_from([0, 1, 3, 4, 10**12]), max_size=8),
    "raw": st.binary(max_size=256),
    "model": st.sampled_from(["conv", "other", ""]),
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fault=tensor_faults)
def test_hypothesis_tensors_match_local_validation(server: Server, fault: dict) -> None:
    request = pb.ModelInferRequest(model_name=fault["model"])
    request.inputs.add(name="input", datatype=fault["datatype"], shape=fault["shape"])
    request.raw_input_contents.append(fault["raw"])
    with grpc.insecure_channel(server.address) as channel:
        code = _caller(channel)("/inference.GRPCInferenceService/ModelInfer", request.SerializeToString(), False)
    # What a correct server must say: only FP32 of rank 4 with 3 channels and a byte length that matches runs.
    shape = fault["shape"]
    size = 4 * int(np.prod([max(d, 0) for d in shape], dtype=object)) if shape else 4
    valid = (fault["model"] == "conv" and fault["datatype"] == "FP32" and len(shape) == 4 and shape[1] == 3
             and min(shape) >= 0 and len(fault["raw"]) == size)
    if not valid:
        assert code in REFUSED, (fault, code)
    else:  # tiny valid inputs: a 3x3 conv with padding runs on any H, W >= 1; an empty one ORT may refuse
        assert code in (grpc.StatusCode.OK, INVALID), (fault, code)


# ---- model uploads: external data, nested subgraphs, value-dependent shapes, mutated files ----------------
def _hostile_model(kind: str, variant: int) -> tuple[bytes, set[grpc.StatusCode], dict[str, np.ndarray] | None]:
    """(model, the load refusals allowed, inputs whose run must be refused RESOURCE_EXHAUSTED if it loads)."""
    if kind == "external":
        models = list(reader_models().values())
        return models[variant % len(models)], {INVALID}, None
    if kind == "nested":
        return nested_if(1 + variant % 16), {grpc.StatusCode.RESOURCE_EXHAUSTED}, None
    cases = list(bombs().values())
    model, inputs = cases[variant % len(cases)]
    return model, set(), inputs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["external", "nested", "bomb"]), variant=st.integers(0, 1000))
def test_hypothesis_hostile_model_uploads_are_refused(server: Server, kind: str, variant: int) -> None:
    model, refusals, inputs = _hostile_model(kind, variant)
    with InferenceClient(server.address, timeout=CALL_TIMEOUT) as c:
        name = f"hostile-{kind}-{variant}"
        try:
            c.load_model(model, name)
        except ServerError as exc:
            assert exc.code in refusals, (kind, variant, exc.code, exc.details)
        else:
            assert not refusals, (kind, variant, "loaded")
            assert inputs is not None
            with pytest.raises(ServerError) as info:
                c.infer_many(name, inputs)
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (kind, variant, info.value.details)
            c.unload_model(name)
        assert c.server_ready(timeout=1.0)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.tuples(st.integers(0, len(MODEL) - 1), st.integers(1, 255)), min_size=1, max_size=8))
@example(flips=[(98, 128)])  # a name that is not UTF-8 once read (found by CI's run of this test: INTERNAL)
def test_hypothesis_mutated_model_files_are_refused_or_served(server: Server, flips: list[tuple[int, int]]) -> None:
    data = bytearray(MODEL)
    for at, xor in flips:
        data[at] ^= xor
    with InferenceClient(server.address, timeout=CALL_TIMEOUT) as c:
        try:
            c.load_model(bytes(data), "mutant")
        except ServerError as exc:
            # A broken file is refused by what is wrong with it; never a server error, never a hang.
            assert exc.code in (INVALID, grpc.StatusCode.RESOURCE_EXHAUSTED), (exc.code, exc.details)
        else:
            try:
                c.infer_many("mutant", {"input": X})
            except ServerError as exc:
                assert exc.code in (INVALID, NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED), (exc.code, exc.details)
            finally:
                c.unload_model("mutant")
        assert c.server_ready(timeout=1.0)
        assert c.loaded_models() == ["conv"]
