"""`deepco run`: the device. Frames from a camera, video, URL, image or directory, through the plan."""

from __future__ import annotations

import argparse
import contextlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from deepco_device.giveup import GIVE_UP_AFTER, MAX_FAILED_FRAMES, GiveUp

from deepco import modelcard
from deepco.cluster import load_cluster
from deepco.errors import UserError
from deepco.parsing import SIZE_HELP, parse_size
from deepco.planning.staged import StagedPlan, pipelined
from deepco.wire import security

if TYPE_CHECKING:  # scipy, through calibration: not on the CLI's start
    from deepco_device.plan_cache import CacheUse

    from deepco.planning.lean_depth import LeanDepth
    from deepco.planning.slo import SloChoice, SloWatch

DEFAULT_DEPTH = 2  # frames in flight without --depth (a live source dropping late frames tries from 1 up)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `deepco run`."""
    p.add_argument("--cluster", required=True, metavar="FILE", help="cluster TOML file (server addresses)")
    p.add_argument("--model", required=True, help="zoo model name or path to an .onnx file")
    p.add_argument("--input-size", default=None, metavar="HxW", help=SIZE_HELP)
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
    p.add_argument("--save-plan", default=None, metavar="F.json",
                   help="write the plan the run settles on (auto: after calibration) for `deepco run --plan`")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--plan-cache", default=None, metavar="DIR",
                       help="where auto keeps the plan it settled on, so that the next start with the same servers, "
                            "model, input size and preprocessing runs its first frame on it without measuring or "
                            "calibrating (default: $XDG_CACHE_HOME/deepco, else ~/.cache/deepco)")
    cache.add_argument("--no-plan-cache", action="store_true",
                       help="neither read nor write the plan cache: every start measures and calibrates")
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
    p.add_argument("--depth", type=int, default=None,
                   help=f"frames in flight at once (pipelining; default {DEFAULT_DEPTH}; --objective slo chooses "
                        f"it; on a live source dropping late frames, without this flag, the fewest that keep the "
                        f"measured frame rate, tried from 1 up to {DEFAULT_DEPTH})")
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
    p.add_argument("--annotate", metavar="OUT.mp4",
                   help="write the frames as the model saw them (its input size) with its reading drawn: boxes, a "
                        "mask overlay or the top label (the model card's [output] kind); a failed frame marked "
                        "'failed'; fps: --source-fps, else the video's, else 10 (.mp4, .mov, .m4v: mp4v; .avi, "
                        ".mkv: MJPG)")
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
    from deepco_device.cpu_share import cpu_budget
    from deepco_device.feed import TakenFeed
    from deepco_device.preprocess import Pixels, fit_threads
    from deepco_device.session import Device
    from deepco_device.sources import drop_mode, first_frame_check, open_feed

    from deepco.partition.source import input_size

    if args.input_size is not None:
        parse_size(args.input_size)  # a bad size fails before anything starts; a missing one once the model is read
    _check_flags(args)
    fit_threads(cpu_budget())  # a camera's fraction of a core: OpenCV's idle workers would spin on it
    give_up = GiveUp(args.give_up_after, args.max_failed_frames)  # bad bounds fail before anything starts
    late = drop_mode(args.source, args.drop, args.source_fps) == "late"
    # Without --depth a live source dropping late frames finds its own (LeanDepth) from 1 up to the default
    args.lean_depth, args.depth = args.depth is None and late, args.depth or DEFAULT_DEPTH
    cluster = load_cluster(args.cluster)
    cluster.require_addresses()
    if args.pace:
        cluster.require_bandwidths("--pace (each antenna's bandwidth in Mbit/s)")
    first_frame_check(args.source)  # a bad source fails before any server is touched
    how = modelcard.from_args(args.model, args)
    height, width = input_size(args.model, args.input_size)
    # what the outputs are, whatever --output does with them (--output raw still annotates the card's kind)
    kind = modelcard.from_args(args.model, argparse.Namespace(**{**vars(args), "output": None})).output
    annotated = None
    if args.annotate:  # an unwritable path fails here, before any server is contacted
        from deepco_device.annotate import Annotated, video_fps

        annotated = Annotated(args.annotate, height, width, video_fps(args.source, args.source_fps), how.rgb)
    results = Results(args, Shown(how, kind, args.output_dir, height))
    results.annotated = annotated

    make_pixels = Pixels(height, width, how)

    def prepare(frame: np.ndarray) -> np.ndarray:
        px = make_pixels(frame)
        results.saved.input(px)
        if results.annotated is not None:
            results.annotated.entered(px)
        return px

    try:
        staged = args.plan is not None or args.algorithm in ("auto", "local", "offload")
        with Device(cluster, args.model, height, width, algorithm="thread" if staged else args.algorithm, cut=args.cut,
                    weights=args.weights, pace=args.pace, depth=args.depth, log=results.progress.write,
                    security=security.from_args(args), preprocessing=how) as dev:
            dev.progress = results.progress.step
            results.report.events = dev.events  # logged with the frames (--json-log)
            cache = _cache_use(args, dev) if staged else None
            if cache is None or cache.cached is None:
                dev.setup(rows=not staged)
            print(f"preprocessing: {how.describe()}", flush=True)
            results.shown.noise = modelcard.seeded_weights(dev.reference_model)
            if results.shown.noise:
                print(f"note: {args.model} has seeded random weights, so its labels are noise; give --weights "
                      "STATE_DICT for real ones", flush=True)
            feed = TakenFeed(open_feed(args.source, args.frames, args.drop, args.source_fps, prepare))
            try:
                results.start()
                _run_frames(args, dev, cache, feed, results, give_up)
            except KeyboardInterrupt:  # the CLI exits 130; first, what was done and what was cancelled
                results.report.interrupted(feed.taken, args.quiet)
                raise
            finally:
                feed.close()
            results.report.finish()
            results.report.log_events()
    finally:
        results.progress.close()
        results.close()
    return results.finish(how.channels, height, width)


