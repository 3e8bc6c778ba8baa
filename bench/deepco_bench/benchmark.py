"""The device side of `deepco bench`: one device, every algorithm, frames interleaved A, B, A, B, ...

Runs where the device lives (inside the testbed's device namespace), sets the device up once (the same
measurements for every algorithm), then
1. latency: one frame at a time per algorithm (nothing pipelined, so a frame's latency is its own),
   in a fresh order every round (`round_order`) so that drift on the machine hits all of them alike;
2. throughput: for each algorithm a run of its own with frames pipelined (``--depth``, at least 2; for
   round-robin one frame per server in flight), giving sustained frames per second;
3. with ``--live-frames`` and ``--slo-factor``, issue 28's runs on `auto`'s plan (`deadlines`): the photo played
   as a live source faster than the engine (capture-to-result latency, drops), and `--objective slo`'s
   choice against every candidate plan and depth measured in the same run.
Every output of every frame is checked against ONNX Runtime on the whole, unpartitioned model with the
same preprocessing. Writes one JSON document with the physical bound of the point (see `bound`).

    python -m deepco_bench.benchmark --cluster C --model resnet18 --input-size 224x224 \\
        --algorithms local,offload,round-robin,auto,thread,modnn-sa --frames 8 --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
from deepco_device.answers import relative_error
from deepco_device.feed import LiveFeed
from deepco_device.preprocess import IMAGENET, Preprocessing, normalise, pixels
from deepco_device.session import ALGORITHMS as ROW_ALGORITHMS
from deepco_device.session import Device
from deepco_device.staged import SETTLE_SECONDS, StagedPlanner, round_order
from tqdm import tqdm

from deepco import modelcard
from deepco.cluster import load_cluster
from deepco.errors import UserError
from deepco.parsing import parse_size
from deepco.planning.staged import pipelined, predict, unstreamed

WARMUP_FRAMES = 2
LIVE_SPEEDUP = 2.0  # --live-frames plays its source this many times faster than the engine's own rate
LIVE_PROBE_FRAMES = 30  # frames that measure the engine's own rate before the live runs
LOADED, GO = "deepco-bench: model loaded", "go"  # the --handshake lines
MODNN = ("modnn-sa", "modnn-ma")
# auto-whole: auto's plan with its windows sent whole (its first stage run once): what streaming the windows in
# sub-bands is worth, side by side (the same as auto where calibration chose a plan that streams nothing)
ALL = ("local", "offload", "round-robin", "auto", "auto-whole", "auto-throughput", *ROW_ALGORITHMS, *MODNN)


def photo_pixels(height: int, width: int, how: Preprocessing = IMAGENET) -> np.ndarray:
    """The benchmark's input: matplotlib's photo of Grace Hopper as the pixels the device sends."""
    import cv2
    import matplotlib

    frame = cv2.imread(str(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"))
    return pixels(frame, height, width, how)


def bound(device: Device) -> dict:
    """The physical bound of one point: latency >= max(input bytes as sent / sum of antenna bandwidths, output
    bytes / the same, model FLOPs / (sum of server FLOP/s + device FLOP/s)); fps <= the least of the inverses.
    Each antenna is shaped in each direction on its own, so the image going out and the outputs coming back
    (a detector's raw heads: 11 MB at 736x1280, four times its image) each need the antennas' sum at least,
    not together. FLOP rates as measured at setup; each antenna's bandwidth the larger of the measured one and
    the cluster's (the shaping's rate): a probe on a busy machine can only underestimate a link, and a bound
    must not be raised by that."""
    m = device.measured
    input_bytes = device.channels * device.height * device.width * device.partitioner.graph.itemsize
    output_bytes = device.costs.output_bytes
    flops = device.partitioner.total_flops
    declared = [(a.bandwidth or 0.0) * 1e6 / 8 for a in device.cluster.device.antennas]
    link = sum(max(b, d) for b, d in zip(m.antenna_bytes_per_second, declared, strict=True))
    compute = sum(m.server_flops_per_second.values()) + m.device_flops_per_second
    return _limits(max(input_bytes, output_bytes), link, flops, compute) | {
        "input_bytes": input_bytes, "output_bytes": output_bytes, "model_flops": flops,
        "link_bytes_per_second": link, "compute_flops_per_second": compute}


def _limits(wire: float, link: float, flops: float, compute: float) -> dict:
    """Latency (s) and fps bounds of ``wire`` bytes over ``link`` bytes/s and ``flops`` over ``compute`` FLOP/s."""
    return {"latency": max(wire / link, flops / compute), "fps": min(link / wire, compute / flops)}


def timed_bound(limits: dict, measured: dict, algorithms: dict) -> dict | None:
    """The same bound with each server's FLOP rate as it ran the whole model in the run's own frames (the
    offload's and round-robin's: its own ONNX Runtime seconds, median) and the device's as its local frames
    ran, instead of setup's probe. The probe times a short head for 0.3 s: on the testbed it read one
    0.45-core server at 37, 80 and 79 GFLOP/s in three setups of one run while that server ran the model at 57,
    50 and 56, so the probe's bound moved 1.7x between repeats whose frames all took about as long. A server
    no whole-model frame ran on (round-robin's frames fewer than the servers) keeps its probed rate times the
    median of the timed servers' rate over probed. ``limits``: `bound`'s; ``measured``: the setup's
    measurements (its JSON form); ``algorithms``: each algorithm's results with its ``timelines``. None where
    no frame ran the whole model on a server."""
    flops = limits["model_flops"]
    seconds: dict[str, list[float]] = {}
    local: list[float] = []
    for name, entry in algorithms.items():
        for t in entry.get("timelines") or []:
            if t.get("server") is not None and t.get("compute", 0) > 0:
                seconds.setdefault(t["server"], []).append(t["compute"])
            elif name == "local" and t.get("compute", 0) > 0:
                local.append(t["compute"])
    probed = measured["server_flops_per_second"]
    timed = {s: flops / statistics.median(v) for s, v in seconds.items() if s in probed}
    if not timed:
        return None
    ratio = statistics.median(timed[s] / probed[s] for s in timed)
    servers = {s: timed.get(s, rate * ratio) for s, rate in probed.items()}
    device = flops / statistics.median(local) if local else measured["device_flops_per_second"]
    wire = max(limits["input_bytes"], limits["output_bytes"])
    return _limits(wire, limits["link_bytes_per_second"], flops, sum(servers.values()) + device) | {
        "server_flops_per_second": servers, "device_flops_per_second": device,
        "servers_timed": sorted(timed), "device_timed": bool(local)}


def summary(latencies: list[float], predicted: float) -> dict:
    """Mean, median, p95 (seconds) and measured (median) / predicted."""
    p50 = float(np.percentile(latencies, 50))
    return {"frames": len(latencies), "mean": statistics.fmean(latencies), "p50": p50,
            "p95": float(np.percentile(latencies, 95)), "predicted": predicted,
            "measured_over_predicted": p50 / predicted if predicted > 0 else None, "latencies": latencies}


class Runner:
    """One algorithm behind one call: ``frame(px) -> (output, latency)`` and ``predicted`` seconds."""

    def __init__(self, name: str, device: Device, peer: float | None, objective_plans: dict):
        self.name, self.device = name, device
        self.timelines: list[dict] = []  # each frame's FrameTiming.to_dict() (the JSON log's `staged`)
        if name in MODNN:
            from deepco_device.modnn import ModnnRunner

            self.impl = ModnnRunner(device, name, peer_bytes_per_second=peer)
            self.predicted, self.predicted_fps, self.plan = self.impl.predicted, None, None
            self.planner = None
        else:  # the paper's plans too: one staged runtime runs every plan
            from deepco_device.staged import StagedRunner

            plan = device.plan_for(name) if name in ROW_ALGORITHMS else objective_plans[name]
            self.impl = StagedRunner(device, plan)
            self.predicted, self.plan = plan.predicted, plan
            self.planner = objective_plans["planner"]
            self.predicted_fps = self.planner.fps(plan)

    def predicted_at(self, depth: int) -> float | None:
        """The predicted latency with ``depth`` frames in flight (`deepco.planning.staged.pipelined`; None:
        not a staged plan)."""
        if self.planner is None:
            return None
        return pipelined(self.plan, self.planner.costs, self.planner.rates(), depth)[0]

    def frame(self, px: np.ndarray) -> tuple[dict[str, np.ndarray], float]:
        """Run one frame alone: (every output by name, seconds); its timeline is kept in ``timelines``."""
        start = time.perf_counter()
        outputs, timing = self.impl.run_frame(px)
        self.timelines.append(timing.to_dict())
        return outputs, time.perf_counter() - start

    def throughput(self, px: np.ndarray, frames: int, depth: int) -> tuple[float, list[dict[str, np.ndarray]],
                                                                       list[float]]:
        """Sustained frames per second with ``depth`` frames in flight, the outputs and each frame's latency."""
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=depth) as pool:
            done = list(pool.map(lambda _: self.impl.run_frame(px), range(frames)))
        return frames / (time.perf_counter() - start), [out for out, _ in done], [t.latency for _, t in done]


