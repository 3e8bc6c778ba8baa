"""The CONVENE paper's simulation (Section VI, Figs. 9-12) on DeepCo's planner, plus THREAD's gap to optimal.

Setting (the paper's): 20 servers, c(i) = 500 + 25 beta GFLOPS and b = 150 + 50 delta Mbps with
beta, delta uniform in [0, 5]; an image of s = 150 Kb; ResNet-101 / ResNet-152 workloads with the paper's
prefetch ratio o(M) = 2 sum floor(f/2) over the conv layers, over a 224-row input. Each point averages
--samples random instances. What the paper leaves open, and what we chose (printed in the JSON too):
- w, the work of one image: 7.6 GFLOPs (ResNet-101) and 11.3 GFLOPs (ResNet-152), He et al. (CVPR'16).
- MoDNN exchanges boundary rows before every layer with a spatial kernel (the 7x7 stem, the max-pool and
  every 3x3 conv: 35 for ResNet-101, 52 for ResNet-152); one exchange costs a fixed latency
  (--exchange-ms, default 1 ms: the 5G user-plane latency target of 3GPP TR 38.913, 0.5 ms each way)
  plus its rows' data at bandwidth b. The paper gives no value and the ranking hinges on it, so the
  "exchange" sweep (not in the paper) varies it.
- The number of antennas, where a figure does not vary it, is 2.

Run:  .venv/bin/python bench/planner_sim.py --out bench/results/planner_sim
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from tqdm import tqdm

from deepco.planning import Instance, make_plan
from deepco.planning.baselines import optimal

ALGORITHMS = ("thread", "thread-sa", "modnn-sa", "modnn-ma")
IMAGE_BITS = 150e3
INPUT_ROWS = 224


@dataclass(frozen=True)
class Model:
    name: str
    gflops: float
    bottleneck_blocks: int  # one 3x3 conv each

    @property
    def halo_rows(self) -> int:
        """o(M) = 2 sum floor(f/2): the 7x7 stem (3) and one 3x3 conv (1) per bottleneck block."""
        return 2 * (3 + self.bottleneck_blocks)

    @property
    def prefetch_ratio(self) -> float:
        return self.halo_rows / INPUT_ROWS

    @property
    def exchanges(self) -> int:
        """Layers whose kernel reaches a neighbour's rows: stem, max-pool, the 3x3 convs."""
        return 2 + self.bottleneck_blocks


MODELS = {"resnet101": Model("resnet101", 7.6, 33), "resnet152": Model("resnet152", 11.3, 50)}


def instance(rng: random.Random, model: Model, *, servers: int = 20, antennas: int = 2,
             delta: float | None = None, capacity_base: float = 500.0, exchange_ms: float = 1.0) -> Instance:
    """One random instance of the paper's setting, in seconds and bits."""
    delta = rng.uniform(0, 5) if delta is None else delta
    b = (150 + 50 * delta) * 1e6
    gflops = [capacity_base + 25 * rng.uniform(0, 5) for _ in range(servers)]
    exchange = exchange_ms / 1e3 + model.prefetch_ratio / model.exchanges * IMAGE_BITS / b
    return Instance(
        names=tuple(f"s{i}" for i in range(servers)),
        capacities=tuple(g * IMAGE_BITS / model.gflops for g in gflops),  # c(i) = c^(i) s / w
        antenna_names=tuple(f"a{m}" for m in range(antennas)), bandwidths=(b,) * antennas,
        data_size=IMAGE_BITS, prefetch_ratio=model.prefetch_ratio, layers=model.exchanges,
        exchange_time=exchange)


SWEEPS = {
    "bandwidth": ("bandwidth b (Mbps)", [150, 200, 250, 300, 350, 400],
                  lambda v: {"delta": (v - 150) / 50}),
    "capacity": ("server capacity base (GFLOPS, + 25 beta)", [300, 400, 500, 600, 700],
                 lambda v: {"capacity_base": float(v)}),
    "antennas": ("antennas |A|", [1, 2, 3, 4, 5], lambda v: {"antennas": v}),
    "servers": ("available servers |V|", [2, 4, 8, 12, 16, 20], lambda v: {"servers": v}),
    # Not in the paper: where MoDNN's per-layer exchanges stop dominating (see the module docstring).
    "exchange": ("latency of one MoDNN exchange (ms)", [0.01, 0.03, 0.1, 0.3, 1.0, 3.0],
                 lambda v: {"exchange_ms": v}),
}


def sweep(name: str, model: Model, samples: int, seed: int, exchange_ms: float) -> dict:
    """Mean completion time (ms) and mean servers used per algorithm at each point of one sweep."""
    label, values, params = SWEEPS[name]
    points = []
    for value in tqdm(values, desc=f"{model.name} {name}", leave=False):
        rng = random.Random(f"{seed}-{name}-{value}")
        times: dict[str, list[float]] = {a: [] for a in ALGORITHMS}
        used: dict[str, list[int]] = {a: [] for a in ALGORITHMS}
        for _ in range(samples):
            inst = instance(rng, model, **({"exchange_ms": exchange_ms} | params(value)))
            for algorithm in ALGORITHMS:
                plan = make_plan(inst, algorithm)
                times[algorithm].append(plan.completion_time * 1e3)
                used[algorithm].append(len(plan.servers))
        points.append({"value": value,
                       "mean_ms": {a: statistics.fmean(t) for a, t in times.items()},
                       "mean_servers": {a: statistics.fmean(u) for a, u in used.items()}})
    return {"label": label, "points": points}


