"""`deepco plan --model M`: the device's dry run. Measure the servers and antennas, plan, print; run nothing.

It is the setup of `deepco run` (device.session.Device.setup) without a source: the model is analysed, the
device, every server and every antenna are measured, every candidate cut is planned, and the chosen plan is
printed. Setup uploads nothing but a small compute probe, which it unloads again.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from deepco_device.planner import StagedPlanner
from deepco_device.progress import Progress
from deepco_device.session import ALGORITHMS, Device

from deepco import modelcard
from deepco.cluster import load_cluster
from deepco.errors import UserError
from deepco.partition.source import input_size
from deepco.planning.staged import DEVICE, StagedPlan, split_shares
from deepco.wire import security

STAGED = ("auto", "local", "offload", "round-robin")  # the staged planner's plans (auto: calibrated on the servers)


def run(args: argparse.Namespace) -> int:
    """Measure, plan and print one plan for ``args.model`` on the servers of ``args.cluster`` (and with
    ``args.save`` write it for `deepco run --plan`)."""
    if args.algorithm not in (*ALGORITHMS, *STAGED):
        raise UserError(f"--algorithm {args.algorithm} plans the abstract workload only; with --model choose "
                        f"one of {', '.join(ALGORITHMS)}, or the staged planner's {', '.join(STAGED)}")
    how = modelcard.from_args(args.model, args)
    cluster = load_cluster(args.cluster)
    cluster.require_addresses()
    height, width = input_size(args.model, args.input_size)
    # With --json, stdout holds exactly one JSON object; progress goes to stderr.
    progress = Progress()  # a bar on stderr while it measures and calibrates, where stderr is a terminal
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else progress.write
    staged = args.algorithm in STAGED
    with Device(cluster, args.model, height, width, algorithm="thread" if staged else args.algorithm, cut=args.cut,
                weights=args.weights, log=log, security=security.from_args(args), preprocessing=how) as dev, progress:
        dev.progress = progress.step
        if staged:
            dev.setup(rows=False)
            planner = StagedPlanner(dev)
            plan = planner.calibrate() if args.algorithm == "auto" else planner.named(args.algorithm)
        else:
            plan = dev.setup()
        progress.close()  # planned: the results print below, without the bar
        if getattr(args, "save", None):
            save_plan(args.save, args.model, height, width, plan)
        if args.json:  # plan: the paper's rows; staged: the same plan as the runtime executes it
            rows = {} if staged else {"cut": asdict(dev.cut)}
            out = {"model": args.model, "input_size": [height, width], **rows, "measured": dev.measured.to_dict()}
            rows = {} if staged else {"plan": plan.breakdown["rows"]}
            print(json.dumps(out | rows | {"staged": plan.to_dict(), "split_share": split_shares(plan, dev.costs)}))
        elif staged:
            print(dev.describe_measurements())
            print(f"plan: {plan.describe()}; predicted {plan.predicted * 1e3:.1f} ms, {planner.fps(plan):.2f} fps")
            share = split_shares(plan, dev.costs)
            print(f"split share: this plan runs {share['plan']:.1%} of the FLOPs on row bands; single-tensor cuts "
                  f"reach {share['single_tensor_cuts']:.1%}, stages across scales {share['across_scales']:.1%} "
                  "(deepco partition lists their levels)")
        else:
            print(dev.describe_plan())
    return 0


def plan_document(model: str, height: int, width: int, plan: StagedPlan) -> dict:
    """A saved plan's JSON: ``plan`` with the model and input size it was made for (`load_plan` reads it; the
    plan cache, device.plan_cache, writes these fields too)."""
    return {"model": model, "input_size": [height, width], "plan": plan.to_dict()}


def save_plan(path: str, model: str, height: int, width: int, plan: StagedPlan) -> None:
    """Write ``plan`` (with the model and input size it was made for) for `deepco run --plan`."""
    with open(path, "w") as f:
        json.dump(plan_document(model, height, width, plan), f, indent=1)


def load_plan(path: str, model: str, height: int, width: int, servers: list[str],
              down: dict[str, str] | None = None) -> StagedPlan:
    """The plan `save_plan` wrote to ``path``; a UserError when it was made for another model or input size,
    names a server the cluster has not, or one that is ``down`` (name -> why, in words). A saved plan is run
    as saved or not at all: to start on the servers that are up, plan again (run without --plan)."""
    try:
        with open(path) as f:
            data = json.load(f)
        plan = StagedPlan.from_dict(data["plan"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"--plan {path}: not a plan saved by `deepco plan --save` ({exc})") from None
    if data.get("model") != model or data.get("input_size") != [height, width]:
        raise UserError(f"--plan {path} was made for {data.get('model')} at {data.get('input_size')}, not for "
                        f"{model} at {[height, width]}")
    gone = [name for name in plan.servers if name in (down or {})]
    if gone:
        raise UserError(f"--plan {path} runs on {', '.join(f'{n} ({down[n]})' for n in gone)}, which "
                        f"{'is' if len(gone) == 1 else 'are'} down; start it, or run without --plan to plan on "
                        "the servers that are up")
    unknown = sorted(set(plan.servers) - set(servers) - set(down or {}) - {DEVICE})
    if unknown:
        raise UserError(f"--plan {path} uses server(s) {', '.join(unknown)} that the cluster file does not name")
    return plan

