"""The `deepco serve` process: a gRPC server on real sockets, its limits, health and graceful shutdown."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import signal
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from deepco_server import logs
from deepco_server.budgets import (
    DEFAULT_IDLE_SECONDS,
    DEFAULT_MAX_HELD_BYTES,
    DEFAULT_MAX_STREAMS,
    BudgetInterceptor,
)
from deepco_server.dataplane import Admission, ServerState
from deepco_server.metrics import Metrics, ObservingInterceptor
from deepco_server.model_checks import DEFAULT_MAX_REQUEST_BYTES
from deepco_server.models import CUDA_OPTIONS, DEFAULT_MAX_MODEL_BYTES, Registry, Runtime, choose_runtime
from deepco_server.refusals import Refusals
from deepco_server.security import ServerSecurity, TokenAuthInterceptor, metrics_warning, plaintext_warning
from deepco_server.service import DeepcoServicer, InferenceServicer
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from deepco.errors import UserError
from deepco.heap import freeze_long_lived
from deepco.wire import GRPC_MESSAGE_OPTIONS
from deepco.wire import deepco_service_pb2_grpc as dpb_grpc
from deepco.wire import inference_pb2_grpc as pb_grpc

log = logging.getLogger("deepco.serve")

# Uploaded models nobody used for this long are unloaded (--model-lease): a device that died does not leak.
DEFAULT_MODEL_LEASE = 600.0
# 1 MiB per stream in flight still moves 100 MB/s at a 10 ms round trip (Java's and Go's gRPC fix 1 MiB too).
STREAM_WINDOW_BYTES = 1 << 20
SERVICES = ("", "inference.GRPCInferenceService", "deepco.DeepcoService")
SERVER_OPTIONS = [
    *GRPC_MESSAGE_OPTIONS,
    # gRPC sets SO_REUSEPORT by default, which lets a second server "bind" a busy port and silently share it;
    # we want "port in use" to be an error.
    ("grpc.so_reuseport", 0),
    # A fixed receive window per stream instead of gRPC's auto-tuned one (at least 4 MiB, more on fast links):
    # that is what gRPC buffers of a request before any handler looks at it, so 200 clients sending 8 MiB
    # requests made it hold 1-2 GB (bench/readiness_flood.py).
    ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
    # Identity only: gRPC inflates a compressed message before any handler or budget sees it (249 KiB of gzip
    # became 250 MiB, every one refused by --max-held-bytes only after it was inflated). A client that
    # compresses anyway is answered UNIMPLEMENTED by gRPC when its headers arrive; Triton's clients and ours
    # send uncompressed by default.
    ("grpc.compression_enabled_algorithms_bitset", 1),
]


@dataclass(frozen=True)
class ServeConfig:
    """Everything `deepco serve` is told on its command line."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: an ephemeral port, reported by Server.port
    device: str = "auto"
    threads: int = 0
    max_models: int = 8
    max_inflight: int = 4
    concurrent_runs: int = 1  # of the admitted inference requests, how many run at once (the rest wait)
    grace: float = 30.0  # seconds in-flight requests get to finish on shutdown
    max_model_bytes: int = DEFAULT_MAX_MODEL_BYTES  # uploaded ONNX bytes held at once, all models together
    max_queue: int | None = None  # control calls waiting for a control thread; None: server.budgets' default
    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS, mutual TLS, token
    metrics_port: int | None = None  # serve Prometheus /metrics on this port (0: any free one); None: off
    metrics_host: str = "127.0.0.1"
    log_format: str = "text"  # "text" or "json" (one object per line, with one line per RPC)
    model_lease: float = DEFAULT_MODEL_LEASE  # seconds an unused uploaded model stays loaded; 0: forever
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # tensors of one request together (shape inference)
    peers: tuple[str, ...] = ()  # peers (host:port) this server may dial besides loopback ones (server.peers)
    metrics_token: str | None = None  # required as 'Authorization: Bearer' on /metrics
    stream_idle_seconds: float = DEFAULT_IDLE_SECONDS  # an open stream without traffic this long is cancelled
    max_streams: int = DEFAULT_MAX_STREAMS  # streams (Run, SplitRun, SplitExchange, FetchWhole, ...) open at once
    max_held_bytes: int = DEFAULT_MAX_HELD_BYTES  # request bytes admitted calls hold at once
    server_id: str | None = None  # what ServerMetadata reports as deepco_server_id; None: `default_server_id`
    derive_stages: bool = True  # hold whole models and derive stage models from descriptions (server.derived)

    def __post_init__(self) -> None:
        # The one check of the limits: the command line's parsers check them too, but a config made in code
        # (tests, bench/) comes here without them.
        if self.max_models < 1 or self.max_inflight < 1 or self.concurrent_runs < 1:
            raise UserError("--max-models, --max-inflight and --concurrent-runs must be >= 1")
        if self.max_model_bytes < 1 or (self.max_queue is not None and self.max_queue < 0):
            raise UserError("--max-model-bytes must be >= 1 and --max-queue >= 0")
        if self.model_lease < 0 or self.max_request_bytes < 1 or self.stream_idle_seconds <= 0:
            raise UserError("--model-lease must be >= 0, --max-request-bytes >= 1 and --stream-idle-timeout > 0")
        if self.max_streams < 1 or self.max_held_bytes < 1:
            raise UserError("--max-streams and --max-held-bytes must be >= 1")
        if self.server_id is not None and not SERVER_ID.fullmatch(self.server_id):
            raise UserError(f"--server-id must be 1-64 letters, digits, '.', '_' or '-', got {self.server_id!r}")


