"""`deepco schedule`: simulate training-job schedulers on a cluster and a workload (trace or synthetic).

The workload is a real trace (``--format alibaba|gavel|tiresias``, detected from the file when omitted) or
synthetic (``--format synthetic``, the default when ``--trace`` is omitted), in which case ``--trace`` may
name the seed whose ranges to use, ``she`` (default) or ``wang``, and ``--horizon`` sets the arrival span.

``--policy okita|okita-fifo|okita-drf|okita-oasis`` runs Okita's cost model instead (``deepco.scheduling.okita``):
the cluster's edge sites with their servers' resources and the [[links]] costs, and synthetic jobs with the
paper's ranges (or a trace's arrivals and sizes); the JSON rows add ``total_cost`` and ``bandwidth_cost``.
``--policy deep-edge`` plans one model update (``deepco.scheduling.deep_edge``) over the cluster's servers and
takes no trace.

Scheduling needs no ``[device]`` table in the cluster file. A cloud server with ``worker_slots`` (and
``ps_slots``) is finite and priced like She et al.'s; ``preemptive`` assumes an unbounded cloud and refuses it.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

from deepco.cluster import load_cluster
from deepco.errors import UserError
from deepco.plots import save_figure
from deepco.scheduling import POLICIES, SimCluster, SimResult, Simulator, bind_delays, make_policy
from deepco.scheduling.execution import command as execution
from deepco.scheduling.jobs import Job
from deepco.scheduling.policies.baselines import GANGS
from deepco.scheduling.synthetic import PRESETS, synthetic_jobs
from deepco.scheduling.topology import usable
from deepco.scheduling.traces import FORMATS, TraceError, load_trace

ALL = "all"
UDL = ("okita", "okita-fifo", "okita-drf", "okita-oasis")
DEEP_EDGE = "deep-edge"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `deepco schedule`."""
    p.add_argument("--cluster", required=True, metavar="FILE", help="cluster TOML file (sites, slots, cloud)")
    p.add_argument("--trace", metavar="FILE",
                   help="trace file; with --format synthetic: omitted, or 'she'/'wang' for the seed's ranges")
    p.add_argument("--format", choices=[*FORMATS, "synthetic"], help="trace format (default: detected)")
    p.add_argument("--jobs", type=int, metavar="N", help="first N jobs by arrival (synthetic: default 100)")
    p.add_argument("--policy", default=ALL, choices=[*POLICIES, *UDL, DEEP_EDGE, ALL],
                   help="policy to run (default: all = the JCT policies; okita* and deep-edge run on their own)")
    p.add_argument("--seed", type=int, default=0, help="seed for filled-in job parameters and delays")
    p.add_argument("--horizon", type=int, default=100,
                   help="synthetic: jobs arrive in [1, horizon / 1.5] slots (default 100)")
    p.add_argument("--slot-seconds", type=float, default=3600.0,
                   help="trace seconds per slot (default 3600: one hour, as in the seeds)")
    p.add_argument("--gang", choices=GANGS, default="demand",
                   help="gang of the job-level baselines: the trace's GPU demand (default) or all D_j chunks")
    p.add_argument("--latency-cost", choices=("sigmoid", "linear", "piecewise"), default="sigmoid",
                   help="okita: the jobs' latency cost function (default sigmoid: tau e^(0.25 t))")
    p.add_argument("--block-sites", metavar="NAMES",
                   help="okita: comma-separated sites where no training may run (e.g. whose inference would "
                        "miss its SLO with training beside it; see deepco.scheduling.deep_edge.sites_to_protect)")
    p.add_argument("--samples", type=int, default=2000, help="deep-edge: data samples of the model update")
    p.add_argument("--slo-ms", type=float, help="deep-edge: the inference SLO (default: the profile's)")
    p.add_argument("--profile", metavar="FILE", help="deep-edge: profile JSON (default: the committed one)")
    p.add_argument("--json", metavar="FILE", help="write {\"results\": [...]} to FILE")
    p.add_argument("--plot", metavar="FILE", help="write a PNG: average JCT per policy and the JCT CDF "
                   "(with --execute: a Gantt chart of what ran where)")
    execution.add_arguments(p)


