"""Upload speed to an in-process `deepco serve` over loopback: the median of 7 Echo calls per size.

    python bench/upload_speed.py

The server's fixed 1 MiB HTTP/2 receive window per stream (server/app.py, STREAM_WINDOW_BYTES) bounds what
gRPC buffers of requests no handler reads yet; this checks it costs uploads nothing on a fast link.
"""

from __future__ import annotations

import numpy as np
from deepco_server.app import ServeConfig, Server

from deepco.wire.client import InferenceClient


def main() -> None:
    """Print one line per size."""
    server = Server(ServeConfig(port=0, device="cpu", threads=1))
    try:
        with InferenceClient(server.address, timeout=60) as c:
            for size in (8 << 20, 64 << 20):
                c.echo(size)
                seconds = float(np.median([c.echo(size) for _ in range(7)]))
                print(f"upload {size >> 20} MiB: {seconds * 1e3:.1f} ms, {size / seconds / 1e6:.0f} MB/s")
    finally:
        server.stop(grace=1)


if __name__ == "__main__":
    main()
