"""`deepco schedule ... --execute ray`: one policy's schedule carried out on Ray, next to its simulation."""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from deepco.errors import UserError
from deepco.plots import save_figure
from deepco.scheduling.jobs import Job
from deepco.scheduling.policies import POLICIES, make_policy
from deepco.scheduling.simulator import SimulationError, Simulator
from deepco.scheduling.topology import SimCluster


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The execution flags of `deepco schedule`."""
    g = p.add_argument_group("execution on Ray (pip install 'deepco[ray]')")
    g.add_argument("--execute", choices=("ray",), help="carry the schedule out: real training on Ray")
    g.add_argument("--ray-address", metavar="ADDR",
                   help="join this Ray cluster (default: start an embedded local one)")
    g.add_argument("--slot-seconds-real", type=float, default=0.5, metavar="S",
                   help="wall-clock seconds of one slot when executing (default 0.5)")
    g.add_argument("--steps-per-job", type=int, default=200, metavar="N",
                   help="real SGD steps that a job's E*D*M mini-batches stand for (default 200)")
    g.add_argument("--checkpoint-dir", metavar="DIR",
                   help="shared checkpoint directory (default: a fresh temporary one; on a multi-node Ray "
                        "cluster a path every node sees)")


def check_flags(args: argparse.Namespace) -> None:
    """The execution flags' one-line errors, before anything is loaded."""
    if not args.execute:
        return
    if args.policy not in POLICIES:
        raise UserError(f"--execute runs one JCT policy: give --policy (one of {', '.join(POLICIES)})")
    if not args.slot_seconds_real > 0:
        raise UserError(f"--slot-seconds-real must be > 0, got {args.slot_seconds_real}")
    if args.steps_per_job < 1:
        raise UserError(f"--steps-per-job must be >= 1, got {args.steps_per_job}")


def format_rows(rows: list[dict[str, Any]], slot_seconds: float) -> str:
    """One line per executed job."""
    head = (f"{'job':>4} {'PS':>8} {'workers on':<22} {'sim JCT':>8} {'exec JCT':>9} {'wall s':>8} "
            f"{'wall/S':>7} {'preempt':>7} {'fail':>4} {'ckpt':>4} {'loss':>13} {'acc':>5}")
    lines = [f"JCTs in slots (one slot = {slot_seconds:g} s of wall clock); wall/S = wall JCT in slots", head,
             "-" * len(head)]
    for r in rows:
        workers = ",".join(r["worker_nodes"])
        workers = workers if len(workers) <= 22 else workers[:19] + "..."
        lines.append(f"{r['job']:>4} {'>'.join(r['ps_nodes']):>8} {workers:<22} {r['sim_jct']:>8} "
                     f"{r['exec_jct']:>9} {r['wall_jct']:>8.2f} {r['wall_jct_slots']:>7.1f} {r['preemptions']:>7} "
                     f"{r['failures']:>4} {r['checkpoints']:>4} {r['loss_start']:>6.3f}>{r['loss_end']:<6.3f} "
                     f"{r['accuracy_end']:>5.2f}")
    return "\n".join(lines)


