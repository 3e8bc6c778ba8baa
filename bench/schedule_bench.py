"""Benchmarks of `deepco.scheduling`: policy ranking on real traces and the seeds' synthetic workloads,
the ratio of each policy to the MILP lower bound on small instances, and simulation speed at scale.

    .venv/bin/python bench/schedule_bench.py ranking [--servers 100] [--jobs 1000] [--seed 0] [--json F]
    .venv/bin/python bench/schedule_bench.py she [--jobs 200] [--seed 0] [--json F]
    .venv/bin/python bench/schedule_bench.py ablation [--servers 100] [--jobs 1000] [--seed 0] [--json F]
    .venv/bin/python bench/schedule_bench.py ratio [--instances 20] [--seed 0] [--json F]
    .venv/bin/python bench/schedule_bench.py scale [--jobs 10000] [--servers 1000] [--policies ...]

Every run prints Markdown tables (the figures of bench/results/scheduling.md come from them) and, with
--json, the raw numbers. The cluster is built from the Alibaba GPU 2023 node list (W_s = GPUs, P_s = CPU
cores, as She et al. set it) plus one cloud, with each paper's upload delays: edge [1, 4] slots, cloud
[10, 40] (She et al. Sec. VI; also used for the traces) or [10, 15] (Wang et al. Sec. V-A). The cloud is
unbounded unless a table says it is finite (``she``: She et al.'s cloud in [S], priced by eqs. (7)-(8)).
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

from deepco.scheduling import POLICIES, Job, SimCluster, SimResult, Simulator, bind_delays, make_policy
from deepco.scheduling.lower_bound import lower_bound
from deepco.scheduling.policies.baselines import Srtf, TiresiasL
from deepco.scheduling.policies.online_batch import OnlineBatch
from deepco.scheduling.synthetic import synthetic_jobs
from deepco.scheduling.traces import alibaba_cluster, load_trace

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
NODES = TRACES / "alibaba-gpu-2023" / "openb_node_list_gpu_node.csv"
BASELINES = ("fifo", "drf", "srtf", "tiresias-l", "batchsche")
SHE_DELAY, WANG_DELAY = (10, 40), (10, 15)  # cloud upload delay ranges, slots (edge: [1, 4] in both)
# She et al. give the cloud finite W and P but no numbers: our assumption is as many worker and PS slots as
# the 100-node edge has workers (544), i.e. the cloud doubles the worker capacity
SHE_CLOUD = (544, 544)


def machine() -> str:
    return f"{platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}"


def cluster(servers: int, cloud_delay: tuple[int, int] = SHE_DELAY,
            cloud_slots: tuple[int, int] | None = None) -> SimCluster:
    return SimCluster.from_cluster(alibaba_cluster(NODES, servers=servers, typed=False, cloud_delay=cloud_delay,
                                                   cloud_slots=cloud_slots))


def workloads(jobs: int, seed: int) -> dict[str, tuple[list[Job], tuple[int, int], str]]:
    """The traces and both seeds' synthetic workloads (arrivals over about 2 x jobs slots), each with its cloud
    upload delay range and what the job-level baselines' ``demand`` gang is."""
    return {
        "gavel-philly 0e4a51": (load_trace(TRACES / "gavel-philly" / "0e4a51.trace", "gavel", seed=seed,
                                           jobs=jobs), SHE_DELAY, "trace GPUs"),
        "alibaba-gpu-2023 pods": (load_trace(TRACES / "alibaba-gpu-2023" / "openb_pod_list_default.csv",
                                             "alibaba", seed=seed, jobs=jobs), SHE_DELAY, "trace GPUs"),
        "synthetic (She et al.)": (synthetic_jobs(jobs, seed=seed, preset="she", horizon=3 * jobs), SHE_DELAY,
                                   "assumed 1/2/4/8"),
        "synthetic (Wang et al.)": (synthetic_jobs(jobs, seed=seed, preset="wang", horizon=3 * jobs), WANG_DELAY,
                                    "assumed 1/2/4/8"),
    }


def row(r: SimResult, **extra: object) -> dict:
    """A result's JSON row plus the mean wait before a job first runs (start - arrival)."""
    wait = statistics.mean(j.start - j.arrival for j in r.jobs) if r.jobs else 0.0
    return {**r.to_dict(), "mean_wait": wait, **extra}


def run_policy(cl: SimCluster, jobs: list[Job], name: str, seed: int, gang: str = "demand") -> dict:
    t0 = time.perf_counter()
    r = Simulator(cl, copy.deepcopy(jobs), make_policy(name, seed, gang)).run()
    return row(r, wall_seconds=time.perf_counter() - t0, gang=gang)


def gang_label(r: dict, demand_label: str) -> str:
    if r["policy"] not in BASELINES:
        return "-"
    return "D_j (derived)" if r["gang"] == "chunks" else demand_label