SERVER_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def default_server_id(host: str, port: int, runtime: Runtime) -> str:
    """An id that stays the same while this host serves on this port with this runtime, and changes when any
    of them does: devices key their cached plans (and the speeds measured with them) on it, so a restarted
    server keeps their plans and a server moved to other hardware, or given other threads, does not."""
    machine = socket.gethostname()
    with contextlib.suppress(OSError):
        machine += "/" + Path("/etc/machine-id").read_text().strip()
    facts = [machine, host, str(port), runtime.device, runtime.provider, str(runtime.threads)]
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:16]


def check_bindable(host: str, port: int) -> None:
    """Raise a UserError naming the reason if ``host:port`` cannot be listened on.

    gRPC itself only says "failed to bind" (and logs a C++ error line to stderr), so we try the bind
    ourselves first, with the SO_REUSEADDR gRPC also uses, to give the user the operating system's reason.
    """
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(f"cannot listen on {host}:{port}: unknown host ({exc.strerror})") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


class Server:
    """A started gRPC server with both services and the standard grpc.health.v1 service.

    Every RPC passes the interceptors: server.metrics.ObservingInterceptor (metrics, per-RPC log line,
    unparsable requests answered INVALID_ARGUMENT), server.budgets.BudgetInterceptor (admission and thread
    pools, asking the next one first) and, with a token configured, server.security.TokenAuthInterceptor.
    ``peer_security`` is how this server should dial its peers.
    """

    def __init__(self, config: ServeConfig, runtime: Runtime | None = None):
        self.config = config  # checked when it was made (ServeConfig.__post_init__)
        self.runtime = runtime or choose_runtime(config.device, config.threads)
        self.peer_security = config.security.peer_security()
        registry = Registry(self.runtime, config.max_models, config.max_model_bytes,
                            lease=config.model_lease or None, max_request_bytes=config.max_request_bytes,
                            derive=config.derive_stages)
        self.refusals = Refusals()
        admission = Admission(config.max_inflight, config.concurrent_runs)
        self.state = ServerState(registry, admission, self.peer_security, config.peers,
                                 refusals=self.refusals)
        # Work calls beyond --max-inflight are refused by the admission inside; the two spare slots let them be.
        self.budgets = BudgetInterceptor(stream_slots=config.max_streams, work_slots=config.max_inflight + 2,
                                         idle_seconds=config.stream_idle_seconds, max_queue=config.max_queue,
                                         max_held_bytes=config.max_held_bytes, refusals=self.refusals,
                                         on_idle=self.state.window_buffers.expire)
        self.max_queue = self.budgets.max_queue
        self.metrics = Metrics(self.state.registry, lambda: self.budgets.queued, lambda: self.budgets.held_bytes,
                               self.refusals.counts)
        # No maximum_concurrent_rpcs: gRPC's own limit refuses whatever call comes next, readiness probes
        # included. The budgets refuse the excess of each class instead, before reading its request.
        self.grpc = grpc.server(self.budgets.control_pool, options=SERVER_OPTIONS, interceptors=self._interceptors())
        self.health = self._add_services()
        self.port = self._listen()
        self.state.server_id = config.server_id or default_server_id(config.host, self.port, self.runtime)
        self.metrics_port = self._serve_metrics()
        self.grpc.start()
        for service in SERVICES:
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def _interceptors(self) -> list[grpc.ServerInterceptor]:
        """Outermost first: observing, then the budgets, then the token check (if a token is configured)."""
        interceptors: list[grpc.ServerInterceptor] = [ObservingInterceptor(self.metrics), self.budgets]
        if self.config.security.token is not None:
            # Asked by the budgets before they admit a call: no slot for a caller without the token.
            interceptors.append(TokenAuthInterceptor(self.config.security.token))
        return interceptors

    def _add_services(self) -> health.HealthServicer:
        """Register both services and grpc.health.v1 on the server; the health servicer."""
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(self.state), self.grpc)
        dpb_grpc.add_DeepcoServiceServicer_to_server(DeepcoServicer(self.state, self.config.max_streams), self.grpc)
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.grpc)
        return health_servicer

    def _listen(self) -> int:
        """Open the gRPC port (TLS if configured); the port bound, or a UserError saying why not."""
        config = self.config
        address = f"{config.host}:{config.port}"
        check_bindable(config.host, config.port)
        try:
            if config.security.tls:
                port = self.grpc.add_secure_port(address, config.security.credentials())
            else:
                port = self.grpc.add_insecure_port(address)
        except RuntimeError:
            port = 0
        if port == 0:
            raise UserError(f"cannot listen on {address}: the port is in use or the address is not local")
        return port

    def _serve_metrics(self) -> int | None:
        """Serve /metrics if configured; the port bound (None: off)."""
        config = self.config
        if config.metrics_port is None:
            return None
        check_bindable(config.metrics_host, config.metrics_port)
        return self.metrics.serve_http(config.metrics_host, config.metrics_port, config.metrics_token)

    @property
    def address(self) -> str:
        """host:port clients connect to."""
        return f"{self.config.host}:{self.port}"

    def stop(self, grace: float | None = None) -> None:
        """Stop accepting requests, let in-flight ones finish (up to ``grace`` seconds), then close."""
        self.state.draining.set()
        self.health.enter_graceful_shutdown()  # health checks now say NOT_SERVING
        self.grpc.stop(self.config.grace if grace is None else grace).wait()
        self.state.peer_channels.close()
        self.budgets.close()
        self.metrics.close()