def check_trace_file(path: Path) -> None:
    """A clear error for a folder given as ``--trace`` (the loaders read one file), naming the files in it."""
    if path.is_dir():
        files = sorted(p.name for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        hint = f" (it holds: {', '.join(files[:6])}{', ...' if len(files) > 6 else ''})" if files else ""
        raise UserError(f"--trace {path}: is a folder; give one trace file{hint}")


def detect_format(path: Path) -> str:
    """alibaba / gavel / tiresias from the file's first line; a TraceError if it matches none."""
    check_trace_file(path)
    try:
        with path.open(encoding="utf-8") as f:
            first = f.readline()
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from None
    if "\t" in first:
        return "gavel"
    header = {h.strip() for h in first.split(",")}
    if "pod_phase" in header:
        return "alibaba"
    if "submit_time" in header:
        return "tiresias"
    raise TraceError(f"{path}:1: cannot tell the trace format from the first line; give --format")


def load_jobs(args: argparse.Namespace, cluster: SimCluster) -> list[Job]:
    """The workload the flags describe."""
    if args.jobs is not None and args.jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {args.jobs}")
    fmt = args.format or ("synthetic" if args.trace is None or args.trace in PRESETS else None)
    if fmt == "synthetic":
        preset = args.trace or "she"
        if preset not in PRESETS:
            raise UserError(f"--format synthetic: --trace must be omitted or one of {', '.join(PRESETS)}, "
                            f"got {preset!r}")
        if args.horizon < 2:
            raise UserError(f"--horizon must be >= 2, got {args.horizon}")
        edge = cluster.edge
        wtypes = sorted({s.worker_type for s in edge if s.worker_type is not None})
        ptypes = sorted({s.ps_type for s in edge if s.ps_type is not None})
        return synthetic_jobs(args.jobs or 100, seed=args.seed, preset=preset, horizon=args.horizon,
                              worker_types=wtypes, ps_types=ptypes)
    if args.trace is None:
        raise UserError(f"--format {fmt}: give the trace file with --trace")
    path = Path(args.trace)
    check_trace_file(path)
    fmt = fmt or detect_format(path)
    return load_trace(path, fmt, seed=args.seed, jobs=args.jobs, slot_seconds=args.slot_seconds)


def format_table(results: list[SimResult], seconds: list[float]) -> str:
    """One row per policy; JCT rate is total JCT over SRTF's (the papers' figures), else over the first."""
    base = next((r for r in results if r.policy == "srtf"), results[0])
    head = (f"{'policy':<16} {'jobs':>6} {'avg JCT':>10} {'JCT rate':>9} {'makespan':>9} {'preempt':>8} "
            f"{'util':>6} {'cloud':>6} {'wall s':>7}")
    lines = [f"JCT rate = total JCT / total JCT of {base.policy}; times in slots", head, "-" * len(head)]
    for r, s in zip(results, seconds, strict=True):
        rate = r.total_jct / base.total_jct if base.total_jct else float("nan")
        cloud = sum(1 for j in r.jobs if j.cloud)
        lines.append(f"{r.policy:<16} {len(r.jobs):>6} {r.avg_jct:>10.2f} {rate:>9.3f} {r.makespan:>9} "
                     f"{r.preemptions:>8} {r.utilization:>6.2f} {cloud:>6} {s:>7.2f}")
    return "\n".join(lines)


def plot(results: list[SimResult], path: str) -> None:
    """Average JCT per policy and the CDF of JCT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar([r.policy for r in results], [r.avg_jct for r in results], color="tab:blue")
    ax1.set_ylabel("average JCT (slots)")
    ax1.tick_params(axis="x", rotation=45)
    for r in results:
        jct = np.sort([j.jct for j in r.jobs])
        ax2.step(jct, np.arange(1, len(jct) + 1) / len(jct), where="post", label=r.policy)
    ax2.set_xscale("symlog")
    ax2.set_xlabel("JCT (slots)")
    ax2.set_ylabel("fraction of jobs")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def _write_json(path: str, rows: list[dict[str, object]]) -> None:
    try:
        Path(path).write_text(json.dumps({"results": rows}, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{path}: cannot write: {exc.strerror}") from None


def run_udl_policy(args: argparse.Namespace) -> int:
    """``--policy okita*``: Okita's cost model on the cluster's sites."""
    import numpy as np

    from deepco.scheduling.okita import UDL_POLICIES, UdlError, UdlInstance, run_udl
    from deepco.scheduling.okita.workloads import cluster_sites, fit_jobs, random_job, trace_jobs

    if args.jobs is not None and args.jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {args.jobs}")
    cap, q, names = cluster_sites(load_cluster(args.cluster, require_device=False))
    rng = np.random.default_rng(args.seed)
    if args.trace is None or args.format == "synthetic":
        if args.horizon < 2:
            raise UserError(f"--horizon must be >= 2, got {args.horizon}")
        arrivals = np.sort(rng.integers(0, max(1, 2 * args.horizon // 3), size=args.jobs or 100))
        jobs = [random_job(rng, i, int(a), len(names), args.latency_cost) for i, a in enumerate(arrivals)]
    else:
        check_trace_file(Path(args.trace))
        fmt = args.format or detect_format(Path(args.trace))
        jobs = trace_jobs(args.trace, fmt, len(names), args.jobs, rng, slot_seconds=args.slot_seconds,
                          kind=args.latency_cost)
    fit_jobs(jobs, cap)
    inst = UdlInstance(capacity=cap, q=q, jobs=jobs, site_names=names)
    policy = UDL_POLICIES[args.policy](args.seed)
    if args.block_sites:
        if args.policy != "okita":
            raise UserError("--block-sites applies to --policy okita only")
        unknown = [n for n in args.block_sites.split(",") if n not in names]
        if unknown:
            raise UserError(f"--block-sites: unknown site {unknown[0]!r} (sites: {', '.join(names)})")
        from deepco.scheduling.okita import Okita

        policy = Okita(blocked=frozenset(names.index(n) for n in args.block_sites.split(",")))
    t0 = time.perf_counter()
    try:
        res = run_udl(inst, policy)
    except UdlError as exc:
        raise UserError(str(exc)) from None
    row = {**res.to_dict(), "wall_seconds": time.perf_counter() - t0}
    print(f"{'policy':<12} {'jobs':>5} {'total cost':>12} {'bandwidth':>11} {'latency':>11} {'avg JCT':>8} "
          f"{'makespan':>8}")
    print(f"{row['policy']:<12} {row['jobs']:>5} {row['total_cost']:>12.1f} {row['bandwidth_cost']:>11.1f} "
          f"{row['latency_cost']:>11.1f} {row['avg_jct']:>8.2f} {row['makespan']:>8}")
    if args.json:
        _write_json(args.json, [row])
    return 0


def run_deep_edge(args: argparse.Namespace) -> int:
    """``--policy deep-edge``: plan one model update over the cluster's servers (Alg. 1 of Deep-Edge)."""
    from deepco.scheduling.deep_edge import plan_from_cluster

    if args.trace is not None or args.format is not None:
        raise UserError("--policy deep-edge plans one model update (--samples) and reads no trace; "
                        "leave out --trace/--format")
    plan = plan_from_cluster(load_cluster(args.cluster, require_device=False), samples=args.samples, slo_ms=args.slo_ms,
                             profile=args.profile)
    print(plan.table())
    if args.json:
        _write_json(args.json, [plan.to_dict()])
    return 0


def run(args: argparse.Namespace) -> int:
    """Load, simulate every requested policy on the same jobs, print, and write JSON/plot."""
    execution.check_flags(args)
    if args.policy in UDL:
        return run_udl_policy(args)
    if args.policy == DEEP_EDGE:
        return run_deep_edge(args)
    cluster = SimCluster.from_cluster(load_cluster(args.cluster, require_device=False))
    jobs = load_jobs(args, cluster)
    bind_delays(jobs, cluster, seed=args.seed)
    names = list(POLICIES) if args.policy == ALL else [args.policy]
    refused = [n for n in names if cluster.finite_cloud and make_policy(n).needs_unbounded_cloud]
    if refused and args.policy != ALL:
        raise UserError(f"{args.cluster}: --policy {args.policy} assumes an unbounded cloud (Wang et al.); this "
                        "cluster's cloud server sets worker_slots. Remove them, or pick another policy")
    if refused:
        print(f"note: skipping {', '.join(refused)} (they assume an unbounded cloud; this cluster's cloud has "
              "worker_slots)", file=sys.stderr)
        names = [n for n in names if n not in refused]
    for name in names:
        edge_only = name == "preemptive-edge"
        bad = [j for j in jobs if not usable(j, cluster, edge_only=edge_only)]
        if bad:
            raise UserError(f"{args.cluster}: job {bad[0].id} ({bad[0].name}) has no "
                            f"{'edge ' if edge_only else ''}server with a worker slot of type "
                            f"{bad[0].worker_type} and a PS slot of type {bad[0].ps_type} (policy {name})")
    if args.execute:
        return execution.run_executed(args, cluster, jobs)
    from tqdm import tqdm

    results, seconds = [], []
    show = len(jobs) * len(names) >= 2000 and sys.stderr.isatty()
    with tqdm(total=len(jobs) * len(names), unit="job", disable=not show, desc="simulating") as bar:
        for name in names:
            bar.set_postfix_str(name)
            t0 = time.perf_counter()
            policy = make_policy(name, args.seed, args.gang)
            result = Simulator(cluster, copy.deepcopy(jobs), policy, progress=bar).run()
            seconds.append(time.perf_counter() - t0)
            results.append(result)
    print(format_table(results, seconds))
    if args.json:
        rows = [{**r.to_dict(), "wall_seconds": s} for r, s in zip(results, seconds, strict=True)]
        try:
            Path(args.json).write_text(json.dumps({"results": rows}, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise UserError(f"{args.json}: cannot write: {exc.strerror}") from None
    if args.plot:
        plot(results, args.plot)
    return 0
