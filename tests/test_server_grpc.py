"""The server in-process on a real loopback socket: statuses, dynamic shapes, limits, health, Profile."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from deepco_server.app import ServeConfig, Server
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_server_support import conv_model, reference

from deepco.wire import inference_pb2 as pb
from deepco.wire import inference_pb2_grpc as pb_grpc
from deepco.wire.client import InferenceClient, ServerError
from deepco.wire.tensors import encode_request

MODEL = conv_model()
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server(ServeConfig(port=0, device="cpu", threads=1, max_models=2, max_inflight=4))
    yield srv
    srv.stop(grace=1)


@pytest.fixture()
def client(server: Server) -> Iterator[InferenceClient]:
    with InferenceClient(server.address) as c:
        c.load_model(MODEL, "conv")
        yield c
        for name in c.loaded_models():
            c.unload_model(name)


@pytest.fixture()
def stub(server: Server) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def _status(call, *args) -> tuple[grpc.StatusCode, str]:
    """The (code, message) a call fails with; fails the test if it succeeds."""
    with pytest.raises((ServerError, grpc.RpcError)) as info:
        call(*args)
    exc = info.value
    if isinstance(exc, ServerError):
        return exc.code, exc.details
    return exc.code(), exc.details()


def _x(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_health_metadata_and_dynamic_shapes(server: Server, client: InferenceClient) -> None:
    assert client.server_live() and client.server_ready()
    meta = client.server_metadata()
    assert meta["deepco_device"] == "cpu" and meta["deepco_execution_provider"] == "CPUExecutionProvider"
    assert meta["deepco_intra_op_threads"] == "1"
    assert server.state.registry.get("conv").session.get_session_options().intra_op_num_threads == 1
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    # The same loaded model takes any batch, height and width.
    for shape in ((1, 3, 16, 16), (1, 3, 17, 40), (2, 3, 64, 9), (1, 3, 1, 1)):
        x = _x(*shape)
        np.testing.assert_allclose(client.infer("conv", x), reference(MODEL, x), rtol=0, atol=1e-5)


def test_typed_contents_are_accepted(client: InferenceClient, stub) -> None:
    # KServe-style clients send InferTensorContents instead of raw bytes.
    x = _x(1, 3, 5, 6)
    request = pb.ModelInferRequest(model_name="conv")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=x.shape)
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    reply = stub.ModelInfer(request, timeout=10)
    assert list(reply.outputs[0].shape) == [1, 4, 5, 6]
    y = np.frombuffer(reply.raw_output_contents[0], "<f4").reshape(1, 4, 5, 6)
    np.testing.assert_allclose(y, reference(MODEL, x), rtol=0, atol=1e-5)


def test_messages_over_grpcs_4mib_default_pass(client: InferenceClient) -> None:
    small = conv_model(channels=(3, 2))
    client.load_model(small, "small")
    x = _x(1, 3, 1000, 1200)  # 14.4 MB in, 9.6 MB out
    np.testing.assert_allclose(client.infer("small", x), reference(small, x), rtol=0, atol=1e-5)


def test_unknown_model_and_version_are_not_found(client: InferenceClient, stub) -> None:
    x = _x(1, 3, 8, 8)
    code, msg = _status(client.infer_many, "nope", {"input": x})
    assert code == grpc.StatusCode.NOT_FOUND and "model 'nope' is not loaded (loaded: 'conv')" in msg
    assert _status(client.model_metadata, "nope")[0] == grpc.StatusCode.NOT_FOUND
    assert _status(client.unload_model, "nope")[0] == grpc.StatusCode.NOT_FOUND
    assert _status(client.profile, "nope", [1, 3, 8, 8])[0] == grpc.StatusCode.NOT_FOUND
    code, msg = _status(stub.ModelInfer, encode_request("conv", {"input": x}, model_version="7"))
    assert code == grpc.StatusCode.NOT_FOUND and "no version '7'" in msg
    assert not client.model_ready("nope")


@pytest.mark.parametrize(("inputs", "fragment"), [
    ({"input": np.zeros((1, 3, 8, 8), np.float64)}, "input 'input' has datatype FP64, expected FP32"),
    ({"input": np.zeros((1, 3, 8, 8), np.int32)}, "input 'input' has datatype INT32, expected FP32"),
    ({"input": np.zeros((3, 8, 8), np.float32)}, "input 'input' has shape [3, 8, 8], expected [-1, 3, -1, -1]"),
    ({"input": np.zeros((1, 5, 8, 8), np.float32)}, "input 'input' has shape [1, 5, 8, 8]"),
    ({"other": np.zeros((1, 3, 8, 8), np.float32)}, "model 'conv' has no input 'other' (inputs: input)"),
    ({}, "input 'input' is missing"),
])
def test_bad_inputs_are_invalid_argument(client: InferenceClient, inputs: dict, fragment: str) -> None:
    code, msg = _status(client.infer_many, "conv", inputs)
    assert code == INVALID and fragment in msg


def test_malformed_tensors_are_invalid_argument(client: InferenceClient, stub) -> None:
    x = _x(1, 3, 4, 4)
    short = encode_request("conv", {"input": x})
    short.raw_input_contents[0] = short.raw_input_contents[0][:-4]
    code, msg = _status(stub.ModelInfer, short)
    assert code == INVALID and "188 bytes of raw data, but shape [1, 3, 4, 4] of FP32 needs 192" in msg

    odd = encode_request("conv", {"input": x})
    odd.inputs[0].datatype = "BF16"
    code, msg = _status(stub.ModelInfer, odd)
    assert code == INVALID and "unsupported datatype 'BF16'" in msg

    extra_raw = encode_request("conv", {"input": x})
    extra_raw.raw_input_contents.append(b"")
    code, msg = _status(stub.ModelInfer, extra_raw)
    assert code == INVALID and "1 inputs but 2 raw_input_contents" in msg

    negative = encode_request("conv", {"input": x})
    negative.inputs[0].shape[2] = -4
    code, msg = _status(stub.ModelInfer, negative)
    assert code == INVALID and "negative dimension" in msg

    bad_output = encode_request("conv", {"input": x}, outputs=["logits"])
    code, msg = _status(stub.ModelInfer, bad_output)
    assert code == INVALID and "model 'conv' has no output 'logits' (outputs: output)" in msg


def test_input_the_graph_cannot_take_is_invalid_argument(client: InferenceClient) -> None:
    client.load_model(conv_model(channels=(3, 4), pad=0), "nopad")
    code, msg = _status(client.infer, "nopad", _x(1, 3, 2, 2))  # smaller than the 3x3 kernel
    assert code == INVALID and "model 'nopad' cannot run on this input:" in msg and "Invalid input shape" in msg
    assert client.infer("nopad", _x(1, 3, 3, 3)).shape == (1, 4, 1, 1)


def test_bad_loads_are_invalid_argument(client: InferenceClient, stub) -> None:
    code, msg = _status(client.load_model, b"\x08\x01garbage", "junk")
    assert code == INVALID and "model 'junk' is not a valid ONNX model" in msg
    code, msg = _status(client.load_model, MODEL[: len(MODEL) // 2], "truncated")
    assert code == INVALID and "not a valid ONNX model" in msg
    # found by the mutated-upload fuzzing: a tensor name that is not UTF-8 was INTERNAL
    code, msg = _status(client.load_model, MODEL.replace(b"input", b"\xce\xffput"), "not-utf8")
    assert code == INVALID and "not a valid ONNX model" in msg

    no_file = pb.RepositoryModelLoadRequest(model_name="conv2")
    no_file.parameters["config"].string_param = "{}"
    code, msg = _status(stub.RepositoryModelLoad, no_file)
    assert code == INVALID and "file:1/model.onnx" in msg

    bad_config = pb.RepositoryModelLoadRequest(model_name="conv2")
    bad_config.parameters["config"].string_param = "{not json"
    bad_config.parameters["file:1/model.onnx"].bytes_param = MODEL
    code, msg = _status(stub.RepositoryModelLoad, bad_config)
    assert code == INVALID and "'config' is not valid JSON" in msg

    two_files = pb.RepositoryModelLoadRequest(model_name="conv2")
    two_files.parameters["file:1/model.onnx"].bytes_param = MODEL
    two_files.parameters["file:1/weights.bin"].bytes_param = b"x"
    code, msg = _status(stub.RepositoryModelLoad, two_files)
    assert code == INVALID and "exactly one" in msg

    assert client.loaded_models() == ["conv"]  # nothing half-loaded


def test_max_models_bound(client: InferenceClient) -> None:
    client.load_model(MODEL, "second")  # the fixture's server allows 2
    code, msg = _status(client.load_model, MODEL, "third")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-models" in msg
    client.load_model(MODEL, "second")  # the same file again: one more reference, no new place
    client.unload_model("second")  # drops that reference: still loaded
    x = _x(1, 3, 8, 8)
    np.testing.assert_allclose(client.infer("second", x), reference(MODEL, x), rtol=0, atol=1e-5)
    client.unload_model("second")
    client.load_model(MODEL, "third")
    assert sorted(client.loaded_models()) == ["conv", "third"]


def test_profile_measures_the_loaded_model(client: InferenceClient) -> None:
    result = client.profile("conv", [1, 3, 32, 32], runs=5, warmup=1)
    assert len(result.run_seconds) == 5 and all(t > 0 for t in result.run_seconds)
    assert result.seconds == sorted(result.run_seconds)[2]
    assert result.execution_provider == "CPUExecutionProvider"
    code, msg = _status(client.profile, "conv", [1, 3, 32], 5, 0)
    assert code == INVALID and "shape [1, 3, 32]" in msg
    code, msg = _status(client.profile, "conv", [1, 3, 8, 8], 100000, 0)
    assert code == INVALID and "runs must be <= 1000" in msg


def test_the_compute_probe_is_kilobytes_and_its_work_is_what_the_device_counts(client: InferenceClient) -> None:
    """The device times servers on a small probe (device/measuring.py), not on the model: tens of MB that
    every server was sent at every cold start."""
    from deepco_device.measuring import PROBE_FLOPS, probe_model, probe_shape
    from onnx import numpy_helper

    model = probe_model()
    data = model.SerializeToString()
    assert len(data) < 200_000
    shape, flops = probe_shape(1e12)  # a big model's head: the probe's work is capped
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    (weight,) = [numpy_helper.to_array(t) for t in model.graph.initializer]
    assert flops == len(convs) * 2 * weight.size * shape[2] * shape[3] <= PROBE_FLOPS  # a MAC per weight per pixel
    client.load_model(data, "probe")
    result = client.profile("probe", shape, runs=2, warmup=1)
    assert len(result.run_seconds) == 2 and result.seconds > 0


def test_concurrent_clients_get_their_own_answers(server: Server, client: InferenceClient) -> None:
    inputs = [_x(1, 3, 10 + i, 12, seed=i) for i in range(8)]
    answers: list[np.ndarray | None] = [None] * len(inputs)
    errors: list[BaseException] = []
    # 8 threads, at most as many calls in flight as the server has compute slots: none may be refused. (The
    # server frees a slot before it answers, so a thread's next call never finds its own slot still taken.)
    slots = threading.Semaphore(server.state.admission.limit)
    start = threading.Barrier(len(inputs))

    def work(i: int) -> None:
        try:
            start.wait(timeout=30)
            with slots:
                answers[i] = client.infer("conv", inputs[i])
        except BaseException as exc:  # reported by the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for x, y in zip(inputs, answers, strict=True):
        assert y is not None
        np.testing.assert_allclose(y, reference(MODEL, x), rtol=0, atol=1e-5)


class _GatedSession:
    """An ORT session whose runs wait for ``release`` (with a deadline), so a test decides how long a request
    holds its compute slot; ``entered`` is set once a run holds it."""

    def __init__(self, session: object, timeout: float = 60.0):
        self._session, self._timeout = session, timeout
        self.entered, self.release = threading.Event(), threading.Event()

    def run(self, *args: object, **kwargs: object) -> object:
        self.entered.set()
        if not self.release.wait(self._timeout):
            raise AssertionError("the test never released the gated run")
        return self._session.run(*args, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self._session, name)


def test_in_flight_bound_refuses_the_excess_and_keeps_control_rpcs_answering() -> None:
    srv = Server(ServeConfig(port=0, device="cpu", threads=1, max_inflight=1))
    gate: _GatedSession | None = None
    try:
        with InferenceClient(srv.address) as c:
            c.load_model(MODEL, "slow")
            c.load_model(MODEL, "conv")
            loaded = srv.state.registry.get("slow")
            gate = loaded.session = _GatedSession(loaded.session)
            held = _x(1, 3, 16, 16)
            outcome: dict[str, object] = {}

            def run_slow() -> None:
                outcome["y"] = c.infer("slow", held)
                outcome["done"] = time.perf_counter()

            worker = threading.Thread(target=run_slow)
            worker.start()
            assert gate.entered.wait(30), "the held request never reached its compute slot"
            code, msg = _status(c.infer, "conv", _x(1, 3, 8, 8))
            refused_at = time.perf_counter()
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-inflight" in msg
            assert _status(c.profile, "conv", [1, 3, 8, 8])[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert c.server_ready() and c.model_ready("conv")  # control RPCs still answered
            assert "done" not in outcome  # the refusals happened while the held request ran
            gate.release.set()
            worker.join(timeout=60)
            assert outcome["done"] > refused_at
            np.testing.assert_allclose(outcome["y"], reference(MODEL, held), rtol=0, atol=1e-5)
            x = _x(1, 3, 8, 8)  # and once the slot is free, requests are served again
            np.testing.assert_allclose(c.infer("conv", x), reference(MODEL, x), rtol=0, atol=1e-5)
    finally:
        if gate is not None:
            gate.release.set()  # a failed assertion must not leave the held run waiting out its deadline
        srv.stop(grace=1)


def test_stop_drains_and_reports_not_ready() -> None:
    srv = Server(ServeConfig(port=0, device="cpu", threads=1))
    with InferenceClient(srv.address) as c:
        c.load_model(MODEL, "conv")
        assert c.server_ready()
        srv.state.draining.set()  # what stop() does first, observed before the socket closes
        assert not c.server_ready() and not c.model_ready("conv")
        srv.stop(grace=1)
        assert _status(c.server_live)[0] == grpc.StatusCode.UNAVAILABLE


def test_budget_classes_follow_each_handlers_streaming_flags() -> None:
    """The stream budget is derived from the handlers' flags; it must give exactly the streams named before."""
    from deepco_server.budgets import CONTROL, PROBE, STREAM, WORK, budget_class
    from deepco_server.service import DeepcoServicer, InferenceServicer
    from grpc_health.v1 import health

    from deepco.wire import deepco_service_pb2_grpc as dpb_grpc

    class Capture:  # what the generated add_*_to_server functions register, by full method name
        def __init__(self) -> None:
            self.handlers: dict[str, grpc.RpcMethodHandler] = {}

        def add_generic_rpc_handlers(self, handlers: object) -> None:
            pass

        def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
            self.handlers.update({f"/{service}/{name}": h for name, h in handlers.items()})

    capture = Capture()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer.__new__(InferenceServicer), capture)
    dpb_grpc.add_DeepcoServiceServicer_to_server(DeepcoServicer.__new__(DeepcoServicer), capture)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), capture)
    classes: dict[str, set[str]] = {}
    for method, handler in capture.handlers.items():
        classes.setdefault(budget_class(handler, method), set()).add(method.rpartition("/")[2])
    assert classes[STREAM] == {"Watch", "Run", "SplitRun", "SplitExchange", "FetchWhole"}
    assert classes[PROBE] == {"ServerLive", "ServerReady", "Check"}
    assert classes[WORK] == {"ModelInfer", "RepositoryModelLoad", "Profile", "Echo", "ProbePeer"}
    assert classes[CONTROL] == {"ServerMetadata", "ModelReady", "ModelMetadata", "ModelConfig", "ModelStatistics",
                                "RepositoryIndex", "RepositoryModelUnload"}


def test_every_fault_kind_maps_to_the_grpc_status_of_its_name() -> None:
    from deepco_server.errors import Kind, NotFound, ServerFault, invalid
    from deepco_server.service import status_of

    from deepco.wire.tensors import TensorError

    for kind in Kind:
        assert status_of(ServerFault("x", kind)) == grpc.StatusCode[kind.name]
    assert status_of(NotFound("x")) == grpc.StatusCode.NOT_FOUND and status_of(invalid("x")) == INVALID
    assert status_of(TensorError("x")) == INVALID
    assert status_of(ValueError("x")) is None  # a bug of ours: answered INTERNAL, with a logged traceback
