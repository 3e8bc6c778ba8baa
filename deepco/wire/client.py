"""A small blocking client for `deepco serve` (or any Open Inference Protocol gRPC server).

Used by the tests and by the device. Every failure the server reports becomes a :class:`ServerError`
(a UserError: one line, naming the server, the gRPC status and the server's message).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.experimental
import numpy as np

from deepco.errors import UserError
from deepco.wire import GRPC_MESSAGE_OPTIONS
from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire import deepco_service_pb2_grpc as dpb_grpc
from deepco.wire import inference_pb2 as pb
from deepco.wire import inference_pb2_grpc as pb_grpc
from deepco.wire.security import ChannelSecurity, make_channel
from deepco.wire.tensors import TensorError, decode_outputs, encode_request
from deepco.wire.watchdog import WATCHDOG, Alarm


def content_name(base: str, model_bytes: bytes) -> str:
    """A content-addressed model name: ``<base>-sha256-<16 hex digits of the file's SHA-256>``.

    `deepco serve` loads under such a name only a file with that digest and never replaces a loaded name, so
    whoever runs the name runs those bytes, whoever uploaded them first.
    """
    return content_name_of(base, hashlib.sha256(model_bytes).hexdigest())


def content_name_of(base: str, sha256: str) -> str:
    """`content_name` from the file's SHA-256 (hex), where the caller has it already."""
    return f"{base[:100]}-sha256-{sha256[:16]}"


class ServerError(UserError):
    """A server answered with an error status (or could not be reached)."""

    def __init__(self, address: str, code: grpc.StatusCode, details: str):
        super().__init__(f"server {address}: {code.name}: {details}")
        self.address, self.code, self.details = address, code, details

    @classmethod
    def from_rpc(cls, address: str, exc: grpc.RpcError) -> ServerError:
        """The one translation of a failed gRPC call to the server at ``address`` into a DeepCo error."""
        return cls(address, exc.code(), exc.details() or "")


class WrongAnswer(ServerError):
    """A server answered, but with something that does not fit the request: a tensor of the wrong shape,
    data type or rows, or one that does not decode. Unlike a failure, this server is not to be trusted again."""

    def __init__(self, address: str, problem: str):
        super().__init__(address, grpc.StatusCode.INTERNAL, f"wrong answer: {problem}")


@dataclass(frozen=True)
class ProfileResult:
    """What DeepcoService.Profile measured: median seconds per run, every run, and the provider used."""

    seconds: float
    run_seconds: tuple[float, ...]
    execution_provider: str


@dataclass
class RunHandle:
    """A slice the server has fully received; `result()` waits for its output."""

    client: InferenceClient
    events: Any  # the rest of the Run response stream
    watchdog: Alarm | None = None  # cancels the call if it outlives its deadline (deepco.wire.watchdog)

    def result(self) -> tuple[dict[str, np.ndarray], dpb.StepTimes]:
        """(outputs by name, the server's own times of the step: queue, compute, ... (`StepTimes`))."""
        try:
            return self._result()
        finally:
            if self.watchdog is not None:
                self.watchdog.cancel()

    def _result(self) -> tuple[dict[str, np.ndarray], dpb.StepTimes]:
        try:
            event = next(self.events)
        except grpc.RpcError as exc:
            raise ServerError.from_rpc(self.client.address, exc) from None
        except StopIteration:
            raise ServerError(self.client.address, grpc.StatusCode.INTERNAL, "Run ended without a result") from None
        if event.WhichOneof("event") != "result":
            raise WrongAnswer(self.client.address, "Run answered out of order")
        result = event.result
        try:
            outputs = decode_outputs(result.response)
        except TensorError as exc:
            raise WrongAnswer(self.client.address, str(exc)) from None
        return outputs, result.times


