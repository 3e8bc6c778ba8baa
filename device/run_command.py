"""`deepco run`: the device. Frames from a camera, video, URL, image or directory, through the plan."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from deepco_device.giveup import GIVE_UP_AFTER, MAX_FAILED_FRAMES, GiveUp

from deepco import modelcard
from deepco.cluster import load_cluster
from deepco.errors import UserError
from deepco.parsing import parse_size
from deepco.planning.staged import StagedPlan, pipelined
from deepco.wire import security

if TYPE_CHECKING:  # scipy, through calibration: not on the CLI's start
    from deepco.planning.slo import SloChoice, SloWatch


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
    p.add_argument("--objective", default="latency", choices=["latency", "throughput", "slo"],
                   help="what auto optimises: one frame's latency, sustained fps with frames pipelined, or (slo) "
                        "the most fps whose p95 latency stays under --max-latency, plan and frames in flight "
                        "chosen by measurement")
    p.add_argument("--max-latency", type=float, default=None, metavar="MS",
                   help="--objective slo's bound on the p95 frame latency, milliseconds")
    p.add_argument("--cut", default="auto", help="cut name (see `deepco partition`) or auto")
    p.add_argument("--weights", default=None, metavar="STATE_DICT",
                   help="a torch state-dict file for a zoo model (torchvision's parameter names for the ResNets); "
                        "without it the zoo's ResNets have seeded random weights and their labels are noise")
    p.add_argument("--pace", action="store_true",
                   help="EMULATE each antenna's configured bandwidth (Mbit/s) by app-level pacing")
    p.add_argument("--depth", type=int, default=2,
                   help="frames in flight at once (pipelining; --objective slo chooses it)")
    p.add_argument("--drop", choices=["late", "never"], default=None,
                   help="late: a live source's frame that cannot enter yet is replaced by the next one (counted, "
                        "logged as dropped), so results stay fresh; never: every frame waits its turn. Default: "
                        "late for cameras, URLs and --source-fps, never for files, images and directories")
    p.add_argument("--source-fps", type=float, default=None, metavar="N",
                   help="play a video file, image or directory as a live source at N frames per second (a real "
                        "clock: frame i is captured at i/N s), for tests and benchmarks")
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
    from deepco_device.run_report import Report, Saved
    from deepco_device.session import Device
    from deepco_device.sources import drop_mode, first_frame_check, open_feed

    height, width = parse_size(args.input_size)
    _check_flags(args)
    give_up = GiveUp(args.give_up_after, args.max_failed_frames)  # bad bounds fail before anything starts
    drop_mode(args.source, args.drop, args.source_fps)
    cluster = load_cluster(args.cluster)
    cluster.require_addresses()
    if args.pace:
        cluster.require_bandwidths("--pace (each antenna's bandwidth in Mbit/s)")
    first_frame_check(args.source)  # a bad source fails before any server is touched
    how = modelcard.from_args(args.model, args)
    shown = Shown(how.output, args.output_dir)
    saved = Saved(args.save_outputs)
    log_file = open(args.json_log, "w") if args.json_log else None  # noqa: SIM115 - closed below
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

            chosen = _plan(args, dev, staged)
            runner = StagedRunner(dev, chosen.plan)
            depth = max(chosen.depth, runner.frames_at_once)
            predicted = chosen.announce(dev, depth)

            def prepare(frame: np.ndarray) -> np.ndarray:
                px = pixels(frame, height, width, how)
                saved.input(normalise(px, how))  # what the unpartitioned model takes
                return px

            report = Report(predicted, depth, log_file)
            feed = open_feed(args.source, args.frames, args.drop, args.source_fps, prepare)
            watch = chosen.watch(depth, runner.frames_at_once)
            results = runner.run_frames(feed, depth=depth, replan=chosen.replan, give_up=give_up,
                                        drift=chosen.drift, in_flight=(lambda: watch.depth) if watch else None)
            for result in results:
                report.dropped(feed.drops(), args.quiet)
                report.frame(result)
                saved.output(result)
                if result.error is not None:
                    print(f"frame {result.index}: ERROR {result.error}", flush=True)
                    continue
                shown_output = shown.frame(result.index, result.outputs)
                if watch is not None and (line := watch.observe(result.latency)):
                    print(line, flush=True)
                if not args.quiet:
                    print(f"frame {result.index}: {result.latency * 1e3:7.1f} ms  {report.fps():5.1f} fps  "
                          f"{shown_output}", flush=True)
            report.dropped(feed.drops(), args.quiet)
            report.finish()
    finally:
        if log_file:
            log_file.close()
    saved.write(how.channels, height, width)
    return report.summary()


def _check_flags(args: argparse.Namespace) -> None:
    """Flags that contradict each other or are out of range: one line each, before anything starts."""
    if args.frames is not None and args.frames <= 0:
        raise UserError(f"--frames must be positive, got {args.frames}")
    if args.objective == "slo":
        if args.max_latency is None or not args.max_latency > 0:
            raise UserError("--objective slo needs --max-latency MS, a positive number of milliseconds")
        if args.plan is not None or args.algorithm != "auto":
            raise UserError("--objective slo chooses the plan itself: it goes with --algorithm auto, not with "
                            "--plan or another --algorithm")
    elif args.max_latency is not None:
        raise UserError("--max-latency is the bound of --objective slo; give --objective slo too")


@dataclass(frozen=True)
class Chosen:
    """What a run runs: the plan and its frames in flight, how failover replans, the drift watch (None:
    none), and with --objective slo its choice (deepco.planning.slo)."""

    plan: StagedPlan
    depth: int
    replan: Callable
    drift: object = None
    slo: SloChoice | None = None
    paper: bool = False  # a paper plan, whose table `_plan` printed

    def announce(self, dev, depth: int) -> float:
        """Print the prediction for what runs, ``depth`` frames in flight; the predicted latency (seconds)."""
        latency, fps = pipelined(self.plan, dev.costs, dev.rates(), depth)
        which = "" if self.paper else f"plan: {self.plan.describe()}; "
        print(f"{which}predicted with {depth} frame(s) in flight: {latency * 1e3:.1f} ms, {fps:.2f} fps (one frame "
              f"alone: {self.plan.predicted * 1e3:.1f} ms)", flush=True)
        if self.slo is not None:
            print(self.slo.note(), flush=True)
        return latency

    def watch(self, depth: int, least: int) -> SloWatch | None:
        """With --objective slo, the watch that keeps the run within its bound."""
        from deepco.planning.slo import SloWatch

        return None if self.slo is None else SloWatch(self.slo.bound, depth, least)


def _plan(args: argparse.Namespace, dev, staged: bool) -> Chosen:
    """The plan to run (printed), its frames in flight, how failover replans, and the drift watch."""
    from deepco_device.health import DriftWatch
    from deepco_device.planner import StagedPlanner

    if not staged:  # the paper's plan; failover replans with the same algorithm, and drift re-profiles
        print(dev.describe_plan(), flush=True)
        return Chosen(dev.plan, args.depth, dev.replan(args.algorithm), DriftWatch(dev.costs, dev.measured),
                      paper=True)
    planner = StagedPlanner(dev)
    objective = "latency" if args.objective == "slo" else args.objective  # failover: the fastest plan left
    replan = lambda down: planner.best(objective, exclude=down)  # noqa: E731
    choice, depth = None, args.depth
    if args.plan is not None:
        from deepco_device.plan_command import load_plan

        plan = load_plan(args.plan, args.model, dev.height, dev.width, planner.servers())
    elif args.objective == "slo":
        choice = planner.choose_slo(args.max_latency / 1e3)
        plan, depth = choice.option.plan, choice.option.depth
    else:
        plan = planner.calibrate(args.objective) if args.algorithm == "auto" else planner.named(args.algorithm)
    print(dev.describe_measurements(), flush=True)
    return Chosen(plan, depth, replan, None, choice)


def _seeded(model: str, weights: str | None) -> bool:
    """Whether ``model`` is a zoo model running on seeded random weights (its labels mean nothing)."""
    if weights is not None or "deepco.zoo" not in sys.modules:  # an ONNX file never imports the zoo (torch)
        return False
    from deepco.zoo import SEEDED

    return model in SEEDED


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
