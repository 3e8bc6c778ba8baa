"""`deepco run`: the device. Frames from a camera, video, URL, image or directory, through the plan."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
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
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--plan-cache", default=None, metavar="DIR",
                       help="where auto keeps the plan it settled on, so that the next start with the same servers, "
                            "model, input size and preprocessing runs its first frame on it without measuring or "
                            "calibrating (default: $XDG_CACHE_HOME/deepco, else ~/.cache/deepco)")
    cache.add_argument("--no-plan-cache", action="store_true",
                       help="neither read nor write the plan cache: every start measures and calibrates")
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
    """Set up the device (or take the plan cache's plan), stream the source through the plan, report."""
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
    results = Results(args, Shown(how.output, args.output_dir))

    def frames():
        for frame in open_source(args.source, args.frames):
            px = pixels(frame, height, width, how)
            if args.save_outputs:
                results.inputs.append(normalise(px, how))  # what the unpartitioned model takes
            yield px

    try:
        staged = args.plan is not None or args.algorithm in ("auto", "local", "offload")
        with Device(cluster, args.model, height, width, algorithm="thread" if staged else args.algorithm, cut=args.cut,
                    weights=args.weights, pace=args.pace, depth=args.depth,
                    log=lambda line: print(line, flush=True), security=security.from_args(args),
                    preprocessing=how) as dev:
            cache = _PlanCacheUse(args, dev) if staged else None
            if cache is None or cache.cached is None:
                dev.setup(rows=not staged)
            print(f"preprocessing: {how.describe()}", flush=True)
            results.shown.noise = modelcard.seeded_weights(dev.reference_model)
            if results.shown.noise:
                print(f"note: {args.model} has seeded random weights, so its labels are noise; give --weights "
                      "STATE_DICT for real ones", flush=True)
            from deepco_device.runners import StagedRunner

            results.start()
            plan, replan, adapt, rest = _plan(args, dev, cache, frames(), results.emit)
            results.predicted = plan.predicted
            if rest is not None:
                runner = StagedRunner(dev, plan)
                depth = max(args.depth, runner.frames_at_once)
                for result in runner.run_frames(rest, depth=depth, replan=replan, give_up=give_up, adapt=adapt,
                                                first=results.count):
                    results.emit(result, plan.predicted)
            results.stop()
    finally:
        results.close()
    return results.finish(how.channels, height, width)


class Results:
    """What `deepco run` does with each frame's result, whichever plan it ran on (calibration's live frames
    or the pipeline's): its line, its JSON log record, its saved output; and the summary at the end."""

    def __init__(self, args: argparse.Namespace, shown: Shown):
        self.args, self.shown = args, shown
        self.inputs: list[np.ndarray] = []  # with --save-outputs: what each frame gave the model
        self.saved: list[dict[str, np.ndarray] | None] = []  # per frame, None for a failed one (--save-outputs)
        self.latencies: list[float] = []
        self.failures = 0
        self.count = 0  # results so far
        self.predicted = 0.0  # the plan's prediction, for the summary
        self.log_file = open(args.json_log, "w") if args.json_log else None  # noqa: SIM115 - closed by close()
        self.began = self.elapsed = 0.0

    def start(self) -> None:
        """The frames begin now (fps counts from here)."""
        self.began = time.perf_counter()

    def emit(self, result, predicted: float) -> None:
        """One frame's result (a device.records.FrameResult), run on a plan that predicted ``predicted``."""
        self.count += 1
        if self.log_file:
            self.log_file.write(json.dumps(result.log_record(predicted)) + "\n")
            self.log_file.flush()  # a line per frame as it comes: the log can be followed live
        if result.error is not None:
            self.failures += 1
            print(f"frame {result.index}: ERROR {result.error}", flush=True)
            if self.args.save_outputs:
                self.saved.append(None)
            return
        self.latencies.append(result.latency)
        if self.args.save_outputs:
            self.saved.append(result.outputs)
        shown = self.shown.frame(result.index, result.outputs)
        if not self.args.quiet:
            fps = len(self.latencies) / (time.perf_counter() - self.began)
            print(f"frame {result.index}: {result.latency * 1e3:7.1f} ms  {fps:5.1f} fps  {shown}", flush=True)

    def stop(self) -> None:
        """The frames are over."""
        self.elapsed = time.perf_counter() - self.began

    def close(self) -> None:
        """Close the JSON log."""
        if self.log_file:
            self.log_file.close()

    def finish(self, channels: int, height: int, width: int) -> int:
        """Save the outputs, print the summary; the exit code."""
        if self.args.save_outputs:
            empty = np.zeros((0, channels, height, width))
            np.savez(self.args.save_outputs, inputs=np.concatenate(self.inputs) if self.inputs else empty,
                     **saved_outputs(self.saved))
        done, elapsed = len(self.latencies), self.elapsed
        if done:
            p50, p95 = np.percentile(self.latencies, [50, 95])
            print(f"{done} frames in {elapsed:.2f} s: {done / elapsed:.1f} fps; latency mean "
                  f"{np.mean(self.latencies) * 1e3:.1f} ms, p50 {p50 * 1e3:.1f}, p95 {p95 * 1e3:.1f}; "
                  f"predicted {self.predicted * 1e3:.1f} ms; {self.failures} failed")
        if self.failures:
            print(f"deepco run: {self.failures} frame(s) failed (see above)", file=sys.stderr)
            return 1
        return 0


class _PlanCacheUse:
    """The plan cache for this run (device.plan_cache): ``cached`` is its plan on a warm start (the device's
    measurements and fit are restored from it), None on a cold one or where the cache is off (``cache``
    None: ``--no-plan-cache``, or the run is not auto's, which calibrates nothing)."""

    def __init__(self, args: argparse.Namespace, dev):
        from deepco_device.plan_cache import PlanCache, cache_key

        from deepco.model_cache import cache_home  # the XDG cache folder: zoo exports are kept there too

        self.cache = self.key = self.cached = None
        self.model = args.model
        if args.no_plan_cache or args.plan is not None or args.algorithm != "auto":
            return
        self.cache = PlanCache(Path(args.plan_cache) if args.plan_cache else cache_home(), dev.log)
        dev.load()
        self.key = cache_key(dev, args.objective)
        self.cached = self.cache.load(self.key)
        if self.cached is not None:
            c = self.cached
            dev.restore(c.measured, c.compute_scale, c.step_overhead)
            print(f"plan cache: warm start from {self.cache.path(self.key)}: no measuring, no calibration",
                  flush=True)

    def store(self, dev, plan: StagedPlan, live) -> None:
        """Keep ``plan``, which calibration settled on over ``live`` frames, for the next start (nothing where
        calibration did not run to its end: the plan was not measured against the others)."""
        from deepco_device.plan_cache import Cached

        if self.cache is None:
            return
        if not live.settled:
            why = "the source ended" if live.ended else f"a server failed ({live.stopped})"
            print(f"plan cache: nothing written: {why} before calibration settled", flush=True)
            return
        m = dev.measurements
        path = self.cache.store(self.key, self.model, Cached(plan, m.measurements, m.compute_scale, m.step_overhead))
        if path is not None:
            print(f"plan cache: wrote {path}", flush=True)


def _plan(args: argparse.Namespace, dev, cache: _PlanCacheUse | None, source: Iterator[np.ndarray],
          emit: Callable) -> tuple[StagedPlan, Callable, object, Iterator[np.ndarray] | None]:
    """The plan to run (printed), how failover replans, live adaptation (None: none; auto and the paper's plans
    adapt, a named or saved plan runs as it is) and the frames left for it (None: calibration took them all)."""
    from deepco_device.adaptation import Adaptation
    from deepco_device.planner import LiveFrames, StagedPlanner

    from deepco.planning.staged import throughput

    if cache is None:  # the paper's plan: failover replans with the same algorithm, and it adapts within it
        print(dev.describe_plan(), flush=True)
        return dev.plan, dev.replan(args.algorithm), Adaptation(dev, dev.replan(args.algorithm)), source
    planner = StagedPlanner(dev)
    rest: Iterator[np.ndarray] | None = source
    if cache.cached is not None:
        plan = cache.cached.plan
    elif args.plan is not None:
        from deepco_device.plan_command import load_plan

        plan = load_plan(args.plan, args.model, dev.height, dev.width, planner.servers())
    elif args.algorithm == "auto":  # calibrated on the run's first frames, which give their results as they go
        live = LiveFrames(source, emit)
        plan = planner.calibrate(args.objective, live=live)
        cache.store(dev, plan, live)
        rest = None if live.ended else live.rest()
    else:
        plan = planner.named(args.algorithm)
    print(dev.describe_measurements(), flush=True)
    print(f"plan: {plan.describe()}; predicted {plan.predicted * 1e3:.1f} ms, {planner.fps(plan):.2f} fps; "
          f"{dev.pool.bytes_sent() / 1e6:.2f} MB sent to the servers so far", flush=True)
    adapt = None
    if args.plan is None and args.algorithm == "auto":
        per_frame = (lambda p, rates: 1 / throughput(p, dev.costs, rates)) if args.objective == "throughput" \
            else None  # else the predicted latency
        adapt = Adaptation(dev, lambda down, rates: planner.plans(args.objective, exclude=down, rates=rates)[0],
                           seconds=per_frame)
    return plan, lambda down: planner.best(args.objective, exclude=down), adapt, rest


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