class SplitJob:
    """One participant's stream of a split job (DeepcoService.SplitRun), read in the contract's order: a
    ``received`` event once the server holds its input, then its ``split_result``. Every failure, an early end
    or an event out of order included, is a ServerError naming the server."""

    def __init__(self, address: str, call: Any):
        self.address, self.call = address, call  # ``call``: the gRPC stream, to cancel from elsewhere

    def received(self) -> None:
        """Wait until the server has received this participant's input."""
        self._next("received")

    def result(self) -> dpb.SplitResult:
        """Wait for this participant's result."""
        return self._next("split_result").split_result

    def cancel(self) -> None:
        """Cancel the job's stream (the server stops it and its peers stop waiting for it)."""
        self.call.cancel()

    def _next(self, kind: str) -> Any:
        try:
            event = next(self.call)
        except grpc.RpcError as exc:
            raise ServerError.from_rpc(self.address, exc) from None
        except StopIteration:
            raise ServerError(self.address, grpc.StatusCode.INTERNAL,
                              "job ended without a result" if kind == "split_result" else "job ended early") from None
        if event.WhichOneof("event") != kind:
            raise WrongAnswer(self.address, "SplitRun answered out of order")
        return event


# gRPC Python's option (EXPERIMENTAL there) to drive a unary-stream call's completion queue from the thread that
# reads its responses, instead of a channel-wide polling thread started whenever no call is in flight
SINGLE_THREADED = (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)
SPLIT_RUN = "/deepco.DeepcoService/SplitRun"  # the methods' paths, as the generated stub names them
SPLIT_EXCHANGE = "/deepco.DeepcoService/SplitExchange"


