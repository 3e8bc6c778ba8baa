"""`deepco serve`: serve ONNX models over the Open Inference Protocol (KServe v2 / Triton gRPC)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


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
    p.add_argument("--grace", type=_seconds, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, how long in-flight requests may still run (default: 30)")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT."""
    # Imported here so that `deepco --help` and the other commands do not load gRPC and ONNX Runtime.
    from server.app import ServeConfig, serve

    return serve(ServeConfig(host=args.host, port=args.port, device=args.device, threads=args.threads,
                             max_models=args.max_models, max_inflight=args.max_inflight, grace=args.grace))
