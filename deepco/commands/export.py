"""`deepco export`: the whole model as one ONNX file, the reference every partitioned run must equal."""

from __future__ import annotations

import argparse
from pathlib import Path

import onnx

from deepco.errors import UserError
from deepco.parsing import SIZE_HELP


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --input-size and --weights, shared with `deepco partition`."""
    p.add_argument(
        "--model",
        required=True,
        metavar="NAME|PATH.onnx",
        help="a zoo model (resnet18/34/50/101/152, efficientnet-lite0, yolov8n, unet) or an ONNX file",
    )
    p.add_argument("--input-size", default=None, metavar="HxW", help=SIZE_HELP)
    p.add_argument(
        "--weights",
        metavar="FILE",
        help="state dict for a zoo model (default: seeded weights; EfficientNet: its ImageNet ones)",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `deepco export`."""
    add_model_arguments(p)
    p.add_argument("--output", required=True, metavar="FILE.onnx", help="where to write the model")


def run(args: argparse.Namespace) -> int:
    """Export (or re-check) the model, check that it runs at the size, and write it."""
    from deepco.partition import check_size, load_model
    from deepco.partition.graph import model_size_problem
    from deepco.partition.source import input_size

    height, width = input_size(args.model, args.input_size)
    out = Path(args.output)
    if out.is_dir():
        raise UserError(f"--output {str(out)!r} is a directory, not a file")
    if not out.parent.is_dir():
        raise UserError(f"--output: directory {str(out.parent)!r} does not exist")
    model = load_model(args.model, height, width, args.weights)
    problem = model_size_problem(model, height, width)
    if problem:
        raise UserError(problem)
    check_size(model, height, width, args.model)
    onnx.save(model, str(out))
    # a model whose size is fixed at height x width would refuse any other: that is how to tell it from a dynamic one
    fixed = model_size_problem(model, height + 1, width + 1) is not None
    size = "fixed height and width" if fixed else "dynamic height and width"
    print(f"wrote {out} ({args.model}, runs at {height}x{width}, {size})")
    return 0