class InferenceClient:
    """One channel to one server; thread-safe, as gRPC channels are. Use as a context manager or close().

    ``security`` (TLS, mutual TLS, bearer token; see deepco.wire.security) defaults to plain text.
    """

    def __init__(self, address: str, timeout: float | None = 60.0, security: ChannelSecurity | None = None):
        self.address, self.timeout = address, timeout
        self.security = security or ChannelSecurity()
        # Run's answers are read on the thread that waits for them: gRPC's default starts a thread per call to
        # poll the channel whenever none is polling it (every frame, one frame in flight), and a thread start
        # is dear on a weak camera (`SINGLE_THREADED`)
        self.channel = make_channel(address, self.security, (*GRPC_MESSAGE_OPTIONS, SINGLE_THREADED))
        self.inference = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.deepco = dpb_grpc.DeepcoServiceStub(self.channel)
        # SplitRun with a request already serialized (`deepco.wire.split_jobs.request_bytes`): gRPC sends the bytes
        self._split_run_bytes = self.channel.unary_stream(SPLIT_RUN, request_serializer=None,
                                                          response_deserializer=dpb.RunEvent.FromString)
        self._split_exchange_bytes = self.channel.stream_unary(SPLIT_EXCHANGE, request_serializer=None,
                                                               response_deserializer=dpb.ExchangeAck.FromString)
        self._input_names: dict[str, str] = {}
        self.bytes_sent = 0  # serialised request bytes this client sent (`_sent`): what setup costs a radio
        self._sent_lock = threading.Lock()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()

    def _sent(self, request: Any) -> Any:
        """Count ``request``'s serialised bytes (a message, or bytes already serialised) in `bytes_sent`; the
        request."""
        with self._sent_lock:
            self.bytes_sent += len(request) if isinstance(request, bytes) else request.ByteSize()
        return request

    def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        self._sent(request)
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as exc:
            raise ServerError.from_rpc(self.address, exc) from None

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the server answers ServerReady=true, or raise ServerError after ``timeout`` s."""
        # A call that waits for the channel, not grpc.channel_ready_future: that future's polling thread outlives
        # a timeout or a cancel and raises "Channel closed" (a thread traceback) once the channel is closed.
        try:
            ready = self.inference.ServerReady(self._sent(pb.ServerReadyRequest()), timeout=timeout,
                                               wait_for_ready=True).ready
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise ServerError(self.address, grpc.StatusCode.UNAVAILABLE,
                                  f"not reachable within {timeout:g}s") from None
            raise ServerError.from_rpc(self.address, exc) from None
        if not ready:
            raise ServerError(self.address, grpc.StatusCode.UNAVAILABLE, "server is not ready")

    def server_live(self) -> bool:
        """ServerLive."""
        return self._call(self.inference.ServerLive, pb.ServerLiveRequest()).live

    def server_ready(self, timeout: float | None = None) -> bool:
        """ServerReady (``timeout``: seconds for this call, default the client's)."""
        return self._call(self.inference.ServerReady, pb.ServerReadyRequest(), timeout=timeout).ready

    def server_metadata(self) -> dict[str, Any]:
        """ServerMetadata as a dict: name, version, extensions, and the ``key=value`` extensions parsed
        (`deepco serve` reports e.g. deepco_device=cpu, deepco_execution_provider=CPUExecutionProvider)."""
        meta = self._call(self.inference.ServerMetadata, pb.ServerMetadataRequest())
        result: dict[str, Any] = {"name": meta.name, "version": meta.version, "extensions": list(meta.extensions)}
        for ext in meta.extensions:
            key, sep, value = ext.partition("=")
            if sep:
                result[key] = value
        return result

    def load_model(self, model_bytes: bytes, name: str, version: str = "1",
                   config: Mapping[str, Any] | None = None, sha256: str | None = None, whole: bool = False) -> None:
        """Load (or replace) a model from its ONNX bytes, as Triton's RepositoryModelLoad with a
        ``file:<version>/model.onnx`` parameter.

        ``sha256`` (hex) goes along as the ``sha256`` parameter and the server refuses the model unless its
        bytes have that digest: pass the digest published with the model to catch a wrong or corrupted file.
        None (the default) sends the digest of ``model_bytes`` (catches corruption on the way); "" sends none.
        ``whole``: `deepco serve` holds the file as a whole model to derive stage models from (`derive_model`)
        rather than loading it to run.
        """
        request = pb.RepositoryModelLoadRequest(model_name=name)
        if whole:
            request.parameters["deepco_whole"].bool_param = True
        request.parameters["config"].string_param = json.dumps(
            dict(config) if config is not None else {"name": name, "backend": "onnxruntime"})
        request.parameters[f"file:{version}/model.onnx"].bytes_param = model_bytes
        if sha256 is None:
            sha256 = hashlib.sha256(model_bytes).hexdigest()
        if sha256:
            request.parameters["sha256"].string_param = sha256
        self._call(self.inference.RepositoryModelLoad, request)
        self._input_names.pop(name, None)

    def derive_model(self, description: bytes, name: str, sha256: str = "") -> None:
        """Load as ``name`` the stage model a `deepco serve` derives from a whole model it holds (``description``:
        a serialized deepco.StageDescription, sent as the ``deepco_stage`` parameter; ``sha256``: the stage's
        expected digest, checked by the server)."""
        request = pb.RepositoryModelLoadRequest(model_name=name)
        request.parameters["deepco_stage"].bytes_param = description
        if sha256:
            request.parameters["sha256"].string_param = sha256
        self._call(self.inference.RepositoryModelLoad, request)
        self._input_names.pop(name, None)

    def fetch_whole_model(self, name: str, sha256: str, peer: str) -> None:
        """Have a `deepco serve` hold as ``name`` the whole model of digest ``sha256`` (as `load_model` with
        ``whole=True``) by fetching it from the server ``peer`` (host:port as servers reach it, which holds it for
        the same identity), so that its bytes cross the servers' LAN instead of this client's link."""
        request = pb.RepositoryModelLoadRequest(model_name=name)
        request.parameters["deepco_whole"].bool_param = True
        request.parameters["deepco_peer"].string_param = peer
        request.parameters["sha256"].string_param = sha256
        self._call(self.inference.RepositoryModelLoad, request)
        self._input_names.pop(name, None)

    def load_whole_part(self, part: bytes | memoryview, name: str, sha256: str, offset: int, total: int) -> None:
        """Send bytes ``[offset, offset + len(part))`` of the whole model ``name`` (``total`` bytes, digest
        ``sha256``) to a `deepco serve` that takes whole models in parts (ServerMetadata's ``deepco_whole_parts``):
        it holds the whole model, as `load_model` with ``whole=True`` would, once every part has come (the call
        that brings the last one returns when it is held). Parts may come over different channels at once."""
        request = pb.RepositoryModelLoadRequest(model_name=name)
        request.parameters["deepco_whole"].bool_param = True
        request.parameters["deepco_part"].string_param = f"{offset}/{total}"
        request.parameters["sha256"].string_param = sha256
        request.parameters["file:1/model.onnx"].bytes_param = bytes(part)
        self._call(self.inference.RepositoryModelLoad, request)
        self._input_names.pop(name, None)

    def unload_model(self, name: str, force: bool = False, timeout: float | None = None) -> None:
        """Unload a model: `deepco serve` drops one reference (other loads of the same file keep it loaded);
        ``force`` drops them all."""
        request = pb.RepositoryModelUnloadRequest(model_name=name)
        if force:
            request.parameters["force"].bool_param = True
        self._call(self.inference.RepositoryModelUnload, request, timeout=timeout)
        self._input_names.pop(name, None)

    def model_index(self) -> list[pb.RepositoryIndexResponse.ModelIndex]:
        """RepositoryIndex: every loaded model (of this client's identity under mutual TLS) with its version,
        state and, from `deepco serve`, a reason like ``refs=1 bytes=123 sha256=... idle=4s``."""
        return list(self._call(self.inference.RepositoryIndex, pb.RepositoryIndexRequest()).models)

    def model_ready(self, name: str, version: str = "") -> bool:
        """ModelReady."""
        return self._call(self.inference.ModelReady, pb.ModelReadyRequest(name=name, version=version)).ready

    def model_metadata(self, name: str) -> pb.ModelMetadataResponse:
        """ModelMetadata (inputs and outputs with data types and shapes; -1 for any size)."""
        meta = self._call(self.inference.ModelMetadata, pb.ModelMetadataRequest(name=name))
        if len(meta.inputs) == 1:  # what `infer` would ask for again
            self._input_names[name] = meta.inputs[0].name
        return meta

    def loaded_models(self) -> list[str]:
        """Names of the models the server has loaded (RepositoryIndex)."""
        index = self._call(self.inference.RepositoryIndex, pb.RepositoryIndexRequest())
        return [m.name for m in index.models]

    def infer_many(self, name: str, inputs: Mapping[str, np.ndarray],
                   outputs: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """Run model ``name`` on named inputs; returns the requested (default: all) outputs by name."""
        response = self._call(self.inference.ModelInfer, encode_request(name, inputs, outputs))
        return decode_outputs(response)

    def infer(self, name: str, array: np.ndarray) -> np.ndarray:
        """Run a one-input, one-output model on ``array`` and return its output (a model with several outputs:
        `infer_many`, which returns them all)."""
        input_name = self._input_names.get(name)
        if input_name is None:
            meta = self.model_metadata(name)
            if len(meta.inputs) != 1:
                raise UserError(f"model {name!r} has {len(meta.inputs)} inputs; use infer_many")
            input_name = meta.inputs[0].name
        response = self._call(self.inference.ModelInfer, encode_request(name, {input_name: array}))
        outputs = decode_outputs(response)
        if len(outputs) != 1:
            raise UserError(f"model {name!r} answered {len(outputs)} outputs ({', '.join(outputs)}); use infer_many")
        return next(iter(outputs.values()))

    def start_run(self, name: str, inputs: Mapping[str, np.ndarray], timeout: float | None = None,
                  started: Callable[[Any], None] | None = None) -> RunHandle:
        """Send one slice with DeepcoService.Run; return once the server has received all of it.

        ``started`` gets the gRPC call as soon as it exists (before any wait), e.g. to cancel it from elsewhere."""
        limit = self.timeout if timeout is None else timeout
        events = self.deepco.Run(self._sent(encode_request(name, inputs)), timeout=limit)
        if started is not None:
            started(events)
        # A second, client-side bound: a stream once sat past its gRPC deadline here (seen on the testbed,
        # not understood); cancelling the call turns any such stall into a CANCELLED error we handle.
        watchdog = WATCHDOG.after(limit + 1.0, events.cancel) if limit is not None else None
        try:
            first = next(events)
        except grpc.RpcError as exc:
            if watchdog is not None:
                watchdog.cancel()
            raise ServerError.from_rpc(self.address, exc) from None
        except StopIteration:
            if watchdog is not None:
                watchdog.cancel()
            raise ServerError(self.address, grpc.StatusCode.INTERNAL, "Run ended before the data arrived") from None
        if first.WhichOneof("event") != "received":
            if watchdog is not None:
                watchdog.cancel()
            events.cancel()
            raise WrongAnswer(self.address, "Run answered out of order")
        return RunHandle(self, events, watchdog)

    def start_split(self, request: dpb.SplitRequest, timeout: float | None = None) -> SplitJob:
        """Start this server's part of a split job; the handle reads its events (nothing is waited for here)."""
        return SplitJob(self.address, self.deepco.SplitRun(self._sent(request), timeout=self.timeout if timeout is None
                                                            else timeout))

    def start_split_bytes(self, request: bytes, timeout: float | None = None) -> SplitJob:
        """`start_split` with the request already serialized (`deepco.wire.split_jobs.request_bytes`)."""
        return SplitJob(self.address, self._split_run_bytes(self._sent(request), timeout=self.timeout if timeout is None
                                                             else timeout))

    def send_rows(self, message: dpb.RowsMessage | bytes, timeout: float | None = None) -> Callable[[], int]:
        """Send rows of a split job to this server, as a peer sends them (SplitExchange, one message, or its
        bytes: `deepco.wire.split_jobs.rest_bytes`): the rest of a window the device streams
        (SplitRequest.input_rest). Returns at once, with a function that waits for the server to have filed them
        (the messages it took) and raises ServerError if it did not: an antenna sends the next rest without
        waiting on a server whose CPU is busy with the first sub-band."""
        call = self._split_exchange_bytes if isinstance(message, bytes) else self.deepco.SplitExchange
        future = call.future(iter([self._sent(message)]), timeout=self.timeout if timeout is None else timeout)

        def acknowledged() -> int:
            try:
                return future.result().messages
            except grpc.RpcError as exc:
                raise ServerError.from_rpc(self.address, exc) from None

        return acknowledged

    def echo(self, payload_bytes: int, reply_bytes: int = 0) -> float:
        """Seconds for ``payload_bytes`` to reach the server and ``reply_bytes`` to come back."""
        request = dpb.EchoRequest(payload=bytes(payload_bytes), reply_bytes=reply_bytes)
        start = time.perf_counter()
        self._call(self.deepco.Echo, request)
        return time.perf_counter() - start

    def profile(self, name: str, shape: Sequence[int], runs: int = 10, warmup: int = 1) -> ProfileResult:
        """Time model ``name`` on the server on an input of ``shape`` (compute only, no transfer)."""
        reply = self._call(self.deepco.Profile,
                           dpb.ProfileRequest(model_name=name, shape=list(shape), runs=runs, warmup=warmup))
        return ProfileResult(reply.seconds, tuple(reply.run_seconds), reply.execution_provider)

    def probe_peer(self, peer: str, nbytes: int, runs: int = 3) -> tuple[float, float]:
        """(small, large): seconds for this server to Echo 1 byte and ``nbytes`` bytes to server ``peer``."""
        reply = self._call(self.deepco.ProbePeer, dpb.ProbePeerRequest(peer=peer, bytes=nbytes, runs=runs))
        return reply.small_seconds, reply.large_seconds
