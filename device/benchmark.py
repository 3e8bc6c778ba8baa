"""The device side of `deepco bench`: one device, several algorithms, frames interleaved A, B, A, B, ...

Runs where the device lives (inside the testbed's device namespace), sets the device up once (same
measurements for every algorithm), then times one frame at a time per algorithm (no pipelining, so a
frame's latency is its own), rotating through the algorithms so that drift on the machine hits all of them
alike. Writes one JSON document.

    python -m device.benchmark --cluster C --model resnet18 --input-size 224x224 \
        --algorithms thread,thread-sa,single --frames 20 --out results.json [--pace] [--label TEXT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tqdm import tqdm

from deepco.cluster import load_cluster
from deepco.errors import UserError
from device.preprocess import preprocess, preprocessing_for
from device.session import ALGORITHMS as ROW_ALGORITHMS
from device.session import Device

WARMUP_FRAMES = 2
MODNN = ("modnn-sa", "modnn-ma")


def photo_input(model: str, height: int, width: int) -> np.ndarray:
    """The benchmark's input: matplotlib's photo of Grace Hopper, preprocessed for the model."""
    import cv2
    import matplotlib

    frame = cv2.imread(str(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"))
    return preprocess(frame, height, width, preprocessing_for(model))


def summary(latencies: list[float], predicted: float) -> dict:
    """Mean, median, p95 (seconds) and measured / predicted."""
    mean = statistics.fmean(latencies)
    return {"frames": len(latencies), "mean": mean, "p50": float(np.percentile(latencies, 50)),
            "p95": float(np.percentile(latencies, 95)), "predicted": predicted,
            "measured_over_predicted": mean / predicted if predicted > 0 else None, "latencies": latencies}


def run_benchmark(args: argparse.Namespace) -> dict:
    """Set up one device, run every algorithm interleaved, return the results document."""
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = [a for a in algorithms if a not in (*ROW_ALGORITHMS, *MODNN)]
    if unknown:
        raise UserError(f"unknown algorithm(s) {', '.join(unknown)} (choose from "
                        f"{', '.join((*ROW_ALGORITHMS, *MODNN))})")
    h, w = (int(v) for v in args.input_size.split("x"))
    cluster = load_cluster(args.cluster)
    device = Device(cluster, args.model, h, w, algorithm="thread", cut=args.cut, pace=args.pace, depth=1,
                    log=lambda line: print(line, file=sys.stderr, flush=True))
    with device:
        device.setup()
        runners = {}
        for algorithm in algorithms:
            if algorithm in MODNN:
                from device.modnn import ModnnRunner

                peer = None if args.peer_mbps is None else args.peer_mbps * 1e6 / 8
                runners[algorithm] = ModnnRunner(device, algorithm, peer_bytes_per_second=peer)
            else:
                runners[algorithm] = device.plan_for(algorithm)
        x = photo_input(args.model, h, w)

        # Every frame of every algorithm is checked against ONNX Runtime on the whole model, here.
        whole = ort.InferenceSession(device.model.SerializeToString(), providers=["CPUExecutionProvider"])
        reference = whole.run(None, {whole.get_inputs()[0].name: x})[0]
        scale = float(np.abs(reference).max()) or 1.0
        worst: dict[str, float] = {a: 0.0 for a in algorithms}

        def once(algorithm: str) -> float:
            runner = runners[algorithm]
            if algorithm in MODNN:
                start = time.perf_counter()
                output, _ = runner.run_frame(x)
                latency = time.perf_counter() - start
            else:
                result = next(device.run([x], plan=runner, depth=1))
                if result.error is not None:
                    raise UserError(f"{algorithm}: frame failed: {result.error}")
                output, latency = result.output, result.latency
            worst[algorithm] = max(worst[algorithm], float(np.abs(output - reference).max()) / scale)
            return latency

        for _ in range(WARMUP_FRAMES):
            for algorithm in algorithms:
                once(algorithm)
        latencies: dict[str, list[float]] = {a: [] for a in algorithms}
        for _ in tqdm(range(args.frames), desc="frames (all algorithms interleaved)", file=sys.stderr):
            for algorithm in algorithms:
                latencies[algorithm].append(once(algorithm))
        results = {}
        for algorithm in algorithms:
            runner = runners[algorithm]
            predicted = runner.predicted if algorithm in MODNN else runner.frame_time
            entry = summary(latencies[algorithm], predicted)
            entry["max_relative_error"] = worst[algorithm]  # vs the whole model, over every frame
            if algorithm not in MODNN:
                entry["servers"] = [{"name": s.name, "antenna": s.antenna, "order": s.order,
                                     "rows": [s.start, s.stop]} for s in runner.slices]
                entry["plan"] = device.describe_plan(runner)
            results[algorithm] = entry
        return {"label": args.label, "model": args.model, "input_size": args.input_size, "cut": device.cut.name,
                "measured": device.measured.to_dict(), "algorithms": results}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the worker process."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", required=True)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--input-size", default="224x224")
    p.add_argument("--algorithms", default="thread,thread-sa,single")
    p.add_argument("--frames", type=int, default=20)
    p.add_argument("--cut", default="auto")
    p.add_argument("--pace", action="store_true")
    p.add_argument("--peer-mbps", type=float, default=None, help="the servers' own links (MoDNN's exchanges)")
    p.add_argument("--label", default="")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        document = run_benchmark(args)
    except UserError as exc:
        print(f"deepco bench: error: {exc}", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(document, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