def ranking(args: argparse.Namespace) -> dict:
    out: dict[str, list[dict]] = {}
    loads = workloads(args.jobs, args.seed)
    clusters = {d: cluster(args.servers, d) for d in {SHE_DELAY, WANG_DELAY}}
    runs = [(w, p, "demand") for w in loads for p in POLICIES]
    runs += [(w, p, "chunks") for w in loads for p in BASELINES]
    bar = tqdm(runs, desc="ranking", unit="run", file=sys.stderr)
    for w, p, gang in bar:
        bar.set_postfix_str(f"{w[:12]} {p} {gang}")
        jobs, delay, _ = loads[w]
        cl = clusters[delay]
        bind_delays(jobs, cl, seed=args.seed)
        out.setdefault(w, []).append(run_policy(cl, jobs, p, args.seed, gang))
    for w, rows in out.items():
        jobs, delay, demand_label = loads[w]
        cl = clusters[delay]
        srtf = next(r for r in rows if r["policy"] == "srtf" and r["gang"] == "demand")
        print(f"\n### {w}: {len(jobs)} jobs, {args.servers} edge servers "
              f"({cl.edge_worker_capacity()} worker slots) + unbounded cloud, cloud upload delay "
              f"{list(delay)} slots\n")
        print("| policy | baseline gang | avg JCT (slots) | JCT rate vs SRTF | mean wait | makespan | preemptions | "
              "edge utilisation | jobs on cloud | wall s |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            rate = r["total_jct"] / srtf["total_jct"]
            print(f"| {r['policy']} | {gang_label(r, demand_label)} | {r['avg_jct']:.1f} | {rate:.3f} | "
                  f"{r['mean_wait']:.1f} | {r['makespan']} | {r['preemptions']} | {r['utilization']:.2f} | "
                  f"{r['cloud_jobs']} | {r['wall_seconds']:.1f} |")
    return out


def _online_batch(cl: SimCluster, jobs: list[Job], f: float, **kw: object) -> dict:
    t0 = time.perf_counter()
    r = Simulator(cl, copy.deepcopy(jobs), OnlineBatch(f1=f, f2=f, **kw)).run()  # type: ignore[arg-type]
    return row(r, wall_seconds=time.perf_counter() - t0)


def she(args: argparse.Namespace) -> dict:
    """She et al.'s own settings at J = 200 (Fig. 5's job count): the cloud unbounded and free, or finite and
    priced by eqs. (7)-(8); F (Fig. 5) and S (Figs. 4 and 6) sweeps against FIFO, DRF and BatchSche."""
    jobs = synthetic_jobs(args.jobs, seed=args.seed, preset="she", horizon=3 * args.jobs)
    clouds = {"unbounded, free": None, f"finite W = P = {SHE_CLOUD[0]}, priced": SHE_CLOUD}
    out: dict[str, list[dict]] = {"F": [], "S": []}
    print(f"\n### She et al. Fig. 5: online-batch's total JCT against F = F_1 = F_2 ({args.jobs} jobs, "
          "100 edge servers, cloud delay [10, 40])\n")
    print("| cloud | F | theta_1 | total JCT | avg JCT | mean wait | jobs on cloud | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, slots in clouds.items():
        cl = cluster(100, SHE_DELAY, slots)
        bind_delays(jobs, cl, seed=args.seed)
        for f in (1e-9, 1e-6, 1e-4, 1e-2, 1.0):
            r = _online_batch(cl, jobs, f)
            theta = 2.0 * (max(j.arrival for j in jobs) + 1) * len(cl.servers) * f + 1.0
            out["F"].append({"cloud": label, "F": f, **r})
            print(f"| {label} | {f:g} | {theta:.4g} | {r['total_jct']:.0f} | {r['avg_jct']:.1f} | "
                  f"{r['mean_wait']:.1f} | {r['cloud_jobs']} | {r['wall_seconds']:.1f} |", flush=True)
    print(f"\n### She et al. Figs. 4 and 6: total JCT against S edge servers ({args.jobs} jobs, cloud delay "
          "[10, 40]); baselines with gang D_j (derived) and 1/2/4/8 (assumed)\n")
    print("| cloud | S | online-batch F=1 | online-batch F=1e-9 | fifo D_j | drf D_j | batchsche D_j | "
          "fifo 1/2/4/8 | drf 1/2/4/8 | batchsche 1/2/4/8 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, slots in clouds.items():
        for servers in (100, 200, 300):
            cl = cluster(servers, SHE_DELAY, slots)
            bind_delays(jobs, cl, seed=args.seed)
            cells = {"online-batch F=1": _online_batch(cl, jobs, 1.0),
                     "online-batch F=1e-9": _online_batch(cl, jobs, 1e-9)}
            for gang in ("chunks", "demand"):
                for p in ("fifo", "drf", "batchsche"):
                    cells[f"{p} {gang}"] = run_policy(cl, jobs, p, args.seed, gang)
            out["S"].append({"cloud": label, "S": servers, **{k: v["total_jct"] for k, v in cells.items()}})
            print(f"| {label} | {servers} | " + " | ".join(f"{v['total_jct']:.0f}" for v in cells.values()) + " |",
                  flush=True)
    return out


def ablation(args: argparse.Namespace) -> dict:
    """What drives the gaps: Alg. 2's c_j loop and the free cloud in online-batch; how `preemptive` differs
    from chunk-wide SRTF / Tiresias-L (one change at a time)."""
    out: dict[str, list[dict]] = {"online-batch": [], "preemptive": []}
    she_jobs = synthetic_jobs(args.jobs, seed=args.seed, preset="she", horizon=3 * args.jobs)
    cl = cluster(args.servers, SHE_DELAY)
    bind_delays(she_jobs, cl, seed=args.seed)
    print(f"\n### online-batch on She et al.'s synthetic workload ({args.jobs} jobs, {args.servers} edge "
          "servers, unbounded cloud, delay [10, 40])\n")
    print("| Alg. 2 | F | avg JCT | mean wait | jobs on cloud | edge utilisation | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for cj in (False, True):
        for f in (1.0, 1e-6):
            r = _online_batch(cl, she_jobs, f, cj_loop=cj)
            out["online-batch"].append({"cj_loop": cj, "F": f, **r})
            print(f"| {'with the c_j loop' if cj else 'D_u loop only (before)'} | {f:g} | {r['avg_jct']:.1f} | "
                  f"{r['mean_wait']:.1f} | {r['cloud_jobs']} | {r['utilization']:.2f} | {r['wall_seconds']:.1f} |",
                  flush=True)
    variants = [
        ("preemptive", lambda: make_policy("preemptive", args.seed)),
        ("srtf, gang D_j", lambda: Srtf(gang="chunks")),
        ("srtf, gang D_j, static priority", lambda: Srtf(gang="chunks", static=True)),
        ("srtf, gang D_j, cloud decided once", lambda: Srtf(gang="chunks", cloud_at_arrival=True)),
        ("srtf, gang D_j, cloud decided once, static priority",
         lambda: Srtf(gang="chunks", cloud_at_arrival=True, static=True)),
        ("srtf, gang D_j, pinned gang", lambda: Srtf(gang="chunks", pinned=True)),
        ("tiresias-l, gang D_j", lambda: TiresiasL(gang="chunks")),
        ("tiresias-l, gang D_j, cloud decided once", lambda: TiresiasL(gang="chunks", cloud_at_arrival=True)),
    ]
    for preset, delay in (("she", SHE_DELAY), ("wang", WANG_DELAY)):
        jobs = synthetic_jobs(args.jobs, seed=args.seed, preset=preset, horizon=3 * args.jobs)
        cl = cluster(args.servers, delay)
        bind_delays(jobs, cl, seed=args.seed)
        print(f"\n### preemptive against chunk-wide SRTF / Tiresias-L, one change at a time: {preset} synthetic, "
              f"{args.jobs} jobs, {args.servers} edge servers, unbounded cloud, delay {list(delay)}\n")
        print("| policy | avg JCT | jobs on cloud | their avg JCT | their mean wait | edge jobs' avg JCT | "
              "preemptions | wall s |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for label, make in variants:
            t0 = time.perf_counter()
            r = Simulator(cl, copy.deepcopy(jobs), make()).run()
            wall = time.perf_counter() - t0
            cloud = [j for j in r.jobs if j.cloud]
            edge = [j for j in r.jobs if not j.cloud]
            c_jct = statistics.mean(j.jct for j in cloud) if cloud else 0.0
            c_wait = statistics.mean(j.start - j.arrival for j in cloud) if cloud else 0.0
            e_jct = statistics.mean(j.jct for j in edge) if edge else 0.0
            out["preemptive"].append({"workload": preset, "variant": label, **row(r), "cloud_avg_jct": c_jct,
                                      "cloud_mean_wait": c_wait, "edge_avg_jct": e_jct, "wall_seconds": wall})
            print(f"| {label} | {r.avg_jct:.1f} | {len(cloud)} | {c_jct:.1f} | {c_wait:.1f} | {e_jct:.1f} | "
                  f"{r.preemptions} | {wall:.1f} |", flush=True)
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
    h = sub.add_parser("she")
    h.add_argument("--jobs", type=int, default=200)
    a = sub.add_parser("ablation")
    a.add_argument("--servers", type=int, default=100)
    a.add_argument("--jobs", type=int, default=1000)
    q = sub.add_parser("ratio")
    q.add_argument("--instances", type=int, default=20)
    s = sub.add_parser("scale")
    s.add_argument("--jobs", type=int, default=10_000)
    s.add_argument("--servers", type=int, default=1000)
    s.add_argument("--horizon", type=int, default=6000)
    s.add_argument("--policies", default=",".join(POLICIES))
    for p in (r, h, a, q, s):
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    print(f"_{' '.join(sys.argv)}; {machine()}; {datetime.now(UTC):%Y-%m-%d %H:%M} UTC_")
    result = {"ranking": ranking, "she": she, "ablation": ablation, "ratio": ratio, "scale": scale}[args.what](args)
    if args.json:
        record = {"command": sys.argv, "machine": machine(), **result}
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
