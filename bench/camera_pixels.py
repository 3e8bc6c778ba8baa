"""A camera frame's pixels (device.preprocess) as `deepco run` made them before 7c8cc7b and as it makes them now,
each in a process of its own: CPU time, wall time and minor page faults a frame, frames apart as a camera's are
(--gap), OpenCV's threads at its default and at one. With --share, each process runs under a cgroup CPU quota of
that share of a core (root; EMULATED camera), as the bench's camera preset runs its device.

    python bench/camera_pixels.py                  # on this machine's free CPU
    python bench/camera_pixels.py --share 0.1      # in a tenth of a core
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import cv2
import matplotlib
import numpy as np
from deepco_device.preprocess import INTERPOLATION, Pixels, center_crop

from deepco.modelcard import IMAGENET

PHOTO = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"  # the bench's input


def before(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """The pixels as `deepco run` made them before 7c8cc7b: a new array for the resize and for the colour
    conversion, then numpy's transposed copy."""
    frame = center_crop(frame, width / height)
    resized = cv2.resize(frame, (width, height), interpolation=INTERPOLATION)
    resized = cv2.cvtColor(resized, cv2.COLOR_BGR2RGB)
    return np.ascontiguousarray(resized.transpose(2, 0, 1)[None])


def measure(variant: str, threads: int, frames: int, gap: float, height: int, width: int) -> dict:
    """One variant in this process alone (the other's arrays would change what the allocator holds): medians
    a frame."""
    if threads:
        cv2.setNumThreads(threads)
    image = cv2.imread(str(PHOTO))
    now = Pixels(height, width, IMAGENET)
    if not np.array_equal(before(image, height, width), now(image)):
        raise SystemExit("camera_pixels: the two variants' pixels differ")
    make = now if variant == "now" else (lambda f: before(f, height, width))
    seen = []
    for _ in range(frames):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        wall, cpu = time.perf_counter(), time.process_time()
        make(image)
        seen.append((time.perf_counter() - wall, time.process_time() - cpu,
                     resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
        time.sleep(gap)
    return {"variant": "Pixels (now)" if variant == "now" else "before 7c8cc7b", "opencv_threads": cv2.getNumThreads(),
            "wall_ms": round(statistics.median(x[0] for x in seen) * 1e3, 2),
            "cpu_ms": round(statistics.median(x[1] for x in seen) * 1e3, 2),
            "minor_faults": statistics.median(x[2] for x in seen)}


def main(argv: list[str] | None = None) -> int:
    """Print one line per variant and thread count."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--share", type=float, help="run under a cgroup CPU quota of this share of a core (root)")
    p.add_argument("--frames", type=int, default=30, help="frames per variant (default 30)")
    p.add_argument("--gap", type=float, default=0.2, help="seconds between two frames (default 0.2)")
    p.add_argument("--size", default="720x1280", help="HxW (default 720x1280)")
    p.add_argument("--worker", nargs=2, metavar=("VARIANT", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    height, width = (int(v) for v in args.size.split("x"))
    if args.worker is not None:
        print(json.dumps(measure(args.worker[0], int(args.worker[1]), args.frames, args.gap, height, width)))
        return 0
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{platform.machine()}, python {platform.python_version()}, {started}; {args.size}, "
          f"{args.frames} frames a variant, {args.gap:g} s apart"
          + (f", in a cgroup quota of {args.share:g} of a core (EMULATED camera)" if args.share else ", free CPU"))
    for threads in (0, 1):  # 0: OpenCV's default
        for variant in ("before", "now"):  # each in a process of its own
            command = [sys.executable, __file__, "--worker", variant, str(threads), "--frames", str(args.frames),
                       "--gap", str(args.gap), "--size", args.size]
            if args.share:
                sys.path.insert(0, str(Path(__file__).parent))
                from deepco_bench.testbed import CPU_PERIOD_US, cpu_quota_group

                with cpu_quota_group(f"deepco-camera-pixels-{variant}-{threads}", args.share, CPU_PERIOD_US) as procs:
                    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
                    procs.write_text(str(proc.pid))
                    out, _ = proc.communicate()
            else:
                out = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            print(f"{row['variant']:>15}, OpenCV threads {row['opencv_threads']}: {row['cpu_ms']:.2f} ms CPU, "
                  f"{row['wall_ms']:.1f} ms wall, {row['minor_faults']:.0f} minor page faults a frame")
    return 0


if __name__ == "__main__":
    sys.exit(main())
