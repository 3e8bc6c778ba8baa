"""Benchmarks of `deepco.scheduling`: policy ranking on real traces and the seeds' synthetic workloads,
the ratio of each policy to the MILP lower bound on small instances, and simulation speed at scale.

    .venv/bin/python bench/schedule_bench.py ranking [--servers 100] [--jobs 1000] [--seed 0] [--json F]
    .venv/bin/python bench/schedule_bench.py ratio [--instances 20] [--seed 0] [--json F]
    .venv/bin/python bench/schedule_bench.py scale [--jobs 10000] [--servers 1000] [--policies ...]

Every run prints Markdown tables (the figures of bench/results/scheduling.md come from them) and, with
--json, the raw numbers. The cluster is built from the Alibaba GPU 2023 node list (W_s = GPUs, P_s = CPU
cores, as She et al. set it) plus one unbounded cloud, with the seeds' upload delays (edge [1, 4] slots,
cloud [10, 40]).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from tqdm import tqdm

from deepco.scheduling import POLICIES, Job, SimCluster, Simulator, bind_delays, make_policy
from deepco.scheduling.lower_bound import lower_bound
from deepco.scheduling.synthetic import synthetic_jobs
from deepco.scheduling.traces import alibaba_cluster, load_trace

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
NODES = TRACES / "alibaba-gpu-2023" / "openb_node_list_gpu_node.csv"
BASELINES = ("fifo", "drf", "srtf", "tiresias-l", "batchsche")


def machine() -> str:
    return f"{platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}"


def cluster(servers: int) -> SimCluster:
    return SimCluster.from_cluster(alibaba_cluster(NODES, servers=servers, typed=False))


def workloads(jobs: int, seed: int) -> dict[str, list[Job]]:
    """The traces of the issue and both seeds' synthetic workloads (arrivals over about 2 x jobs slots)."""
    return {
        "gavel-philly 0e4a51": load_trace(TRACES / "gavel-philly" / "0e4a51.trace", "gavel", seed=seed,
                                          jobs=jobs),
        "alibaba-gpu-2023 pods": load_trace(TRACES / "alibaba-gpu-2023" / "openb_pod_list_default.csv",
                                            "alibaba", seed=seed, jobs=jobs),
        "synthetic (She et al.)": synthetic_jobs(jobs, seed=seed, preset="she", horizon=3 * jobs),
        "synthetic (Wang et al.)": synthetic_jobs(jobs, seed=seed, preset="wang", horizon=3 * jobs),
    }


def run_policy(cl: SimCluster, jobs: list[Job], name: str, seed: int, gang: str = "demand") -> dict:
    t0 = time.perf_counter()
    r = Simulator(cl, copy.deepcopy(jobs), make_policy(name, seed, gang)).run()
    return {**r.to_dict(), "wall_seconds": time.perf_counter() - t0, "gang": gang}


