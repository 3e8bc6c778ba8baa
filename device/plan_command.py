"""`deepco plan --model M`: the device's dry run. Measure the servers and antennas, plan, print; run nothing.

It is the setup of `deepco run` (device.session.Device.setup) without a source: the model is analysed, the
device, every server and every antenna are measured, every candidate cut is planned, and the chosen plan is
printed. Setup uploads nothing but a probe head, which it unloads again.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from deepco_device.session import ALGORITHMS, Device

from deepco import modelcard
from deepco.cluster import load_cluster
from deepco.errors import UserError
from deepco.parsing import parse_size
from deepco.wire import security


def run(args: argparse.Namespace) -> int:
    """Measure, plan and print one plan for ``args.model`` on the servers of ``args.cluster``."""
    if args.algorithm not in ALGORITHMS:
        raise UserError(f"--algorithm {args.algorithm} plans the abstract workload only; with --model choose "
                        f"one of {', '.join(ALGORITHMS)}")
    height, width = parse_size(args.input_size)
    how = modelcard.from_args(args.model, args)
    cluster = load_cluster(args.cluster)
    cluster.require_addresses()
    # With --json, stdout holds exactly one JSON object; progress goes to stderr.
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
    with Device(cluster, args.model, height, width, algorithm=args.algorithm, cut=args.cut, weights=args.weights,
                log=log, security=security.from_args(args), preprocessing=how) as dev:
        dev.setup()
        if args.json:  # plan: the paper's rows; staged: the same plan as the runtime executes it
            print(json.dumps({"model": args.model, "input_size": [height, width], "cut": asdict(dev.cut),
                              "measured": dev.measured.to_dict(), "plan": dev.plan.breakdown["rows"],
                              "staged": dev.plan.to_dict()}))
        else:
            print(dev.describe_plan())
    return 0

