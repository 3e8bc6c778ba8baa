"""The servers of a testbed run: their CPU shares, a `deepco serve` in each, and the cluster file the device
reads (shared by `deepco bench`'s points and its scenarios)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from deepco.errors import UserError
from deepco_bench.testbed import Testbed, cpu_quota_group

DEFAULT_SHARES = (0.45, 0.30, 0.15, 0.10)  # the heterogeneous servers, fractions of one core
PORT = 50051


@contextlib.contextmanager
def server_under_quota(share: float, *serve_args: str, period_us: int = 100_000) -> Iterator[str]:
    """A `deepco serve` on loopback (``serve_args`` added) whose process runs in a cpu cgroup of its own with
    ``share`` of a core (EMULATED: a weaker server); yields its address."""
    with cpu_quota_group(f"deepco-quota-{os.getpid()}-{share}", share, period_us) as procs:
        proc = subprocess.Popen([sys.executable, "-m", "deepco", "serve", "--port", "0", *serve_args],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                preexec_fn=lambda: procs.write_text(str(os.getpid())))
        try:
            listening = re.search(r"listening on (\S+)", proc.stdout.readline())
            if not listening:
                raise UserError("the quota'd server did not start")
            yield listening.group(1)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def shares_for(args: argparse.Namespace, servers: int, scale: float = 1.0) -> list[float]:
    """Each server's CPU share."""
    if args.shares:
        try:
            shares = [float(v) for v in args.shares.split(",")]
        except ValueError:
            raise UserError(f"--shares must be numbers, got {args.shares!r}") from None
    else:
        shares = [DEFAULT_SHARES[k % len(DEFAULT_SHARES)] for k in range(servers)]
    if len(shares) < servers:
        raise UserError(f"--shares gives {len(shares)} shares for {servers} servers")
    return [round(s * scale, 3) for s in shares[:servers]]


def write_cluster(path: Path, tb: Testbed, ports: list[int], bandwidth: float) -> Path:
    """The cluster file the device reads: every server's address on every antenna."""
    antennas = len(tb.spec.antenna_mbps)
    lines = ["[device]", f"antennas = {antennas}", f"bandwidth = {bandwidth}", ""]
    for k, server in enumerate(tb.spec.servers):
        addresses = ", ".join(f'"{tb.server_host(k, m)}:{ports[k]}"' for m in range(antennas))
        lines += ["[[servers]]", f'name = "{server.name}"', f"capacity = {server.cpu or 1.0}",
                  f"antenna_addresses = [{addresses}]", ""]
    path.write_text("\n".join(lines))
    return path


def start_servers(tb: Testbed, workdir: Path, name: str) -> tuple[Path, list]:
    """Start a `deepco serve` in every server of ``tb``, apply their CPU shares once they listen; the cluster
    file the device reads (cluster-NAME.toml in ``workdir``) and the servers' log files."""
    servers = len(tb.spec.servers)
    ports = [PORT if tb.kernel else PORT + k for k in range(servers)]
    host = "0.0.0.0" if tb.kernel else "127.0.0.1"
    # --peers: server-to-server exchanges cross the namespaces' (non-loopback) addresses.
    peers = ",".join(f"{tb.server_host(k, 0)}:{ports[k]}" for k in range(servers))
    serve = [sys.executable, "-m", "deepco", "serve", "--host", host, "--threads", "1", "--max-models", "64",
             "--max-inflight", "8",  # room for two pipelined frames' jobs (each holds a thread per feeder)
             "--peers", peers]
    logs = [(workdir / f"server-{k}.log").open("w") for k in range(servers)]
    procs = [tb.spawn([*serve, "--port", str(ports[k])], server=k, stdout=subprocess.PIPE,
                      stderr=logs[k], text=True) for k in range(servers)]
    for k, proc in enumerate(procs):
        line = proc.stdout.readline()
        if "listening" not in line:
            raise UserError(f"server s{k} did not start in the testbed (it printed {line.strip()!r})")
    tb.apply_cpu_limits(device=False)  # only now: start-up at a tenth of a core would take a while
    return write_cluster(workdir / f"cluster-{name}.toml", tb, ports, tb.spec.antenna_mbps[0]), logs