def optimality_gap(model: Model, samples: int, seed: int, servers: int, antennas: int) -> dict:
    """THREAD / optimal on instances small enough for exhaustive search."""
    rng = random.Random(f"{seed}-gap")
    ratios = []
    for _ in tqdm(range(samples), desc=f"{model.name} gap", leave=False):
        inst = instance(rng, model, servers=servers, antennas=antennas)
        ratios.append(make_plan(inst, "thread").completion_time / optimal(inst).completion_time)
    return {"servers": servers, "antennas": antennas, "samples": samples, "mean_ratio": statistics.fmean(ratios),
            "max_ratio": max(ratios), "share_optimal": sum(r <= 1 + 1e-9 for r in ratios) / len(ratios)}


def planning_speed(servers: int = 1000, antennas: int = 4, repeats: int = 5) -> dict:
    """Wall time of THREAD and THREAD-SA on a large instance (median of ``repeats``)."""
    rng = random.Random(7)
    inst = instance(rng, MODELS["resnet101"], servers=servers, antennas=antennas)
    result = {"servers": servers, "antennas": antennas}
    for algorithm in ("thread", "thread-sa"):
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            make_plan(inst, algorithm)
            runs.append(time.perf_counter() - start)
        result[f"{algorithm}_median_s"] = statistics.median(runs)
    return result


def plot(results: dict, out: Path) -> list[str]:
    """One PNG per sweep, both models side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for name in SWEEPS:
        fig, axes = plt.subplots(1, len(results["models"]), figsize=(11, 4), squeeze=False)
        for ax, (model, data) in zip(axes[0], results["models"].items(), strict=True):
            sw = data["sweeps"][name]
            xs = [p["value"] for p in sw["points"]]
            for algorithm in ALGORITHMS:
                ax.plot(xs, [p["mean_ms"][algorithm] for p in sw["points"]], marker="o", label=algorithm)
            ax.set_title(f"{model}: completion time vs {name}")
            ax.set_xlabel(sw["label"])
            ax.set_ylabel("mean completion time (ms)")
            ax.set_yscale("log")
            if name == "exchange":
                ax.set_xscale("log")
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.text(0.01, 0.01, "simulation of the paper's model (not a measurement)", fontsize=8)
        fig.tight_layout()
        path = out / f"fig_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(str(path))
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/planner_sim", help="folder for results.json and the PNGs")
    p.add_argument("--samples", type=int, default=500, help="random instances per point (paper: 500)")
    p.add_argument("--gap-samples", type=int, default=200)
    p.add_argument("--exchange-ms", type=float, default=1.0, help="fixed latency of one MoDNN exchange")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} python {platform.python_version()}".strip(),
        "setting": {"image_bits": IMAGE_BITS, "exchange_ms": args.exchange_ms, "samples": args.samples,
                    "default_antennas": 2, "default_servers": 20},
        "models": {},
    }
    for model in MODELS.values():
        results["models"][model.name] = {
            "gflops": model.gflops, "prefetch_ratio": model.prefetch_ratio, "exchanges": model.exchanges,
            "sweeps": {name: sweep(name, model, args.samples, args.seed, args.exchange_ms) for name in SWEEPS},
            "optimality_gap": [optimality_gap(model, args.gap_samples, args.seed, n, a)
                               for n, a in ((6, 2), (8, 2), (6, 3))],
        }
    results["planning_speed"] = planning_speed()
    results["plots"] = plot(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(summary(results))
    return 0


def summary(results: dict) -> str:
    """A markdown summary of the headline numbers."""
    lines = []
    for model, data in results["models"].items():
        point = next(p for p in data["sweeps"]["servers"]["points"] if p["value"] == 20)
        ms = point["mean_ms"]
        lines.append(f"{model} (r_o = {data['prefetch_ratio']:.3f}, 20 servers, 2 antennas): "
                     + ", ".join(f"{a} {ms[a]:.2f} ms ({point['mean_servers'][a]:.1f} servers)" for a in ALGORITHMS)
                     + f"; MoDNN-SA / THREAD = {ms['modnn-sa'] / ms['thread']:.2f}")
        for gap in data["optimality_gap"]:
            lines.append(f"  THREAD / optimal on {gap['servers']} servers, {gap['antennas']} antennas: mean "
                         f"{gap['mean_ratio']:.6f}, max {gap['max_ratio']:.6f}, optimal in "
                         f"{100 * gap['share_optimal']:.0f}% of {gap['samples']}")
    speed = results["planning_speed"]
    lines.append(f"planning {speed['servers']} servers on {speed['antennas']} antennas: THREAD "
                 f"{speed['thread_median_s'] * 1e3:.1f} ms, THREAD-SA {speed['thread-sa_median_s'] * 1e3:.1f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
