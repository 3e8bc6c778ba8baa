"""The `deepco serve` process: a gRPC server on real sockets, its limits, health and graceful shutdown."""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from deepco.errors import UserError
from deepco.wire import GRPC_MESSAGE_OPTIONS
from deepco.wire import deepco_service_pb2_grpc as dpb_grpc
from deepco.wire import inference_pb2_grpc as pb_grpc
from server.models import Registry, Runtime, choose_runtime
from server.service import Admission, DeepcoServicer, InferenceServicer, ServerState

log = logging.getLogger("deepco.serve")

# Worker threads beyond the compute slots, so that health, metadata and load requests are answered even
# while every compute slot is busy.
CONTROL_THREADS = 4
SERVICES = ("", "inference.GRPCInferenceService", "deepco.DeepcoService")


@dataclass(frozen=True)
class ServeConfig:
    """Everything `deepco serve` is told on its command line."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: an ephemeral port, reported by Server.port
    device: str = "auto"
    threads: int = 0
    max_models: int = 8
    max_inflight: int = 4
    grace: float = 30.0  # seconds in-flight requests get to finish on shutdown


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
    """A started gRPC server with both services and the standard grpc.health.v1 service."""

    def __init__(self, config: ServeConfig, runtime: Runtime | None = None):
        if config.max_models < 1 or config.max_inflight < 1:
            raise UserError("--max-models and --max-inflight must be >= 1")
        self.config = config
        self.runtime = runtime or choose_runtime(config.device, config.threads)
        self.state = ServerState(Registry(self.runtime, config.max_models), Admission(config.max_inflight))
        workers = config.max_inflight + CONTROL_THREADS
        options = [*GRPC_MESSAGE_OPTIONS,
                   # gRPC sets SO_REUSEPORT by default, which lets a second server "bind" a busy port and
                   # silently share it; we want "port in use" to be an error.
                   ("grpc.so_reuseport", 0)]
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="deepco-rpc"),
                                options=options,
                                # a hard cap on RPCs held at once (running or queued); gRPC answers the
                                # excess with RESOURCE_EXHAUSTED itself
                                maximum_concurrent_rpcs=4 * workers)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(self.state), self.grpc)
        dpb_grpc.add_DeepcoServiceServicer_to_server(DeepcoServicer(self.state), self.grpc)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        address = f"{config.host}:{config.port}"
        check_bindable(config.host, config.port)
        try:
            self.port = self.grpc.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise UserError(f"cannot listen on {address}: the port is in use or the address is not local")
        self.grpc.start()
        for service in SERVICES:
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    @property
    def address(self) -> str:
        """host:port clients connect to."""
        return f"{self.config.host}:{self.port}"

    def stop(self, grace: float | None = None) -> None:
        """Stop accepting requests, let in-flight ones finish (up to ``grace`` seconds), then close."""
        self.state.draining.set()
        self.health.enter_graceful_shutdown()  # health checks now say NOT_SERVING
        self.grpc.stop(self.config.grace if grace is None else grace).wait()


def serve(config: ServeConfig) -> int:
    """Run `deepco serve` until SIGTERM or SIGINT; returns the exit code (0 after a clean drain)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="deepco serve: %(message)s")
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("%s: draining (in-flight requests get up to %gs)", signal.Signals(signum).name, config.grace)
        stop.set()

    # Installed before the port opens, so a signal at any moment after start-up drains cleanly.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = Server(config)
    log.info("execution provider %s (device %s, --device %s), intra-op threads %s, max models %d, "
             "max in-flight %d", server.runtime.provider, server.runtime.device, config.device,
             config.threads or "ORT default", config.max_models, config.max_inflight)
    # The one line on stdout: scripts and tests read the port from it (useful with --port 0).
    print(f"deepco serve: listening on {server.address}", flush=True)
    while not stop.wait(0.5):  # a timed wait keeps the main thread responsive to signals
        pass
    server.stop()
    log.info("stopped")
    return 0
