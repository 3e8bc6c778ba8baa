"""Admission and worker-thread lanes, so that health and readiness always answer, even under a flood.

gRPC Python's synchronous server runs every call on a thread of a pool, for as long as the call lasts, and
reads a unary request on that thread before the handler sees it. Two floods broke readiness before:

- any eight open streams (an idle ``Health/Watch``, an idle ``SplitExchange``, a ``Run`` whose result is never
  read) took every thread of the one pool, and nothing was answered, ServerReady included;
- 200 clients sending 8 MiB ModelInfer requests: gRPC's own limit of calls at once
  (``maximum_concurrent_rpcs``) refused ServerReady along with the excess, and the calls it admitted read
  their 8 MiB on threads readiness waited behind (2-4 of about 110 probes failed, RSS 3.1-3.5 GB;
  bench/readiness_flood.py).

:class:`BudgetInterceptor` decides on each call when its headers arrive, before its request is read (gRPC runs
interceptors on its polling thread), and runs each class of call on its own pool (gRPC's per-behaviour
``experimental_thread_pool``):

- *probes* (ServerLive, ServerReady, Health/Check): their own threads, never refused, and their request is never
  read (an empty one stands in for it): two probes whose body never came held both probe threads, and every
  probe timed out for as long as their connection stayed open;
- *streams* (every method streaming its request or its response: Health/Watch, Run, SplitRun, SplitExchange,
  FetchWhole):
  at most ``stream_slots`` at once, a thread each; one that sees no message read or written for
  ``idle_seconds`` is cancelled, which frees its thread;
- *work* (ModelInfer, Profile, RepositoryModelLoad, Echo, ProbePeer): at most ``work_slots`` at once, a
  thread each; one whose request does not arrive within ``idle_seconds`` is cancelled too;
- *control* (the rest: metadata, index, unload, ...): at most ``CONTROL_THREADS + max_queue`` at once, a thread
  each, whose request must arrive within ``CONTROL_BODY_SECONDS`` (four headers-only RepositoryIndex calls held
  every control thread before);
- *refusals*: a call over its budget is answered RESOURCE_EXHAUSTED at once by a handler that never reads
  its request (so an 8 MiB request costs no thread time and no memory beyond gRPC's flow-control window).

Stream, work and control calls with a unary request also count its bytes against ``max_held_bytes`` while they
hold it; a request that would go over is refused RESOURCE_EXHAUSTED (and dropped at once). A unary reply counts
in its request's place from when the handler returns until gRPC has flushed it (gRPC keeps it in its buffers
while the client grants no flow-control window: 40 such Echo replies took 3.6 GB), keeping the call's slot;
one not flushed within ``idle_seconds`` is cancelled (a write stall). Refusals are counted by reason
(server.refusals). The interceptor runs
before the token check in the chain but asks it first, so a caller without the token holds no slot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
from deepco_server.memory import release_freed_memory
from deepco_server.parsing import deferred, parsed
from deepco_server.refusals import Refusals
from deepco_server.rpc import behavior, is_refusal, on_pool, refusal, split_method

# Probes and work are named, not derived: like control calls they are unary-unary, so a handler's streaming
# flags cannot tell them apart. What sets them apart is who calls (orchestrators, without credentials, for
# probes) and what a call costs (compute, an upload, a dial for work), which a handler does not say.
PROBE_METHODS = frozenset({
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
    "/grpc.health.v1.Health/Check",
})
WORK_METHODS = frozenset({
    "/inference.GRPCInferenceService/ModelInfer",
    "/inference.GRPCInferenceService/RepositoryModelLoad",  # with `deepco_peer`, it also dials a peer (whole_fetch)
    "/deepco.DeepcoService/Profile",
    "/deepco.DeepcoService/Echo",
    "/deepco.DeepcoService/ProbePeer",  # holds a thread while it dials a peer: bounded like the rest
})
PROBE, STREAM, WORK, CONTROL = "probe", "stream", "work", "control"
DEFAULT_IDLE_SECONDS = 120.0
# Streams open at once (--max-streams): a device keeps about --depth Run streams per server open, a split job a
# job's run plus one per feeding peer; a thread each (about 8 MB of address space, little memory).
DEFAULT_MAX_STREAMS = 16
# Request bytes held at once by admitted calls (--max-held-bytes): a device's frame slices are a few MiB.
DEFAULT_MAX_HELD_BYTES = 1 << 30
PROBE_THREADS = 2  # a probe takes microseconds of a thread
REFUSAL_THREADS = 2  # so does a refusal: it sends a status and reads nothing
CONTROL_THREADS = 4
# A control call's request (a name, a few parameters) must arrive this soon after its headers (at most
# --stream-idle-timeout): one whose body never comes held a control thread for as long as its connection lived.
CONTROL_BODY_SECONDS = 2.0
SWEEP_SECONDS = 0.5
# Freed memory is given back to the system (server.memory) once no call (probes aside) was open or arrived for
# this long. Not while one is open: given back in the middle of a split job, a ResNet-50 frame's next windows
# (12-18 MB) took fresh pages, 10-30 ms of kernel time each under a 0.35-0.45-core quota.
QUIET_SECONDS = 1.0


_running = threading.local()  # .holding: what the admitted call this thread serves holds


def reserve(size: int) -> bool:
    """Count ``size`` bytes that the call served on this thread is about to allocate for its reply against the
    held-bytes budget, before it allocates them (a reply is counted anyway once built, until it is flushed:
    this refuses one that would not fit before its bytes exist). False if they do not fit: refuse the call.
    True outside an admitted call."""
    holding = getattr(_running, "holding", None)
    return holding is None or holding.hold(size)


def budget_class(handler: grpc.RpcMethodHandler, method: str) -> str:
    """The class of calls (PROBE, STREAM, WORK or CONTROL) that ``handler`` of ``method`` belongs to.

    A stream is any method streaming its request or its response (Health/Watch, Run, SplitRun, SplitExchange,
    FetchWhole):
    it holds a thread for as long as it is open, whatever it is called, hence its own budget.
    """
    if method in PROBE_METHODS:
        return PROBE
    if handler.request_streaming or handler.response_streaming:
        return STREAM
    return WORK if method in WORK_METHODS else CONTROL


class CountingExecutor(futures.ThreadPoolExecutor):
    """A worker pool counting the work submitted but not yet started: its queue depth."""

    def __init__(self, max_workers: int, thread_name_prefix: str = ""):
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._queued = 0
        self._lock = threading.Lock()

    @property
    def queued(self) -> int:
        """Calls waiting for a worker thread."""
        return self._queued

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future:
        """Queue ``fn`` like ThreadPoolExecutor.submit, counting it until a worker starts it."""
        with self._lock:
            self._queued += 1

        def started(*a: Any, **kw: Any) -> Any:
            with self._lock:
                self._queued -= 1
            return fn(*a, **kw)

        try:
            return super().submit(started, *args, **kwargs)
        except BaseException:  # shut down: it will never start
            with self._lock:
                self._queued -= 1
            raise


class _Lane:
    """A class of calls with its own threads and at most ``limit`` calls at once."""

    def __init__(self, kind: str, limit: int, spare_threads: int = 2):
        self.kind, self.limit = kind, limit
        self._free = threading.BoundedSemaphore(limit)
        self.taken = 0  # slots held now (read without the lock: a gauge, not a decision)
        self._lock = threading.Lock()
        # Spare threads: a call gives its slot back just before its thread returns to the pool.
        self.pool = CountingExecutor(limit + spare_threads, thread_name_prefix=f"deepco-{kind.split('/')[0]}")

    def take(self) -> bool:
        if not self._free.acquire(blocking=False):
            return False
        with self._lock:
            self.taken += 1
        return True

    def give(self) -> None:
        with self._lock:
            self.taken -= 1
        self._free.release()

    def busy(self, method: str) -> str:
        return (f"server busy: {self.limit} {self.kind} calls already open ({split_method(method)[1]} refused); "
                "retry later")


class _HeldBytes:
    """Request bytes held by admitted calls, at most ``limit`` together."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self._lock = threading.Lock()

    def take(self, size: int) -> bool:
        with self._lock:
            if self.held + size > self.limit:
                return False
            self.held += size
            return True

    def give(self, size: int) -> None:
        with self._lock:
            self.held -= size


