"""A search beside live frames yields the camera's CPU: the budget is read from the process's cgroups, the pace
holds a thread to a share of it, and the search calls the pace without changing what it finds."""

from __future__ import annotations

import time

from deepco_device.cpu_share import Pacer, cpu_budget

from deepco.partition import Partitioner, load_model
from deepco.planning.pacing import paced
from deepco.planning.staged import CostModel, Rates, search


def test_the_budget_is_the_tightest_quota_along_the_cgroup_path(tmp_path):
    """cgroup v1 (cpu.cfs_quota_us over cpu.cfs_period_us, -1 unlimited) and v2 (cpu.max), a parent's limit
    binding a child's; no quota at all leaves the CPUs the process may run on."""
    v1 = tmp_path / "v1"
    for path, quota in (("cpu", -1), ("cpu/testbed", 40000), ("cpu/testbed/device", 100000)):
        (v1 / path).mkdir(parents=True)
        (v1 / path / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        (v1 / path / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup-v1"
    proc.write_text("4:memory:/x\n1:cpu:/testbed/device\n0::/\n")
    assert cpu_budget(proc, v1) == 0.4

    v2 = tmp_path / "v2"
    (v2 / "camera").mkdir(parents=True)
    (v2 / "cpu.max").write_text("max 100000\n")
    (v2 / "camera" / "cpu.max").write_text("10000 100000\n")
    proc.write_text("0::/camera\n")
    assert cpu_budget(proc, v2) == 0.1
    proc.write_text("0::/\n")
    assert cpu_budget(proc, v2) >= 1.0  # no quota: the CPUs


def test_a_pacer_holds_a_thread_to_what_the_other_threads_leave_of_the_budget():
    """Alone, a paced thread takes ``ceiling`` of the budget; beside threads that use all of it (the live frames
    on a weak camera), only ``floor`` of it."""
    import threading

    def paced_work(pacer: Pacer, cpu: float) -> float:
        pacer()
        began, cpu0 = time.monotonic(), time.thread_time()
        while time.thread_time() - cpu0 < cpu:
            sum(range(2_000))
            pacer()
        return time.monotonic() - began

    assert paced_work(Pacer(ceiling=0.5, cores=0.4), 0.1) >= 0.45  # 0.1 s of CPU at 0.2 s a second

    stop = threading.Event()

    def frames() -> None:
        while not stop.is_set():
            sum(range(2_000))

    busy = threading.Thread(target=frames)
    busy.start()
    try:
        took = paced_work(Pacer(share=0.9, floor=0.1, cores=0.2), 0.01)  # the other thread takes over 0.18 core
    finally:
        stop.set()
        busy.join()
    assert took >= 0.3  # 0.01 s of CPU at the floor, 0.02 s a second: half a second (the ceiling: 0.2 s)


def test_a_paced_search_yields_between_candidates_and_finds_the_same_plans():
    costs = CostModel(Partitioner(load_model("resnet18", 64, 64), 64, 64), 3 * 64 * 64, 4000)
    rates = Rates({"s0": 4e10, "s1": 3e10}, [12.5e6, 12.5e6], 0.005, 1e10, 1e8, 0.001)
    calls = []
    with paced(lambda: calls.append(1)):
        yielded = search(costs, rates, ["s0", "s1"])
    plain = search(costs, rates, ["s0", "s1"])
    assert len(calls) > 10
    assert [p.to_dict() for p in yielded] == [p.to_dict() for p in plain]
    calls.clear()
    search(costs, rates, ["s0", "s1"])
    assert calls == []  # no pace set: none called


def test_a_pace_whose_clocks_are_dear_still_leaves_the_thread_its_allowance(monkeypatch):
    """Under a tight CPU quota reading a CPU clock is dear (tens of microseconds), and the reads count against
    the thread's own allowance. A pace that reads them on every call and after every nap spent all of it on
    itself: the work behind it never ended. Here each read burns 100 us of this thread's CPU."""
    import threading
    import types

    import deepco_device.cpu_share as cpu_share

    def dear(clock):
        def read() -> float:
            until = time.thread_time() + 1e-4
            while time.thread_time() < until:
                pass
            return clock()
        return read

    monkeypatch.setattr(cpu_share, "time", types.SimpleNamespace(
        monotonic=time.monotonic, sleep=time.sleep, thread_time=dear(time.thread_time),
        process_time=dear(time.process_time)))
    pacer = Pacer(ceiling=0.25, cores=0.4)  # alone: 0.1 of a core
    took: list[float] = []

    def work() -> None:
        pacer()
        began, cpu0 = time.monotonic(), time.thread_time()
        while time.thread_time() - cpu0 < 0.05:  # the clocks' reads included
            sum(range(2_000))
            pacer()
        took.append(time.monotonic() - began)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert took, "the paced work did not end within 10 s (0.05 s of CPU at 0.1 of a core takes 0.5 s)"
    assert 0.4 <= took[0] <= 2.0
