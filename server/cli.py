"""`deepco serve`: serve ONNX models over the Open Inference Protocol (KServe v2 / Triton gRPC)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from deepco.parsing import split_address


def _int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer within bounds."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _addresses(text: str) -> tuple[str, ...]:
    items = tuple(a.strip() for a in text.split(",") if a.strip())
    for item in items:
        try:
            split_address(item)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return items


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `deepco serve`."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", required=True, type=_int_at_least(0, 65535),
                   help="TCP port; 0 picks a free one (the chosen port is printed)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: CUDA when onnxruntime-gpu and a GPU are present, else CPU (default: auto)")
    p.add_argument("--threads", type=_int_at_least(0), default=0, metavar="N",
                   help="ONNX Runtime intra-op threads per request (default: 0, ORT's choice)")
    p.add_argument("--max-models", type=_int_at_least(1), default=8, metavar="N",
                   help="models loaded at once; more loads are refused with RESOURCE_EXHAUSTED (default: 8)")
    p.add_argument("--max-inflight", type=_int_at_least(1), default=4, metavar="N",
                   help="inference requests running at once; the excess is refused with RESOURCE_EXHAUSTED "
                        "(default: 4)")
    p.add_argument("--concurrent-runs", type=_int_at_least(1), default=1, metavar="N",
                   help="of the admitted inference requests, how many run at once; the rest wait their turn "
                        "(default: 1, like Triton's one instance per model: ONNX Runtime already spreads one run "
                        "over the cores, and two at once on one CPU share only slow each other down)")
    p.add_argument("--grace", type=_seconds, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, how long in-flight requests may still run (default: 30)")
    p.add_argument("--max-model-bytes", type=_int_at_least(1), default=1 << 30, metavar="BYTES",
                   help="uploaded ONNX bytes of all loaded models together; a load over it is refused with "
                        "RESOURCE_EXHAUSTED (default: 1073741824, 1 GiB)")
    p.add_argument("--max-queue", type=_int_at_least(0), default=None, metavar="N",
                   help="control calls (metadata, model index, unload, ...) open at once beyond 4, a thread each; a "
                        "control call's request must arrive within 2 s; the excess is refused at once with "
                        "RESOURCE_EXHAUSTED. Inference, uploads and "
                        "streams never wait: over their budgets they are refused before their request is read; "
                        "ServerLive/ServerReady/health checks have threads of their own and are never refused "
                        "(default: 12)")
    p.add_argument("--max-held-bytes", type=_int_at_least(1), default=1 << 30, metavar="BYTES",
                   help="request bytes that admitted calls hold at once, and their replies' until the client has "
                        "read them; a request or reply that would pass it is refused with RESOURCE_EXHAUSTED and "
                        "dropped (default: 1073741824, 1 GiB)")
    p.add_argument("--model-lease", type=_seconds, default=600.0, metavar="SECONDS",
                   help="unload an uploaded model nobody used (loaded, ran, asked about) for this long, so a "
                        "device that died does not leak it; 0: never (default: 600)")
    p.add_argument("--max-request-bytes", type=_int_at_least(1), default=4 << 30, metavar="BYTES",
                   help="all tensors of one request together, bounded by ONNX shape inference on the request's "
                        "input shapes before it runs; over it, or not boundable (sizes that depend on input "
                        "values), is refused with RESOURCE_EXHAUSTED; convolutions' column buffers count too "
                        "(default: 4294967296, 4 GiB)")
    p.add_argument("--stream-idle-timeout", type=_seconds, default=120.0, metavar="SECONDS",
                   help="cancel an open stream (Run, SplitRun, SplitExchange, FetchWhole, Health/Watch) that sent or "
                        "received nothing for this long, an inference or upload call whose request took "
                        "longer to arrive, and a call whose reply the client did not read for this long "
                        "(default: 120)")
    p.add_argument("--max-streams", type=_int_at_least(1), default=16, metavar="N",
                   help="streams open at once (Run, SplitRun, SplitExchange, FetchWhole, Health/Watch), each holding a "
                        "worker thread; the excess is refused with RESOURCE_EXHAUSTED (default: 16)")
    p.add_argument("--peers", type=_addresses, default=(), metavar="HOST:PORT,...",
                   help="peers this server may dial (with its own token / certificate) when a device's SplitRun, "
                        "ProbePeer or whole-model fetch names them; loopback addresses are always allowed, others "
                        "are refused with PERMISSION_DENIED unless listed (default: none)")
    p.add_argument("--server-id", default=None, metavar="ID",
                   help="the id ServerMetadata reports (deepco_server_id), which devices key their cached plans on; "
                        "default: one derived from the host, the port and the runtime, the same across restarts")
    p.add_argument("--no-derive-stages", dest="derive_stages", action="store_false",
                   help="do not hold whole models nor derive stage models from a device's stage descriptions (devices "
                        "then upload every stage model; default: derive them, so a new plan sends a few hundred bytes "
                        "per stage)")
    sec = p.add_argument_group("security (plain text off loopback is allowed, with a warning on stderr)")
    sec.add_argument("--tls-cert", type=Path, metavar="PEM", help="server certificate (chain): serve TLS only")
    sec.add_argument("--tls-key", type=Path, metavar="PEM", help="private key of --tls-cert")
    sec.add_argument("--tls-ca", type=Path, metavar="PEM",
                     help="CA of client certificates: mutual TLS, clients without one are refused")
    token = sec.add_mutually_exclusive_group()
    token.add_argument("--token", metavar="TOKEN",
                       help="shared token every RPC but ServerLive/ServerReady/health must send as metadata "
                            "'authorization: Bearer TOKEN' (visible in ps: prefer --token-file)")
    token.add_argument("--token-file", type=Path, metavar="FILE", help="read the shared token from FILE")
    obs = p.add_argument_group("observability")
    obs.add_argument("--metrics-port", type=_int_at_least(0, 65535), default=None, metavar="P",
                     help="serve Prometheus metrics at http://HOST:P/metrics (default: off)")
    obs.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                     help="address of the metrics endpoint (default: 127.0.0.1)")
    obs.add_argument("--metrics-token", metavar="TOKEN",
                     help="require 'Authorization: Bearer TOKEN' on /metrics (warned about when --metrics-host "
                          "is not loopback and this is not set)")
    obs.add_argument("--log-format", choices=("text", "json"), default="text",
                     help="stderr log lines: text, or one JSON object per line with one line per RPC "
                          "(fields ts, level, event, service, method, code, ms, model, peer) (default: text)")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT."""
    # Imported here so that `deepco --help` and the other commands do not load gRPC and ONNX Runtime.
    from deepco_server.app import ServeConfig, serve
    from deepco_server.security import ServerSecurity

    from deepco.wire.security import read_token_file

    token = read_token_file(args.token_file) if args.token_file is not None else args.token
    security = ServerSecurity(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca, token=token)
    return serve(ServeConfig(host=args.host, port=args.port, device=args.device, threads=args.threads,
                             max_models=args.max_models, max_inflight=args.max_inflight,
                             concurrent_runs=args.concurrent_runs, grace=args.grace,
                             max_model_bytes=args.max_model_bytes, max_queue=args.max_queue, security=security,
                             metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                             log_format=args.log_format, model_lease=args.model_lease,
                             max_request_bytes=args.max_request_bytes, peers=args.peers,
                             metrics_token=args.metrics_token, stream_idle_seconds=args.stream_idle_timeout,
                             max_streams=args.max_streams, max_held_bytes=args.max_held_bytes,
                             server_id=args.server_id, derive_stages=args.derive_stages))
