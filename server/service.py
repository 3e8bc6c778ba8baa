"""The gRPC servicers: the Open Inference Protocol (inference.GRPCInferenceService) and DeepcoService.

They translate the protocol: read a request, call the data plane (server.dataplane's state and admission,
server.models' registry, server.split_jobs's jobs), build the response. What the data plane raises is a
transport-free server.errors.ServerFault; :func:`status_of` is the one place that maps it to a gRPC status.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from deepco_server.budgets import reserve
from deepco_server.dataplane import ServerState
from deepco_server.derived import is_whole, stage_from_load_request
from deepco_server.errors import PermissionDenied, ResourceExhausted, ServerFault, Unavailable, invalid
from deepco_server.models import PLATFORM, model_from_load_request
from deepco_server.security import client_identity, sender_identity
from deepco_server.split_jobs import SplitJobs, parse_request
from deepco_server.triton_extensions import (
    add_classification,
    classification_counts,
    model_config,
)
from deepco_server.whole_fetch import fetch_from_load_request, load_from_peer, whole_chunks
from deepco_server.whole_parts import part_from_load_request

import deepco
from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire import deepco_service_pb2_grpc as dpb_grpc
from deepco.wire import inference_pb2 as pb
from deepco.wire import inference_pb2_grpc as pb_grpc
from deepco.wire.step_times import StepClock
from deepco.wire.tensors import TensorError, add_output, decode_inputs

log = logging.getLogger("deepco.serve")

PROFILE_DEFAULT_RUNS = 10
PROFILE_MAX_RUNS = 1000
PROFILE_MAX_WARMUP = 100
ECHO_MAX_REPLY = 64 << 20
PROBE_MAX_BYTES = 16 << 20
PROBE_MAX_RUNS = 10
PROBE_TIMEOUT = 10.0
# A slice queued behind the previous frame's slice (pipelining) waits this long for a compute slot.
RUN_QUEUE_SECONDS = 30.0

R = TypeVar("R")


def status_of(exc: Exception) -> grpc.StatusCode | None:
    """The gRPC status that answers a failure of the data plane, or None for one that is a bug of ours.

    A ServerFault's kind has the status's name (server.errors.Kind); a TensorError is a request whose
    tensors do not decode, which the client sent.
    """
    if isinstance(exc, ServerFault):
        return grpc.StatusCode[exc.kind.name]
    if isinstance(exc, TensorError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return None


@contextlib.contextmanager
def _answering(name: str, context: grpc.ServicerContext) -> Iterator[None]:
    """Answer a data-plane failure with its status (:func:`status_of`), and any other failure with INTERNAL."""
    try:
        yield
    except Exception as exc:
        code = status_of(exc)
        if code is not None:
            context.abort(code, str(exc))
        log.exception("%s failed", name)  # a bug of ours: with its traceback; the client gets one line
        context.abort(grpc.StatusCode.INTERNAL, f"{name}: {type(exc).__name__}: {exc}")


def _statuses(method: Callable[..., R]) -> Callable[..., R]:
    """A unary method whose failures become the right gRPC status (see `_answering`)."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> R:
        with _answering(method.__name__, context):
            return method(self, request, context)
        raise AssertionError("unreachable: context.abort raises")

    return wrapper


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """inference.GRPCInferenceService on top of the model registry."""

    def __init__(self, state: ServerState):
        self.state = state

    @_statuses
    def ServerLive(self, request: pb.ServerLiveRequest, context: grpc.ServicerContext) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @_statuses
    def ServerReady(self, request: pb.ServerReadyRequest,
                    context: grpc.ServicerContext) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=not self.state.draining.is_set())

    @_statuses
    def ServerMetadata(self, request: pb.ServerMetadataRequest,
                       context: grpc.ServicerContext) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="deepco", version=deepco.__version__,
                                         extensions=self.state.extensions())

    @_statuses
    def ModelReady(self, request: pb.ModelReadyRequest, context: grpc.ServicerContext) -> pb.ModelReadyResponse:
        # The protocol answers "not ready" for a model it does not have, rather than an error.
        try:
            self.state.registry.get(request.name, request.version, client_identity(context))
        except ServerFault:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=not self.state.draining.is_set())

    @_statuses
    def ModelMetadata(self, request: pb.ModelMetadataRequest,
                      context: grpc.ServicerContext) -> pb.ModelMetadataResponse:
        model = self.state.registry.get(request.name, request.version, client_identity(context))
        meta = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=model.name, versions=[model.version], platform=PLATFORM,
            inputs=[meta(name=s.name, datatype=s.datatype, shape=s.shape) for s in model.inputs],
            outputs=[meta(name=s.name, datatype=s.datatype, shape=s.shape) for s in model.outputs])

    @_statuses
    def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.ServicerContext) -> pb.ModelInferResponse:
        model = self.state.registry.get(request.model_name, request.model_version, client_identity(context))
        with self.state.statistics.measuring(model) as timer:
            arrays = decode_inputs(request)
            model.check_inputs(arrays)
            outputs = model.output_names([o.name for o in request.outputs])
            classes = classification_counts(request, model)
            timer.lap("compute_input")
            with self.state.admission:
                timer.lap("queue")
                results = model.run(arrays, outputs)
                timer.lap("compute_infer")
            response = pb.ModelInferResponse(model_name=model.name, model_version=model.version, id=request.id)
            for name in outputs:
                if name in classes:
                    add_classification(response, name, results[name], classes[name])
                else:
                    add_output(response, name, results[name])
            timer.lap("compute_output")
        return response

    @_statuses
    def ModelConfig(self, request: pb.ModelConfigRequest, context: grpc.ServicerContext) -> pb.ModelConfigResponse:
        """Triton's model-configuration extension: the configuration derived from the loaded ONNX model."""
        model = self.state.registry.get(request.name, request.version, client_identity(context))
        return pb.ModelConfigResponse(config=model_config(model))

    @_statuses
    def ModelStatistics(self, request: pb.ModelStatisticsRequest,
                        context: grpc.ServicerContext) -> pb.ModelStatisticsResponse:
        """Triton's statistics extension: one model's counters, or every loaded model's (empty name)."""
        registry = self.state.registry
        owner = client_identity(context)
        models = [registry.get(request.name, request.version, owner)] if request.name else registry.all(owner)
        return self.state.statistics.response(models)

    @_statuses
    def RepositoryIndex(self, request: pb.RepositoryIndexRequest,
                        context: grpc.ServicerContext) -> pb.RepositoryIndexResponse:
        index = pb.RepositoryIndexResponse.ModelIndex
        # reason: what `deepco models` shows (references, bytes, sha256 prefix, seconds since last use)
        now = time.monotonic()
        return pb.RepositoryIndexResponse(models=[
            index(name=h.model.name, version=h.model.version, state="READY",
                  reason=f"refs={h.refs} bytes={h.model.size} sha256={h.sha256[:16]} idle={now - h.last_used:.0f}s")
            for _, h in self.state.registry.holdings(client_identity(context))])

    @_statuses
    def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                            context: grpc.ServicerContext) -> pb.RepositoryModelLoadResponse:
        if self.state.draining.is_set():
            raise Unavailable("server is shutting down")
        registry, owner = self.state.registry, client_identity(context)
        self.state.parts.sweep()  # whole models abandoned half-sent in parts give their room back first
        stage = stage_from_load_request(request.parameters)
        if stage is not None:  # a stage model derived from a whole model held here (server.derived)
            registry.derive(request.model_name, "1", *stage, owner)
            return pb.RepositoryModelLoadResponse()
        part = part_from_load_request(request.parameters)
        if part is not None:  # a part of a whole model, the rest over the device's other antennas (server.whole_parts)
            self.state.parts.load(request.model_name, part, owner)
            return pb.RepositoryModelLoadResponse()
        fetch = fetch_from_load_request(request.parameters)
        if fetch is not None:  # a whole model a peer holds, over the servers' LAN (server.whole_fetch)
            load_from_peer(self.state, request.model_name, *fetch, owner, context.is_active, context.time_remaining())
            return pb.RepositoryModelLoadResponse()
        model_bytes, version = model_from_load_request(request.parameters)
        if is_whole(request.parameters):
            registry.load_whole(request.model_name, model_bytes, owner)
        else:
            registry.load(request.model_name, version, model_bytes, owner)
        return pb.RepositoryModelLoadResponse()

    @_statuses
    def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                              context: grpc.ServicerContext) -> pb.RepositoryModelUnloadResponse:
        force = request.parameters.get("force")
        if force is not None and force.WhichOneof("parameter_choice") != "bool_param":
            raise invalid("parameter 'force' must be a bool (true: drop every reference, not just one)")
        self.state.registry.unload(request.model_name, client_identity(context),
                                   force=force is not None and force.bool_param)
        return pb.RepositoryModelUnloadResponse()


