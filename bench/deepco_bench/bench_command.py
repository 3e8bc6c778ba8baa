"""`deepco bench`: measured frame latency of each algorithm on an emulated edge network.

Builds the testbed (deepco_bench.testbed: servers in network namespaces, antennas shaped with tc, CPU shares
enforced with cgroup quotas), starts a real `deepco serve` in every server namespace, and runs the device
benchmark (deepco_bench.benchmark) in the device namespace: one device, the algorithms interleaved frame by
frame. Prints a table, writes JSON and a plot; `--sweep` repeats it over bandwidth, capacity, antennas or
servers like the paper's Figs. 9-12. Every output is labelled with what was emulated and how.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from deepco import modelcard
from deepco.errors import UserError
from deepco.parsing import parse_size
from deepco.planning.calibration import FIDELITY
from deepco.planning.staged import same_plan
from deepco.plots import save_figure
from deepco.timelines import gantt, split_text, step_split
from deepco_bench.benchmark import GO, LOADED
from deepco_bench.camera import CAMERA, CAMERA_CAP, camera_share
from deepco_bench.testbed import DEFAULT_MTU, ServerSpec, Testbed, TestbedSpec, cpu_quota_of
from deepco_bench.testbed_servers import shares_for, start_servers

SWEEPS = {
    "bandwidth": [25.0, 50.0, 100.0, 200.0, 400.0],
    "capacity": [0.5, 0.75, 1.0, 1.5, 2.0],  # multiplies every server's CPU share
    "antennas": [1, 2, 3, 4],
    "servers": [1, 2, 3, 4],
}
# Each preset fills the flags it names; a flag given on the command line wins.
PRESETS: dict[str, dict] = {
    # the defaults before presets existed: a mid-range device, wireless server-to-server links
    "default": {"servers": 4, "antennas": 2, "bandwidth": 100.0, "shares": "0.45,0.30,0.15,0.10",
                "device_share": 0.5, "peer_bandwidth": "same", "model": "resnet18", "input_size": "224x224"},
    # the paper's setting on this machine: a weak camera, four edge servers on one site's LAN, a camera frame
    "camera": {"servers": 4, "antennas": 2, "bandwidth": 100.0, "shares": "0.45,0.45,0.35,0.35",
               "device_share": 0.1, "peer_bandwidth": "lan", "model": "resnet18", "input_size": "720x1280"},
    # `deepco demo`'s setting (bench/deepco_bench/demo.py): a 0.2-core camera, three 0.6-core edge boxes, two
    # antennas at 20 Mbit/s, a 288x288 frame; a benchmark row for the demo's claim
    "demo": {"servers": 3, "antennas": 2, "bandwidth": 20.0, "shares": "0.6,0.6,0.6", "device_share": CAMERA,
             "peer_bandwidth": "lan", "model": "efficientnet-lite0", "input_size": "288x288"},
    # the paper's Section VI ratios as far as two cores allow: compute dominates (fast links, weak device)
    "paper": {"servers": 4, "antennas": 2, "bandwidth": 400.0, "shares": "0.4,0.4,0.35,0.35",
              "device_share": 0.1, "peer_bandwidth": "lan", "model": "resnet18", "input_size": "224x224"},
}
DEFAULT_ALGORITHMS = "local,offload,round-robin,auto,thread,thread-sa,modnn-sa,modnn-ma,single"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `deepco bench` (unset flags come from --preset, default 'default')."""
    p.add_argument("--preset", choices=list(PRESETS), default="default",
                   help="a named testbed: " + "; ".join(f"{k}: {v}" for k, v in PRESETS.items()))
    p.add_argument("--servers", type=int, default=None, help="number of servers (preset; default 4)")
    p.add_argument("--antennas", type=int, default=None, help="number of device antennas (preset; default 2)")
    p.add_argument("--bandwidth", type=float, default=None, metavar="MBPS",
                   help="each antenna's bandwidth in Mbit/s (preset; default 100)")
    p.add_argument("--shares", default=None,
                   help="CPU share of each server in cores, comma-separated (preset; default 0.45,0.30,0.15,0.10)")
    p.add_argument("--device-share", type=float, default=None,
                   help="the device's own CPU share of a core (preset; default 0.5; the demo preset's is "
                        "measured: a camera of deepco demo's GFLOP/s on this machine)")
    p.add_argument("--peer-bandwidth", default=None, metavar="MBPS|same|lan",
                   help="each server's own link, which exchanges between servers cross: Mbit/s, 'same' as the "
                        "antennas (wireless peers) or 'lan' (unshaped) (preset; default same)")
    p.add_argument("--mtu", type=int, default=DEFAULT_MTU,
                   help=f"every emulated link's MTU in bytes (default {DEFAULT_MTU}; 1500 was the default before "
                        "2026-11-29: the kernel charged its packets' work to the servers' CPU quotas)")
    p.add_argument("--model", default=None, help="zoo model or .onnx path (preset; default resnet18)")
    p.add_argument("--input-size", default=None, metavar="HxW", help="input size (preset; default 224x224)")
    p.add_argument("--algorithms", default=DEFAULT_ALGORITHMS,
                   help=f"comma-separated, measured interleaved in one run (default {DEFAULT_ALGORITHMS})")
    p.add_argument("--frames", type=int, default=8, help="timed frames per algorithm, one in flight (default 8)")
    p.add_argument("--fps-frames", type=int, default=8,
                   help="frames per algorithm in the pipelined throughput run (default 8; 0: skip)")
    p.add_argument("--depth", type=int, default=2, help="frames in flight in the throughput run (default 2)")
    p.add_argument("--live-frames", type=int, default=0, metavar="N",
                   help="also play the photo as a live source at twice the engine's rate (auto's plan, measured at "
                        "--live-depth first) for N frames, dropping "
                        "late frames and not: capture-to-result p50/p95 against auto's single-frame p50, drops "
                        "(needs auto in --algorithms; default 0: skip)")
    p.add_argument("--live-depth", type=int, default=0, metavar="N",
                   help="frames in flight in the --live-frames runs (default 0: the least past which the cost model "
                        "predicts auto's plan no more fps)")
    p.add_argument("--slo-factor", type=float, default=0.0, metavar="X",
                   help="also run --objective slo with a bound of X times auto's measured p50, and measure every "
                        "candidate plan and depth in the same run: the chosen fps against the best that met the "
                        "bound (default 0: skip)")
    p.add_argument("--repeat", type=int, default=1,
                   help="independent repetitions (testbed, setup and plan each time); tables give medians "
                        "(default 1)")
    p.add_argument("--cut", default="auto", help="THREAD's cut name (see `deepco partition`) or auto (default auto)")
    p.add_argument("--sweep", choices=list(SWEEPS), default=None,
                   help="repeat over a range: bandwidth 25..400 Mbit/s, capacity x0.5..x2 (every server's CPU "
                        "share), antennas 1..4, servers 1..4 (default: one point)")
    p.add_argument("--scenario", choices=["bandwidth-drop", "bandwidth-rise", "server-slowdown", "server-join",
                                          "contention"], default=None,
                   help="instead of a table: change the emulated network in the middle of a run of auto (every "
                        "antenna to a tenth or from a tenth to full, the busiest server to a quarter of its CPU "
                        "share, the last server up from down, a second device on the same servers) and report "
                        "each phase (auto, the static plans, a fresh setup) and the frames until adapted "
                        "(docs/usage.md; needs the kernel emulation; default: none)")
    p.add_argument("--phase-frames", type=int, default=60,
                   help="--scenario: frames after calibration before the change, and at least as many after it "
                        "(default 60)")
    p.add_argument("--static-frames", type=int, default=20,
                   help="--scenario: timed frames of each static plan in each phase (default 20; 0: none)")
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="--scenario: keep every run's log, printed lines and the servers' logs in DIR (a new or "
                        "empty folder; default: a temporary folder, removed at the end)")
    p.add_argument("--json", metavar="FILE",
                   help="write every result as JSON to FILE (fields: docs/formats.md; default: none)")
    p.add_argument("--plot", metavar="FILE.png", help="write a PNG of measured and predicted latency (default: none)")
    p.add_argument("--gantt", metavar="FILE.png",
                   help="write a Gantt chart of auto's frame of median latency (the first point's first repeat: "
                        "per participant and antenna, receive / compute / exchange / idle) and print auto's "
                        "per-step time split (default: none)")
    p.add_argument("--fallback", action="store_true", help="force the no-root fallback (loopback + pacing; default: "
                   "only without root, tc or a cpu cgroup)")
    p.add_argument("--timeout", type=float, default=1200.0,
                   help="seconds one testbed run may take (default 1200)")
    modelcard.add_arguments(p)


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the flags left unset from the preset (the demo's camera: its share measured on this machine, as
    `deepco demo` measures it, deepco_bench.camera)."""
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device_share == CAMERA:
        args.device_share = _camera_share(args.model, args.input_size)
    return args


def _camera_share(model: str, input_size: str) -> float:
    """The device share that makes it the demo's weak camera on ``model`` (zoo name or .onnx) at this size."""
    import onnx

    from deepco.partition.source import load_model
    height, width = parse_size(input_size)
    loaded = onnx.load(model) if model.endswith(".onnx") else load_model(model, height, width)
    cores, host = camera_share(loaded, height, width, CAMERA_CAP)
    print(f"device share {cores:.3g} core: a camera of {cores * host:.1f} GFLOP/s on {model} (this machine's "
          f"core: {host:.0f} GFLOP/s)", flush=True)
    return round(cores, 3)


