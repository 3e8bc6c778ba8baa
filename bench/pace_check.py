"""Does a paced search leave the camera's CPU to the frames? Beside a thread that does 4 ms of CPU work every 80
ms (a frame's device work), run the planner's search for ResNet-18 at 224x224 over four servers: not at all, at
full speed, and paced (`device/cpu_share.Pacer`); print how long the search took and the worst time that work
took. Run it under the camera's quota to see what a weak camera sees, e.g. in a cgroup with a tenth of a core:

    echo $$ > /sys/fs/cgroup/cpu/GROUP/tasks; python bench/pace_check.py

(2026-11-26, Intel Xeon, 0.1-core cgroup v1 quota: unpaced 1.3 s, work up to 103 ms; paced 14 s, at most 17 ms.)
"""

from __future__ import annotations

import statistics
import threading
import time

from deepco_device.cpu_share import Pacer, cpu_budget

from deepco.partition import Partitioner, load_model
from deepco.planning.pacing import paced
from deepco.planning.staged import CostModel, Rates, search

SERVERS = ["s0", "s1", "s2", "s3"]
WORK, EVERY = 0.004, 0.08  # a frame's device CPU and its period


def frames(stop: threading.Event, took: list[float]) -> None:
    """The frames' device work: WORK seconds of CPU every EVERY seconds, each's wall time in ``took``."""
    while not stop.is_set():
        began, cpu = time.monotonic(), time.thread_time()
        while time.thread_time() - cpu < WORK:
            sum(range(1000))
        took.append(time.monotonic() - began)
        time.sleep(EVERY)


def main() -> None:
    costs = CostModel(Partitioner(load_model("resnet18", 224, 224), 224, 224), 3 * 224 * 224, 4000)
    rates = Rates({"s0": 47e9, "s1": 44e9, "s2": 41e9, "s3": 33e9}, [13e6, 13e6], 0.009, 10e9, 100e6, 0.001)
    search(costs, rates, SERVERS)  # warm the cost model's caches, as a running device's are
    print(f"CPU budget: {cpu_budget():g} core(s)")
    for mode in ("no search", "unpaced", "paced"):
        stop, took = threading.Event(), []
        beside = threading.Thread(target=frames, args=(stop, took))
        beside.start()
        time.sleep(1.0)
        began = time.monotonic()
        if mode == "no search":
            time.sleep(2.0)
        else:
            with paced(Pacer() if mode == "paced" else None):
                search(costs, rates, SERVERS)
        searched = time.monotonic() - began
        stop.set()
        beside.join()
        print(f"{mode}: {searched:.1f} s; the frames' work p50 {statistics.median(took) * 1e3:.0f} ms, "
              f"max {max(took) * 1e3:.0f} ms over {len(took)}")


if __name__ == "__main__":
    main()