def run_benchmark(args: argparse.Namespace) -> dict:
    """Set up one device, run every algorithm interleaved, then each pipelined; return the results."""
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = [a for a in algorithms if a not in ALL]
    if unknown:
        raise UserError(f"unknown algorithm(s) {', '.join(unknown)} (choose from {', '.join(ALL)})")
    h, w = parse_size(args.input_size)
    cluster = load_cluster(args.cluster)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    how = modelcard.from_args(args.model, args)
    device = Device(cluster, args.model, h, w, algorithm="thread", cut=args.cut, pace=args.pace, depth=1, log=log,
                    preprocessing=how)
    with device:
        device.load()
        if args.handshake:
            # The bench applies the device's CPU quota now: loading (exporting) the model is what a camera
            # did before it was switched on, and at a tenth of a core it took a minute per repeat.
            print(LOADED, flush=True)
            if sys.stdin.readline().strip() != GO:
                raise UserError("the bench did not confirm the device's CPU quota")
        device.setup()
        planner = StagedPlanner(device)  # the paper's plans are predicted on the same (calibrated) rates as auto's
        calibrated = {"auto", "auto-whole"} & set(algorithms)
        auto = planner.calibrate("latency") if calibrated else None  # fits the step overhead first
        plans = {"planner": planner, "local": planner.named("local"), "offload": planner.named("offload"),
                 "round-robin": planner.named("round-robin"), "auto": auto,
                 "auto-throughput": planner.best("throughput")}
        if auto is not None:
            whole = unstreamed(auto)
            plans["auto-whole"] = replace(whole, predicted=predict(whole, planner.costs, planner.rates())["frame"])
        for name in ("auto", "auto-whole", "auto-throughput"):
            if name in algorithms:
                log(f"{name} plan: {plans[name].describe()} (predicted {plans[name].predicted * 1e3:.1f} ms, "
                    f"{planner.fps(plans[name]):.2f} fps)")
        peer = None if args.peer_mbps is None else args.peer_mbps * 1e6 / 8
        runners = {a: Runner(a, device, peer, plans) for a in algorithms}
        px = photo_pixels(h, w, how)
        whole = ort.InferenceSession(device.reference_model.SerializeToString(), providers=["CPUExecutionProvider"])
        names = [o.name for o in whole.get_outputs()]
        reference = dict(zip(names, whole.run(None, {whole.get_inputs()[0].name: normalise(px, how)}), strict=True))
        worst = {a: 0.0 for a in algorithms}

        def check(algorithm: str, outputs: dict[str, np.ndarray]) -> None:
            worst[algorithm] = max(worst[algorithm], relative_error(outputs, reference))

        for _ in range(WARMUP_FRAMES):
            for a in algorithms:
                check(a, runners[a].frame(px)[0])
        latencies: dict[str, list[float]] = {a: [] for a in algorithms}
        for k in tqdm(range(args.frames), desc="latency (algorithms interleaved)", file=sys.stderr):
            for a in round_order(algorithms, k):
                time.sleep(SETTLE_SECONDS)
                output, latency = runners[a].frame(px)
                check(a, output)
                latencies[a].append(latency)
        fps: dict[str, float] = {}
        pipelined_p50: dict[str, tuple[int, float]] = {}  # the depth and the frames' p50 of the throughput run
        if args.fps_frames > 0:
            for a in tqdm(algorithms, desc="throughput (each pipelined)", file=sys.stderr):
                plan = runners[a].plan
                round_robin = plan is not None and plan.kind == "round-robin"  # one frame per server in flight
                depth = max(args.depth, len(cluster.servers)) if round_robin else args.depth
                fps[a], outputs, seconds = runners[a].throughput(px, max(args.fps_frames, 2 * depth), depth)
                pipelined_p50[a] = depth, float(np.percentile(seconds, 50))
                for output in outputs:
                    check(a, output)
        limits = bound(device)
        results = {}
        for a in algorithms:
            r = runners[a]
            entry = summary(latencies[a], r.predicted)
            entry["max_relative_error"] = worst[a]
            entry["fps"] = fps.get(a)
            entry["predicted_fps"] = r.predicted_fps
            if a in pipelined_p50:  # the prediction `deepco run` prints, against the throughput run's frames
                depth, p50 = pipelined_p50[a]
                predicted = r.predicted_at(depth)
                entry |= {"depth": depth, "pipelined_p50": p50, "predicted_pipelined": predicted,
                          "pipelined_over_predicted": p50 / predicted if predicted else None}
            entry["p50_over_bound"] = entry["p50"] / limits["latency"]
            entry["timelines"] = r.timelines[-args.frames:]  # the timed frames' (bench/step_split.py, --gantt)
            entry["fps_over_bound"] = None if entry["fps"] is None else entry["fps"] / limits["fps"]
            if r.plan is not None:
                entry["plan"] = r.plan.to_dict()
                entry["plan_text"] = r.plan.describe()
            if a in ROW_ALGORITHMS:
                entry["servers"] = [{"name": s, "antenna": m, "order": k, "rows": list(rows)} for s, m, k, rows in
                                    zip(r.plan.servers, r.plan.antennas, r.plan.order, r.plan.bands[1], strict=True)]
                entry["plan_text"] = device.describe_plan(r.plan)
            results[a] = entry
        measured = device.measured.to_dict() | {"step_overhead": planner.step_overhead}
        limits["timed"] = timed_bound(limits, measured, results)
        for entry in results.values():
            entry["p50_over_timed_bound"] = None if limits["timed"] is None else \
                entry["p50"] / limits["timed"]["latency"]
        extras = deadlines(args, planner, runners, results, px, lambda outputs: check("auto", outputs))
        return {"label": args.label, "model": args.model, "input_size": args.input_size, "cut": device.cut.name,
                "measured": measured, "calibration": planner.trials, "bound": limits, "algorithms": results} | extras