class DeepcoServicer(dpb_grpc.DeepcoServiceServicer):
    """deepco.DeepcoService: what the engine needs beyond the standard protocol."""

    def __init__(self, state: ServerState, max_streams: int | None = None):
        self.state = state
        # split jobs hold a stream (a worker thread) for their run and each feeding peer while they wait:
        # --max-inflight + 2 of them, within the stream budget (server.budgets) so that jobs cannot starve
        # each other's exchange streams.
        threads = state.admission.limit + 2
        self.split_jobs = SplitJobs(state, threads=threads if max_streams is None else min(threads, max_streams))

    @_statuses
    def Profile(self, request: dpb.ProfileRequest, context: grpc.ServicerContext) -> dpb.ProfileResponse:
        model = self.state.registry.get(request.model_name, owner=client_identity(context))
        runs = request.runs or PROFILE_DEFAULT_RUNS
        if runs > PROFILE_MAX_RUNS:
            raise invalid(f"Profile: runs must be <= {PROFILE_MAX_RUNS}, got {runs}")
        if request.warmup > PROFILE_MAX_WARMUP:
            raise invalid(f"Profile: warmup must be <= {PROFILE_MAX_WARMUP}, got {request.warmup}")
        with self.state.admission:
            times = model.profile(list(request.shape), runs, request.warmup)
        return dpb.ProfileResponse(seconds=statistics.median(times), run_seconds=times,
                                   execution_provider=model.providers[0])

    def Run(self, request: pb.ModelInferRequest, context: grpc.ServicerContext) -> Iterator[dpb.RunEvent]:
        with _answering("Run", context):
            model = self.state.registry.get(request.model_name, request.model_version, client_identity(context))
        times = dpb.StepTimes()
        clock = StepClock(times, time.perf_counter())
        with self.state.statistics.measuring(model) as timer:  # counted in ModelStatistics like ModelInfer
            with _answering("Run", context):
                arrays = decode_inputs(request)
                model.check_inputs(arrays)
                outputs = model.output_names([o.name for o in request.outputs])
                clock.since("input", clock.origin)
                timer.lap("compute_input")
            yield dpb.RunEvent(received=dpb.RunReceived())
            timer.lap(None)
            with _answering("Run", context):
                queued = time.perf_counter()
                with self.state.admission.waiting(RUN_QUEUE_SECONDS):
                    timer.lap("queue")
                    start = clock.since("queue", queued)
                    results = model.run(arrays, outputs)
                    done = clock.since("compute", start)
                    timer.lap("compute_infer")
                response = pb.ModelInferResponse(model_name=model.name, model_version=model.version, id=request.id)
                for name in outputs:
                    add_output(response, name, results[name])
                timer.lap("compute_output")
                clock.since("encode", done)
                clock.finish()
        yield dpb.RunEvent(result=dpb.RunResult(response=response, times=times))

    @_statuses
    def Echo(self, request: dpb.EchoRequest, context: grpc.ServicerContext) -> dpb.EchoResponse:
        if request.reply_bytes > ECHO_MAX_REPLY:
            raise invalid(f"Echo: reply_bytes must be <= {ECHO_MAX_REPLY}, got {request.reply_bytes}")
        if not reserve(request.reply_bytes):  # counted before it exists: 40 unread 64 MiB replies took 3.6 GB
            message = f"Echo: a reply of {request.reply_bytes} bytes does not fit --max-held-bytes now; retry later"
            self.state.refusals.count("held_bytes", message)
            raise ResourceExhausted(message)
        return dpb.EchoResponse(payload=bytes(request.reply_bytes))

    @_statuses
    def ProbePeer(self, request: dpb.ProbePeerRequest, context: grpc.ServicerContext) -> dpb.ProbePeerResponse:
        if not 0 < request.bytes <= PROBE_MAX_BYTES:
            raise invalid(f"ProbePeer: bytes must be in [1, {PROBE_MAX_BYTES}], got {request.bytes}")
        runs = request.runs or 3
        if runs > PROBE_MAX_RUNS:
            raise invalid(f"ProbePeer: runs must be <= {PROBE_MAX_RUNS}, got {runs}")
        stub = self.state.peer_channels.stub(request.peer)

        def median_of(payload: bytes) -> float:
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                try:
                    stub.Echo(dpb.EchoRequest(payload=payload), timeout=PROBE_TIMEOUT)
                except grpc.RpcError as exc:
                    raise Unavailable(f"ProbePeer: peer {request.peer} answered {exc.code().name}") from None
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        small = median_of(b"\0")
        return dpb.ProbePeerResponse(small_seconds=small, large_seconds=median_of(bytes(request.bytes)))

    def FetchWhole(self, request: dpb.FetchWholeRequest, context: grpc.ServicerContext) -> Iterator[dpb.WholeChunk]:
        """A whole model held here, for a peer server to load (server.whole_fetch): only the caller's own, only by
        its exact digest."""
        with _answering("FetchWhole", context):
            if self.state.draining.is_set():
                raise Unavailable("server is shutting down")
            caller = client_identity(context)
            if request.identity != caller:  # a server fetching for someone else: models stay within an identity
                raise PermissionDenied("FetchWhole: a server fetches whole models only for callers of its own identity")
            whole = self.state.registry.whole_to_serve(request.sha256, caller)
            model_bytes = whole.lend()
        try:
            yield from whole_chunks(model_bytes)
        finally:  # also when the peer goes away mid-way: gRPC closes the generator
            whole.give_back()

    def SplitRun(self, request: dpb.SplitRequest, context: grpc.ServicerContext) -> Iterator[dpb.RunEvent]:
        """A split job: this server's band of a frame, level by level with direct peer exchanges (split_jobs.py)."""
        with _answering("SplitRun", context):
            if self.state.draining.is_set():
                raise Unavailable("server is shutting down")
            began = time.perf_counter()
            job = parse_request(request, self.state.registry, client_identity(context), self.state.peers)
            self.split_jobs.mailboxes.claim(job.id, job.threads)
            decoded = time.perf_counter() - began
        try:
            yield dpb.RunEvent(received=dpb.RunReceived())
            with _answering("SplitRun", context):
                result = self.split_jobs.run(job, context.is_active, began, began + decoded)
            yield dpb.RunEvent(split_result=result)
        finally:
            self.split_jobs.mailboxes.drop(job.id)

    def SplitExchange(self, request_iterator: Iterator[dpb.RowsMessage],
                      context: grpc.ServicerContext) -> dpb.ExchangeAck:
        """A split job, server to server: a peer's boundary rows for the jobs running (or about to run) here."""
        with _answering("SplitExchange", context):
            return self.split_jobs.exchange(request_iterator, sender_identity(context))
        raise AssertionError("unreachable: context.abort raises")
