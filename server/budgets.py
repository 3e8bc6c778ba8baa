"""Worker-thread budgets, so that health and readiness always find a free thread.

gRPC Python's synchronous server runs every call on a thread of one pool, for as long as the call lasts; a
stream that stays open (an idle ``Health/Watch``, an idle ``ModnnExchange``, a ``Run`` whose result the
client never reads) holds its thread all that time. Without a bound, any eight such streams took every
thread and nothing was answered, ServerReady included.

:class:`BudgetInterceptor` sorts methods into three classes:

- *streams* (Health/Watch, Run, ModnnRun, ModnnExchange): at most ``stream_slots`` at once; one that sees
  no message read or written for ``idle_seconds`` is cancelled, which frees its thread;
- *work* (ModelInfer, Profile, RepositoryModelLoad, Echo, ProbePeer): at most ``work_slots`` at once;
- *control* (the rest: ServerLive/ServerReady, Health/Check, metadata, index, unload): always admitted; they
  are short and the pool keeps threads beyond the two budgets for them.

The excess of a class is refused at once with RESOURCE_EXHAUSTED. The interceptor runs after the token
check, so a caller without the token never holds a slot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from deepco_server.rpc import behavior, rebuild, split_method

STREAM_METHODS = frozenset({
    "/grpc.health.v1.Health/Watch",
    "/deepco.DeepcoService/Run",
    "/deepco.DeepcoService/ModnnRun",
    "/deepco.DeepcoService/ModnnExchange",
})
WORK_METHODS = frozenset({
    "/inference.GRPCInferenceService/ModelInfer",
    "/inference.GRPCInferenceService/RepositoryModelLoad",
    "/deepco.DeepcoService/Profile",
    "/deepco.DeepcoService/Echo",
    "/deepco.DeepcoService/ProbePeer",  # holds a thread while it dials a peer: bounded like the rest
})
DEFAULT_IDLE_SECONDS = 120.0
# Streams open at once (--max-streams): a device keeps about --depth Run streams per server open, MoDNN a
# job's run plus one per feeding peer; a thread each (about 8 MB of address space, little memory).
DEFAULT_MAX_STREAMS = 16
SWEEP_SECONDS = 0.5


class _Slots:
    def __init__(self, kind: str, limit: int):
        self.kind, self.limit = kind, limit
        self._free = threading.BoundedSemaphore(limit)

    def take(self, method: str, context: grpc.ServicerContext) -> None:
        if not self._free.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"server busy: {self.limit} {self.kind} calls already open ({split_method(method)[1]} "
                          "refused); retry later")

    def give(self) -> None:
        self._free.release()


class _Watched:
    """An open stream: when it last moved, and how to cancel it."""

    def __init__(self, context: grpc.ServicerContext):
        self.context = context
        self.last = time.monotonic()

    def touch(self) -> None:
        self.last = time.monotonic()

    def reading(self, requests: Iterator[Any]) -> Iterator[Any]:
        for request in requests:
            self.touch()
            yield request
            self.touch()


class BudgetInterceptor(grpc.ServerInterceptor):
    """Admits stream and work calls within their budgets and cancels idle streams (see the module doc)."""

    def __init__(self, stream_slots: int, work_slots: int, idle_seconds: float = DEFAULT_IDLE_SECONDS):
        self.idle_seconds = idle_seconds
        self._streams = _Slots("stream", stream_slots)
        self._work = _Slots("inference/upload", work_slots)
        self._open: dict[int, _Watched] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="deepco-idle-streams", daemon=True)
        self._sweeper.start()

    def close(self) -> None:
        """Stop cancelling idle streams (the server is stopping)."""
        self._stop.set()

    def _sweep(self) -> None:
        while not self._stop.wait(SWEEP_SECONDS):
            now = time.monotonic()
            with self._lock:
                idle = [w for w in self._open.values() if now - w.last > self.idle_seconds]
            for watched in idle:
                watched.context.cancel()  # the call ends CANCELLED; its thread returns to the pool

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        """The method's handler, wrapped in its class's budget."""
        handler = continuation(details)
        if handler is None:
            return handler
        if details.method in WORK_METHODS:
            return self._bounded(handler, details.method)
        if details.method in STREAM_METHODS:
            return self._stream(handler, details.method)
        return handler

    def _bounded(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        inner = behavior(handler)
        slots = self._work

        def call(request: Any, context: grpc.ServicerContext) -> Any:
            slots.take(method, context)
            try:
                return inner(request, context)
            finally:
                slots.give()

        return rebuild(handler, call)

    def _watch(self, context: grpc.ServicerContext) -> tuple[int, _Watched]:
        watched = _Watched(context)
        with self._lock:
            self._open[id(watched)] = watched
        return id(watched), watched

    def _unwatch(self, key: int) -> None:
        with self._lock:
            self._open.pop(key, None)

    def _stream(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        inner = behavior(handler)
        slots = self._streams

        if handler.response_streaming:
            def streaming(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                slots.take(method, context)
                key, watched = self._watch(context)
                try:
                    if handler.request_streaming:
                        request = watched.reading(request)
                    for response in inner(request, context):
                        watched.touch()
                        yield response
                        watched.touch()  # resumed: the response went out
                finally:
                    self._unwatch(key)
                    slots.give()

            return rebuild(handler, streaming)

        def unary_response(request: Any, context: grpc.ServicerContext) -> Any:
            slots.take(method, context)
            key, watched = self._watch(context)
            try:
                return inner(watched.reading(request) if handler.request_streaming else request, context)
            finally:
                self._unwatch(key)
                slots.give()

        return rebuild(handler, unary_response)
