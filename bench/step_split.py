"""Where a step's time goes, from a JSON log (`deepco run --json-log FILE`, one line per frame) or from
`deepco bench --json` (auto's recorded frames): the median of every phase of the servers' steps and the
per-step overhead (a segment step's wall time less its compute; see deepco/timelines.py).

    python bench/step_split.py run.jsonl [--gantt frame.png] [--levels]
        # --gantt: the median frame as a Gantt chart; --levels: each server's compute and wait per level, and
        # how long a neighbour's rows took from being queued to ending a wait for them
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from deepco.errors import UserError
from deepco.timelines import by_level, by_level_text, gantt, row_delays, split_text, step_split


def records_of(path: str, algorithm: str = "auto") -> list[dict]:
    """The frame records in ``path``: JSON lines of a run's log, or a bench document's recorded timelines of
    ``algorithm``."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UserError(f"{path}: cannot read the log: {exc.strerror}") from None
    try:
        if text.lstrip().startswith("{\n") or text.lstrip().startswith('{"points"'):
            document = json.loads(text)
            return [{"staged": t, "plan": entry.get("plan_text", "")} for p in document.get("points", [])
                    for r in p.get("runs", []) for entry in [r.get("algorithms", {}).get(algorithm, {})]
                    for t in entry.get("timelines", [])]
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not a JSON log ({exc.msg}, line {exc.lineno})") from None


def main(argv: list[str] | None = None) -> int:
    """Print the split; write the median frame's Gantt chart if asked."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", help="a --json-log file (JSON lines) or a deepco bench --json document")
    p.add_argument("--gantt", metavar="FILE.png", help="draw the frame of median latency as a Gantt chart")
    p.add_argument("--algorithm", default="auto", help="of a bench document, whose frames (default auto)")
    p.add_argument("--levels", action="store_true",
                   help="also each server's median compute and wait for peers' rows at every level")
    args = p.parse_args(argv)
    try:
        records = [r for r in records_of(args.log, args.algorithm) if r.get("staged") and not r.get("error")]
        split = step_split(records)
        if not split["server_steps"]:
            raise UserError(f"{args.log}: no frame with server step timelines (a split or offload plan's run)")
        print(split_text(split))
        if args.levels:  # per plan: the levels of two plans are not the same levels
            plans = list(dict.fromkeys(r.get("plan", "") for r in records))
            for plan in plans:
                if len(plans) > 1:
                    print(plan)
                print(by_level_text(by_level(r for r in records if r.get("plan", "") == plan)))
            delays = sorted(row_delays(records))
            if delays:
                median, p90 = delays[len(delays) // 2] * 1e3, delays[9 * len(delays) // 10] * 1e3
                print(f"a neighbour's rows ended a wait for them (> 2 ms) a median {median:.1f} ms after it had "
                      f"queued them (p90 {p90:.1f}; {len(delays)} waits)")
        if args.gantt:
            timed = [r for r in records if r["staged"].get("servers")]
            median = statistics.median_low(r["staged"]["latency"] for r in timed)
            frame = next(r for r in timed if r["staged"]["latency"] == median)
            gantt(frame["staged"], args.gantt)
    except UserError as exc:
        print(f"step_split: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