def deadlines(args: argparse.Namespace, planner: StagedPlanner, runners: dict, results: dict, px: np.ndarray,
              check) -> dict:
    """The runs of issue 28's must-shows, on `auto`'s plan: ``live`` (``--live-frames``: the photo played as a
    live source at ``LIVE_SPEEDUP`` times the engine's own rate at the same depth, measured first, once
    dropping late frames, once not) and
    ``slo`` (``--slo-factor``: `--objective slo` with a bound of that factor times `auto`'s measured p50,
    against every candidate plan and depth measured in the same run)."""
    out: dict = {}
    if (args.live_frames > 0 or args.slo_factor > 0) and "auto" not in runners:
        raise UserError("--live-frames and --slo-factor run auto's plan: put auto in --algorithms")
    if args.live_frames > 0:
        runner = runners["auto"].impl
        depth = args.live_depth or saturating_depth(planner, runners["auto"].plan)
        engine = engine_fps(runner, px, depth, min(args.live_frames, LIVE_PROBE_FRAMES))
        # as `deepco run` does without --depth: a source dropping late frames settles its depth by measurement
        lean = None if args.live_depth else runner.frames_at_once
        out["live"] = {drop: live_run(runner, px, LIVE_SPEEDUP * engine, args.live_frames, depth, drop, check,
                                      lean if drop == "late" else None)
                       | {"single_frame_p50": results["auto"]["p50"], "engine_fps": engine}
                       for drop in ("late", "never")}
    if args.slo_factor > 0:
        out["slo"] = slo_run(planner, runners["auto"].plan, args.slo_factor * results["auto"]["p50"])
    return out