def _run_frames(args: argparse.Namespace, dev, cache: CacheUse | None, feed, results: Results,
                give_up: GiveUp) -> None:
    """Plan (auto: calibrating on the feed's first frames, whose results come out as they go), then run the
    rest of the feed through the plan, frames in flight as it says."""
    from deepco_device.runners import StagedRunner

    from deepco.heap import freeze_long_lived

    chosen, rest = _plan(args, dev, cache, feed, results.emit)
    results.progress.close()  # set up and calibrated: from here on, frame lines only
    if rest is None:
        return
    if args.save_plan:
        from deepco_device.plan_command import save_plan

        try:
            save_plan(args.save_plan, args.model, dev.height, dev.width, chosen.plan)
        except OSError as exc:
            raise UserError(f"--save-plan {args.save_plan}: cannot write it ({exc.strerror or exc})") from None
    if cache is not None and cache.cached is not None:  # a warm start: its models may take a while to send
        from deepco_device.planner import set_up_live

        runner, rest = set_up_live(dev, chosen.plan, rest, results.emit)
    else:
        runner = StagedRunner(dev, chosen.plan)
    freeze_long_lived()  # set up: the heap so far out of the collector's full passes (deepco.heap says why)
    depth = max(chosen.depth, runner.frames_at_once)
    results.report.predicted, results.report.depth = chosen.announce(dev, depth), depth
    watch = chosen.watch(depth, runner.frames_at_once, lean=getattr(args, "lean_depth", False))
    # Closed at once when the loop ends by an exception (a Ctrl-C between two frames): its calls in flight are
    # cancelled and its pool's threads end before the Device closes the channels under them. Left to the garbage
    # collector, those threads outlived the Device and the interpreter's exit waited on them.
    frames = runner.run_frames(rest, depth=depth, replan=chosen.replan, give_up=give_up, adapt=chosen.adapt,
                               in_flight=(lambda: watch.depth) if watch else None)
    with contextlib.closing(frames):
        for result in frames:
            results.dropped(feed.drops())
            results.emit(result, results.report.predicted)
            if watch is not None and result.error is None and \
                    (line := watch.observe(result.latency, result.delivered)):
                print(line, flush=True)
    results.dropped(feed.drops())


