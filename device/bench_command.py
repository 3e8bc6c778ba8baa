"""`deepco bench`: measured frame latency of each algorithm on an emulated edge network.

Builds the testbed (deepco.testbed: servers in network namespaces, antennas shaped with tc, CPU shares
enforced with cgroup quotas), starts a real `deepco serve` in every server namespace, and runs the device
benchmark (device.benchmark) in the device namespace: one device, the algorithms interleaved frame by
frame. Prints a table, writes JSON and a plot; `--sweep` repeats it over bandwidth, capacity, antennas or
servers like the paper's Figs. 9-12. Every output is labelled with what was emulated and how.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from deepco.errors import UserError
from deepco.testbed import ServerSpec, Testbed, TestbedSpec

DEFAULT_SHARES = (0.45, 0.30, 0.15, 0.10)  # the heterogeneous servers, fractions of one core
PORT = 50051
SWEEPS = {
    "bandwidth": [25.0, 50.0, 100.0, 200.0, 400.0],
    "capacity": [0.5, 0.75, 1.0, 1.5, 2.0],  # multiplies every server's CPU share
    "antennas": [1, 2, 3, 4],
    "servers": [1, 2, 3, 4],
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `deepco bench`."""
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--antennas", type=int, default=2)
    p.add_argument("--bandwidth", type=float, default=100.0, metavar="MBPS", help="per antenna (default 100)")
    p.add_argument("--shares", default=None,
                   help="CPU share of each server, comma-separated (default 0.45,0.30,0.15,0.10 ...)")
    p.add_argument("--device-share", type=float, default=0.5,
                   help="the device's own CPU share of a core (default 0.5: a camera, not a workstation)")
    p.add_argument("--peer-bandwidth", default="same", metavar="MBPS|same|lan",
                   help="each server's own link, which MoDNN's exchanges cross: Mbit/s, 'same' as the antennas "
                        "(default: wireless peers) or 'lan' (unshaped)")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--input-size", default="224x224", metavar="HxW")
    p.add_argument("--algorithms", default="thread,thread-sa,modnn-sa,modnn-ma,single")
    p.add_argument("--frames", type=int, default=20)
    p.add_argument("--cut", default="auto")
    p.add_argument("--sweep", choices=list(SWEEPS), default=None)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    p.add_argument("--fallback", action="store_true", help="force the no-root fallback (loopback + pacing)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one testbed run may take (default 600)")


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


def peer_bandwidth(text: str, antenna_mbps: float) -> float | None:
    """--peer-bandwidth: Mbit/s, 'same' (as the antennas) or 'lan' (None: unshaped)."""
    if text == "same":
        return antenna_mbps
    if text == "lan":
        return None
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"--peer-bandwidth must be a number of Mbit/s, 'same' or 'lan', got {text!r}") from None
    if value <= 0:
        raise UserError(f"--peer-bandwidth must be positive, got {text!r}")
    return value


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


def one_point(args: argparse.Namespace, servers: int, antennas: int, bandwidth: float, scale: float,
              workdir: Path) -> dict:
    """Build a testbed, start servers, run the device benchmark in it, tear it all down."""
    shares = shares_for(args, servers, scale)
    spec = TestbedSpec(antenna_mbps=(bandwidth,) * antennas,
                       servers=tuple(ServerSpec(f"s{k}", cpu) for k, cpu in enumerate(shares)),
                       device_cpu=args.device_share, peer_mbps=peer_bandwidth(args.peer_bandwidth, bandwidth))
    with Testbed(spec, force_fallback=args.fallback, defer_cpu_limits=True) as tb:
        print(tb.label, flush=True)
        ports = [PORT if tb.kernel else PORT + k for k in range(servers)]
        host = "0.0.0.0" if tb.kernel else "127.0.0.1"
        # --peers: MoDNN's server-to-server exchanges cross the namespaces' (non-loopback) addresses.
        peers = ",".join(f"{tb.server_host(k, 0)}:{ports[k]}" for k in range(servers))
        serve = [sys.executable, "-m", "deepco", "serve", "--host", host, "--threads", "1", "--max-models", "64",
                 "--peers", peers]
        logs = [(workdir / f"server-{k}.log").open("w") for k in range(servers)]
        procs = [tb.spawn([*serve, "--port", str(ports[k])], server=k, stdout=subprocess.PIPE,
                          stderr=logs[k], text=True) for k in range(servers)]
        for k, proc in enumerate(procs):
            line = proc.stdout.readline()
            if "listening" not in line:
                raise UserError(f"server s{k} did not start in the testbed (it printed {line.strip()!r})")
        tb.apply_cpu_limits()  # only now: start-up at a tenth of a core would take a while
        cluster = write_cluster(workdir / f"cluster-{servers}-{antennas}-{bandwidth:g}-{scale:g}.toml", tb, ports,
                                bandwidth)
        out = workdir / "point.json"
        worker = [sys.executable, "-m", "device.benchmark", "--cluster", str(cluster), "--model", args.model,
                  "--input-size", args.input_size, "--algorithms", args.algorithms, "--frames", str(args.frames),
                  "--cut", args.cut, "--label", tb.label, "--out", str(out)]
        if spec.peer_mbps is not None:
            worker += ["--peer-mbps", str(spec.peer_mbps)]
        if not tb.kernel:
            worker.append("--pace")
        try:
            code = tb.spawn(worker).wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            code = None
        if code != 0:
            for k, log in enumerate(logs):
                log.flush()
                tail = (workdir / f"server-{k}.log").read_text().strip().splitlines()[-3:]
                print(f"server s{k} log (last lines): " + " | ".join(tail), file=sys.stderr)
            why = f"exit {code}" if code is not None else f"no result within --timeout {args.timeout:g} s"
            raise UserError(f"the device benchmark failed ({why}; see the messages above)")
        point = json.loads(out.read_text())
    point.update({"servers": servers, "antennas": antennas, "bandwidth_mbps": bandwidth, "cpu_shares": shares,
                  "device_share": args.device_share, "peer_bandwidth": args.peer_bandwidth})
    return point