def peer_bandwidth(text: str, antenna_mbps: float) -> float | None:
    """--peer-bandwidth: Mbit/s, 'same' (as the antennas) or 'lan' (None: unshaped)."""
    if text == "same":
        return antenna_mbps
    if text == "lan":
        return None
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"--peer-bandwidth must be a number of Mbit/s, 'same' or 'lan', got {text!r}") from None
    if value <= 0:
        raise UserError(f"--peer-bandwidth must be positive, got {text!r}")
    return value


def _device_quota_after_loading(tb: Testbed, proc: subprocess.Popen, timeout: float) -> float | None:
    """Wait for the worker's LOADED line, apply the device's CPU quota, answer GO (see benchmark --handshake);
    the quota the worker's cgroup has when it is let go (None: it exited first, e.g. on a bad model, and
    reports its own error)."""
    reply: list[str] = []
    reader = threading.Thread(target=lambda: reply.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        raise subprocess.TimeoutExpired(proc.args, timeout)
    if not reply or reply[0].strip() != LOADED:
        return None
    tb.apply_device_cpu_limit()
    quota = cpu_quota_of(proc.pid)
    proc.stdin.write(GO + "\n")
    proc.stdin.flush()
    return quota


def testbed_spec(shares: Sequence[float], antennas: int, bandwidth: float, device_share: float,
                 peer: str | None, mtu: int = DEFAULT_MTU) -> TestbedSpec:
    """A point's testbed: servers s0, s1, ... of these CPU ``shares``, ``antennas`` of ``bandwidth`` Mbit/s each,
    the device's share, the servers' own links (``peer``: `peer_bandwidth`'s argument), every link's ``mtu``."""
    return TestbedSpec(antenna_mbps=(bandwidth,) * antennas,
                       servers=tuple(ServerSpec(f"s{k}", cpu) for k, cpu in enumerate(shares)),
                       device_cpu=device_share, peer_mbps=peer_bandwidth(peer, bandwidth), mtu=mtu)


def one_point(args: argparse.Namespace, servers: int, antennas: int, bandwidth: float, scale: float,
              workdir: Path) -> dict:
    """Build a testbed, start servers, run the device benchmark in it, tear it all down."""
    shares = shares_for(args, servers, scale)
    spec = testbed_spec(shares, antennas, bandwidth, args.device_share, args.peer_bandwidth, args.mtu)
    with Testbed(spec, force_fallback=args.fallback, defer_cpu_limits=True) as tb:
        print(tb.label, flush=True)
        cluster, logs = start_servers(tb, workdir, f"{servers}-{antennas}-{bandwidth:g}-{scale:g}")
        out = workdir / "point.json"
        worker = [sys.executable, "-m", "deepco_bench.benchmark", "--cluster", str(cluster), "--model", args.model,
                  "--input-size", args.input_size, "--algorithms", args.algorithms, "--frames", str(args.frames),
                  "--fps-frames", str(args.fps_frames), "--depth", str(args.depth),
                  "--cut", args.cut, "--label", tb.label, "--out", str(out), "--live-frames", str(args.live_frames),
                  "--live-depth", str(args.live_depth), "--slo-factor", str(args.slo_factor),
                  *modelcard.to_argv(args)]
        if spec.peer_mbps is not None:
            worker += ["--peer-mbps", str(spec.peer_mbps)]
        if not tb.kernel:
            worker.append("--pace")
        else:  # the device's quota starts once its model is loaded, before it measures anything
            worker.append("--handshake")
        proc = tb.spawn(worker, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) if tb.kernel \
            else tb.spawn(worker)
        quota = None
        try:
            if tb.kernel:
                quota = _device_quota_after_loading(tb, proc, args.timeout)
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
        if code != 0:
            for k, log in enumerate(logs):
                log.flush()
                tail = (workdir / f"server-{k}.log").read_text().strip().splitlines()[-3:]
                print(f"server s{k} log (last lines): " + " | ".join(tail), file=sys.stderr)
            why = f"exit {code}" if code is not None else f"no result within --timeout {args.timeout:g} s"
            raise UserError(f"the device benchmark failed ({why}; see the messages above)")
        point = json.loads(out.read_text())
    point.update({"servers": servers, "antennas": antennas, "bandwidth_mbps": bandwidth, "cpu_shares": shares,
                  "device_share": args.device_share, "device_cpu_quota": quota, "peer_bandwidth": args.peer_bandwidth})
    return point


def aggregate(runs: list[dict]) -> dict:
    """One point from ``runs`` (repeats of it): medians of every figure, the spread of p50 and fps."""
    point = {k: v for k, v in runs[0].items() if k not in ("algorithms", "bound", "measured")}
    point["repeats"] = len(runs)
    point["bound"] = {k: statistics.median(r["bound"][k] for r in runs) for k in ("latency", "fps")}
    point["bound"]["input_bytes"] = runs[0]["bound"]["input_bytes"]
    point["bound"]["output_bytes"] = runs[0]["bound"].get("output_bytes")
    point["bound"]["model_flops"] = runs[0]["bound"]["model_flops"]
    timed = [r["bound"]["timed"]["latency"] for r in runs if r["bound"].get("timed")]
    point["bound"]["timed_latency"] = statistics.median(timed) if timed else None
    point["algorithms"] = {}
    for name in runs[0]["algorithms"]:
        entries = [r["algorithms"][name] for r in runs]
        agg = {}
        for key in ("p50", "p95", "mean", "fps", "predicted", "measured_over_predicted", "predicted_fps",
                    "p50_over_bound", "fps_over_bound", "depth", "pipelined_p50", "predicted_pipelined",
                    "pipelined_over_predicted", "p50_over_timed_bound"):
            values = [e[key] for e in entries if e.get(key) is not None]
            agg[key] = statistics.median(values) if values else None
        p50s = [e["p50"] for e in entries]
        fpss = [e["fps"] for e in entries if e.get("fps") is not None]
        agg.update({"p50_min": min(p50s), "p50_max": max(p50s), "fps_min": min(fpss) if fpss else None,
                    "fps_max": max(fpss) if fpss else None,
                    "max_relative_error": max(e["max_relative_error"] for e in entries),
                    "frames": sum(e["frames"] for e in entries),
                    "plan_text": [e.get("plan_text", "") for e in entries]})
        for key in ("servers", "plan"):  # the first repeat's plan (each repeat's is in "runs")
            if key in entries[0]:
                agg[key] = entries[0][key]
        point["algorithms"][name] = agg
    point.update(aggregate_deadlines(runs))
    point["runs"] = runs
    return point


LIVE_FIGURES = ("depth", "capture_to_result_p50", "capture_to_result_p95", "first_third_p95", "last_third_p95",
                "latency_p50", "latency_p95", "dropped", "done", "source_fps", "engine_fps", "single_frame_p50")
SLO_FIGURES = ("bound", "chosen_fps", "chosen_p95", "best_fps", "chosen_over_best_fps")


def aggregate_deadlines(runs: list[dict]) -> dict:
    """Medians over ``runs`` of the live and slo runs' figures (benchmark.deadlines), where they ran."""
    def median(entries: list[dict], key: str) -> float | None:
        values = [e[key] for e in entries if e.get(key) is not None]
        return statistics.median(values) if values else None

    out: dict = {}
    if all("live" in r for r in runs):
        out["live"] = {drop: {k: median([r["live"][drop] for r in runs], k) for k in LIVE_FIGURES}
                       for drop in runs[0]["live"]}
    if all("slo" in r for r in runs):
        out["slo"] = {k: median([r["slo"] for r in runs], k) for k in SLO_FIGURES}
        out["slo"]["met"] = [r["slo"]["met"] for r in runs]
        out["slo"]["chosen"] = [r["slo"]["chosen"] for r in runs]
    return out


def deadline_lines(point: dict) -> list[str]:
    """The table's lines for the prediction at depth, the live and the slo runs (medians over the repeats)."""
    at_depth = [f"{name} {r['pipelined_p50'] * 1e3:.1f}/{r['predicted_pipelined'] * 1e3:.1f} ms = "
                f"{r['pipelined_over_predicted']:.2f}" for name, r in point["algorithms"].items()
                if r.get("pipelined_over_predicted")]
    lines = [f"with frames in flight (the throughput run), measured p50 / predicted: {'; '.join(at_depth)}"] \
        if at_depth else []
    for drop, r in point.get("live", {}).items():
        if r["capture_to_result_p95"] is None:
            continue
        lines.append(f"live, --drop {drop}, {r['depth']:.0f} in flight: source at {r['source_fps']:.2f} fps "
                     f"(2x the engine's {r['engine_fps']:.2f}), {r['done']:.0f} frames done, {r['dropped']:.0f} "
                     f"dropped; capture to result p50 {r['capture_to_result_p50'] * 1e3:.1f} ms, p95 "
                     f"{r['capture_to_result_p95'] * 1e3:.1f} ms = "
                     f"{r['capture_to_result_p95'] / r['single_frame_p50']:.2f}x auto's single-frame p50 "
                     f"({r['single_frame_p50'] * 1e3:.1f} ms); p95 of the first third "
                     f"{r['first_third_p95'] * 1e3:.1f} ms, of the last {r['last_third_p95'] * 1e3:.1f} ms; compute "
                     f"p50 {r['latency_p50'] * 1e3:.1f} ms")
    s = point.get("slo")
    if s:
        best = (f"{s['chosen_over_best_fps']:.2f} of the most fps measured within the bound ({s['best_fps']:.2f})"
                if s["best_fps"] else "no candidate met the bound when all were measured")
        lines.append(f"slo, bound {s['bound'] * 1e3:.1f} ms: chose {'; '.join(dict.fromkeys(s['chosen']))} (met: "
                     f"{s['met']}): {s['chosen_fps']:.2f} fps, p95 {s['chosen_p95'] * 1e3:.1f} ms = {best}")
    return lines


def violations(point: dict) -> list[str]:
    """Measurements that beat the physical bound: a bug in the bound or in the measurement."""
    bad = []
    for name, r in point["algorithms"].items():
        if r["p50"] < point["bound"]["latency"]:
            bad.append(f"{name}: p50 {r['p50'] * 1e3:.1f} ms is below the bound {point['bound']['latency'] * 1e3:.1f}")
        if r.get("fps") is not None and r["fps"] > point["bound"]["fps"]:
            bad.append(f"{name}: {r['fps']:.2f} fps is above the bound {point['bound']['fps']:.2f}")
    return bad


def twins(point: dict) -> list[str]:
    """A line per row that ran the very plan `auto` ran (in which repeats): their p50s differ by the
    benchmark's own noise between two runners of one plan, not by a choice."""
    same: dict[str, list[int]] = {}
    for k, run in enumerate(point.get("runs", [])):
        auto = run["algorithms"].get("auto", {}).get("plan")
        for name, r in run["algorithms"].items():
            if name != "auto" and auto is not None and r.get("plan") is not None and same_plan(auto, r["plan"]):
                same.setdefault(name, []).append(k + 1)
    return [f"auto ran the same plan as {name} in repeat(s) {', '.join(map(str, ks))} of {len(point['runs'])}: "
            "there the two rows differ by measurement noise only" for name, ks in same.items()]


def unpredicted(point: dict) -> list[str]:
    """A line per repeat whose auto plan's measured / predicted falls outside ``FIDELITY``, with the plan's
    own reason (from calibration) or, where calibration's frames did match it, the difference between
    calibration's and the benchmark's frames."""
    lines = []
    for k, run in enumerate(point.get("runs", [])):
        r = run["algorithms"].get("auto")
        if r is None or not r.get("measured_over_predicted") or \
                FIDELITY[0] <= r["measured_over_predicted"] <= FIDELITY[1]:
            continue
        f = r.get("plan", {}).get("fidelity") or {}
        why = f.get("why") or (
            f"calibration measured {f['measured'] * 1e3:.1f} ms over {f['frames']} frames (ratio {f['ratio']:.2f}), "
            f"the benchmark's frames {r['p50'] * 1e3:.1f} ms: the machine ran this plan differently then"
            if f else "the plan was not calibrated")
        lines.append(f"auto, repeat {k + 1}: measured/predicted {r['measured_over_predicted']:.2f} is outside "
                     f"{FIDELITY[0]}-{FIDELITY[1]}: {why}")
    return lines


def table(point: dict) -> str:
    """One point's results as a table (milliseconds; medians over the repeats, the fastest row marked *)."""
    algos = point["algorithms"]
    fastest = min(algos, key=lambda n: algos[n]["p50"])
    best_fps = max((n for n in algos if algos[n].get("fps")), key=lambda n: algos[n]["fps"], default=None)
    b = point["bound"]
    lines = [point["label"],
             f"model {point['model']} {point['input_size']}, {point['servers']} servers "
             f"(CPU shares {', '.join(map(str, point['cpu_shares']))}), {point['antennas']} antenna(s) at "
             f"{point['bandwidth_mbps']:g} Mbit/s, device CPU share {point['device_share']:g}, "
             f"server-to-server links: {point['peer_bandwidth']}; medians of {point['repeats']} repeat(s)",
             f"physical bound: latency >= {b['latency'] * 1e3:.1f} ms, fps <= {b['fps']:.2f}"
             + ("" if not b.get("timed_latency") else f"; with each server's FLOP rate as it ran the whole model "
                f"in this run's frames (benchmark.timed_bound): latency >= {b['timed_latency'] * 1e3:.1f} ms"),
             f"{'algorithm':<16} {'p50':>8} {'(min-max)':>15} {'p95':>8} {'fps':>7} {'pred':>8} {'meas/pred':>9} "
             f"{'p50/bound':>9} {'fps/bound':>9} {'max error':>9}"]
    for name, r in algos.items():
        mark = ("*" if name == fastest else " ") + ("f" if name == best_fps else " ")
        fps = f"{r['fps']:7.2f}" if r.get("fps") else f"{'-':>7}"
        fpsb = f"{r['fps_over_bound']:9.2f}" if r.get("fps_over_bound") else f"{'-':>9}"
        spread = f"({r['p50_min'] * 1e3:.0f}-{r['p50_max'] * 1e3:.0f})"
        lines.append(f"{name + ' ' + mark:<16} {r['p50'] * 1e3:>8.1f} {spread:>15} {r['p95'] * 1e3:>8.1f} {fps} "
                     f"{r['predicted'] * 1e3:>8.1f} {r['measured_over_predicted']:>9.2f} {r['p50_over_bound']:>9.2f} "
                     f"{fpsb} {r['max_relative_error']:>9.1e}")
    lines.append("* least p50 latency, f most fps")
    if b.get("timed_latency"):
        lines.append("p50 / timed bound (median of the repeats): " + ", ".join(
            f"{name} {r['p50_over_timed_bound']:.2f}" for name, r in algos.items() if r.get("p50_over_timed_bound")))
    for name in ("auto", "auto-whole", "auto-throughput"):
        if name in algos:
            lines.append(f"{name} plan: {algos[name]['plan_text'][0]}")
    lines += deadline_lines(point)
    lines += twins(point) + unpredicted(point)
    lines += [f"WARNING (measurement below the physical bound): {v}" for v in violations(point)]
    return "\n".join(lines)


def plot(document: dict, path: str) -> None:
    """Bars (one point) or lines (a sweep) of median p50 latency, min-max whiskers, predicted markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = document["points"]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    algorithms = list(points[0]["algorithms"])
    if document.get("sweep"):
        xs = [p[document["sweep_key"]] for p in points]
        for name in algorithms:
            ax.plot(xs, [p["algorithms"][name]["p50"] * 1e3 for p in points], marker="o", label=f"{name} measured")
            ax.plot(xs, [p["algorithms"][name]["predicted"] * 1e3 for p in points], linestyle=":",
                    color=ax.lines[-1].get_color(), label=f"{name} predicted")
        ax.plot(xs, [p["bound"]["latency"] * 1e3 for p in points], color="black", linestyle="--",
                label="physical bound")
        ax.set_xlabel(document["sweep"])
    else:
        point = points[0]
        p50 = [point["algorithms"][n]["p50"] * 1e3 for n in algorithms]
        lo = [v - point["algorithms"][n]["p50_min"] * 1e3 for v, n in zip(p50, algorithms, strict=True)]
        hi = [point["algorithms"][n]["p50_max"] * 1e3 - v for v, n in zip(p50, algorithms, strict=True)]
        ax.bar(algorithms, p50, yerr=[lo, hi], capsize=4, label="measured p50 (whiskers: min-max over repeats)")
        ax.scatter(algorithms, [point["algorithms"][n]["predicted"] * 1e3 for n in algorithms], color="black",
                   marker="_", s=400, zorder=3, label="predicted")
        ax.axhline(point["bound"]["latency"] * 1e3, color="red", linestyle="--", label="physical bound")
        ax.set_yscale("log")
        ax.tick_params(axis="x", labelrotation=30)
    ax.set_ylabel("frame latency (ms)")
    ax.set_title(f"{points[0]['model']} {points[0]['input_size']}: measured on an EMULATED edge network")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    first = "the sweep's first point: " if document.get("sweep") else ""
    footer = textwrap.fill(first + points[0]["label"], 200)  # the whole label: it says what was EMULATED
    fig.text(0.01, 0.01, footer, fontsize=6, va="bottom")
    fig.tight_layout(rect=(0, 0.015 + 0.022 * (footer.count("\n") + 1), 1, 1))
    save_figure(fig, path, dpi=110)


def auto_gantt(point: dict, path: str) -> None:
    """Draw auto's frame of median latency in ``point``'s first repeat into ``path``, and print auto's per-step
    time split over every repeat (deepco.timelines)."""
    frames = [t for t in point["runs"][0]["algorithms"]["auto"].get("timelines", []) if t.get("servers")]
    if not frames:
        print("bench: --gantt: auto's plan ran no server steps (a local plan): no chart", flush=True)
        return
    median = statistics.median_low(t["latency"] for t in frames)
    frame = next(t for t in frames if t["latency"] == median)
    gantt(frame, path, f"auto, {point['model']} {point['input_size']}, the frame of median latency: "
                       f"{median * 1e3:.1f} ms (EMULATED network)")
    split = step_split({"staged": t} for r in point["runs"] for t in r["algorithms"]["auto"].get("timelines", []))
    print("auto's step split: " + split_text(split), flush=True)


def _document(args: argparse.Namespace, points: list[dict], started: float) -> dict:
    """The JSON document of the points measured so far."""
    key = {"bandwidth": "bandwidth_mbps", "capacity": "capacity_scale", "antennas": "antennas",
           "servers": "servers"}.get(args.sweep or "")
    return {"command": "deepco bench " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 else "deepco bench",
            "preset": args.preset,
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
            "emulated": "EMULATED: network namespaces + tc tbf per antenna, cgroup CPU quotas (see label)",
            "seconds": time.perf_counter() - started, "sweep": args.sweep, "sweep_key": key, "points": points}


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (or a sweep), each point ``--repeat`` times, and report."""
    resolve(args)
    if args.frames <= 0 or args.servers <= 0 or args.antennas <= 0 or args.bandwidth <= 0 or args.repeat <= 0:
        raise UserError("--frames, --servers, --antennas, --bandwidth and --repeat must be positive")
    if args.live_frames < 0 or args.slo_factor < 0 or args.live_depth < 0:
        raise UserError("--live-frames, --live-depth and --slo-factor must be >= 0")
    if (args.live_frames or args.slo_factor) and "auto" not in args.algorithms.split(","):
        raise UserError("--live-frames and --slo-factor run auto's plan: put auto in --algorithms")
    if args.gantt and "auto" not in args.algorithms.split(","):
        raise UserError("--gantt draws auto's frame: put auto in --algorithms")
    if args.depth < 2 and args.fps_frames > 0:
        raise UserError("--depth must be at least 2: the throughput run pipelines frames")
    modelcard.from_args(args.model, args)  # a bad preprocessing flag or card fails before any testbed is built
    parse_size(args.input_size)  # and so does a bad size, which the device process would only refuse later
    if args.scenario is not None:
        return _scenario(args)
    started = time.perf_counter()
    values: list = [None] if args.sweep is None else SWEEPS[args.sweep]
    points = []
    with tempfile.TemporaryDirectory(prefix="deepco-bench-") as tmp:
        for value in values:
            servers, antennas, bandwidth, scale = args.servers, args.antennas, args.bandwidth, 1.0
            if args.sweep == "bandwidth":
                bandwidth = value
            elif args.sweep == "capacity":
                scale = value
            elif args.sweep == "antennas":
                antennas = value
            elif args.sweep == "servers":
                servers = value
            runs = []
            for k in range(args.repeat):
                print(f"point {len(points) + 1}/{len(values)}, repeat {k + 1}/{args.repeat}", flush=True)
                run_point = one_point(args, servers, antennas, bandwidth, scale, Path(tmp))
                run_point["capacity_scale"] = scale
                runs.append(run_point)
                if args.json:  # after every repeat: an interrupted run keeps what it measured ("repeats" says)
                    partial = _document(args, [*points, aggregate(runs)], started)
                    Path(args.json).write_text(json.dumps(partial, indent=2))
            point = aggregate(runs)
            points.append(point)
            print(table(point), flush=True)
    document = _document(args, points, started)
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=2))
    if args.plot:
        plot(document, args.plot)
    if args.gantt:
        auto_gantt(points[0], args.gantt)
    print(f"bench: {len(points)} point(s) x {args.repeat} repeat(s) in {document['seconds']:.0f} s", flush=True)
    bad = [v for p in points for v in violations(p)]
    return 3 if bad else 0


def _scenario(args: argparse.Namespace) -> int:
    """`--scenario`: run it (deepco_bench.scenarios), print its report, write JSON and a plot if asked."""
    from deepco_bench import scenarios

    if args.phase_frames < 2 * scenarios.ADAPTED_WINDOW:
        raise UserError(f"--phase-frames must be at least {2 * scenarios.ADAPTED_WINDOW}, got {args.phase_frames}")
    if args.static_frames < 0:
        raise UserError(f"--static-frames must be 0 or more, got {args.static_frames}")
    if args.keep is not None:
        keep = Path(args.keep)
        if keep.exists() and (not keep.is_dir() or any(keep.iterdir())):
            raise UserError(f"--keep {args.keep}: not a new or empty folder")
        keep.mkdir(parents=True, exist_ok=True)
        result = scenarios.run_repeats(args, keep)
    else:
        with tempfile.TemporaryDirectory(prefix="deepco-scenario-") as tmp:
            result = scenarios.run_repeats(args, Path(tmp))
    print(scenarios.report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        scenarios.plot(result, args.plot)
    return 0 if result["median"]["lost"] == 0 and result["median"]["in_order"] else 1