class Results:
    """What `deepco run` does with each frame's result, whichever plan it ran on (calibration's live frames
    or the pipeline's): its line, and through `Report` and `Saved` (device.run_report) its JSON log record,
    its count and its saved output; the summary at the end."""

    def __init__(self, args: argparse.Namespace, shown: Shown):
        from deepco_device.progress import Progress
        from deepco_device.run_report import Report, Saved

        self.args, self.shown = args, shown
        self.progress = Progress()  # a bar on stderr while setting up and calibrating, where it is a terminal
        self.saved = Saved(args.save_outputs, shown.how)
        self.log_file = open(args.json_log, "w") if args.json_log else None  # noqa: SIM115 - closed by close()
        self.report = Report(0.0, args.depth, self.log_file)
        self.annotated = None  # --annotate's video (device.annotate.Annotated)

    def start(self) -> None:
        """The frames begin now (fps counts from here)."""
        self.report.start = time.perf_counter()

    def dropped(self, drops: list) -> None:
        """Frames the feed dropped (a live source's late frames): counted, logged."""
        self.report.dropped(drops, self.args.quiet)

    def emit(self, result, predicted: float) -> None:
        """One frame's result (a device.records.FrameResult), run on a plan that predicted ``predicted``."""
        self.report.frame(result, predicted)
        self.saved.output(result)
        if result.error is not None:
            if self.annotated is not None:
                self.annotated.result(None, result.error)
            self.progress.write(f"frame {result.index}: ERROR {result.error}")
            return
        shown, reading = self.shown.frame(result.index, result.outputs)
        if self.annotated is not None:
            self.annotated.result(reading, None)
        if not self.args.quiet:
            self.progress.write(f"frame {result.index}: {result.latency * 1e3:7.1f} ms  {self.report.fps():5.1f} fps  "
                                f"{shown}")

    def close(self) -> None:
        """Close the JSON log and the annotated video."""
        if self.log_file:
            self.log_file.close()
        if self.annotated is not None:
            self.annotated.close()
            print(f"annotated: {self.annotated.written} frame(s) written to {self.annotated.path}", flush=True)

    def finish(self, channels: int, height: int, width: int) -> int:
        """Save the outputs, print the summary; the exit code."""
        self.saved.write(channels, height, width)
        return self.report.summary()


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
    if args.depth is not None and args.depth < 1:
        raise UserError(f"--depth must be at least 1, got {args.depth}")


@dataclass(frozen=True)
class Chosen:
    """What a run runs: the plan and its frames in flight, how failover replans, live adaptation (None: none),
    and with --objective slo its choice (deepco.planning.slo)."""

    plan: StagedPlan
    depth: int
    replan: Callable
    adapt: object = None
    slo: SloChoice | None = None
    paper: bool = False  # a paper plan, whose table `_plan` printed

    def announce(self, dev, depth: int) -> float:
        """Print the prediction for what runs, ``depth`` frames in flight; the predicted latency (seconds)."""
        latency, fps = pipelined(self.plan, dev.costs, dev.rates(), depth)
        which = "" if self.paper else f"plan: {self.plan.describe()}; "
        sent, models = dev.pool.bytes_sent(), dev.uploads.sent_bytes
        print(f"{which}predicted with {depth} frame(s) in flight: {latency * 1e3:.1f} ms, {fps:.2f} fps (one frame "
              f"alone: {self.plan.predicted * 1e3:.1f} ms); {sent / 1e6:.2f} MB sent to the servers so far, "
              f"{models / 1e6:.2f} MB of them in model loads", flush=True)
        # the run's JSON log (--json-log) records the setup's bytes with the frames: issue 27's "before and after"
        dev.events.append({"event": "setup", "bytes_sent": sent, "model_load_bytes": models,
                           "at": time.perf_counter()})
        if self.slo is not None:
            print(self.slo.note(), flush=True)
        return latency

    def watch(self, depth: int, least: int, lean: bool) -> SloWatch | LeanDepth | None:
        """What changes the frames in flight during the run: with --objective slo, the watch that keeps the run
        within its bound; with ``lean`` (a live source dropping late frames, --depth not given), the fewest
        frames in flight that keep the measured frame rate (deepco.planning.lean_depth); else nothing."""
        from deepco.planning.lean_depth import LeanDepth
        from deepco.planning.slo import SloWatch

        if self.slo is not None:
            return SloWatch(self.slo.bound, depth, least)
        return LeanDepth(least, depth) if lean else None


