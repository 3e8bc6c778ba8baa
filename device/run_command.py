"""`deepco run`: the device. Frames from a camera, video, URL, image or directory, through the plan."""

from __future__ import annotations

import argparse
import json
import re
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
                   help="auto (default): the staged planner's fastest plan (local, offload, THREAD, MoDNN-like, "
                        "fused hybrids or one stage across scales, docs/usage.md); local: the device alone; "
                        "offload: the whole model on the best server; thread/thread-sa/single: the paper's planners "
                        "(tail on the device); equal: every server, equal rows (a naive baseline)")
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
    p.add_argument("--save-outputs", metavar="FILE.npz",
                   help="write inputs and outputs for checking: 'inputs', and 'outputs' (a one-output model) or "
                        "'outputs/<name>' for every output of the model; a failed frame's rows are NaN")
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
    shown = Shown(how.output, args.output_dir)
    inputs: list[np.ndarray] = []
    outputs: list[dict[str, np.ndarray] | None] = []  # per frame, None for a failed one (--save-outputs)
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

            plan, replan, drift = _plan(args, dev, staged)
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
            results = runner.run_frames(frames(), depth=depth, replan=replan, give_up=give_up, drift=drift)
            for result in results:
                if log_file:
                    log_file.write(json.dumps(result.log_record(predicted)) + "\n")
                if result.error is not None:
                    failures += 1
                    print(f"frame {result.index}: ERROR {result.error}", flush=True)
                    if args.save_outputs:
                        outputs.append(None)
                    continue
                latencies.append(result.latency)
                if args.save_outputs:
                    outputs.append(result.outputs)
                shown_output = shown.frame(result.index, result.outputs)
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
        np.savez(args.save_outputs, inputs=np.concatenate(inputs) if inputs else empty, **saved_outputs(outputs))
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
    """The plan to run (printed), how failover replans, and the drift watch (None: none)."""
    from deepco_device.health import DriftWatch
    from deepco_device.planner import StagedPlanner

    if staged:
        planner = StagedPlanner(dev)
        plan = _staged_plan(args, planner, dev)
        print(dev.describe_measurements(), flush=True)
        print(f"plan: {plan.describe()}; predicted {plan.predicted * 1e3:.1f} ms, "
              f"{planner.fps(plan):.2f} fps", flush=True)
        return plan, lambda down: planner.best(args.objective, exclude=down), None
    # the paper's plan; failover replans with the same algorithm, and drift re-profiles
    print(dev.describe_plan(), flush=True)
    return dev.plan, dev.replan(args.algorithm), DriftWatch(dev.costs, dev.measured)


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


def saved_outputs(frames: list[dict[str, np.ndarray] | None]) -> dict[str, np.ndarray]:
    """The --save-outputs arrays of every frame's outputs (None: a failed frame, NaN rows): ``outputs`` for a
    one-output model, else ``outputs/<name>`` for each output; nothing succeeded: ``outputs``, empty."""
    first = next((f for f in frames if f is not None), None)
    if first is None:
        return {"outputs": np.zeros((0,))}
    keys = {name: "outputs" if len(first) == 1 else f"outputs/{name}" for name in first}

    def failed(like: np.ndarray) -> np.ndarray:
        return np.full(like.shape, np.nan, dtype=like.dtype if like.dtype.kind == "f" else np.float64)

    return {keys[name]: np.concatenate([f[name] if f is not None else failed(like) for f in frames])
            for name, like in first.items()}


def file_names(names: list[str]) -> dict[str, str]:
    """Each output's name as a part of a file name: what is not a letter, digit, '.', '-' or '_' becomes '_',
    and names that would then clash get their output's index appended."""
    safe = {name: re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".") or "output" for name in names}
    taken = list(safe.values())
    return {name: s if taken.count(s) == 1 else f"{s}-{k}" for k, (name, s) in enumerate(safe.items())}


class Shown:
    """What `deepco run` does with each frame's outputs: top labels, saved tensors (raw), or their shapes."""

    def __init__(self, mode: str, directory: str):
        self.mode, self.directory = mode, Path(directory)
        self.noise = False

    def frame(self, index: int, outputs: dict[str, np.ndarray]) -> str:
        """Show or save one frame's outputs; the text for its line. ``--output raw`` writes one file per output:
        ``frame-NNNNNN.npy`` for a one-output model, else ``frame-NNNNNN-<name>.npy``."""
        from deepco_device.preprocess import top_labels

        only = next(iter(outputs.values())) if len(outputs) == 1 else None
        mode = self.mode if self.mode != "auto" else ("labels" if only is not None and only.size == 1000 else "shape")
        if mode == "labels" and only is not None:
            labels = ", ".join(f"{n} {p:.2f}" for n, p in top_labels(only, 3))
            return f"random weights: {labels}" if self.noise else labels
        described = [(name, f"{'output' if only is not None else name} {'x'.join(map(str, y.shape))} {y.dtype} in "
                            f"[{float(y.min()):.3g}, {float(y.max()):.3g}]") for name, y in outputs.items()]
        text = "; ".join(d for _, d in described)
        if mode != "raw":
            return text + f" (--output raw saves {'it' if only is not None else 'them'})"
        self.directory.mkdir(parents=True, exist_ok=True)
        shown = []
        files = file_names(list(outputs))
        for name, what in described:
            suffix = "" if only is not None else f"-{files[name]}"
            path = self.directory / f"frame-{index:06d}{suffix}.npy"
            np.save(path, outputs[name])
            shown.append(f"{what} -> {path}")
        return "; ".join(shown)
