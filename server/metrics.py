"""Observability of `deepco serve`: Prometheus metrics, one structured log line per RPC, and malformed
requests answered INVALID_ARGUMENT.

:class:`ObservingInterceptor` is a gRPC server interceptor, so every RPC of every service registered on
the server is counted and timed, the standard ones and any added later, without touching the servicers.
The metrics live in a per-server :class:`prometheus_client.CollectorRegistry` (several servers can run in
one test process) and are served as Prometheus text on ``GET /metrics`` by :meth:`Metrics.serve_http`.

Exported (``service`` is e.g. ``inference.GRPCInferenceService``, ``method`` e.g. ``ModelInfer``):

- ``deepco_grpc_requests_total{service,method,code}``: finished RPCs by status code (``OK``, ...),
- ``deepco_grpc_errors_total{service,method,code}``: the same, only those not ``OK``,
- ``deepco_grpc_request_seconds{service,method}``: histogram of seconds from the RPC's arrival at the
  server (queueing for a worker thread included) to its last response,
- ``deepco_grpc_inflight``: RPCs running on a worker thread now; ``deepco_grpc_queued``: RPCs accepted
  and waiting for a worker thread (server.budgets: control calls, bounded by ``--max-queue``, and the
  moments between a call's admission and its thread), ``deepco_request_bytes_held``: request bytes the
  admitted calls hold (bounded by ``--max-held-bytes``; replies count until they are flushed),
- ``deepco_refusals_total{reason}``: calls refused or cancelled by a budget (server.refusals: ``slots``,
  ``queue``, ``held_bytes``, ``body_deadline``, ``write_stall``, ``idle_stream``, ``mailbox``),
- ``deepco_models_loaded``, ``deepco_model_bytes{model}``, ``deepco_model_bytes_total`` and
  ``deepco_model_bytes_limit``: the loaded models and their uploaded bytes (``--max-model-bytes``).

Calls gRPC refuses before any interceptor runs (messages over the size limit) are not counted: gRPC Python
gives no hook there.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from deepco_server.models import Registry
from deepco_server.parsing import Malformed, checked_stream, model_of, tolerant
from deepco_server.rpc import behavior, rebuild, refusal, split_method
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

rpc_log = logging.getLogger("deepco.serve.rpc")

# Seconds: from a cached 0.1 ms health check to a multi-second partitioned frame on a slow server.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
UNKNOWN_METHOD = "unknown"


class _ModelsCollector(Collector):
    """Loaded models and their bytes, read from the registry at scrape time (no stale labels on unload)."""

    def __init__(self, registry: Registry):
        self._registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The model gauges, now."""
        held = self._registry.holdings()
        models = [h.model for _, h in held]
        yield GaugeMetricFamily("deepco_models_loaded", "Models loaded now", value=len(models))
        per_model = GaugeMetricFamily("deepco_model_bytes", "Uploaded ONNX bytes of each loaded model",
                                      labels=["model"])
        for owner, holding in held:  # a model of an mTLS client is labelled "<identity>/<name>"
            per_model.add_metric([f"{owner}/{holding.model.name}" if owner else holding.model.name],
                                 holding.model.size)
        yield per_model
        yield GaugeMetricFamily("deepco_model_bytes_total", "Uploaded ONNX bytes of all loaded models",
                                value=sum(m.size for m in models))
        yield GaugeMetricFamily("deepco_model_bytes_limit", "The --max-model-bytes budget",
                                value=self._registry.max_model_bytes)


class _RefusalsCollector(Collector):
    """Budget refusals by reason (server.refusals), read at scrape time."""

    def __init__(self, counts: Callable[[], dict[str, int]]):
        self._counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        """The refusal counter, now."""
        family = CounterMetricFamily("deepco_refusals", "Calls refused or cancelled by a budget, by reason",
                                     labels=["reason"])
        for reason, count in sorted(self._counts().items()):
            family.add_metric([reason], count)
        yield family


