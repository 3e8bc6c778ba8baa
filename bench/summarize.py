"""Markdown tables from `deepco bench --json` files (what bench/README.md quotes).

    python bench/summarize.py bench/results/bench/camera-720x1280.json [...]

One table per point: every algorithm's median p50 (min-max over the repeats), p95, pipelined fps, predicted
latency, measured / predicted, p50 / physical bound and the worst relative error against the whole model;
the least p50 is in bold, and the lines under the table say which plan `auto` ran and, where its
prediction missed, why.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from deepco_bench.bench_command import twins, unpredicted


def ms(seconds: float | None) -> str:
    """Milliseconds, or a dash."""
    return "-" if seconds is None else f"{seconds * 1e3:.0f}" if seconds >= 0.1 else f"{seconds * 1e3:.1f}"


def versus_best(point: dict, rows: tuple[str, ...] = ("local", "offload"), draws: int = 2000) -> str | None:
    """`auto`'s p50 over the best of ``rows``' (medians over the repeats, as in the table), with a 95%
    bootstrap interval: each repeat's frames resampled, the statistic recomputed ``draws`` times."""
    runs = point.get("runs", [])
    if not runs or any(name not in runs[0]["algorithms"] for name in ("auto", *rows)):
        return None
    rng = np.random.default_rng(0)

    def ratio(sample) -> float:
        p50 = {n: np.median([np.median(sample(r["algorithms"][n]["latencies"])) for r in runs])
               for n in ("auto", *rows)}
        return float(p50["auto"] / min(p50[n] for n in rows))

    measured = ratio(lambda xs: np.asarray(xs))
    boot = [ratio(lambda xs: rng.choice(xs, size=len(xs))) for _ in range(draws)]
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return (f"`auto` / best of {' and '.join(rows)}: {measured:.2f} (95% bootstrap interval over the frames "
            f"{lo:.2f}-{hi:.2f})")


def point_table(point: dict) -> str:
    """One point as a markdown table."""
    algos = point["algorithms"]
    fastest = min(algos, key=lambda n: algos[n]["p50"])
    lines = ["| algorithm | p50 ms (min-max) | p95 ms | fps | predicted ms | measured / predicted | p50 / bound "
             "| fps / bound | max error |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in algos.items():
        p50 = f"{ms(r['p50'])} ({ms(r['p50_min'])}-{ms(r['p50_max'])})"
        if name == fastest:
            p50 = f"**{p50}**"
        fps = "-" if r.get("fps") is None else f"{r['fps']:.2f}"
        fpsb = "-" if r.get("fps_over_bound") is None else f"{r['fps_over_bound']:.2f}"
        lines.append(f"| {name} | {p50} | {ms(r['p95'])} | {fps} | {ms(r['predicted'])} | "
                     f"{r['measured_over_predicted']:.2f} | {r['p50_over_bound']:.2f} | {fpsb} | "
                     f"{r['max_relative_error']:.1e} |")
    b = point["bound"]
    lines.append("")
    lines.append(f"Physical bound: latency >= {ms(b['latency'])} ms, fps <= {b['fps']:.2f}.")
    for name in ("auto", "auto-whole", "auto-throughput"):
        if name in algos:
            plans = sorted(set(algos[name]["plan_text"]))
            lines.append(f"`{name}` ran: " + "; ".join(f"`{p}`" for p in plans) + ".")
    versus = versus_best(point)
    lines += [f"{line}." for line in ([versus] if versus else []) + twins(point) + unpredicted(point)]
    return "\n".join(lines)


def main(paths: list[str]) -> int:
    """Print every file's tables."""
    for path in paths:
        doc = json.loads(Path(path).read_text())
        for point in doc["points"]:
            where = ", ".join(f"{k} {point[k]}" for k in ("bandwidth_mbps", "servers", "antennas") if k in point)
            if "cpu_shares" in point:
                where += f", server CPU {','.join(f'{c:g}' for c in point['cpu_shares'])}"
            print(f"### {Path(path).stem}: {point['model']} {point['input_size']} ({where}; "
                  f"{point['repeats']} repeat(s))\n")
            print(f"`{doc['command']}` — {doc['date']}, {doc['machine']}, {doc['seconds']:.0f} s. {doc['emulated']}\n")
            print(point_table(point) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
