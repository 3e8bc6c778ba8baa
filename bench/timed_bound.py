"""Each repeat's physical bound two ways, from a `deepco bench --json` document: on setup's probed rates (the
bound the table prints) and on the rates the servers and the device ran the whole model at in that repeat's
own frames (`deepco_bench.benchmark.timed_bound`), with every algorithm's p50 over the second. Documents
written before the timed bound existed hold the frames it needs, so it is derived here for them too.

    python bench/timed_bound.py bench/results/bench/camera-720x1280-2db5bfb.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from deepco_bench.benchmark import timed_bound


def rows(document: dict) -> list[str]:
    """One line per repeat of each point, and the medians over the repeats."""
    lines = []
    for point in document.get("points", []):
        over: dict[str, list[float]] = {}
        for k, run in enumerate(point.get("runs", []), 1):
            timed = timed_bound(run["bound"], run["measured"], run["algorithms"])
            if timed is None:
                lines.append(f"repeat {k}: no whole-model frame on a server: no timed bound")
                continue
            rates = ", ".join(f"{s} {v / 1e9:.1f}" for s, v in timed["server_flops_per_second"].items())
            ratios = {a: e["p50"] / timed["latency"] for a, e in run["algorithms"].items()}
            for a, v in ratios.items():
                over.setdefault(a, []).append(v)
            lines.append(f"repeat {k}: bound {run['bound']['latency'] * 1e3:.1f} ms probed, "
                         f"{timed['latency'] * 1e3:.1f} ms timed (GFLOP/s {rates}, timed: "
                         f"{', '.join(timed['servers_timed'])}; device {timed['device_flops_per_second'] / 1e9:.1f}); "
                         "p50 / timed bound: " + ", ".join(f"{a} {v:.2f}" for a, v in ratios.items()))
        if over:
            lines.append("median p50 / timed bound: " + ", ".join(f"{a} {statistics.median(v):.2f}"
                                                                 for a, v in over.items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    """Print the lines."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("document", help="a deepco bench --json document")
    args = p.parse_args(argv)
    try:
        document = json.loads(Path(args.document).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"timed_bound: error: {args.document}: not a readable deepco bench --json document ({exc})",
              file=sys.stderr)
        return 2
    print("\n".join(rows(document)))
    return 0

if __name__ == "__main__":
    sys.exit(main())
