"""The `deepco` command line: a thin shell that dispatches each subcommand to its module.

Library commands live in deepco/commands/; the server's and the device's own commands live in those
packages (server/, device/), and `bench` and `demo` in the orchestration (deepco_bench), so that the core
library itself never imports them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys

import deepco
from deepco.errors import UserError

DESCRIPTION = ("Partitioned CNN inference at the network edge: serve models on edge servers, run a camera's frames "
               "over them on a measured plan, benchmark against the alternatives; and a training-job scheduler.")

# subcommand -> (module providing add_arguments(parser) and run(args) -> int, help)
COMMANDS = {
    "plan": ("deepco.commands.plan",
             "plan a frame's partition over the cluster (THREAD, THREAD-SA, MoDNN, ...)"),
    "export": ("deepco.commands.export",
               "export a zoo model (or re-check an ONNX file) as one ONNX model"),
    "partition": ("deepco.commands.partition",
                  "slice a CNN exactly at a cut: rows, halo, bytes, FLOPs; save head/tail"),
    "schedule": ("deepco.commands.schedule",
                 "simulate training-job schedulers (online-batch, preemptive, baselines) on a trace"),
    "models": ("deepco.commands.models",
               "list the models loaded on a cluster's servers, or unload them (--unload NAME, --all)"),
    "serve": ("deepco_server.cli",
              "serve ONNX models over the Open Inference Protocol (KServe v2 / Triton gRPC)"),
    "run": ("deepco_device.run_command",
            "the device: stream a camera/video/images through the servers on a measured plan (auto by default)"),
    "bench": ("deepco_bench.bench_command",
              "measured latency of THREAD vs MoDNN and baselines on an emulated edge network (tc, cgroups)"),
    "demo": ("deepco_bench.demo",
             "three local servers, a real photo as a clip, EfficientNet-Lite0, live per-frame results"),
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the full usage stays available with --help)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def version() -> str:
    """The installed package's version (its metadata); deepco.__version__ when run from a source tree."""
    try:
        return importlib.metadata.version("deepco")
    except importlib.metadata.PackageNotFoundError:
        return deepco.__version__


def _chosen(argv: list[str]) -> str | None:
    """The subcommand named on the command line (the first word that is not an option), if any."""
    return next((word for word in argv if not word.startswith("-")), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser with every registered subcommand; only the one ``argv`` names (every one when
    ``argv`` is None) is imported and given its arguments.

    Importing every command's module took about 2.5 s of CPU (SciPy's optimiser, the planner, the
    benchmark) before `deepco serve` or `deepco --help` could start; a command now pays only for its own.
    """
    parser = _Parser(prog="deepco", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"deepco {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    chosen = None if argv is None else _chosen(argv)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if argv is None or name == chosen:
            command = importlib.import_module(module)
            command.add_arguments(p)
            p.set_defaults(_run=command.run)
    return parser


def _run(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except UserError as exc:
        print(f"deepco {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"deepco {args.command}: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    """Entry point: run one subcommand; user errors print one line and exit 2.

    When the reader of stdout goes away (`deepco ... | head`), stop quietly with 141 (128 + SIGPIPE, what
    a shell reports for a tool killed by the signal) instead of a BrokenPipeError traceback.
    """
    try:
        code = _run(argv)
        sys.stdout.flush()  # here, not at interpreter exit, where a broken pipe can no longer be caught
        return code
    except BrokenPipeError:
        # Point stdout at /dev/null so that the interpreter's own final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
