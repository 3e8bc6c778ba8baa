"""Load test: several devices at once against two servers on loopback; every frame must come out.

Starts two `deepco serve` processes, then N concurrent `deepco run` processes (each its own device, all on
the same two servers, every server used by every device: --algorithm equal), each for a bounded number of
frames and a bounded time. Counts lost frames (a frame missing from a device's log, or logged with an
error) and reports latency percentiles over all frames of all devices.

    .venv/bin/python bench/load_test.py [--devices 8] [--frames 40] [--input-size 128x160] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from deepco_bench.demo import grace_hopper, local_servers, write_cluster
from deepco_device.sources import make_pan_zoom_clip

ROOT = Path(__file__).resolve().parent.parent


def load_test(devices: int, frames: int, input_size: str, time_limit: float, workdir: Path) -> dict:
    """Run the load test; returns counts and latency percentiles (seconds)."""
    clip = make_pan_zoom_clip(grace_hopper(), workdir / "clip.avi", frames=frames)
    model = workdir / "resnet18.onnx"
    subprocess.run([sys.executable, "-m", "deepco", "export", "--model", "resnet18", "--input-size", input_size,
                    "--output", str(model)], check=True, cwd=ROOT, capture_output=True)
    with local_servers(2, threads=1, extra=("--max-models", "64")) as addresses:
        cluster = write_cluster(workdir / "cluster.toml", addresses, antennas=2, bandwidth=1000.0)
        started = time.perf_counter()
        procs = []
        for d in range(devices):
            log = workdir / f"device{d}.jsonl"
            procs.append((log, subprocess.Popen(
                [sys.executable, "-m", "deepco", "run", "--cluster", str(cluster), "--model", str(model),
                 "--input-size", input_size, "--source", str(clip), "--frames", str(frames), "--algorithm", "equal",
                 "--cut", "layer2", "--quiet", "--json-log", str(log)],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        exits = []
        for _, proc in procs:
            try:
                out, err = proc.communicate(timeout=max(1.0, time_limit - (time.perf_counter() - started)))
                exits.append((proc.returncode, err.strip().splitlines()[-1:] if proc.returncode else []))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                exits.append((None, ["killed at the time limit"]))
        elapsed = time.perf_counter() - started
    latencies, lost, errors = [], 0, []
    for (log, _), (code, err) in zip(procs, exits, strict=True):
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        good = [r for r in records if r["error"] is None]
        lost += frames - len(good)
        latencies += [r["latency"] for r in good]
        errors += [r["error"] for r in records if r["error"] is not None] + ([f"exit {code}: {err}"] if code else [])
    p50, p95, p99 = (float(v) for v in np.percentile(latencies, [50, 95, 99])) if latencies else (0.0,) * 3
    return {"devices": devices, "frames_per_device": frames, "input_size": input_size, "servers": 2,
            "frames_out": len(latencies), "lost_frames": lost, "errors": errors[:10], "seconds": elapsed,
            "throughput_fps": len(latencies) / elapsed, "latency_p50": p50, "latency_p95": p95,
            "latency_p99": p99, "latency_max": max(latencies, default=0.0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--frames", type=int, default=40)
    p.add_argument("--input-size", default="128x160")
    p.add_argument("--time-limit", type=float, default=300.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="deepco-load-") as tmp:
        result = load_test(args.devices, args.frames, args.input_size, args.time_limit, Path(tmp))
    result.update({"command": " ".join(["bench/load_test.py", *(argv or sys.argv[1:])]),
                   "date": datetime.now(UTC).isoformat(timespec="seconds"),
                   "machine": f"{platform.machine()}, 2 cores, python {platform.python_version()}"})
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["lost_frames"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
