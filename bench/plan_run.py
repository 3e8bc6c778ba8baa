"""One or more fixed plans run side by side on an emulated testbed: what a plan costs, apart from which plan the
planner would choose (the bench's repeats each calibrate and may choose different plans, so they cannot compare
two plans, or one plan before and after a change in the runtime).

Builds the preset's testbed (network namespaces, tc-shaped antennas, cgroup CPU quotas: EMULATED), starts the
servers, then runs each plan with `deepco run --plan` in the device's namespace, alternating the plans round after
round in the same testbed. The device's CPU quota applies once its run is set up (its models loaded), as
`deepco bench` applies it before it measures. Each run's JSON log (one line per frame: every server's phases)
is kept in --workdir for `bench/step_split.py`; the table has, per run, the p50 over the frames after the
first --skip, when each server's window was in (median), when its first level's compute ended, and the median
step overhead less halo (deepco.timelines).

    python bench/plan_run.py PLAN.json [PLAN2.json ...] [--preset camera] [--frames 14] [--rounds 2]
    python bench/plan_run.py bench/results/bench/camera-720x1280-5ce18a1.json@1   # repeat 1's auto plan

A plan file is what `deepco run --save-plan` / `deepco plan --save` write; FILE.json@K takes the plan `auto` ran
in repeat K of a `deepco bench --json` document (and @K:whole the same plan with its windows sent whole).
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
import threading
import time
from pathlib import Path

import matplotlib
from deepco_bench.bench_command import PRESETS, testbed_spec
from deepco_bench.testbed import DEFAULT_MTU, Testbed
from deepco_bench.testbed_servers import start_servers

from deepco.errors import UserError
from deepco.planning.staged import StagedPlan, unstreamed
from deepco.timelines import step_split

MACHINE = f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}"  # as deepco bench
PHOTO = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"  # the bench's input


def plan_file(spec: str, workdir: Path, k: int) -> tuple[Path, str]:
    """A plan file `deepco run --plan` reads, from a plan file or FILE.json@K[:whole]; (path, its label)."""
    if "@" not in spec:
        try:
            json.loads(Path(spec).read_text())["plan"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{spec}: not a plan file (deepco run --save-plan writes one): {exc}") from None
        return Path(spec), spec
    path, _, which = spec.rpartition("@")
    repeat, _, variant = which.partition(":")
    try:
        document = json.loads(Path(path).read_text())
        point = document["points"][0]
        run = point["runs"][int(repeat) - 1]
        plan = StagedPlan.from_dict(run["algorithms"]["auto"]["plan"])
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise UserError(f"{spec}: no auto plan of repeat {repeat} in a deepco bench document ({exc})") from None
    if variant == "whole":
        plan = unstreamed(plan)
    elif variant:
        raise UserError(f"{spec}: after @K only ':whole' is known, got {variant!r}")
    height, width = (int(x) for x in point["input_size"].split("x"))
    out = workdir / f"plan-{k}.json"
    out.write_text(json.dumps({"model": point["model"], "input_size": [height, width], "plan": plan.to_dict()}))
    return out, f"{Path(path).name}@{which}"


def one_run(tb: Testbed, cluster: Path, plan: Path, log: Path, args: argparse.Namespace) -> dict:
    """`deepco run --plan` in the device's namespace; the quota applied once the run prints its plan line."""
    argv = [sys.executable, "-m", "deepco", "run", "--cluster", str(cluster), "--model", args.model,
            "--input-size", args.input_size, "--source", str(args.source), "--frames", str(args.frames),
            "--plan", str(plan), "--json-log", str(log), "--no-plan-cache", "--quiet", "--depth", "1"]
    proc = tb.spawn(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("plan:") and tb.kernel:
                tb.apply_device_cpu_limit()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise UserError(f"{plan}: no result within --timeout {args.timeout:g} s") from None
    reader.join(10)
    tb.lift_device_cpu_limit()  # the next run sets up as this one did, before its quota applies
    if code != 0:
        raise UserError(f"deepco run --plan {plan} failed (exit {code}): " + " | ".join(lines[-3:]))
    return summary([json.loads(x) for x in log.read_text().splitlines() if x.strip()], args.skip)


def summary(records: list[dict], skip: int) -> dict:
    """A run's figures from its JSON log lines (the first ``skip`` frames left out): latency p50 and mean,
    per server the median time its window was in and its first level's compute ended (ms from the frame's
    start, on the device's clock), and the steps' median overhead less halo (deepco.timelines.step_split)."""
    frames = [r for r in records if r.get("staged") and not r.get("error")][skip:]
    if not frames:
        raise UserError("no frame with server timelines after the skipped ones: give more --frames")
    latency = [r["staged"]["latency"] for r in frames]
    arrived: dict[str, list[float]] = {}
    first_level: dict[str, list[float]] = {}
    for r in frames:
        for s in r["staged"]["servers"]:
            arrived.setdefault(s["name"], []).append(s["received"])
            computes = [p for p in s["times"].get("phases", []) if p["phase"] == "compute" and p["level"] == 1]
            if computes:
                first_level.setdefault(s["name"], []).append(s["origin"] + computes[-1]["end"])
    ms = {k: {name: round(statistics.median(v) * 1e3, 1) for name, v in d.items()}
          for k, d in (("window_in_ms", arrived), ("first_level_end_ms", first_level))}
    overhead = step_split(frames)["segment"]["overhead_less_halo"]
    return {"frames": len(frames), "p50_ms": round(statistics.median(latency) * 1e3, 1),
            "mean_ms": round(statistics.mean(latency) * 1e3, 1), **ms,
            "step_overhead_less_halo_ms": None if overhead is None else round(overhead * 1e3, 2),
            "failed": sum(1 for r in records if r.get("error"))}


def main(argv: list[str] | None = None) -> int:
    """Run the plans round after round; print one line per run and the medians per plan; write --json."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plans", nargs="+", help="plan files, or BENCH.json@K[:whole] (repeat K's auto plan)")
    p.add_argument("--preset", choices=list(PRESETS), default="camera", help="the testbed (default camera)")
    p.add_argument("--model", help="zoo name (default: the plans' model, else the preset's)")
    p.add_argument("--input-size", help="HxW (default: the plans', else the preset's)")
    p.add_argument("--frames", type=int, default=14, help="frames per run (default 14)")
    p.add_argument("--mtu", type=int, default=DEFAULT_MTU, help=f"the testbed links' MTU (default {DEFAULT_MTU})")
    p.add_argument("--skip", type=int, default=2, help="first frames of a run left out of its figures (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each plan, alternating (default 2)")
    p.add_argument("--source", default=str(PHOTO), help="the image or video the device runs (default: the "
                   "bench's photo)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take (default 900)")
    p.add_argument("--workdir", help="where the logs go (default: a new temporary folder)")
    p.add_argument("--json", metavar="FILE", help="write every run's figures here")
    args = p.parse_args(argv)
    if args.frames <= args.skip or args.skip < 0 or args.rounds < 1:
        p.error("--frames must exceed --skip (at least 0), and --rounds be at least 1")
    try:
        return _run(args)
    except UserError as exc:
        print(f"plan_run: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="deepco-plan-run-"))
    workdir.mkdir(parents=True, exist_ok=True)
    plans = [plan_file(spec, workdir, k) for k, spec in enumerate(args.plans)]
    first = json.loads(plans[0][0].read_text())
    preset = PRESETS[args.preset]
    args.model = args.model or first.get("model") or preset["model"]
    size = first.get("input_size")
    args.input_size = args.input_size or (f"{size[0]}x{size[1]}" if size and None not in size
                                          else preset["input_size"])
    if not isinstance(preset["device_share"], float):
        raise UserError(f"preset {args.preset}: its camera's share is measured by deepco bench; use another preset")
    spec = testbed_spec([float(x) for x in preset["shares"].split(",")], preset["antennas"], preset["bandwidth"],
                        preset["device_share"], preset["peer_bandwidth"], args.mtu)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs = []
    with Testbed(spec, defer_cpu_limits=True) as tb:
        if not tb.kernel:  # app-level pacing instead of tc and quotas: not the testbed the bench measures on
            raise UserError(f"plan_run needs the kernel testbed (root, ip and tc); here: {tb.label}")
        print(f"{tb.label}\n{args.model} {args.input_size}, {args.frames} frames a run (first {args.skip} left "
              f"out), {args.rounds} round(s); {MACHINE}, {started}", flush=True)
        cluster, _ = start_servers(tb, workdir, "plans")
        for r in range(args.rounds):
            order = plans if r % 2 == 0 else plans[::-1]  # neither plan always runs first
            for path, label in order:
                log = workdir / f"run-{len(runs)}.jsonl"
                figures = one_run(tb, cluster, path, log, args)
                runs.append({"plan": label, "round": r + 1, "log": str(log), **figures})
                failed = f", {figures['failed']} frame(s) FAILED" if figures["failed"] else ""
                print(f"round {r + 1} {label}: p50 {figures['p50_ms']} ms (mean {figures['mean_ms']}{failed}), "
                      f"windows in {figures['window_in_ms']}, first level ends {figures['first_level_end_ms']}, "
                      f"step overhead less halo {figures['step_overhead_less_halo_ms']} ms", flush=True)
    for _, label in plans:
        p50s = [x["p50_ms"] for x in runs if x["plan"] == label]
        print(f"{label}: p50 median over rounds {statistics.median(p50s):.1f} ms ({', '.join(map(str, p50s))}) "
              "(EMULATED)")
    if args.json:
        document = {"label": tb.label, "started": started, "machine": MACHINE, "command": sys.argv,
                    "model": args.model, "input_size": args.input_size, "runs": runs}
        Path(args.json).write_text(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