def table(point: dict) -> str:
    """One point's results as a table (milliseconds)."""
    lines = [point["label"],
             f"model {point['model']} {point['input_size']}, cut {point['cut']}, {point['servers']} servers "
             f"(CPU shares {', '.join(map(str, point['cpu_shares']))}), {point['antennas']} antenna(s) at "
             f"{point['bandwidth_mbps']:g} Mbit/s, device CPU share {point['device_share']:g}, "
             f"server-to-server links: {point['peer_bandwidth']}",
             f"{'algorithm':<10} {'mean':>8} {'p50':>8} {'p95':>8} {'predicted':>10} {'meas/pred':>10} {'frames':>7} "
             f"{'max error':>10}"]
    for name, r in point["algorithms"].items():
        ratio = r["measured_over_predicted"]
        lines.append(f"{name:<10} {r['mean'] * 1e3:>8.1f} {r['p50'] * 1e3:>8.1f} {r['p95'] * 1e3:>8.1f} "
                     f"{r['predicted'] * 1e3:>10.1f} {ratio:>10.2f} {r['frames']:>7} {r['max_relative_error']:>10.1e}")
    if "thread" in point["algorithms"]:
        base = point["algorithms"]["thread"]["mean"]
        lines.append("latency / THREAD's: " + ", ".join(f"{n} {r['mean'] / base:.2f}"
                                                       for n, r in point["algorithms"].items()))
    return "\n".join(lines)


def plot(document: dict, path: str) -> None:
    """Bars (one point) or lines (a sweep) of mean latency, p95 whiskers, predicted markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = document["points"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    algorithms = list(points[0]["algorithms"])
    if document.get("sweep"):
        xs = [p[document["sweep_key"]] for p in points]
        for name in algorithms:
            ax.plot(xs, [p["algorithms"][name]["mean"] * 1e3 for p in points], marker="o", label=f"{name} measured")
            ax.plot(xs, [p["algorithms"][name]["predicted"] * 1e3 for p in points], linestyle=":",
                    color=ax.lines[-1].get_color(), label=f"{name} predicted")
        ax.set_xlabel(document["sweep"])
    else:
        point = points[0]
        means = [point["algorithms"][n]["mean"] * 1e3 for n in algorithms]
        p95 = [point["algorithms"][n]["p95"] * 1e3 for n in algorithms]
        ax.bar(algorithms, means, yerr=[[0] * len(means), [b - a for a, b in zip(means, p95, strict=True)]],
               capsize=4, label="measured mean (whisker: p95)")
        ax.scatter(algorithms, [point["algorithms"][n]["predicted"] * 1e3 for n in algorithms], color="black",
                   marker="_", s=400, zorder=3, label="predicted")
    ax.set_ylabel("frame latency (ms)")
    ax.set_title(f"{points[0]['model']} {points[0]['input_size']}: measured on an EMULATED edge network")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.text(0.01, 0.01, points[0]["label"][:160], fontsize=6)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (or a sweep) and report."""
    if args.frames <= 0 or args.servers <= 0 or args.antennas <= 0 or args.bandwidth <= 0:
        raise UserError("--frames, --servers, --antennas and --bandwidth must be positive")
    started = time.perf_counter()
    values: list = [None] if args.sweep is None else SWEEPS[args.sweep]
    points = []
    with tempfile.TemporaryDirectory(prefix="deepco-bench-") as tmp:
        for value in values:
            servers, antennas, bandwidth, scale = args.servers, args.antennas, args.bandwidth, 1.0
            if args.sweep == "bandwidth":
                bandwidth = value
            elif args.sweep == "capacity":
                scale = value
            elif args.sweep == "antennas":
                antennas = value
            elif args.sweep == "servers":
                servers = value
            point = one_point(args, servers, antennas, bandwidth, scale, Path(tmp))
            point["capacity_scale"] = scale
            points.append(point)
            print(table(point), flush=True)
    key = {"bandwidth": "bandwidth_mbps", "capacity": "capacity_scale", "antennas": "antennas",
           "servers": "servers"}.get(args.sweep or "")
    document = {"command": "deepco bench " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 else "deepco bench",
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores, python "
                           f"{platform.python_version()}",
                "seconds": time.perf_counter() - started, "sweep": args.sweep, "sweep_key": key, "points": points}
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=2))
    if args.plot:
        plot(document, args.plot)
    print(f"bench: {len(points)} testbed(s) in {document['seconds']:.0f} s", flush=True)
    return 0
