"""Two frames at once on one server held to a CPU share: run together, or one after another?

    python bench/concurrent_runs.py [--model resnet18] [--input-size 224x224] [--share 0.45] [--frames 12]

Starts a real `deepco serve --threads 1` in a cpu cgroup of its own with ``--share`` of a core (EMULATED: a
cgroup CPU quota, as the camera preset's servers; needs root), once with `--concurrent-runs 1` and once with
`--concurrent-runs 2`, and sends it frames two at a time (Run calls, as the device's `depth 2` does) and then
one at a time. Prints runs per second and each frame's median latency, server compute and server queue time.
With the same total work, two runs at once are no faster than one after another if the server is
CPU-bound; the question is how much slower.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from deepco_bench.testbed_servers import server_under_quota

from deepco.model_cache import cached_export
from deepco.parsing import parse_size
from deepco.wire.client import InferenceClient
from deepco.zoo import export


def measure(client: InferenceClient, feeds: dict[str, np.ndarray], frames: int, together: int) -> dict[str, float]:
    """``frames`` Run calls, ``together`` at a time: runs/s and medians of latency, compute and queue (ms)."""
    latency, compute, queue = [], [], []
    start = time.perf_counter()
    for _ in range(frames // together):
        sent = time.perf_counter()
        handles = [client.start_run("model", feeds) for _ in range(together)]
        for handle in handles:
            times = handle.result()[1]
            latency.append(time.perf_counter() - sent)
            compute.append(times.compute_seconds)
            queue.append(times.queue_seconds)
    wall = time.perf_counter() - start
    return {"runs_per_s": len(latency) / wall, "latency_ms": 1e3 * statistics.median(latency),
            "compute_ms": 1e3 * statistics.median(compute), "queue_ms": 1e3 * statistics.median(queue)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--input-size", default="224x224")
    p.add_argument("--share", type=float, default=0.45, help="the server's share of a core (default: 0.45)")
    p.add_argument("--frames", type=int, default=12)
    args = p.parse_args()
    h, w = parse_size(args.input_size)
    model = cached_export(args.model, h, w, None, lambda: export(args.model, h, w))
    feeds = {model.graph.input[0].name: np.random.default_rng(0).standard_normal((1, 3, h, w)).astype(np.float32)}
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{args.model} {args.input_size}, one `deepco serve --threads 1` held to {args.share} core "
          f"(EMULATED: cgroup CPU quota), {args.frames} frames per row, {when}")
    print(f"{'--concurrent-runs':>17} {'frames at once':>14} {'runs/s':>7} {'latency ms':>10} {'compute ms':>10} "
          f"{'queue ms':>8}")
    for runs in (1, 2):
        serving = server_under_quota(args.share, "--threads", "1", "--concurrent-runs", str(runs))
        with serving as address, InferenceClient(address) as client:
            client.load_model(model.SerializeToString(), "model")
            measure(client, feeds, 2, 1)  # warm-up
            for together in (2, 1):
                row = measure(client, feeds, args.frames, together)
                print(f"{runs:>17} {together:>14} {row['runs_per_s']:>7.2f} {row['latency_ms']:>10.0f} "
                      f"{row['compute_ms']:>10.0f} {row['queue_ms']:>8.0f}")


if __name__ == "__main__":
    main()
