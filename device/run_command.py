"""`deepco run`: the device. Frames from a camera, video, URL, image or directory, through the plan."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from deepco_device.giveup import GIVE_UP_AFTER, MAX_FAILED_FRAMES, GiveUp

from deepco import modelcard
from deepco.cluster import load_cluster
from deepco.errors import UserError
from deepco.parsing import parse_size
from deepco.planning.staged import StagedPlan
from deepco.wire import security


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `deepco run`."""
    p.add_argument("--cluster", required=True, metavar="FILE", help="cluster TOML file (server addresses)")
    p.add_argument("--model", required=True, help="zoo model name or path to an .onnx file")
    p.add_argument("--input-size", default="224x224", metavar="HxW")
    p.add_argument("--source", required=True, help="camera index, video file, rtsp/http URL, image, or directory")
    p.add_argument("--frames", type=int, default=None, help="stop after N frames")
    p.add_argument("--algorithm", default="auto",
                   choices=["auto", "local", "offload", "thread", "thread-sa", "single", "equal"],
                   help="auto (default): the staged planner's fastest plan (local, offload, THREAD, MoDNN-like or "
                        "fused hybrids, see README); local: the device alone; offload: the whole model on the best "
                        "server; thread/thread-sa/single: the paper's planners (tail on the device); equal: every "
                        "server, equal rows (a naive baseline)")
    p.add_argument("--plan", default=None, metavar="F.json",
                   help="run exactly the plan `deepco plan --model ... --save F.json` wrote (instead of --algorithm); "
                        "failover replans as auto does")
    p.add_argument("--objective", default="latency", choices=["latency", "throughput"],
                   help="what auto optimises: one frame's latency, or sustained fps with frames pipelined")
    p.add_argument("--cut", default="auto", help="cut name (see `deepco partition`) or auto")
    p.add_argument("--weights", default=None, metavar="STATE_DICT",
                   help="a torch state-dict file for a zoo model (torchvision's parameter names for the ResNets); "
                        "without it the zoo's ResNets have seeded random weights and their labels are noise")
    p.add_argument("--pace", action="store_true",
                   help="EMULATE each antenna's configured bandwidth (Mbit/s) by app-level pacing")
    p.add_argument("--depth", type=int, default=2, help="frames in flight at once (pipelining)")
    p.add_argument("--save-outputs", metavar="FILE.npz", help="write inputs and outputs for checking")
    p.add_argument("--json-log", metavar="FILE", help="one JSON object per frame")
    p.add_argument("--quiet", action="store_true", help="no per-frame lines")
    p.add_argument("--give-up-after", type=float, default=GIVE_UP_AFTER, metavar="SECONDS",
                   help=f"stop (exit 2) when frames have been in flight this long and none succeeded, e.g. with "
                        f"every server frozen (default {GIVE_UP_AFTER:g}; 0: never)")
    p.add_argument("--max-failed-frames", type=int, default=MAX_FAILED_FRAMES, metavar="N",
                   help=f"stop (exit 2) after N failed frames in a row (default {MAX_FAILED_FRAMES}; 0: never)")
    modelcard.add_arguments(p, output=True)
    security.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Set up the device, stream the source through the plan, report."""
    from deepco_device.preprocess import normalise, pixels
    from deepco_device.session import Device
    from deepco_device.sources import first_frame_check, open_source

    height, width = parse_size(args.input_size)
    if args.frames is not None and args.frames <= 0:
        raise UserError(f"--frames must be positive, got {args.frames}")
    give_up = GiveUp(args.give_up_after, args.max_failed_frames)  # bad bounds fail before anything starts
    cluster = load_cluster(args.cluster)
    cluster.require_addresses()
    if args.pace:
        cluster.require_bandwidths("--pace (each antenna's bandwidth in Mbit/s)")
    first_frame_check(args.source)  # a bad source fails before any server is touched
    how = modelcard.from_args(args.model, args)
    shown = Outputs(how.output, args.output_dir)
    inputs: list[np.ndarray] = []
    outputs: list[np.ndarray] = []
    log_file = open(args.json_log, "w") if args.json_log else None  # noqa: SIM115 - closed below
    failures = 0
    try:
        staged = args.plan is not None or args.algorithm in ("auto", "local", "offload")
        with Device(cluster, args.model, height, width, algorithm="thread" if staged else args.algorithm, cut=args.cut,
                    weights=args.weights, pace=args.pace, depth=args.depth,
                    log=lambda line: print(line, flush=True), security=security.from_args(args),
                    preprocessing=how) as dev:
            dev.setup(rows=not staged)
            print(f"preprocessing: {how.describe()}", flush=True)
            shown.noise = _seeded(args.model, args.weights)
            if shown.noise:
                print(f"note: {args.model} has seeded random weights, so its labels are noise; give --weights "
                      "STATE_DICT for real ones", flush=True)
            from deepco_device.runners import StagedRunner

            plan, replan, adapt = _plan(args, dev, staged)
            runner = StagedRunner(dev, plan)
            predicted = plan.predicted

            def frames():
                for frame in open_source(args.source, args.frames):
                    px = pixels(frame, height, width, how)
                    if args.save_outputs:
                        inputs.append(normalise(px, how))  # what the unpartitioned model takes
                    yield px

            start = time.perf_counter()
            latencies = []
            depth = max(args.depth, runner.frames_at_once)
            results = runner.run_frames(frames(), depth=depth, replan=replan, give_up=give_up, adapt=adapt)
            for result in results:
                if log_file:  # a line per frame as it comes: the log can be followed live
                    log_file.write(json.dumps(result.log_record(predicted)) + "\n")
                    log_file.flush()
                if result.error is not None:
                    failures += 1
                    print(f"frame {result.index}: ERROR {result.error}", flush=True)
                    if args.save_outputs:
                        outputs.append(np.full_like(outputs[-1], np.nan) if outputs else np.array([np.nan]))
                    continue
                latencies.append(result.latency)
                if args.save_outputs:
                    outputs.append(result.output)
                shown_output = shown.frame(result.index, result.output)
                if not args.quiet:
                    fps = len(latencies) / (time.perf_counter() - start)
                    print(f"frame {result.index}: {result.latency * 1e3:7.1f} ms  {fps:5.1f} fps  {shown_output}",
                          flush=True)
            elapsed = time.perf_counter() - start
    finally:
        if log_file:
            log_file.close()
    if args.save_outputs:
        empty = np.zeros((0, how.channels, height, width))
        np.savez(args.save_outputs, inputs=np.concatenate(inputs) if inputs else empty,
                 outputs=np.concatenate(outputs) if outputs else np.zeros((0,)))
    done = len(latencies)
    if done:
        p50, p95 = np.percentile(latencies, [50, 95])
        print(f"{done} frames in {elapsed:.2f} s: {done / elapsed:.1f} fps; latency mean "
              f"{np.mean(latencies) * 1e3:.1f} ms, p50 {p50 * 1e3:.1f}, p95 {p95 * 1e3:.1f}; "
              f"predicted {predicted * 1e3:.1f} ms; {failures} failed")
    if failures:
        print(f"deepco run: {failures} frame(s) failed (see above)", file=sys.stderr)
        return 1
    return 0




def _plan(args: argparse.Namespace, dev, staged: bool) -> tuple[StagedPlan, Callable, object]:
    """The plan to run (printed), how failover replans, and live adaptation (None: none; auto and the paper's
    plans adapt, a named or saved plan runs as it is)."""
    from deepco_device.adaptation import Adaptation
    from deepco_device.planner import StagedPlanner

    from deepco.planning.staged import throughput

    if staged:
        planner = StagedPlanner(dev)
        plan = _staged_plan(args, planner, dev)
        print(dev.describe_measurements(), flush=True)
        print(f"plan: {plan.describe()}; predicted {plan.predicted * 1e3:.1f} ms, "
              f"{planner.fps(plan):.2f} fps", flush=True)
        adapt = None
        if args.plan is None and args.algorithm == "auto":
            per_frame = (lambda p, rates: 1 / throughput(p, dev.costs, rates)) if args.objective == "throughput" \
                else None  # else the predicted latency
            adapt = Adaptation(dev, lambda down, rates: planner.plans(args.objective, exclude=down, rates=rates)[0],
                               seconds=per_frame)
        return plan, lambda down: planner.best(args.objective, exclude=down), adapt
    # the paper's plan: failover replans with the same algorithm, and it adapts within that algorithm
    print(dev.describe_plan(), flush=True)
    return dev.plan, dev.replan(args.algorithm), Adaptation(dev, dev.replan(args.algorithm))


def _staged_plan(args: argparse.Namespace, planner, dev) -> StagedPlan:
    """The plan a staged run runs: the one saved in ``--plan``, auto's (calibrated) or the named one."""
    if args.plan is not None:
        from deepco_device.plan_command import load_plan

        return load_plan(args.plan, args.model, dev.height, dev.width, planner.servers())
    return planner.calibrate(args.objective) if args.algorithm == "auto" else planner.named(args.algorithm)


