"""Each participant's band of every level of a recorded plan, timed in ONNX Runtime on one free thread: the
segment as the model's own nodes on its window (padded, its rows to crop included) against the segment on open
rows for the participant's sides (deepco/partition/open_rows.py), with the FLOPs of each.

    python bench/open_rows_timing.py bench/results/bench/camera-720x1280-a43acea.json --repeat 1 [--extended] \
        [--model resnet18 --input-size 720x1280]

``--extended``: ORT's EXTENDED graph optimisation instead of ALL (the servers' default), i.e. without the NCHWc
layout transforms. Timing only: nothing is compared against the whole model here (tests/test_open_rows.py does).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import onnx
import onnxruntime as ort

from deepco.partition import Partitioner, load_model
from deepco.partition.derive import open_segment
from deepco.partition.open_rows import sides_for
from deepco.planning.staged import StagedPlan


def session(model: onnx.ModelProto, level: ort.GraphOptimizationLevel) -> ort.InferenceSession:
    """One thread, as `deepco serve --threads 1`."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.graph_optimization_level = level
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def best_of(s: ort.InferenceSession, x: np.ndarray, runs: int = 3) -> float:
    """Seconds of the fastest of ``runs`` runs after a warm-up."""
    feed = {s.get_inputs()[0].name: x}
    s.run(None, feed)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        s.run(None, feed)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json")
    ap.add_argument("--repeat", type=int, default=1, help="the repeat whose `auto` plan to time (1-based)")
    ap.add_argument("--extended", action="store_true", help="ORT's EXTENDED optimisation level instead of ALL")
    ap.add_argument("--model", default="resnet18", help="the model the bench ran (default resnet18)")
    ap.add_argument("--input-size", default="720x1280", help="HxW the bench ran at (default 720x1280)")
    args = ap.parse_args()
    with open(args.bench_json) as f:
        doc = json.load(f)
    plan = StagedPlan.from_dict(doc["points"][0]["runs"][args.repeat - 1]["algorithms"]["auto"]["plan"])
    h, w = (int(v) for v in args.input_size.split("x"))
    levels = ort.GraphOptimizationLevel
    level = levels.ORT_ENABLE_EXTENDED if args.extended else levels.ORT_ENABLE_ALL
    p = Partitioner(load_model(args.model, h, w), h, w)
    segments = p.segments(plan.levels[-1], models=True, through=plan.levels[:-1])
    rng = np.random.default_rng(0)
    total = np.zeros(4)
    for j, seg in enumerate(segments, start=1):
        sessions: dict = {}
        row = np.zeros(4)
        for i in range(len(plan.servers)):
            (a, b), (lo, hi) = plan.bands[j][i], plan.windows[j][i]
            sides = sides_for((lo, hi), seg.in_height)
            channels = seg.model.graph.input[0].type.tensor_type.shape.dim[1].dim_value
            x = rng.standard_normal((1, channels, hi - lo, p.graph.hw[seg.source][1])).astype(np.float32)
            if "padded" not in sessions:
                sessions["padded"] = session(seg.model, level)
            if sides not in sessions:
                sessions[sides] = session(open_segment(seg.model, sides), level)
            row += [best_of(sessions["padded"], x), seg.window(a, b).flops, best_of(sessions[sides], x),
                    seg.open_window(a, b).flops]
        total += row
        print(f"level {j} {seg.name:10s} padded {row[0] * 1e3:7.1f} ms {row[1] / 1e9:6.2f} GFLOP   "
              f"open {row[2] * 1e3:7.1f} ms {row[3] / 1e9:6.2f} GFLOP")
    print(f"all: padded {total[0] * 1e3:.1f} ms, {total[1] / 1e9:.2f} GFLOP ({total[1] / total[0] / 1e9:.1f} GFLOP/s); "
          f"open {total[2] * 1e3:.1f} ms, {total[3] / 1e9:.2f} GFLOP ({total[3] / total[2] / 1e9:.1f} GFLOP/s)")


if __name__ == "__main__":
    main()
