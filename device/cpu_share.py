"""The camera's CPU budget, and a pace for background work that leaves most of it to the live frames.

A camera in a container, or an edge box under a CPU quota, may use a fraction of a core however many cores
it sees: the budget is the tightest CFS quota of the cgroups this process is in (cgroup v1's
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, v2's ``cpu.max``, along the path to the root), else the CPUs it
may run on. `Pacer` holds a thread to what the process's other threads leave of that budget
(deepco.planning.pacing says why).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
SHARE = 0.9  # of the camera's CPU budget, what a paced search and the live frames may take together
FLOOR = 0.05  # of the budget, what a paced search takes however busy the frames are (so that it ends)
CEILING = 0.25  # of the budget, what a paced search takes however idle: the frames' need comes in bursts (a
# send, a decode), and a quota spent early in its period makes them wait for the next one
LOOK_EVERY = 0.002  # seconds of work between two looks at the CPU clocks
NAP = 0.01  # seconds: the shortest nap of a thread ahead of its pace
LONGEST_NAP = 0.05  # seconds: the longest, after which the frames' use is looked at again


def _limits(directory: Path, stop: Path) -> list[float]:
    """The quotas (cores) set on ``directory`` and its parents up to ``stop``."""
    found = []
    while True:
        try:
            v2 = (directory / "cpu.max").read_text().split()
            if v2 and v2[0] != "max":
                found.append(int(v2[0]) / int(v2[1]))
        except (OSError, ValueError, IndexError):
            try:
                quota = int((directory / "cpu.cfs_quota_us").read_text())
                period = int((directory / "cpu.cfs_period_us").read_text())
                if quota > 0 and period > 0:
                    found.append(quota / period)
            except (OSError, ValueError):
                pass
        if directory == stop or directory.parent == directory:
            return found
        directory = directory.parent


def cpu_budget(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = ROOT) -> float:
    """Cores this process may use: its cgroups' tightest CPU quota, else the CPUs it may run on."""
    cpus = float(len(os.sched_getaffinity(0)))
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return cpus
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",")
        if controllers == "":  # cgroup v2: one hierarchy
            base = root
        elif "cpu" in names:  # cgroup v1: the cpu controller's hierarchy, mounted alone or with cpuacct
            base = next((root / m for m in (controllers, "cpu", "cpu,cpuacct") if (root / m).is_dir()), None)
            if base is None:
                continue
        else:
            continue
        quotas += _limits(base / path.lstrip("/"), base)
    return min([cpus, *quotas])


class Pacer:
    """Called between units of work on one thread: sleeps while that thread's CPU time since the first call is
    over what it may take. It may take ``share`` of the camera's budget (``cores``, default `cpu_budget`) less
    what the process's other threads (the live frames) used meanwhile, never less than ``floor`` of the
    budget, so that it ends, and never more than ``ceiling``. On the testbed's 0.1-core camera a search held to
    half of the budget, or to what the frames' average use left, still took the frames around it from 90 to
    150-450 ms (their sends waited for the quota's next period)."""

    def __init__(self, share: float = SHARE, floor: float = FLOOR, ceiling: float = CEILING,
                 cores: float | None = None):
        self.budget = cpu_budget() if cores is None else cores
        self.share, self.floor, self.ceiling = share, floor, ceiling
        self._start: tuple[float, float, float] | None = None  # wall, process CPU, this thread's CPU
        self._next_look = 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if self._start is None:
            self._start = now, time.process_time(), time.thread_time()
            self._next_look = now + LOOK_EVERY
            return
        # The CPU clocks are system calls (the wall clock is not), and they count against the thread's own
        # allowance: read on every call, and again after each nap that ended as soon as the thread was back on
        # pace, the pace's own clock reads and wake-ups took the whole allowance at a 0.1-core quota (1,100 naps
        # a second; a search that takes 0.3 s of CPU alone had not ended after 360 s). So the clocks are read at
        # most every LOOK_EVERY of work, and a thread ahead of its pace naps at least NAP at a time.
        if now < self._next_look:
            return
        wall0, process0, mine0 = self._start
        while True:
            elapsed = time.monotonic() - wall0
            mine = time.thread_time() - mine0
            others = time.process_time() - process0 - mine
            left = self.share * self.budget - others / max(elapsed, 1e-3)
            rate = self.budget * min(self.ceiling, max(self.floor, left / self.budget))
            ahead = mine / rate - elapsed
            if ahead <= 0:
                break
            time.sleep(min(max(ahead, NAP), LONGEST_NAP))  # then looked at again: the frames' use changes
        self._next_look = time.monotonic() + LOOK_EVERY