class _Holding:
    """What one admitted call holds (a slot, its request's bytes, an idle watch), given back exactly once."""

    def __init__(self, lane: _Lane, held: _HeldBytes):
        self._lane, self._held = lane, held
        self.unwatch: Callable[[], None] | None = None
        self.size = 0
        self._done = False
        self._lock = threading.Lock()

    def hold(self, size: int) -> bool:
        """Count ``size`` more request bytes, if the held-bytes budget has room."""
        with self._lock:
            if self._done:  # the call is over: nothing to hold
                return True
            if not self._held.take(size):
                return False
            self.size += size
            return True

    def unhold(self, size: int) -> None:
        """Give back ``size`` request or reply bytes held before (a streamed reply message went out)."""
        with self._lock:
            if self._done:
                return
            self._held.give(size)
            self.size -= size

    def settle(self, reply: int) -> bool:
        """Trade the request's bytes (read, no longer needed) for its reply's, held until the reply is flushed;
        False if the reply does not fit the held-bytes budget."""
        with self._lock:
            if self._done:
                return True
            self._held.give(self.size)
            self.size = 0
            if not self._held.take(reply):
                return False
            self.size = reply
            return True

    def release(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        if self.unwatch is not None:
            self.unwatch()
        self._held.give(self.size)
        self._lane.give()


class _OverBudget:
    """What a request over the held-bytes budget deserializes to: its size (its bytes are dropped at once)."""

    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = size


class _Watched:
    """An open call: when it last moved, how long it may stand still (``limit`` s), why, and how to cancel it."""

    def __init__(self, context: grpc.ServicerContext, limit: float, reason: str):
        self.context, self.limit, self.reason = context, limit, reason
        self.last = time.monotonic()

    def touch(self) -> None:
        self.last = time.monotonic()

    def reading(self, requests: Iterator[Any]) -> Iterator[Any]:
        for request in requests:
            self.touch()
            yield request
            self.touch()


class BudgetInterceptor(grpc.ServerInterceptor):
    """Admits calls within their budgets, runs each class on its own threads, cancels idle streams (module doc).

    ``control_pool`` is the server's default executor (give it to ``grpc.server``): calls this interceptor
    does not route elsewhere run there.
    """

    def __init__(self, stream_slots: int, work_slots: int, idle_seconds: float = DEFAULT_IDLE_SECONDS,
                 max_queue: int | None = None, max_held_bytes: int = DEFAULT_MAX_HELD_BYTES,
                 refusals: Refusals | None = None, on_idle: Callable[[], bool] = lambda: False):
        self.idle_seconds = idle_seconds
        # Asked at every sweep while no call is open; True when it dropped what the server kept for reuse (the
        # split jobs' windows, server.window_buffers), which is then given back to the system too.
        self.on_idle = on_idle
        self.max_queue = 3 * CONTROL_THREADS if max_queue is None else max_queue
        self.refusals = refusals if refusals is not None else Refusals()
        self._streams = _Lane("stream", stream_slots)
        self._work = _Lane("inference/upload", work_slots)
        # Control calls: CONTROL_THREADS running plus --max-queue more at once, each with a thread of its own
        # (one waiting for its body holds a thread, for CONTROL_BODY_SECONDS at most).
        self._control = _Lane("control", CONTROL_THREADS + self.max_queue)
        self._held = _HeldBytes(max_held_bytes)
        # gRPC's default executor: what no lane takes (an unknown method's refusal) runs here.
        self.control_pool = CountingExecutor(CONTROL_THREADS, thread_name_prefix="deepco-default")
        self._probes = CountingExecutor(PROBE_THREADS, thread_name_prefix="deepco-probe")
        self._refusals = CountingExecutor(REFUSAL_THREADS, thread_name_prefix="deepco-refuse")
        self._pools = (self.control_pool, self._probes, self._refusals, self._streams.pool, self._work.pool,
                       self._control.pool)
        self._open: dict[int, _Watched] = {}
        self._since: float | None = None  # the last call (probes aside) since memory was last given back
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="deepco-idle-streams", daemon=True)
        self._sweeper.start()

    @property
    def queued(self) -> int:
        """Calls admitted and waiting for a worker thread, all pools together."""
        return sum(pool.queued for pool in self._pools)

    @property
    def open_calls(self) -> int:
        """Calls holding a stream, work or control slot now (probes and refusals hold none)."""
        return self._streams.taken + self._work.taken + self._control.taken

    @property
    def held_bytes(self) -> int:
        """Request bytes admitted calls hold now."""
        return self._held.held

    def close(self) -> None:
        """Stop cancelling idle streams and let the pools' threads end (the server has stopped)."""
        self._stop.set()
        for pool in self._pools:
            pool.shutdown(wait=False)

    def _sweep(self) -> None:
        while not self._stop.wait(SWEEP_SECONDS):
            now = time.monotonic()
            if self.open_calls:  # a frame's job can outlast QUIET_SECONDS with no call arriving meanwhile
                self._since = now
            elif self._since is not None and now - self._since > QUIET_SECONDS:
                self._since = None
                release_freed_memory()
            if not self.open_calls and self.on_idle():
                release_freed_memory()
            with self._lock:
                idle = [w for w in self._open.values() if now - w.last > w.limit]
                for watched in idle:  # cancelled once
                    self._open.pop(id(watched), None)
            for watched in idle:
                self.refusals.count(watched.reason, f"a call stood still for {watched.limit:g}s ({watched.reason}); "
                                    "cancelled")
                watched.context.cancel()  # the call ends CANCELLED; its thread returns to the pool

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        """The method's handler, on its class's pool and within its budget, or a refusal."""
        handler = continuation(details)  # the token check first: a caller without the token takes no slot
        if handler is None:
            return handler
        method = details.method
        if method in PROBE_METHODS:
            return on_pool(_bodiless(handler), self._probes)
        self._since = time.monotonic()
        if is_refusal(handler):  # the token check's: it reads nothing, and its streaming flags are not the method's
            return on_pool(handler, self._refusals)
        lane = {WORK: self._work, STREAM: self._streams}.get(budget_class(handler, method), self._control)
        if not lane.take():
            message = lane.busy(method)
            if lane is self._control:
                message = (f"server busy: {lane.limit} control calls already open (--max-queue; "
                           f"{split_method(method)[1]} refused); retry later")
            self.refusals.count("queue" if lane is self._control else "slots", message)
            return on_pool(refusal(handler, grpc.StatusCode.RESOURCE_EXHAUSTED, message), self._refusals)
        return on_pool(self._admitted(handler, method, lane), lane.pool)

    def _watch(self, context: grpc.ServicerContext, limit: float,
               reason: str) -> tuple[_Watched, Callable[[], None]]:
        watched = _Watched(context, limit, reason)
        with self._lock:
            self._open[id(watched)] = watched

        def unwatch() -> None:
            with self._lock:
                self._open.pop(id(watched), None)

        return watched, unwatch

    def _admitted(self, handler: grpc.RpcMethodHandler, method: str, lane: _Lane) -> grpc.RpcMethodHandler:
        """``handler`` as a call holding a slot of ``lane``, given back when the call ends however it ends.

        The handler is rebuilt to take its request as a stream, which gRPC always hands to the behaviour (a
        unary request the client cancels mid-way would otherwise skip it, and the slot would leak). Its
        deserializer, run by gRPC on its polling thread as the request arrives, only counts a unary request's
        bytes against the held-bytes budget (or drops them, over it); the message is parsed on this call's
        own thread (server.parsing). A request must arrive within ``idle_seconds`` (a control call's within
        CONTROL_BODY_SECONDS).

        The reply counts too: gRPC keeps a unary reply in its buffers after the behaviour returns until the
        client's flow-control window lets it out, so the call keeps its slot and the reply's bytes (instead of
        its request's) until gRPC says the call ended, and is cancelled if the reply is not flushed within
        ``idle_seconds`` (a write stall). A streamed reply's messages count while each is sent.
        """
        inner = behavior(handler)
        unary_request, response_streaming = not handler.request_streaming, handler.response_streaming
        stream = lane is self._streams
        holding = _Holding(lane, self._held)
        parse = handler.request_deserializer
        defer = deferred(parse)
        name = split_method(method)[1]
        body_seconds = min(self.idle_seconds, CONTROL_BODY_SECONDS) if lane is self._control else self.idle_seconds

        def receive(data: bytes) -> Any:
            if unary_request and not holding.hold(len(data)):
                return _OverBudget(len(data))
            return defer(data) if defer is not None else data

        def over_budget(context: grpc.ServicerContext, what: str, size: int) -> None:
            message = (f"server busy: admitted calls hold {self._held.held} bytes, this {what}'s {size} would pass "
                       f"the {self._held.limit} limit (--max-held-bytes; {name} refused); retry later")
            self.refusals.count("held_bytes", message)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

        def serve(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            watched = None
            if stream or unary_request:  # a work call is watched while its request arrives, not while it runs
                watched, holding.unwatch = self._watch(context, self.idle_seconds if stream else body_seconds,
                                                       "idle_stream" if stream else "body_deadline")
            if not context.add_callback(holding.release):  # the call is already over
                holding.release()
                context.abort(grpc.StatusCode.CANCELLED, "call ended before it started")
            try:
                if unary_request:
                    request = _one(requests, context, method)
                    if not stream and holding.unwatch is not None:
                        holding.unwatch()
                    if isinstance(request, _OverBudget):
                        over_budget(context, "request", request.size)
                else:
                    request = watched.reading(parsed(requests)) if watched is not None else parsed(requests)
                if response_streaming:
                    return _released_after(inner(request, context), holding, watched, context, over_budget)
                _running.holding = holding
                try:
                    reply = inner(request, context)
                finally:
                    _running.holding = None
                size = reply.ByteSize() if hasattr(reply, "ByteSize") else len(reply)
                if not holding.settle(size):
                    over_budget(context, "reply", size)
                if stream and watched is not None:
                    watched.touch()  # its watch goes on: a reply not flushed within idle_seconds is cancelled
                else:
                    _, holding.unwatch = self._watch(context, self.idle_seconds, "write_stall")
                return reply
            except BaseException:
                holding.release()
                raise

        make = grpc.stream_stream_rpc_method_handler if response_streaming else grpc.stream_unary_rpc_method_handler
        return make(serve, request_deserializer=receive if parse is not None else None,
                    response_serializer=handler.response_serializer)


def _bodiless(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A probe's handler that answers without reading its request: an empty message stands in for it.

    gRPC Python reads a unary request on the worker thread before the behaviour runs, so two probes whose
    body never came held both probe threads, and every probe timed out, for as long as their connection
    lived. ServerLive's and ServerReady's requests have no fields; Health/Check is answered for the whole
    server (service ""), which every service of this one shares.
    """
    if handler.request_streaming:  # not a probe's: leave it be
        return handler
    inner, parse = behavior(handler), handler.request_deserializer

    def serve(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        return inner(parse(b"") if parse is not None else b"", context)

    return grpc.stream_unary_rpc_method_handler(serve, request_deserializer=parse,
                                                response_serializer=handler.response_serializer)


def _one(requests: Iterator[Any], context: grpc.ServicerContext, method: str) -> Any:
    """The one message of a unary request."""
    for request in parsed(requests):
        return request
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{split_method(method)[1]} needs exactly one request message")


def _released_after(responses: Iterator[Any], holding: _Holding, watched: _Watched | None,
                    context: grpc.ServicerContext, over_budget: Callable[[grpc.ServicerContext, str, int], None],
                    ) -> Iterator[Any]:
    """The replies of a streamed response, each counted against the held-bytes budget while it is sent (gRPC
    Python's sending thread waits until a message went out); the slot is given back when the call ends."""
    try:
        for response in responses:
            size = response.ByteSize() if hasattr(response, "ByteSize") else len(response)
            if not holding.hold(size):
                over_budget(context, "reply", size)
            if watched is not None:
                watched.touch()
            yield response
            holding.unhold(size)  # resumed: the message went out
            if watched is not None:
                watched.touch()
    except BaseException:
        holding.release()
        raise
