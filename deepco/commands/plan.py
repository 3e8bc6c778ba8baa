"""`deepco plan`: plan one frame over the cluster.

Without --model: the paper's abstract workload model ([workload], capacities and bandwidths from the file).
With --model: a dry run of the device on the real servers of the file (measure, plan, print); that part
lives with the device (device/plan_command.py), which this library does not import: it is looked up by
name, as deepco/cli.py dispatches `run` and `serve`.
"""

from __future__ import annotations

import argparse
import importlib
import json

from deepco import modelcard
from deepco.cluster import load_cluster
from deepco.errors import UserError
from deepco.parsing import SIZE_HELP
from deepco.planning import ALGORITHMS, Instance, Plan, make_plan
from deepco.wire import security

DRY_RUN = "deepco_device.plan_command"
# plans the device's dry run has and the abstract workload model has not: a real model's rows, and the staged
# planner's (auto calibrates on the servers)
MODEL_ONLY = ("equal", "auto", "local", "offload", "round-robin")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `deepco plan`."""
    p.add_argument("--cluster", required=True, metavar="FILE", help="cluster TOML file")
    p.add_argument("--algorithm", default="thread", choices=[*ALGORITHMS, *MODEL_ONLY],
                   help="planner (default: thread; equal, auto, local, offload, round-robin: with --model only)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object instead of a table")
    dry = p.add_argument_group("dry run on the real servers (with --model: measure, plan, print; nothing is run)")
    dry.add_argument("--model", default=None,
                     help="zoo model name or path to an .onnx file; without it the abstract [workload] is planned")
    dry.add_argument("--input-size", default=None, metavar="HxW", help=SIZE_HELP)
    dry.add_argument("--cut", default="auto", help="cut name (see `deepco partition`) or auto (default)")
    dry.add_argument("--weights", default=None, help="state-dict file for a zoo model")
    dry.add_argument("--save", default=None, metavar="F.json",
                     help="write the plan to F.json, for `deepco run --plan F.json` to run exactly it")
    modelcard.add_arguments(p)
    security.add_arguments(p)


def format_plan(plan: Plan) -> str:
    """A readable table of a plan."""
    # columns as wide as their longest entry: servers are often named by host:port
    w = max([len("server"), *(len(a.name) for a in plan.servers)])
    v = max([len("antenna"), *(len(str(a.antenna)) for a in plan.servers)])
    head = (f"{'server':<{w}} {'antenna':<{v}} {'order':>5} {'ratio':>8} {'tx start':>10} {'tx time':>10} "
            f"{'compute':>10} {'exchange':>10} {'finish':>10}")
    lines = [f"algorithm: {plan.algorithm}   completion time: {plan.completion_time:.6g}   "
             f"servers: {len(plan.servers)}   halo ratio per block: {plan.halo_ratio:g}", head,
             "-" * len(head)]
    for a in plan.servers:
        lines.append(f"{a.name:<{w}} {a.antenna:<{v}} {a.order:>5} {a.ratio:>8.4f} {a.transfer_start:>10.4g} "
                     f"{a.transfer_time:>10.4g} {a.compute_time:>10.4g} {a.exchange_time:>10.4g} "
                     f"{a.finish_time:>10.4g}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Load the cluster, plan, print (or, with --model, hand over to the device's dry run)."""
    if args.model is not None:
        return importlib.import_module(DRY_RUN).run(args)
    if args.algorithm in MODEL_ONLY:
        raise UserError(f"--algorithm {args.algorithm} plans a real model's rows: give --model (the abstract "
                        f"[workload] is planned with one of {', '.join(ALGORITHMS)})")
    plan = make_plan(Instance.from_cluster(load_cluster(args.cluster)), args.algorithm)
    print(json.dumps(plan.to_dict()) if args.json else format_plan(plan))
    return 0
