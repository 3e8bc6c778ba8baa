"""What ONNX Runtime's CPU memory arena buys `deepco serve`: one run's time with it and without it.

    python bench/ort_arena.py

One intra-op thread, as `deepco serve --threads 1`: a 3x3 convolution 3 -> 4 channels on a 1x3x1024x683 input
(8 MiB in, 10.7 MiB out: memory-bound, where a fresh allocation per run costs most) and the tests' heavy
six-convolution net on 1x3x768x768 (compute-bound). Prints the median of 30 (5) runs after one warm-up.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_server_support import conv_model, heavy_model  # noqa: E402


def median_ms(model: bytes, x: np.ndarray, arena: bool, runs: int) -> float:
    """Median milliseconds of ``runs`` runs of ``model`` on ``x``."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    opts.enable_cpu_mem_arena = arena
    session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    session.run(None, {"input": x})
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, {"input": x})
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    """Print one line per model."""
    rng = np.random.default_rng(0)
    for name, model, shape, runs in (("conv 3->4, 8 MiB input", conv_model(channels=(3, 4)), (1, 3, 1024, 683), 30),
                                     ("heavy net", heavy_model(), (1, 3, 768, 768), 5)):
        x = rng.standard_normal(shape).astype(np.float32)
        print(f"{name}: arena {median_ms(model, x, True, runs):.1f} ms, "
              f"no arena {median_ms(model, x, False, runs):.1f} ms")


if __name__ == "__main__":
    main()
