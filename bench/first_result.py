"""How soon `deepco run` gives its first result, cold and warm, and what it sends the servers meanwhile.

    python bench/first_result.py [--model resnet18] [--input-size 224x224] [--servers 3] [--frames 60]

Cold: an empty plan cache (a fresh --plan-cache folder), an empty model cache (a fresh DEEPCO_MODEL_CACHE: the
zoo model is exported) and servers just started. Warm: the same command again, with the cold run's caches and
the servers restarted on the same ports (so they hold no models).
Each time counts from the process start, the model's export included, to the first `frame N:` line. The
bytes are what the device sent the servers until its `plan:` line (models, probes and frames), as its
client counts them. Also the p50 of the first 30 frames' latencies (cold: calibration's live frames among
them). One JSON object on stdout.

    python bench/first_result.py --bandwidth 8 [--input-size 224x224]     # needs root

With ``--bandwidth`` it runs in the camera preset's EMULATED testbed instead of on loopback (network namespaces,
two antennas shaped by tc to that many Mbit/s, servers under cgroup CPU quotas of 0.45, 0.45, 0.35, 0.35 core,
the device under 0.1 core from its process start). The model is exported beforehand and given to `deepco run`
as its ONNX file: a camera ships its model; exporting a PyTorch model on a tenth of a core is not a camera's
start-up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"


@contextlib.contextmanager
def servers(ports: list[int]):
    """`deepco serve --threads 1` on each of ``ports`` (0: any); yields their addresses."""
    procs, addresses = [], []
    try:
        for port in ports:
            proc = subprocess.Popen([sys.executable, "-m", "deepco", "serve", "--port", str(port), "--threads", "1"],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
            procs.append(proc)
            match = re.fullmatch(r"deepco serve: listening on (\S+)\n", proc.stdout.readline())
            if not match:
                raise SystemExit("deepco serve did not start")
            addresses.append(match.group(1))
        yield addresses
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)


def timed_run(cmd: list[str], models: Path, spawn=subprocess.Popen, log=None) -> dict:
    """Run ``cmd`` (started by ``spawn``) with its zoo exports kept in ``models``; seconds to its first frame
    line, MB on its `plan:` line, the first 30 frames' p50 (ms), and the p50 of the frames after its `plan:` line (the
    calibrated plan's, once its models are there)."""
    start = time.perf_counter()
    proc = spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE if log is None else subprocess.STDOUT,
                 text=True, cwd=ROOT,
                 env=dict(os.environ, DEEPCO_MODEL_CACHE=str(models)))
    first, sent, warm, latencies, planned = None, None, False, [], None
    for line in proc.stdout:
        if log is not None:
            log.write(f"{time.perf_counter() - start:7.1f} {line}")
        frame = re.match(r"frame \d+:\s+([\d.]+) ms", line)
        if frame:
            first = first if first is not None else time.perf_counter() - start
            latencies.append(float(frame.group(1)))
        if line.startswith("plan: "):
            mb = re.search(r"([\d.]+) MB sent to the servers", line)
            sent = float(mb.group(1)) if mb else None
            planned = len(latencies)
        warm = warm or line.startswith("plan cache: warm start")
    code = proc.wait()
    if code != 0:
        raise SystemExit(f"deepco run failed ({code}): "
                         f"{proc.stderr.read().strip() if proc.stderr else 'its lines are in the --log file'}")
    return {"first_result_s": first, "mb_sent_until_plan": sent, "warm_start": warm,
            "total_s": time.perf_counter() - start,
            "p50_first_30_ms": statistics.median(latencies[:30]) if latencies else None,
            # the calibrated plan's own frames: those after the `plan:` line (calibration and its uploads are over)
            "frames_after_plan": 0 if planned is None else len(latencies) - planned,
            "p50_after_plan_ms": statistics.median(latencies[planned:])
            if planned is not None and len(latencies) > planned else None}


CAMERA_SHARES = (0.45, 0.45, 0.35, 0.35)  # `deepco bench --preset camera`'s servers


def in_testbed(args: argparse.Namespace, run: list[str], folder: Path) -> dict:
    """The cold and the warm run in the camera preset's testbed at ``args.bandwidth`` Mbit/s per antenna."""
    sys.path.insert(0, str(ROOT / "bench"))
    from deepco_bench.testbed import ServerSpec, Testbed, TestbedSpec
    from deepco_bench.testbed_servers import set_up_servers, start_server

    spec = TestbedSpec(antenna_mbps=(args.bandwidth,) * 2, device_cpu=0.1,
                       servers=tuple(ServerSpec(f"s{k}", CAMERA_SHARES[k % 4]) for k in range(args.servers)))
    out = {}
    with Testbed(spec, defer_cpu_limits=True) as tb:
        if not tb.kernel:
            raise SystemExit(f"--bandwidth needs the kernel's emulation (root, tc, netns): {tb.reason}")
        out["emulation"] = tb.label
        cluster, procs, logs = set_up_servers(tb, folder, "first")
        run = [*run, "--cluster", str(cluster)]
        tb.apply_device_cpu_limit()
        out["cold"] = timed_run(run, folder / "models", spawn=tb.spawn, log=args.log)
        for k, proc in enumerate(procs):  # restarted: they hold no models
            tb.stop(proc)
            start_server(tb, k, logs[k])
        tb.apply_cpu_limits(device=False)
        out["warm"] = timed_run(run, folder / "models", spawn=tb.spawn, log=args.log)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--input-size", default="224x224")
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--frames", type=int, default=60)
    p.add_argument("--bandwidth", type=float, default=None, metavar="MBPS",
                   help="run in the camera preset's EMULATED testbed with antennas at MBPS (needs root)")
    p.add_argument("--log", type=argparse.FileType("w", bufsize=1), default=None, metavar="FILE",
                   help="write every line the runs print to FILE, each with the seconds since its run started")
    p.add_argument("--no-cache-flag", action="store_true",
                   help="for a checkout from before the plan cache: run without --plan-cache")
    args = p.parse_args()
    out = {"model": args.model, "input_size": args.input_size, "servers": args.servers, "frames": args.frames,
           "bandwidth_mbps": args.bandwidth}
    with tempfile.TemporaryDirectory() as folder:
        cluster, cache = Path(folder) / "cluster.toml", Path(folder) / "cache"
        model = args.model
        if args.bandwidth is not None:  # a camera ships its model (see the docstring)
            model = str(Path(folder) / f"{args.model}.onnx")
            subprocess.run([sys.executable, "-m", "deepco", "export", "--model", args.model, "--input-size",
                            args.input_size, "--output", model], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        run = [sys.executable, "-m", "deepco", "run", "--model", model,
               "--input-size", args.input_size, "--source", str(PHOTO), "--frames", str(args.frames),
               *([] if args.no_cache_flag else ["--plan-cache", str(cache)])]
        if args.bandwidth is not None:
            out.update(in_testbed(args, run, Path(folder)))
        else:
            run += ["--cluster", str(cluster)]
            with servers([0] * args.servers) as addresses:
                cluster.write_text("".join(f'[[servers]]\naddress = "{a}"\n' for a in addresses))
                out["cold"] = timed_run(run, Path(folder) / "models", log=args.log)
            with servers([int(a.rsplit(":", 1)[1]) for a in addresses]):  # restarted: they hold no models
                out["warm"] = timed_run(run, Path(folder) / "models", log=args.log)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