def _cache_use(args: argparse.Namespace, dev) -> CacheUse:
    """The plan cache for this run (device.plan_cache.CacheUse): off with --no-plan-cache, and for a run that
    calibrates nothing (a saved plan, a named algorithm)."""
    from deepco_device.plan_cache import CacheUse, directory

    on = not args.no_plan_cache and args.plan is None and args.algorithm == "auto"
    return CacheUse(dev, directory(args.plan_cache) if on else None, args.model, args.objective, dev.log)


def _unsettled(live) -> str | None:
    """Why calibration over ``live`` frames did not settle (device.planner.LiveFrames), or None if it did."""
    if live.settled:
        return None
    return "the source ended" if live.ended else f"a server failed ({live.stopped})"


def _plan(args: argparse.Namespace, dev, cache: CacheUse | None, feed,
          emit: Callable) -> tuple[Chosen, object | None]:
    """What to run (printed) and the frames left for it: the feed, or None where calibration took them all."""
    from deepco_device.adaptation import Adaptation
    from deepco_device.planner import LiveFrames, StagedPlanner
    from deepco_device.runners import send_whole_early, upload_bytes, warm

    from deepco.planning.staged import throughput

    if cache is None:  # the paper's plan: failover replans with the same algorithm, and it adapts within it
        print(dev.describe_plan(), flush=True)
        adapt = Adaptation(dev, dev.replan(args.algorithm), warm=lambda p: warm(dev, p),
                           upload=lambda p: upload_bytes(dev, p))
        return Chosen(dev.plan, args.depth, dev.replan(args.algorithm), adapt, paper=True), feed
    planner = StagedPlanner(dev)
    objective = "latency" if args.objective == "slo" else args.objective  # failover: the fastest plan left
    rest, choice, depth = feed, None, args.depth
    if cache.cached is not None:
        plan = cache.plan(planner, objective)
    elif args.plan is not None:
        from deepco_device.plan_command import load_plan

        down = {name: f"{dev.pool.client(name, 0).address}: {why}" for name, why in dev.reach().items()}
        plan = load_plan(args.plan, args.model, dev.height, dev.width, planner.servers(), down)
    elif args.objective == "slo":
        choice = planner.choose_slo(args.max_latency / 1e3)
        plan, depth = choice.option.plan, choice.option.depth
    elif args.algorithm == "auto":  # calibrated on the run's first frames, which give their results as they go
        ahead = send_whole_early(dev)  # the radio carries the whole model while the device plans
        live = LiveFrames(feed, emit)  # calibration's finalists stay loaded for live adaptation (below)
        plan = planner.calibrate(objective, live=live, standby=True,
                                 first_on_device=ahead is not None and ahead.is_alive())
        cache.store(dev, plan, _unsettled(live))
        rest = None if live.ended else live.rest()
    else:
        plan = planner.named(args.algorithm)
    print(dev.describe_measurements(), flush=True)
    adapt = None
    if args.plan is None and args.algorithm == "auto" and choice is None:
        per_frame = (lambda p, rates: 1 / throughput(p, dev.costs, rates)) if objective == "throughput" \
            else None  # else the predicted latency
        ahead, assumed = _ahead(planner, objective, dev.log)
        adapt = Adaptation(dev, lambda down, rates: planner.plans(objective, exclude=down, rates=rates),
                           seconds=per_frame, warm=lambda p: warm(dev, p),
                           known=[r.plan for r in planner.standby], ahead=ahead, assumed=assumed,
                           keep_reserve=True, upload=lambda p: upload_bytes(dev, p),
                           # each known plan's last timing (a runoff's comes after its first)
                           measured={t["plan"]: t["measured"] for t in planner.trials if "measured" in t})
    return Chosen(plan, depth, lambda down: planner.best(objective, exclude=down), adapt, choice), rest


