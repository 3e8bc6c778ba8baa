"""Okita (Han et al.) against FIFO, DRF and OASiS in Okita's setting, and the performance ratio to the exact
optimum on small instances.

    .venv/bin/python bench/okita_bench.py synthetic [--seeds 3] [--kinds sigmoid linear piecewise]
    .venv/bin/python bench/okita_bench.py trace [--seeds 3]
    .venv/bin/python bench/okita_bench.py ratio [--instances 20]

Prints Markdown tables (bench/results/okita-deep-edge.md is made of them) and writes --json if given.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

from deepco.scheduling.okita import Oasis, Okita, UdlDrf, UdlFifo, run_udl
from deepco.scheduling.okita.optimum import optimum, small_instance
from deepco.scheduling.okita.workloads import synthetic, trace_driven

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
TRACE_FILES = {"gavel-philly 0e4a51": (TRACES / "gavel-philly" / "0e4a51.trace", "gavel"),
               "alibaba-gpu-2023 pods": (TRACES / "alibaba-gpu-2023" / "openb_pod_list_default.csv", "alibaba")}


def policies(seed: int) -> list:
    return [Okita(), UdlFifo(seed=seed), UdlDrf(seed=seed), Oasis()]


def header(cmd: str) -> str:
    return (f"`{cmd}` ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
            f"{platform.python_version()}, 2-core sandbox)")


def table(rows: list[dict]) -> str:
    out = ["| setup | policy | total cost (mean over seeds) | vs okita | bandwidth cost | latency cost | "
           "avg latency (slots) | makespan | wall s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for setup in dict.fromkeys(r["setup"] for r in rows):
        rs = [r for r in rows if r["setup"] == setup]
        base = statistics.mean(r["total_cost"] for r in rs if r["policy"] == "okita")
        for pol in dict.fromkeys(r["policy"] for r in rs):
            p = [r for r in rs if r["policy"] == pol]
            m = {k: statistics.mean(float(x[k]) for x in p) for k in
                 ("total_cost", "bandwidth_cost", "latency_cost", "avg_jct", "makespan", "wall_seconds")}
            out.append(f"| {setup} | {pol} | {m['total_cost']:.4g} | {m['total_cost'] / base:.3g} | "
                       f"{m['bandwidth_cost']:.4g} | {m['latency_cost']:.4g} | {m['avg_jct']:.2f} | "
                       f"{m['makespan']:.1f} | {m['wall_seconds']:.1f} |")
    return "\n".join(out)


def run_all(setup: str, inst, seed: int) -> list[dict]:
    rows = []
    for p in policies(seed):
        t0 = time.perf_counter()
        r = run_udl(inst, p)
        rows.append({"setup": setup, "seed": seed, **r.to_dict(), "wall_seconds": time.perf_counter() - t0})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("synthetic", "trace", "ratio"))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--kinds", nargs="+", default=["sigmoid", "linear", "piecewise"])
    ap.add_argument("--instances", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows: list[dict] = []
    if a.what == "synthetic":
        for kind in a.kinds:
            for seed in range(a.seeds):
                rows += run_all(f"R=50, I=100, T=150, f={kind}", synthetic(50, 100, 150, seed=seed, kind=kind), seed)
        print(header(f"bench/okita_bench.py synthetic --seeds {a.seeds}"))
        print(table(rows))
    elif a.what == "trace":
        for name, (path, fmt) in TRACE_FILES.items():
            for seed in range(a.seeds):
                inst = trace_driven(path, fmt, sites=50, jobs=100, seed=seed, slot_seconds=1800.0)
                rows += run_all(f"{name} (first 100 jobs, 30-min slots), R=50", inst, seed)
        print(header(f"bench/okita_bench.py trace --seeds {a.seeds}"))
        print(table(rows))
    else:
        ratios: dict[str, list[float]] = {}
        solved = 0
        for seed in range(a.instances):
            inst = small_instance(seed)
            t0 = time.perf_counter()
            opt = optimum(inst, horizon=10, time_limit=120)
            dt = time.perf_counter() - t0
            if opt is None:
                print(f"instance {seed}: MILP not solved in time, skipped")
                continue
            solved += 1
            for p in policies(seed):
                r = run_udl(inst, p)
                ratios.setdefault(p.name, []).append(r.total_cost / opt)
                rows.append({"instance": seed, "policy": p.name, "cost": r.total_cost, "optimum": opt,
                             "completion": max(j.completion for j in r.jobs), "milp_seconds": dt})
        print(header(f"bench/okita_bench.py ratio --instances {a.instances}"))
        print(f"{solved} instances solved to optimality (3 sites, 4 jobs, horizon 10 slots)\n")
        print("| policy | mean ratio | median | max | instances with ratio < 1.8 |\n|---|---:|---:|---:|---:|")
        for name, rs in ratios.items():
            print(f"| {name} | {statistics.mean(rs):.3f} | {statistics.median(rs):.3f} | {max(rs):.3f} | "
                  f"{sum(x < 1.8 for x in rs)}/{len(rs)} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
