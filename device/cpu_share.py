"""The camera's CPU budget, and a pace for background work that leaves most of it to the live frames.

A camera in a container, or an edge box under a CPU quota, may use a fraction of a core however many cores
it sees: the budget is the tightest CFS quota of the cgroups this process is in (cgroup v1's
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, v2's ``cpu.max``, along the path to the root), else the CPUs it
may run on. `Pacer` keeps a thread's CPU time at most a share of that budget (deepco.planning.pacing says
why).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
SHARE = 0.5  # of the camera's CPU budget, what a paced search may take: the frames keep the rest


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
    """Called between units of work on one thread: sleeps as long as that thread's CPU time since the first
    call is over ``share`` of ``cores`` (default: `cpu_budget`) times the wall time since then."""

    def __init__(self, share: float = SHARE, cores: float | None = None):
        self.rate = share * (cpu_budget() if cores is None else cores)
        self._cpu0: float | None = None
        self._wall0 = 0.0

    def __call__(self) -> None:
        if self._cpu0 is None:
            self._cpu0, self._wall0 = time.thread_time(), time.monotonic()
            return
        ahead = (time.thread_time() - self._cpu0) / self.rate - (time.monotonic() - self._wall0)
        if ahead > 0:
            time.sleep(ahead)
