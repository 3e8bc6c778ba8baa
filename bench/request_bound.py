"""Cost of the server's per-request memory bound (server.model_checks.SizeBound) on an ONNX model.

    python -m deepco export --model resnet50 --input-size 224x224 --output /tmp/r50.onnx
    PYTHONPATH=. python bench/request_bound.py /tmp/r50.onnx 1,3,224,224

Prints the time to build the shape-inference skeleton (at load), the first check of an input shape (ONNX
shape inference), a cached check (mean of 1000), and the bound itself.
"""

from __future__ import annotations

import sys
import time

import onnx
from deepco_server.model_checks import SizeBound


def main(path: str, shape_text: str) -> None:
    """Measure and print one line."""
    shape = tuple(int(v) for v in shape_text.split(","))
    model = onnx.load(path)
    name = model.graph.input[0].name
    start = time.perf_counter()
    bound = SizeBound(model, "m", 1 << 50, [name])
    built = time.perf_counter() - start
    start = time.perf_counter()
    total = bound.check({name: shape})
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(1000):
        bound.check({name: shape})
    cached = (time.perf_counter() - start) / 1000
    print(f"{path}: skeleton {built * 1e3:.1f} ms, first check {first * 1e3:.1f} ms, cached {cached * 1e6:.1f} us, "
          f"bound {total / 2**20:.0f} MiB for {list(shape)}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