def serve(config: ServeConfig) -> int:
    """Run `deepco serve` until SIGTERM or SIGINT; returns the exit code (0 after a clean drain)."""
    logs.configure(config.log_format)
    warning = plaintext_warning(config.host, config.security)
    if warning:  # through the log, so that with --log-format json every stderr line is still JSON
        log.warning("%s", warning)
    warning = metrics_warning(config.metrics_port, config.metrics_host, config.metrics_token)
    if warning:
        log.warning("%s", warning)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("%s: draining (in-flight requests get up to %gs)", signal.Signals(signum).name, config.grace)
        stop.set()

    # Installed before the port opens, so a signal at any moment after start-up drains cleanly.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = Server(config)
    log.info("execution provider %s%s (device %s, --device %s), intra-op threads %s, max models %d, "
             "max in-flight %d, runs at once %d", server.runtime.provider,
             f" {CUDA_OPTIONS}" if server.runtime.device == "cuda" else "", server.runtime.device, config.device,
             config.threads or "ORT default", config.max_models, config.max_inflight, config.concurrent_runs)
    log.info("TLS %s, token %s, max model bytes %d, max request bytes %d, model lease %s, max queue %d, "
             "max held bytes %d, split-job peers %s, metrics %s",
             ("mutual" if config.security.ca else "on") if config.security.tls else "off",
             "required" if config.security.token else "off", config.max_model_bytes, config.max_request_bytes,
             f"{config.model_lease:g}s" if config.model_lease else "off", server.max_queue, config.max_held_bytes,
             ", ".join(config.peers) + " and loopback" if config.peers else "loopback only",
             f"http://{config.metrics_host}:{server.metrics_port}/metrics" if server.metrics_port is not None
             else "off")
    freeze_long_lived()  # the start-up heap out of the collector's full passes (deepco.heap says why)
    # The one line on stdout: scripts and tests read the port from it (useful with --port 0).
    print(f"deepco serve: listening on {server.address}", flush=True)
    while not stop.wait(0.5):  # a timed wait keeps the main thread responsive to signals
        pass
    server.stop()
    log.info("stopped")
    return 0