class Metrics:
    """The Prometheus metrics of one server."""

    def __init__(self, models: Registry, queued: Callable[[], int] | None = None,
                 held_bytes: Callable[[], int] | None = None, refusals: Callable[[], dict[str, int]] | None = None):
        self.registry = CollectorRegistry()
        labels = ["service", "method"]
        self.requests = Counter("deepco_grpc_requests", "Finished RPCs by status code", [*labels, "code"],
                                registry=self.registry)
        self.errors = Counter("deepco_grpc_errors", "Finished RPCs whose status is not OK", [*labels, "code"],
                              registry=self.registry)
        self.latency = Histogram("deepco_grpc_request_seconds", "Seconds from an RPC's arrival to its end",
                                 labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inflight = Gauge("deepco_grpc_inflight", "RPCs running on a worker thread now", registry=self.registry)
        queued_gauge = Gauge("deepco_grpc_queued", "RPCs accepted and waiting for a worker thread",
                             registry=self.registry)
        if queued is not None:
            queued_gauge.set_function(queued)
        held_gauge = Gauge("deepco_request_bytes_held", "Request bytes admitted calls hold now (--max-held-bytes)",
                           registry=self.registry)
        if held_bytes is not None:
            held_gauge.set_function(held_bytes)
        self.registry.register(_ModelsCollector(models))
        if refusals is not None:
            self.registry.register(_RefusalsCollector(refusals))
        self._http: Any = None

    def observe(self, service: str, method: str, code: grpc.StatusCode, seconds: float) -> None:
        """Count one finished RPC."""
        self.requests.labels(service, method, code.name).inc()
        if code != grpc.StatusCode.OK:
            self.errors.labels(service, method, code.name).inc()
        self.latency.labels(service, method).observe(seconds)

    def serve_http(self, host: str, port: int, token: str | None = None) -> int:
        """Serve ``GET /metrics`` (Prometheus text) on ``host:port`` in a daemon thread; the port bound.

        With ``token``, a scrape must send ``Authorization: Bearer <token>`` (Prometheus: ``authorization:
        {credentials: ...}`` or ``bearer_token_file``); others get 401.
        """
        if token is None:
            self._http, _ = start_http_server(port, addr=host, registry=self.registry)
            return int(self._http.server_port)
        registry, expected = self.registry, f"Bearer {token}".encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                given = (self.headers.get("Authorization") or "").strip().encode()
                if not hmac.compare_digest(given, expected):
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", "Bearer")
                    self.end_headers()
                    self.wfile.write(b"metrics need 'Authorization: Bearer <token>' (--metrics-token)\n")
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # scrapes are not worth a log line
                pass

        server = ThreadingHTTPServer((host, port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="deepco-metrics", daemon=True).start()
        self._http = server
        return int(server.server_port)

    def close(self) -> None:
        """Stop the HTTP endpoint, if it runs."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def _code(context: grpc.ServicerContext, failed: bool) -> grpc.StatusCode:
    """The status an RPC ended with: the one the servicer set, else UNKNOWN after an exception, else OK."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    return grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK


class ObservingInterceptor(grpc.ServerInterceptor):
    """Counts, times and logs every RPC, and answers requests that do not parse with INVALID_ARGUMENT.

    Installed first (outermost), so calls that a later interceptor refuses (a missing token) are counted too.
    """

    def __init__(self, metrics: Metrics | None):
        self.metrics = metrics

    def _finish(self, service: str, method: str, arrived: float, code: grpc.StatusCode, model: str | None,
                context: grpc.ServicerContext) -> None:
        seconds = time.perf_counter() - arrived
        if self.metrics is not None:
            self.metrics.inflight.dec()
            self.metrics.observe(service, method, code, seconds)
        if rpc_log.isEnabledFor(logging.INFO):
            fields = {"event": "rpc", "service": service, "method": method, "code": code.name,
                      "ms": round(seconds * 1000, 3), "model": model, "peer": context.peer()}
            level = logging.INFO if code == grpc.StatusCode.OK else logging.WARNING
            rpc_log.log(level, "%s/%s %s %.1f ms%s", service, method, code.name, seconds * 1000,
                        f" model {model!r}" if model else "", extra={"fields": fields})

    def _start(self) -> None:
        if self.metrics is not None:
            self.metrics.inflight.inc()

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        """The method's handler, wrapped to be observed."""
        arrived = time.perf_counter()
        handler = continuation(details)
        service, method = split_method(details.method)
        if handler is None:
            # Not a method of ours: answered UNIMPLEMENTED here (rather than by gRPC) so that it is counted,
            # under one label value, so that random method names cannot grow the label set.
            service, method = "", UNKNOWN_METHOD
            handler = refusal(None, grpc.StatusCode.UNIMPLEMENTED, f"unknown method {details.method[:200]!r}")
        inner = behavior(handler)
        finish, start = self._finish, self._start
        streaming_request = handler.request_streaming

        def admit(request: Any, context: grpc.ServicerContext, malformed: list[str], models: list[str | None]) -> Any:
            """The request (stream) to hand the servicer; a unary request that did not parse is refused."""
            if streaming_request:
                return checked_stream(request, malformed, models)
            if isinstance(request, Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return request

        def refuse_malformed(context: grpc.ServicerContext, malformed: list[str]) -> None:
            # A malformed streamed message wins over whatever status the servicer made of it.
            if malformed:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed[0])

        if not handler.response_streaming:
            def serve(request: Any, context: grpc.ServicerContext) -> Any:
                start()
                failed, malformed, models = False, [], [] if streaming_request else [model_of(request)]
                try:
                    return inner(admit(request, context, malformed, models), context)
                except BaseException:
                    failed = True
                    refuse_malformed(context, malformed)
                    raise
                finally:
                    finish(service, method, arrived, _code(context, failed), models[0] if models else None, context)
        else:
            def serve(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:  # type: ignore[misc]
                start()
                failed, malformed, models = False, [], [] if streaming_request else [model_of(request)]
                code: grpc.StatusCode | None = None
                try:
                    yield from inner(admit(request, context, malformed, models), context)
                except GeneratorExit:  # the client went away mid-stream
                    code = grpc.StatusCode.CANCELLED
                    raise
                except BaseException:
                    failed = True
                    refuse_malformed(context, malformed)
                    raise
                finally:
                    finish(service, method, arrived, code or _code(context, failed), models[0] if models else None,
                           context)

        return rebuild(handler, serve, request_deserializer=tolerant(handler.request_deserializer))
