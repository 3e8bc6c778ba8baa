"""`deepco partition`: exact data-lookahead slicing of a CNN at a cut; optionally save head, tail, slices."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import onnx

from deepco.commands.export import add_model_arguments
from deepco.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `deepco partition`."""
    add_model_arguments(p)
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument(
        "--slices", type=int, metavar="K", help="K slices of (nearly) equal output rows at the cut"
    )
    how.add_argument(
        "--rows",
        metavar="r0,r1,...",
        help="output row boundaries at the cut: 0, ..., the cut's height (slice i is [r_i, r_i+1))",
    )
    p.add_argument(
        "--cut",
        default="auto",
        metavar="NODE|auto",
        help="cut name (as listed), tensor or node name; auto (default) picks one and says why",
    )
    p.add_argument(
        "--cluster", metavar="FILE", help="with --cut auto: pick the cut of least predicted time here"
    )
    p.add_argument(
        "--max-halo",
        type=float,
        default=None,
        metavar="FRACTION",
        help="with --cut auto and no cluster: largest halo as a fraction of the input height (default 0.25)",
    )
    p.add_argument("--save", metavar="DIR", help="write head.onnx, tail.onnx and slices.json into DIR")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object instead of tables")


def _boundaries(part, cut, args: argparse.Namespace) -> list[int]:
    if args.slices is not None:
        return part.equal_boundaries(cut, args.slices)
    try:
        return [int(r) for r in args.rows.split(",")]
    except ValueError:
        raise UserError(f"--rows must be comma-separated integers, got {args.rows!r}") from None


def _table(part, choice, cut, slices, reason: str | None) -> str:
    lines = [
        f"model input {part.height}x{part.width}   cut: {cut.name} ({cut.tensor})   "
        f"rows at cut: {cut.height}   "
        f"total stride: {cut.stride}   halo: {cut.halo_top}+{cut.halo_bottom} rows "
        f"(paper's o(M): {cut.paper_halo})"
    ]
    if reason:
        lines.append(f"auto cut: {reason}")
    if part.stop is not None:
        lines.append(f"partitionable prefix stops at {part.stop.describe()}")
    lines.append(
        f"FLOPs: whole model {part.total_flops:.4g}, head {cut.head_flops:.4g}, tail {cut.tail_flops:.4g}"
    )
    last = part.levels[-1]
    lines.append(
        f"split stages: {part.split_share():.1%} of the FLOPs can run on row bands across scales "
        f"({len(part.levels) - 1} levels, the last {last.name!r} with {len(last.tensors)} tensor(s) at strides "
        f"{', '.join(map(str, last.strides))}); this single-tensor cut's head: "
        f"{cut.head_flops / part.total_flops if part.total_flops else 0:.1%}"
    )
    head = (
        f"{'slice':>5} {'output rows':>13} {'input rows':>13} {'crop':>11} {'in bytes':>11} "
        f"{'out bytes':>11} {'FLOPs':>11}"
    )
    lines += [head, "-" * len(head)]
    for i, s in enumerate(slices):
        lines.append(
            f"{i:>5} {str(list(s.output_rows)):>13} {str(list(s.input_rows)):>13} {str(list(s.crop)):>11} "
            f"{s.input_bytes:>11} {s.output_bytes:>11} {s.flops:>11.4g}"
        )
    redundant = sum(s.flops for s in slices) / cut.head_flops - 1 if cut.head_flops else 0.0
    lines.append(f"redundant head FLOPs (halo work): {redundant:.2%}")
    lines.append(
        "cuts: " + ", ".join(f"{c.name} (stride {c.stride}, halo {c.halo})" for c in part.cuts)
    )
    if choice is not None and choice.times:
        lines.append(
            "predicted completion time per cut: " + ", ".join(f"{n} {t:.4g}" for n, t in choice.times.items())
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Analyse, slice, print; save head/tail/slices.json when asked."""
    from deepco.partition import Partitioner, check_size, choose_cut, load_model
    from deepco.partition.choose import DEFAULT_MAX_HALO
    from deepco.partition.source import input_size

    height, width = input_size(args.model, args.input_size)
    if args.cut != "auto" and (args.cluster or args.max_halo is not None):
        raise UserError("--cluster and --max-halo only apply with --cut auto")
    if args.cluster and args.max_halo is not None:
        raise UserError("give either --cluster or --max-halo, not both")
    save = Path(args.save) if args.save else None
    if save is not None and save.exists() and not save.is_dir():
        raise UserError(f"--save {str(save)!r} exists and is not a directory")
    model = load_model(args.model, height, width, args.weights)
    check_size(model, height, width, args.model)
    part = Partitioner(model, height, width)
    choice = None
    if args.cut == "auto":
        cluster = None
        if args.cluster:
            from deepco.cluster import load_cluster

            cluster = load_cluster(args.cluster)
        choice = choose_cut(part, cluster, DEFAULT_MAX_HALO if args.max_halo is None else args.max_halo)
        cut = choice.cut
    else:
        cut = part.cut(args.cut)
    slices = part.slices(cut, _boundaries(part, cut, args))
    doc = {
        "cut": cut.name,
        "cut_tensor": cut.tensor,
        "input_size": [height, width],
        "head_output_rows": cut.height,
        "total_stride": cut.stride,
        "halo": [cut.halo_top, cut.halo_bottom],
        "paper_halo": cut.paper_halo,
        "flops": {"model": part.total_flops, "head": cut.head_flops, "tail": cut.tail_flops},
        "split_share": part.split_share(),
        "levels": [{"name": lv.name, "tensors": list(lv.tensors), "strides": list(lv.strides),
                    "head_flops": lv.head_flops} for lv in part.levels],
        "slices": [s.to_dict() for s in slices],
    }
    if choice is not None:
        doc["auto_reason"] = choice.reason
    if save is not None:
        save.mkdir(parents=True, exist_ok=True)
        head, tail = part.split(cut)
        onnx.save(head, str(save / "head.onnx"))
        onnx.save(tail, str(save / "tail.onnx"))
        (save / "slices.json").write_text(json.dumps(doc, indent=1) + "\n")
    if args.json:
        print(json.dumps(doc))
    else:
        print(_table(part, choice, cut, slices, choice.reason if choice else None))
        if save is not None:
            print(f"wrote {save / 'head.onnx'}, {save / 'tail.onnx'}, {save / 'slices.json'}")
    return 0