def ranking(args: argparse.Namespace) -> dict:
    cl = cluster(args.servers)
    out: dict[str, list[dict]] = {}
    loads = workloads(args.jobs, args.seed)
    runs = [(w, p, "demand") for w in loads for p in POLICIES]
    runs += [(w, p, "chunks") for w in loads for p in BASELINES]
    bar = tqdm(runs, desc="ranking", unit="run", file=sys.stderr)
    for w, p, gang in bar:
        bar.set_postfix_str(f"{w[:12]} {p} {gang}")
        jobs = loads[w]
        bind_delays(jobs, cl, seed=args.seed)
        out.setdefault(w, []).append(run_policy(cl, jobs, p, args.seed, gang))
    for w, rows in out.items():
        srtf = next(r for r in rows if r["policy"] == "srtf" and r["gang"] == "demand")
        print(f"\n### {w}: {len(loads[w])} jobs, {args.servers} edge servers "
              f"({cl.edge_worker_capacity()} worker slots) + cloud\n")
        print("| policy | baseline gang | avg JCT (slots) | JCT rate vs SRTF | makespan | preemptions | "
              "edge utilisation | jobs on cloud | wall s |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            gang = r["gang"] if r["policy"] in BASELINES else "-"
            rate = r["total_jct"] / srtf["total_jct"]
            print(f"| {r['policy']} | {gang} | {r['avg_jct']:.1f} | {rate:.3f} | "
                  f"{r['makespan']} | {r['preemptions']} | {r['utilization']:.2f} | {r['cloud_jobs']} | "
                  f"{r['wall_seconds']:.1f} |")
    return out


def small_instance(rng: np.random.Generator, n_jobs: int) -> tuple[SimCluster, list[Job]]:
    from deepco.cluster import parse_cluster

    servers = [{"name": f"e{i}", "capacity": 1.0, "site": "edge", "worker_slots": int(rng.integers(1, 4)),
                "ps_slots": 1} for i in range(int(rng.integers(2, 4)))]
    servers.append({"name": "cloud", "capacity": 1.0, "site": "cloud"})
    data = {"device": {"antennas": 1, "bandwidth": 1.0}, "servers": servers,
            "sites": [{"name": "edge", "upload_delay": 1, "upload_delay_max": 2},
                      {"name": "cloud", "kind": "cloud", "upload_delay": 4, "upload_delay_max": 8}]}
    cl = SimCluster.from_cluster(parse_cluster(data))
    jobs = [Job(id=i, arrival=int(rng.integers(0, 8)), chunks=int(rng.integers(1, 5)),
                minibatches=int(rng.integers(2, 6)), epochs=int(rng.integers(1, 4)),
                worker_time=float(rng.uniform(0.3, 0.6)), ps_time=float(rng.uniform(0.01, 0.1)),
                grad_size=float(rng.uniform(0.5, 2.0)), bandwidth=float(rng.uniform(5.0, 20.0)),
                demand=1) for i in range(n_jobs)]
    for j in jobs:
        j.demand = int(rng.integers(1, j.chunks + 1))
    bind_delays(jobs, cl, seed=int(rng.integers(1 << 30)))
    return cl, jobs


def ratio(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    ratios: dict[str, list[float]] = {p: [] for p in POLICIES}
    bounds = []
    for _ in tqdm(range(args.instances), desc="ratio", unit="instance", file=sys.stderr):
        cl, jobs = small_instance(rng, int(rng.integers(4, 8)))
        totals = {p: Simulator(cl, copy.deepcopy(jobs), make_policy(p, args.seed)).run().total_jct
                  for p in POLICIES}
        t0 = time.perf_counter()
        lb = lower_bound(cl, jobs, upper=min(totals.values()), time_limit=120)
        bounds.append({"jobs": len(jobs), "lower_bound": lb.total_jct, "status": lb.status,
                       "variables": lb.variables, "seconds": time.perf_counter() - t0, "totals": totals})
        for p, v in totals.items():
            ratios[p].append(v / lb.total_jct)
    print(f"\n### Ratio to the MILP lower bound: {args.instances} random instances, 4-7 jobs, "
          "2-3 edge servers + cloud\n")
    print("| policy | mean ratio | median | max |")
    print("|---|---:|---:|---:|")
    for p, rs in ratios.items():
        print(f"| {p} | {statistics.mean(rs):.3f} | {statistics.median(rs):.3f} | {max(rs):.3f} |")
    solve = [b["seconds"] for b in bounds]
    print(f"\nHiGHS solve time per instance: median {statistics.median(solve):.2f} s, "
          f"max {max(solve):.2f} s; "
          f"all optimal: {all('Optimal' in b['status'] for b in bounds)}")
    return {"ratios": ratios, "instances": bounds}


def scale(args: argparse.Namespace) -> dict:
    cl = cluster(args.servers)
    jobs = synthetic_jobs(args.jobs, seed=args.seed, preset="she", horizon=args.horizon)
    bind_delays(jobs, cl, seed=args.seed)
    rows = []
    print(f"\n### Scale: {args.jobs} jobs (She et al. ranges, arrivals in [1, {int(args.horizon / 1.5)}]), "
          f"{args.servers} edge servers ({cl.edge_worker_capacity()} worker slots) + cloud\n")
    print("| policy | wall s | simulated slots | avg JCT | preemptions | jobs on cloud |")
    print("|---|---:|---:|---:|---:|---:|")
    for p in args.policies.split(","):
        t0 = time.perf_counter()
        with tqdm(total=len(jobs), desc=p, unit="job", file=sys.stderr) as bar:
            r = Simulator(cl, copy.deepcopy(jobs), make_policy(p, args.seed), progress=bar).run()
        wall = time.perf_counter() - t0
        rows.append({**r.to_dict(), "wall_seconds": wall, "slots": r.slots})
        print(f"| {p} | {wall:.1f} | {r.slots} | {r.avg_jct:.1f} | {r.preemptions} | "
              f"{rows[-1]['cloud_jobs']} |", flush=True)
    return {"rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("ranking")
    r.add_argument("--servers", type=int, default=100)
    r.add_argument("--jobs", type=int, default=1000)
    q = sub.add_parser("ratio")
    q.add_argument("--instances", type=int, default=20)
    s = sub.add_parser("scale")
    s.add_argument("--jobs", type=int, default=10_000)
    s.add_argument("--servers", type=int, default=1000)
    s.add_argument("--horizon", type=int, default=6000)
    s.add_argument("--policies", default=",".join(POLICIES))
    for p in (r, q, s):
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    print(f"_{' '.join(sys.argv)}; {machine()}; {datetime.now(UTC):%Y-%m-%d %H:%M} UTC_")
    result = {"ranking": ranking, "ratio": ratio, "scale": scale}[args.what](args)
    if args.json:
        record = {"command": sys.argv, "machine": machine(), **result}
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
