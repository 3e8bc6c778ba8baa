"""`deepco demo`: three local servers, a clip made from a real photo, EfficientNet-Lite0 with its real
ImageNet weights, a THREAD plan, one line per frame; everything shut down at the end and on Ctrl-C."""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from deepco.errors import UserError

LISTENING = re.compile(r"deepco serve: listening on (\S+)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `deepco demo`."""
    p.add_argument("--servers", type=int, default=3, help="local `deepco serve` processes (default 3)")
    p.add_argument("--antennas", type=int, default=2)
    p.add_argument("--bandwidth", type=float, default=200.0,
                   help="Mbit/s per antenna, EMULATED by app-level pacing on loopback (default 200)")
    p.add_argument("--frames", type=int, default=24)
    p.add_argument("--model", default="efficientnet-lite0")
    p.add_argument("--input-size", default="224x224", metavar="HxW")
    p.add_argument("--algorithm", default="thread", choices=["thread", "thread-sa", "single", "equal"])
    p.add_argument("--json-log", metavar="FILE")
    p.add_argument("--save-outputs", metavar="FILE.npz")


@contextlib.contextmanager
def local_servers(count: int, threads: int = 1, extra: tuple[str, ...] = ()) -> Iterator[list[str]]:
    """Start ``count`` `deepco serve` processes on free loopback ports (``extra``: more flags); stop them
    (SIGTERM) on exit."""
    procs: list[subprocess.Popen] = []
    addresses: list[str] = []
    try:
        for _ in range(count):
            proc = subprocess.Popen([sys.executable, "-m", "deepco", "serve", "--port", "0", "--threads", str(threads),
                                     *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            procs.append(proc)
            line = proc.stdout.readline()
            match = LISTENING.search(line)
            if not match:
                raise UserError(f"a local `deepco serve` did not start (it printed {line.strip()!r})")
            addresses.append(match.group(1))
            # keep draining stdout so the server never blocks on a full pipe
            threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield addresses
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def write_cluster(path: Path, addresses: list[str], antennas: int, bandwidth: float) -> Path:
    """A cluster file for local servers."""
    lines = ["[device]", f"antennas = {antennas}", f"bandwidth = {bandwidth}", ""]
    for i, address in enumerate(addresses):
        lines += ["[[servers]]", f'name = "local{i + 1}"', "capacity = 1.0", f'address = "{address}"', ""]
    path.write_text("\n".join(lines))
    return path


def grace_hopper() -> Path:
    """matplotlib's sample photo of Grace Hopper (shipped with matplotlib, no download)."""
    import matplotlib

    path = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    if not path.exists():
        raise UserError(f"matplotlib's sample picture is missing at {path}")
    return path


def run(args: argparse.Namespace) -> int:
    """Servers up, clip made, device run, servers down."""
    from device import run_command
    from device.sources import make_pan_zoom_clip

    if not 1 <= args.servers <= 16:
        raise UserError(f"--servers must be in 1..16, got {args.servers}")
    with tempfile.TemporaryDirectory(prefix="deepco-demo-") as tmp:
        clip = make_pan_zoom_clip(grace_hopper(), Path(tmp) / "grace_hopper_pan_zoom.avi", frames=args.frames)
        print(f"demo: clip {clip.name}: {args.frames} frames panning and zooming over grace_hopper.jpg "
              f"(written with OpenCV's VideoWriter, FFV1)", flush=True)
        with local_servers(args.servers) as addresses:
            print(f"demo: {len(addresses)} local servers: {', '.join(addresses)}", flush=True)
            print(f"demo: EMULATED links: {args.antennas} antenna(s) at {args.bandwidth:g} Mbit/s each, by app-level "
                  "pacing on loopback; all servers share this machine's cores", flush=True)
            cluster = write_cluster(Path(tmp) / "cluster.toml", addresses, args.antennas, args.bandwidth)
            # exactly what `deepco run` would parse, so every flag it has gets its default
            parser = argparse.ArgumentParser()
            run_command.add_arguments(parser)
            argv = ["--cluster", str(cluster), "--model", args.model, "--input-size", args.input_size,
                    "--source", str(clip), "--frames", str(args.frames), "--algorithm", args.algorithm, "--pace"]
            argv += ["--save-outputs", args.save_outputs] if args.save_outputs else []
            argv += ["--json-log", args.json_log] if args.json_log else []
            code = run_command.run(parser.parse_args(argv))
        print("demo: servers stopped", flush=True)
    return code