def _ahead(planner, objective: str, log: Callable[[str], None]) -> tuple[list, dict[str, float]]:
    """`StagedPlanner.ahead` where servers were down at the start (one line: for which, on what rate, how long
    it took), so that their joining needs no search beside the live frames."""
    began = time.perf_counter()
    ahead, assumed = planner.ahead(objective)
    if ahead:
        log(f"planned ahead for {', '.join(assumed)} (down; assumed {min(assumed.values()) / 1e9:.2f} GFLOP/s, "
            f"the slowest measured): {len(ahead)} plans in {time.perf_counter() - began:.2f} s")
    return ahead, assumed


def file_names(names: list[str]) -> dict[str, str]:
    """Each output's name as a part of a file name: what is not a letter, digit, '.', '-' or '_' becomes '_',
    and names that would then clash get their output's index appended."""
    safe = {name: re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".") or "output" for name in names}
    taken = list(safe.values())
    return {name: s if taken.count(s) == 1 else f"{s}-{k}" for k, (name, s) in enumerate(safe.items())}


class Shown:
    """What `deepco run` does with each frame's outputs: their reading (labels, detections, mask: device.readings),
    saved tensors (raw), or their shapes."""

    def __init__(self, how: modelcard.Preprocessing, kind: str, directory: str, height: int):
        self.how, self.mode, self.kind, self.directory, self.height = how, how.output, kind, Path(directory), height
        self.noise = False

    def frame(self, index: int, outputs: dict[str, np.ndarray]) -> tuple[str, object]:
        """Show or save one frame's outputs: the text for its line and its reading (for --annotate; None where
        the kind has none). ``--output raw`` writes one file per output: ``frame-NNNNNN.npy`` for a one-output
        model, else ``frame-NNNNNN-<name>.npy``."""
        from deepco_device.readings import READERS, read

        only = next(iter(outputs.values())) if len(outputs) == 1 else None
        auto = "labels" if only is not None and only.size == 1000 else "shape"
        mode = self.mode if self.mode != "auto" else auto
        # read as --output says, else (raw, auto) as the card says: --output raw still annotates
        kind = mode if mode in READERS else (self.kind if self.kind in READERS else auto)
        try:
            reading = read(kind, outputs, self.how, self.height, self.noise)
        except ValueError as exc:  # the outputs do not fit the kind: one line, not a traceback
            raise UserError(f"output kind {kind}: {exc}") from None
        if mode != "raw" and reading is not None:
            return reading.line(), reading
        described = [(name, f"{'output' if only is not None else name} {'x'.join(map(str, y.shape))} {y.dtype} in "
                            f"[{float(y.min()):.3g}, {float(y.max()):.3g}]") for name, y in outputs.items()]
        text = "; ".join(d for _, d in described)
        if mode != "raw":
            return text + f" (--output raw saves {'it' if only is not None else 'them'})", reading
        self.directory.mkdir(parents=True, exist_ok=True)
        shown = []
        files = file_names(list(outputs))
        for name, what in described:
            suffix = "" if only is not None else f"-{files[name]}"
            path = self.directory / f"frame-{index:06d}{suffix}.npy"
            np.save(path, outputs[name])
            shown.append(f"{what} -> {path}")
        return "; ".join(shown), reading
