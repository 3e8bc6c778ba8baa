"""A plan search beside the live frames on the weak camera: what it costs the frames, and the camera's CPU per frame.

    python bench/search_beside_frames.py [--frames 60] [--modes none,search,none,search] [--ceiling 0.25]  # root

On the camera preset's testbed (EMULATED: network namespaces, tc tbf per antenna at 100 Mbit/s, cgroup CPU
quotas: servers 0.45/0.45/0.35/0.35 of a core, the camera 0.1), a device process in the camera's namespace
and quota offloads ResNet-18 at 224x224 to the best server, one frame at a time, ``--frames`` per mode:
``none``, nothing beside the frames; ``search``, live adaptation's search (the staged planner's ranking of
every plan, `StagedPlanner.plans`) over and over on a thread beside them, paced as live adaptation paces a
search that need not hurry (deepco.planning.pacing, `device.cpu_share.Pacer`). Prints per mode the frames'
p50, p90 and worst latency, the device process's CPU per frame (the search's included) and the searches
done. ``--ceiling``: the most of the camera's CPU budget the search may take (the Pacer's; default as live
adaptation's). The device loads the model before its quota is applied (as `deepco bench` does).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from deepco_device.cpu_share import CEILING

SHARES = (0.45, 0.45, 0.35, 0.35)
CAMERA = 0.1
LOADED, GO = "search_beside_frames: loaded", "go"


def device_side(cluster: str, modes: list[str], frames: int, ceiling: float) -> None:
    """In the testbed's device namespace: set up, then each mode's frames; one line per mode."""
    from deepco_bench.benchmark import photo_pixels
    from deepco_device.cpu_share import Pacer
    from deepco_device.planner import StagedPlanner
    from deepco_device.preprocess import IMAGENET
    from deepco_device.runners import StagedRunner
    from deepco_device.session import Device

    from deepco.cluster import load_cluster
    from deepco.planning.pacing import paced

    dev = Device(load_cluster(cluster), "resnet18", 224, 224, algorithm="thread", depth=1, log=lambda line: None,
                 preprocessing=IMAGENET)
    with dev:
        dev.load()
        print(LOADED, flush=True)
        sys.stdin.readline()
        dev.setup()
        planner = StagedPlanner(dev)
        runner = StagedRunner(dev, planner.named("offload"))
        px = photo_pixels(224, 224, IMAGENET)

        def frame() -> float:
            start = time.perf_counter()
            runner.run_frame(px)
            return time.perf_counter() - start

        def search(stop: threading.Event, done: list[int]) -> None:
            with paced(Pacer(ceiling=ceiling)):
                while not stop.is_set():
                    done[0] += 1
                    rates = planner.rates()  # moved a little each time: a new ranking, as after a change point
                    rates.server_flops_per_second = {s: v * (1 + 1e-6 * done[0])
                                                     for s, v in rates.server_flops_per_second.items()}
                    planner.plans("latency", rates=rates)

        for _ in range(5):
            frame()
        print(f"the camera's CPU budget as it reads it: {Pacer().budget:g} cores", flush=True)
        for mode in modes:
            stop, done = threading.Event(), [0]
            beside = threading.Thread(target=search, args=(stop, done), daemon=True)
            if mode == "search":
                beside.start()
            cpu, wall = time.process_time(), time.perf_counter()
            latencies = np.array([frame() for _ in range(frames)]) * 1e3
            cpu, wall = (time.process_time() - cpu) / frames * 1e3, time.perf_counter() - wall
            stop.set()
            ending = time.perf_counter()
            if mode == "search":
                beside.join()
            ending = time.perf_counter() - ending
            each = f" ({wall / done[0]:.1f} s each; the last ended {ending:.1f} s after the frames)" if done[0] else ""
            print(f"{mode:>6}: p50 {np.median(latencies):6.1f} p90 {np.percentile(latencies, 90):6.1f} "
                  f"max {latencies.max():6.1f} ms; camera CPU {cpu:.2f} ms a frame; {done[0]} searches{each}",
                  flush=True)


def main(argv: list[str] | None = None) -> int:
    """Start the testbed and the device side; print the device's lines."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=60, help="frames per mode (default 60)")
    p.add_argument("--modes", default="none,search,none,search", help="none or search, in order")
    p.add_argument("--ceiling", type=float, default=CEILING,
                   help=f"the search's most of the camera's CPU budget (device.cpu_share.Pacer; default {CEILING})")
    p.add_argument("--device-side", nargs=2, metavar=("CLUSTER", "MODES"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device_side:
        device_side(args.device_side[0], args.device_side[1].split(","), args.frames, args.ceiling)
        return 0
    modes = args.modes.split(",")
    if set(modes) - {"none", "search"}:
        print("search_beside_frames: --modes takes none and search", file=sys.stderr)
        return 2
    import tempfile

    from deepco_bench.testbed import ServerSpec, Testbed, TestbedSpec
    from deepco_bench.testbed_servers import set_up_servers

    spec = TestbedSpec(antenna_mbps=(100.0, 100.0), device_cpu=CAMERA,
                       servers=tuple(ServerSpec(f"s{k}", share) for k, share in enumerate(SHARES)))
    with tempfile.TemporaryDirectory() as work, Testbed(spec, defer_cpu_limits=True) as tb:
        if not tb.kernel:
            print(f"search_beside_frames: needs the kernel emulation: {tb.reason}", file=sys.stderr)
            return 2
        print(tb.label, flush=True)
        cluster, _, _ = set_up_servers(tb, Path(work), "search")
        device = tb.spawn([sys.executable, __file__, "--frames", str(args.frames), "--ceiling", str(args.ceiling),
                           "--device-side", str(cluster),
                           ",".join(modes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for line in device.stdout:  # loading at a tenth of a core takes a minute: the quota comes after it
            if line.strip() == LOADED:
                break
        tb.apply_device_cpu_limit()
        device.stdin.write(GO + "\n")
        device.stdin.flush()
        for line in device.stdout:
            print(line, end="", flush=True)
        return device.wait()


if __name__ == "__main__":
    sys.exit(main())
