"""The cost of a server step, measured: real `deepco serve` processes on loopback, a real split plan, N frames.

    python bench/step_overhead.py [--model resnet18] [--input-size 224x224] [--servers 2] [--frames 30]
                                  [--overlap plan|on|off|compare] [--json-log F.jsonl] [--gantt F.png]

The plan is a split over every server at several levels (an exchange of halo rows between each pair of
segments) with the tail gathered on the first server, so each frame takes many steps. Prints, from the
frames' step timelines (deepco/timelines.py), the median of each phase and the per-step overhead: a segment
step's wall time less its compute (and less its wait for peers' rows), the figure issue 30 asks to cut.
Every frame is checked against the whole model (within 1e-4). On a shared machine the numbers are
indicative only; compare a before and an after measured back to back on the same machine.

``--overlap`` (deepco/planning/overlap.py): ``plan`` runs the stages as the planner chose, ``on`` every stage
that can in parts (the interior while the halo is in flight), ``off`` every stage once; ``compare`` runs
``off`` and ``on`` on the same servers, their frames interleaved, and prints both and their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
from deepco_device.preprocess import normalise
from deepco_device.session import Device
from deepco_device.staged import StagedPlanner, StagedRunner

from deepco.cluster import parse_cluster
from deepco.parsing import parse_size
from deepco.planning.staged import in_parts, split_plan
from deepco.timelines import gantt, split_text, step_split

LEVELS = {"resnet18": ["layer1", "layer2.0", "layer2", "layer3.0", "layer3", "layer4"],
          "resnet50": ["layer1", "layer2", "layer3", "layer4"]}


@contextlib.contextmanager
def server(threads: int, max_models: int = 32) -> Iterator[str]:
    """A `deepco serve` process on a free loopback port: its address."""
    proc = subprocess.Popen([sys.executable, "-m", "deepco", "serve", "--port", "0", "--threads", str(threads),
                             "--max-models", str(max_models)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        match = re.fullmatch(r"deepco serve: listening on (\S+)\n", lines.get(timeout=60))
        if not match:
            raise SystemExit("deepco serve did not start")
        yield match.group(1)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _frames(runners: dict, px: np.ndarray, want: np.ndarray, frames: int) -> dict[str, tuple[list, list]]:
    """``frames`` frames through each runner, interleaved, each checked against ``want`` (the whole model):
    per runner (records, latencies)."""
    for runner in runners.values():
        for _ in range(3):  # warm-up: sessions, channels, allocators
            runner.run_frame(px)
    runs: dict[str, tuple[list, list]] = {name: ([], []) for name in runners}
    for _ in range(frames):
        for name, runner in runners.items():
            records, latencies = runs[name]
            started = time.perf_counter()
            outputs, timing = runner.run_frame(px)
            latencies.append(time.perf_counter() - started)
            (got,) = outputs.values()
            error = float(np.abs(got - want).max()) / float(np.abs(want).max())
            if error >= 1e-4:
                raise SystemExit(f"a frame ({name}) differs from the whole model: relative error {error:.2e}")
            records.append({"frame": len(records), "latency": latencies[-1], "error": None,
                            "staged": timing.to_dict()})
    return runs


def main(argv: list[str] | None = None) -> int:
    """Measure and print."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18", choices=list(LEVELS))
    p.add_argument("--input-size", default="224x224")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--frames", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads per server (default 1)")
    p.add_argument("--json-log", metavar="FILE", help="write each frame's timeline, a JSON line each (as deepco run "
                                                     "--json-log's `staged`; read by bench/step_split.py)")
    p.add_argument("--gantt", metavar="FILE.png", help="draw the frame of median latency as a Gantt chart")
    p.add_argument("--overlap", choices=["plan", "on", "off", "compare"], default="plan",
                   help="run stages as planned, in parts where they can (on), once (off), or compare off and on")
    args = p.parse_args(argv)
    h, w = parse_size(args.input_size)
    with contextlib.ExitStack() as stack:
        addresses = [stack.enter_context(server(args.threads)) for _ in range(args.servers)]
        names = [f"s{k}" for k in range(args.servers)]
        cluster = parse_cluster({"device": {"antennas": 1, "bandwidth": 1000.0},
                                 "servers": [{"name": n, "capacity": 1.0, "address": a}
                                             for n, a in zip(names, addresses, strict=True)]})
        dev = stack.enter_context(Device(cluster, args.model, h, w, log=lambda _: None))
        dev.setup()
        planner = StagedPlanner(dev)
        plan = split_plan(planner.costs, planner.rates(), names, LEVELS[args.model], True, names[0])
        if plan is None:
            raise SystemExit(f"{args.input_size} is too small for a split at {LEVELS[args.model]}")
        variants = {"plan": plan, "on": in_parts(plan, planner.costs), "off": replace(plan, overlap=[])}
        chosen = ["off", "on"] if args.overlap == "compare" else [args.overlap]
        runners = {name: StagedRunner(dev, variants[name]) for name in chosen}
        px = np.random.default_rng(0).integers(0, 256, (1, 3, h, w), dtype=np.uint8)
        whole = ort.InferenceSession(dev.reference_model.SerializeToString(), providers=["CPUExecutionProvider"])
        want = whole.run(None, {whole.get_inputs()[0].name: normalise(px, dev.preprocessing)})[0]
        runs = _frames(runners, px, want, args.frames)
        for runner in runners.values():
            runner.close()
    if args.overlap == "compare":
        off, on = (statistics.median(lat) for _, lat in (runs["off"], runs["on"]))
        print(f"overlap off: frame p50 {off * 1e3:.1f} ms; on: {on * 1e3:.1f} ms; on/off {on / off:.3f} "
              "(INDICATIVE: a shared machine; frames interleaved)")
    records, latencies = runs[chosen[-1]]
    plan = variants[chosen[-1]]
    if args.json_log:
        Path(args.json_log).write_text("".join(json.dumps(r) + "\n" for r in records))
    if args.gantt:
        median = sorted(records, key=lambda r: r["latency"])[len(records) // 2]
        gantt(median["staged"], args.gantt, f"{args.model} {args.input_size}, {args.servers} servers on loopback: "
                                            f"the frame of median latency, {median['latency'] * 1e3:.1f} ms")
    split = step_split(records)
    print(f"{args.model} {args.input_size}, {args.servers} servers, plan {plan.describe()}")
    print(f"frame p50 {statistics.median(latencies) * 1e3:.1f} ms (INDICATIVE: a shared machine)")
    print(split_text(split))
    print(f"per-step overhead median: {split['segment']['overhead'] * 1e3:.2f} ms "
          f"(less halo {split['segment']['overhead_less_halo'] * 1e3:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