def _seeded(model: str, weights: str | None) -> bool:
    """Whether ``model`` is a zoo model running on seeded random weights (its labels mean nothing)."""
    if weights is not None or "deepco.zoo" not in sys.modules:  # an ONNX file never imports the zoo (torch)
        return False
    from deepco.zoo import SEEDED

    return model in SEEDED


class Outputs:
    """What `deepco run` does with each frame's output: top labels, a saved tensor (raw), or its shape."""

    def __init__(self, mode: str, directory: str):
        self.mode, self.directory = mode, Path(directory)
        self.noise = False

    def frame(self, index: int, output: np.ndarray) -> str:
        """Show or save one frame's output; the text for its line."""
        from deepco_device.preprocess import top_labels

        mode = self.mode if self.mode != "auto" else ("labels" if output.size == 1000 else "shape")
        if mode == "labels":
            labels = ", ".join(f"{n} {p:.2f}" for n, p in top_labels(output, 3))
            return f"random weights: {labels}" if self.noise else labels
        described = (f"output {'x'.join(map(str, output.shape))} {output.dtype} in "
                     f"[{float(output.min()):.3g}, {float(output.max()):.3g}]")
        if mode == "shape":
            return described + " (--output raw saves it)"
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"frame-{index:06d}.npy"
        np.save(path, output)
        return f"{described} -> {path}"
