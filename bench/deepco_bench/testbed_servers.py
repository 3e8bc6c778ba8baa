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


def serve_argv(tb: Testbed, k: int) -> list[str]:
    """The `deepco serve` of server k in ``tb`` (--peers: server-to-server exchanges cross the namespaces'
    non-loopback addresses)."""
    servers = len(tb.spec.servers)
    ports = [PORT if tb.kernel else PORT + j for j in range(servers)]
    host = "0.0.0.0" if tb.kernel else "127.0.0.1"
    peers = ",".join(f"{tb.server_host(j, 0)}:{ports[j]}" for j in range(servers))
    return [sys.executable, "-m", "deepco", "serve", "--host", host, "--threads", "1", "--max-models", "64",
            "--max-inflight", "8",  # room for two pipelined frames' jobs (each holds a thread per feeder)
            "--peers", peers, "--port", str(ports[k])]


def start_server(tb: Testbed, k: int, log) -> subprocess.Popen:
    """Start server k of ``tb`` (its output to ``log``) and wait until it listens; its process."""
    proc = tb.spawn(serve_argv(tb, k), server=k, stdout=subprocess.PIPE, stderr=log, text=True)
    line = proc.stdout.readline()
    if "listening" not in line:
        raise UserError(f"server s{k} did not start in the testbed (it printed {line.strip()!r})")
    return proc


def start_servers(tb: Testbed, workdir: Path, name: str) -> tuple[Path, list]:
    """Start a `deepco serve` in every server of ``tb``, apply their CPU shares once they listen; the cluster
    file the device reads (cluster-NAME.toml in ``workdir``) and the servers' log files."""
    cluster, _, logs = set_up_servers(tb, workdir, name)
    return cluster, logs


def set_up_servers(tb: Testbed, workdir: Path, name: str,
                   up: int | None = None) -> tuple[Path, list[subprocess.Popen | None], list]:
    """`start_servers`, but only the first ``up`` servers (the cluster file names them all): the cluster file,
    each server's process (None: not started) and the servers' log files."""
    servers = len(tb.spec.servers)
    ports = [PORT if tb.kernel else PORT + k for k in range(servers)]
    logs = [(workdir / f"server-{k}.log").open("w") for k in range(servers)]
    procs = [start_server(tb, k, logs[k]) if up is None or k < up else None for k in range(servers)]
    tb.apply_cpu_limits(device=False)  # only now: start-up at a tenth of a core would take a while
    return write_cluster(workdir / f"cluster-{name}.toml", tb, ports, tb.spec.antenna_mbps[0]), procs, logs
