"""`deepco bench --scenario NAME`: the emulated network changes in the middle of a run of `auto`, and the
report says how each phase went and how soon the run adapted.

Scenarios: ``bandwidth-drop`` (every antenna to a tenth of its rate) and ``server-slowdown`` (the server that
carried the most work in the first phase cut to a quarter of its CPU share). One run of `deepco run
--algorithm auto` (live adaptation on) streams ``2 x --phase-frames`` frames of a clip in the testbed's
device namespace, one in flight; once the first phase's frames are logged the change is applied; then a
fresh `deepco run --algorithm auto` (a new setup and calibration under the new conditions) gives the
reference p50. Per phase: p50 and p95, frames lost (missing, failed or out of order), every output's error
against the whole model; and the frames until adapted: the first frame after the change from which the p50
of every 10 consecutive frames stays within 15% of the fresh setup's p50. Static plans per phase are not
measured here (`deepco bench` without a scenario measures them under fixed conditions).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from deepco.errors import UserError
from deepco.plots import save_figure
from deepco_bench.testbed import ServerSpec, Testbed, TestbedSpec
from deepco_bench.testbed_servers import shares_for, start_servers

SCENARIOS = ("bandwidth-drop", "server-slowdown")
ADAPTED_WINDOW = 10  # frames whose p50 must stay ...
ADAPTED_WITHIN = 0.15  # ... within 15% of the fresh setup's p50
PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"


def frames_until_adapted(latencies: list[float], fresh_p50: float) -> int | None:
    """Frames after the change (``latencies``: the second phase's, in order) before the first one from which
    every ``ADAPTED_WINDOW`` consecutive frames have a p50 within ``ADAPTED_WITHIN`` of ``fresh_p50`` (None:
    never within the phase)."""
    n = len(latencies)
    ok = [abs(statistics.median(latencies[i:i + ADAPTED_WINDOW]) / fresh_p50 - 1) <= ADAPTED_WITHIN
          for i in range(n - ADAPTED_WINDOW + 1)]
    for start in range(len(ok)):
        if all(ok[start:]):
            return start
    return None


def _run_argv(args: argparse.Namespace, cluster: Path, source: Path, frames: int, log: Path) -> list[str]:
    return [sys.executable, "-m", "deepco", "run", "--cluster", str(cluster), "--model", args.model,
            "--input-size", args.input_size, "--source", str(source), "--frames", str(frames), "--algorithm",
            "auto", "--depth", "1", "--json-log", str(log), "--save-outputs", str(log.with_suffix(".npz"))]


def _logged(log: Path) -> list[dict]:
    """The frames' lines of a run's JSON log (not its servers' down and up events)."""
    if not log.exists():
        return []
    return [r for x in log.read_text().splitlines() if x.endswith("}") and "frame" in (r := json.loads(x))]


def _change(tb: Testbed, scenario: str, records: list[dict], shares: list[float]) -> str:
    """Apply ``scenario``'s change; what was changed, in words."""
    if scenario == "bandwidth-drop":
        mbps = tb.spec.antenna_mbps[0] / 10
        tb.set_antennas(mbps)
        return f"every antenna to {mbps:g} Mbit/s"
    work: dict[str, float] = {}
    for record in records:
        for s in record["servers"]:
            work[s["name"]] = work.get(s["name"], 0.0) + s["compute"]
    if not work:
        raise UserError("server-slowdown: auto ran no frame on a server in the first phase; nothing to slow down")
    name = max(work, key=work.get)
    k = [s.name for s in tb.spec.servers].index(name)
    tb.set_server_cpu(k, shares[k] / 4)
    return f"server {name} (most work) to {shares[k] / 4:g} of a core"


def frame_errors(log: Path, model: str, size: str) -> list[float]:
    """Each saved frame's relative error against the whole model (ONNX Runtime) on its saved input: the worst
    of its outputs, each judged on its own scale (a detector's heads); NaN for a failed frame."""
    import onnxruntime as ort
    from deepco_device.answers import relative_error
    from deepco_device.run_report import saved_key

    from deepco.parsing import parse_size
    from deepco.partition import load_model

    saved = np.load(log.with_suffix(".npz"))
    height, width = parse_size(size)
    session = ort.InferenceSession(load_model(model, height, width).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    name, names = session.get_inputs()[0].name, [o.name for o in session.get_outputs()]
    out = []
    for i, x in enumerate(saved["inputs"]):
        got = {n: saved[saved_key(n, len(names))][i:i + 1] for n in names}
        want = dict(zip(names, session.run(None, {name: x[None].astype(np.float32)}), strict=True))
        failed = any(np.isnan(v).any() for v in got.values())
        out.append(float("nan") if failed else relative_error(got, want))
    return out


def _phase(records: list[dict]) -> dict:
    latencies = [r["latency"] for r in records if r["error"] is None]
    p50, p95 = np.percentile(latencies, [50, 95]) if latencies else (float("nan"), float("nan"))
    return {"frames": len(records), "failed": sum(r["error"] is not None for r in records), "p50": float(p50),
            "p95": float(p95)}


def run_scenario(args: argparse.Namespace, workdir: Path) -> dict:
    """One scenario on a fresh testbed (see the module doc): its report as a dict."""
    from deepco_device.sources import make_pan_zoom_clip

    phase = args.phase_frames
    shares = shares_for(args, args.servers)
    spec = TestbedSpec(antenna_mbps=(args.bandwidth,) * args.antennas,
                       servers=tuple(ServerSpec(f"s{k}", cpu) for k, cpu in enumerate(shares)),
                       device_cpu=args.device_share)
    clip = make_pan_zoom_clip(PHOTO, workdir / "clip.avi", frames=2 * phase)
    if not args.model.endswith(".onnx"):  # a zoo model, exported here at full speed: the device loads it under
        model = workdir / "model.onnx"      # its CPU share
        subprocess.run([sys.executable, "-m", "deepco", "export", "--model", args.model, "--input-size",
                        args.input_size, "--output", str(model)], check=True, capture_output=True)
        args = argparse.Namespace(**{**vars(args), "model": str(model)})
    with Testbed(spec, defer_cpu_limits=True) as tb:
        if not tb.kernel:
            raise UserError(f"--scenario needs the kernel emulation (tc, network namespaces): {tb.reason}")
        print(tb.label, flush=True)
        cluster, _ = start_servers(tb, workdir, "scenario")
        tb.apply_device_cpu_limit()
        log = workdir / "scenario.jsonl"
        with (workdir / "run.out").open("w") as printed:  # a file, not a pipe: nothing blocks the run's prints
            proc = tb.spawn(_run_argv(args, cluster, clip, 2 * phase, log), stdout=printed, stderr=subprocess.STDOUT)
            while len(_logged(log)) < phase and proc.poll() is None:
                time.sleep(0.05)  # orchestration, not a test: the run goes at its own pace
            before = _logged(log)
            changed = _change(tb, args.scenario, before, shares)
            split = len(before)  # the frames logged before the change (the log is written frame by frame)
            print(f"after frame {split - 1}: {changed}", flush=True)
            proc.wait(timeout=args.timeout)
        out = (workdir / "run.out").read_text()
        if proc.returncode != 0:
            raise UserError(f"the scenario's run failed (exit {proc.returncode}): {out.strip()[-400:]}")
        fresh_log = workdir / "fresh.jsonl"
        fresh = tb.spawn(_run_argv(args, cluster, clip, 20, fresh_log), stdout=subprocess.DEVNULL)
        fresh.wait(timeout=args.timeout)
    records = _logged(log)
    switches = _switch_frames(out)
    fresh_p50 = statistics.median(r["latency"] for r in _logged(fresh_log)[5:])
    after = [r["latency"] for r in records[split:] if r["error"] is None]
    errors = frame_errors(log, args.model, args.input_size)
    return {"scenario": args.scenario, "change": changed, "label": tb.label, "phase_frames": phase,
            "changed_after": split, "before": _phase(records[:split]), "after": _phase(records[split:]),
            "fresh_p50": fresh_p50,
            "frames_until_adapted": frames_until_adapted(after, fresh_p50),
            "lost": 2 * phase - len(records) + sum(r["error"] is not None for r in records),
            "in_order": [r["frame"] for r in records] == list(range(len(records))),
            "max_relative_error": max(errors, default=float("nan")), "switches": switches,
            "latencies": [r["latency"] for r in records]}


def _switch_frames(out: str) -> list[dict]:
    """The run's switch lines, each with the last frame reported before it."""
    last, found = -1, []
    for line in out.splitlines():
        if line.startswith("frame ") and ":" in line:
            last = int(line.split()[1].rstrip(":"))
        elif line.startswith("switch: "):
            found.append({"after_frame": last, "line": line})
    return found


def report(result: dict) -> str:
    """The scenario's report, in lines."""
    lines = [result["label"], f"scenario {result['scenario']}: after {result['changed_after']} frames, "
             f"{result['change']}"]
    for name in ("before", "after"):
        p = result[name]
        lines.append(f"{name:<7} auto p50 {p['p50'] * 1e3:8.1f} ms  p95 {p['p95'] * 1e3:8.1f} ms  "
                     f"({p['frames']} frames, {p['failed']} failed)")
    adapted = result["frames_until_adapted"]
    lines += [f"fresh setup under the new conditions: p50 {result['fresh_p50'] * 1e3:.1f} ms",
              f"frames until adapted: {adapted if adapted is not None else 'not within the phase'}",
              f"frames lost: {result['lost']}; in order: {result['in_order']}; max relative error "
              f"{result['max_relative_error']:.1e}"]
    lines += [f"  after frame {s['after_frame']}: {s['line']}" for s in result["switches"]]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Latency per frame, the change and the switches marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot([v * 1e3 for v in result["latencies"]], marker=".", label="auto")
    ax.axvline(result["changed_after"] - 0.5, color="red", linestyle="--", label=result["change"])
    for k, s in enumerate(result["switches"]):
        ax.axvline(s["after_frame"] + 0.5, color="green", linestyle=":", label="switch" if k == 0 else None)
    ax.axhline(result["fresh_p50"] * 1e3, color="black", linewidth=0.8, label="fresh setup p50 after the change")
    ax.set_xlabel("frame")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"scenario {result['scenario']} on an EMULATED edge network")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