def saturating_depth(planner: StagedPlanner, plan) -> int:
    """The frames in flight past which the cost model predicts no more fps for ``plan`` (more would only queue,
    and a live source's results would come older): the deepest of `deepco.planning.slo.options`."""
    from deepco_device.planner import least_depth

    from deepco.planning.slo import options

    return options([plan], planner.costs, planner.rates(), least_depth)[-1].depth


def engine_fps(runner, px: np.ndarray, depth: int, frames: int) -> float:
    """The engine's own rate with ``depth`` frames in flight: ``frames`` frames of a file taken as fast as the
    pipeline takes them (frames / wall time)."""
    start = time.perf_counter()
    for _ in runner.run_frames([px] * frames, depth=depth):
        pass
    return frames / (time.perf_counter() - start)


def live_run(runner, px: np.ndarray, fps: float, frames: int, depth: int, drop: str, check,
             lean: int | None = None) -> dict:
    """``frames`` copies of ``px`` played as a live source at ``fps`` (device.feed.LiveFeed, a real clock)
    through ``runner`` with ``depth`` frames in flight (``lean``: from that many up to ``depth``, as
    `deepco.planning.lean_depth` settles it): capture-to-result and compute latency percentiles (overall, and
    the p95 of the first and last third, to see whether it grows), frames dropped."""
    from deepco.planning.lean_depth import LeanDepth

    feed = LiveFeed(drop, fps).start(iter([px] * frames))
    watch = None if lean is None else LeanDepth(lean, depth)
    ages, latencies, failed = [], [], 0
    start = time.perf_counter()
    for result in runner.run_frames(feed, depth=depth, in_flight=(lambda: watch.depth) if watch else None):
        if result.error is not None:
            failed += 1
            continue
        check(result.outputs)
        ages.append(result.capture_to_result)
        latencies.append(result.latency)
        if watch is not None:
            watch.observe(result.latency, result.delivered)
    depth = depth if watch is None else watch.depth
    third = max(1, len(ages) // 3)
    p = lambda values, q: float(np.percentile(values, q)) if values else None  # noqa: E731
    return {"drop": drop, "source_fps": fps, "frames": frames, "depth": depth, "done": len(ages),
            "dropped": feed.dropped, "failed": failed, "seconds": time.perf_counter() - start,
            "capture_to_result_p50": p(ages, 50), "capture_to_result_p95": p(ages, 95),
            "first_third_p95": p(ages[:third], 95), "last_third_p95": p(ages[-third:], 95),
            "latency_p50": p(latencies, 50), "latency_p95": p(latencies, 95), "capture_to_result": ages,
            "fps_per_depth": {} if watch is None else {str(d): r for d, r in watch.rates.items()}}


def slo_run(planner: StagedPlanner, auto_plan, bound: float) -> dict:
    """`--objective slo`'s choice with ``bound`` seconds, then every candidate (plan, depth) measured the same
    way in the same run: the chosen one's fps against the most fps among those that met the bound."""
    candidates = planner.slo_options(auto_plan)
    choice = planner.choose_slo(bound, candidates=candidates)
    every = planner.measure_options(candidates)
    meeting = [t for t in every if t.p95 <= bound]
    best = max(meeting, key=lambda t: t.fps, default=None)
    again = next(t for t in every if t.option == choice.option)
    return {"bound": bound, "met": choice.met, "chosen": choice.option.describe(), "chosen_depth": choice.option.depth,
            "chosen_fps": again.fps, "chosen_p95": again.p95,
            "best": best.option.describe() if best else None, "best_fps": best.fps if best else None,
            "chosen_over_best_fps": again.fps / best.fps if best else None,
            "trials": [{"plan": t.option.describe(), "depth": t.option.depth, "predicted_latency": t.option.latency,
                        "predicted_fps": t.option.fps, "p95": t.p95, "fps": t.fps} for t in every]}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the worker process."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", required=True)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--input-size", default="224x224")
    p.add_argument("--algorithms", default="local,offload,round-robin,auto,thread,modnn-sa")
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--fps-frames", type=int, default=8)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--cut", default="auto")
    p.add_argument("--pace", action="store_true")
    p.add_argument("--peer-mbps", type=float, default=None, help="the servers' own links (MoDNN's exchanges)")
    p.add_argument("--live-frames", type=int, default=0,
                   help=f"play the photo as a live source at {LIVE_SPEEDUP:g}x the engine's rate for N frames "
                        "(0: skip)")
    p.add_argument("--live-depth", type=int, default=0,
                   help="frames in flight in the live runs (0: the least past which auto's plan is predicted no "
                        "more fps)")
    p.add_argument("--slo-factor", type=float, default=0.0,
                   help="run --objective slo with a bound of this factor times auto's p50 (0: skip)")
    p.add_argument("--label", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--handshake", action="store_true",
                   help=f"print {LOADED!r} once the model is loaded, and wait for {GO!r} on stdin (the device's CPU "
                        "quota applied) before measuring anything")
    modelcard.add_arguments(p)
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