def plot_gantt(spans: list[tuple[int, str, str, float, float]], path: str, title: str) -> None:
    """Which server ran which job's PS and workers, when, as executed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    merged: dict[tuple[int, str, bool], list[list[float]]] = {}  # back-to-back steps as one bar
    for jid, server, role, a, b in sorted(spans, key=lambda x: x[3]):
        bars = merged.setdefault((jid, server, role == "PS"), [])
        if bars and a - bars[-1][1] < 0.05:
            bars[-1][1] = max(bars[-1][1], b)
        else:
            bars.append([a, b])
    servers = sorted({s for _, s, _ in merged})
    row = {s: i for i, s in enumerate(servers)}
    lanes = {s: sorted({j for j, srv, _ in merged if srv == s}) for s in servers}  # one lane per job
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(10, 1 + 0.6 * max(1, len(servers))))
    jobs = sorted({j for j, _, _ in merged})
    for (jid, server, ps), bars in merged.items():
        height = 0.9 / len(lanes[server])
        y = row[server] + 0.05 + lanes[server].index(jid) * height
        lane = (y, 0.3 * height) if ps else (y + 0.3 * height, 0.7 * height)
        ax.broken_barh([(a, b - a) for a, b in bars], lane,
                       facecolor=colors(jobs.index(jid) % 10), hatch="////" if ps else None, edgecolor="black",
                       linewidth=0.3)
    ax.set_yticks([i + 0.5 for i in range(len(servers))], servers)
    ax.set_xlabel("seconds since the first step (hatched: a job's PS; plain: its workers)")
    ax.set_title(title)
    handles = [matplotlib.patches.Patch(color=colors(i % 10), label=f"job {j}") for i, j in enumerate(jobs)]
    ax.legend(handles=handles, fontsize=7, loc="upper right")
    fig.tight_layout()
    save_figure(fig, path)


def run_executed(args: argparse.Namespace, cluster: SimCluster, jobs: list[Job]) -> int:
    """Simulate the policy, then execute it on Ray; print both, write the JSON rows and the Gantt chart."""
    from tqdm import tqdm

    from deepco.scheduling.execution.ray_executor import ExecutionError, RayExecutor, connect, import_ray

    check_flags(args)
    from deepco.scheduling.execution.training import digits

    digits()  # scikit-learn present? (a clear error before Ray starts)
    simulated = Simulator(cluster, copy.deepcopy(jobs), make_policy(args.policy, args.seed, args.gang)).run()
    ray = import_ray()
    started = connect(cluster, args.ray_address)
    ckdir = args.checkpoint_dir or tempfile.mkdtemp(prefix="deepco-checkpoints-")
    t0 = time.perf_counter()
    try:
        with tqdm(total=len(jobs), unit="job", desc=f"executing {args.policy}") as bar:
            executor = RayExecutor(cluster, slot_seconds=args.slot_seconds_real, steps_per_job=args.steps_per_job,
                                   checkpoint_dir=ckdir, seed=args.seed, progress=bar)
            try:
                executed = Simulator(cluster, copy.deepcopy(jobs), make_policy(args.policy, args.seed, args.gang),
                                     progress=bar, executor=executor).run()
            finally:
                executor.close()
    except (ExecutionError, SimulationError, ray.exceptions.RayError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"execution on Ray failed: {first}") from None
    finally:
        if started:
            ray.shutdown()
    wall = time.perf_counter() - t0
    rows = executor.rows(executed, simulated)
    print(format_rows(rows, args.slot_seconds_real))
    summary = {"policy": args.policy, "jobs": len(rows), "slot_seconds_real": args.slot_seconds_real,
               "steps_per_job": args.steps_per_job, "sim_avg_jct": simulated.avg_jct,
               "exec_avg_jct": executed.avg_jct,
               "wall_avg_jct_slots": sum(r["wall_jct_slots"] for r in rows) / max(1, len(rows)),
               "sim_makespan": simulated.makespan, "exec_makespan": executed.makespan, "wall_seconds": wall,
               "overheads": executor.timing, "checkpoint_dir": ckdir}
    print(f"average JCT: simulated {summary['sim_avg_jct']:.2f} slots, executed {summary['exec_avg_jct']:.2f} "
          f"slots, wall {summary['wall_avg_jct_slots']:.2f} slots; whole run {wall:.1f} s")
    if args.json:
        try:
            Path(args.json).write_text(json.dumps({"results": [summary], "jobs": rows}, indent=2) + "\n",
                                       encoding="utf-8")
        except OSError as exc:
            raise UserError(f"{args.json}: cannot write: {exc.strerror}") from None
    if args.plot:
        plot_gantt(executor.spans(), args.plot, f"{args.policy} executed on Ray ({len(rows)} jobs)")
    return 0
