"""THREAD-SA (SSP + TSP) and THREAD (antenna association + eq. 14, then TSP per antenna).

Where the paper is loose we are correct, and say so here:
- TSP "randomly picks" the transfer order. We send in selection order (strongest first, as the
  paper's Example 3) and, if that gives some server a negative ratio, in ascending capacity order,
  which maximises the smallest share (an adjacent-swap argument: putting the weaker of two neighbours
  first never lowers the smaller of their two shares and leaves every other share unchanged). If that
  order still yields a negative ratio, the selection is infeasible and is not returned.
- SSP and THREAD stop "when the completion time stops decreasing". We evaluate every prefix of the
  capacity order (still O(|V|) and O(|V||A|)) and keep the best feasible one, which is the paper's
  answer whenever T is unimodal in the number of servers, and never worse when it is not.
- THREAD's association rule ignores per-antenna bandwidth, so with unequal antennas it can lose to
  a single antenna; THREAD returns the better of its association and THREAD-SA, so it is never worse.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from deepco.planning.law import (
    RATIO_EPS,
    capacity_from_log_growth,
    equal_finish_merged,
    equal_finish_time,
    halo_ratio,
    transfer_schedule,
)
from deepco.planning.plan import Assignment, Instance, Plan


def schedule_groups(inst: Instance, groups: Sequence[Sequence[int]], algorithm: str) -> Plan | None:
    """TSP on every antenna for a given association; None if no order keeps all ratios >= 0.

    ``groups[m]`` lists the servers on antenna m in their preferred transfer order.
    """
    selected = sum(len(g) for g in groups)
    halo = halo_ratio(inst.prefetch_ratio, selected)
    total, _ = equal_finish_time(
        inst.data_size, halo, [(inst.bandwidths[m], [inst.capacities[i] for i in g])
                               for m, g in enumerate(groups)])
    plan = Plan(algorithm=algorithm, completion_time=total, halo_ratio=halo)
    for m, group in enumerate(groups):
        if not group:
            continue
        b = inst.bandwidths[m]
        ascending = sorted(group, key=lambda i: (inst.capacities[i], i))
        for order in (list(group), ascending):
            sched = transfer_schedule(inst.data_size, b, [inst.capacities[i] for i in order], total, halo)
            if all(r >= -RATIO_EPS for r, _ in sched):
                break
        else:
            return None
        for pos, (i, (ratio, start)) in enumerate(zip(order, sched, strict=True)):
            received = (max(ratio, 0.0) + halo) * inst.data_size
            transfer = received / b
            compute = received / inst.capacities[i]
            plan.servers.append(Assignment(
                name=inst.names[i], antenna=inst.antenna_names[m], order=pos, ratio=max(ratio, 0.0),
                transfer_start=start, transfer_time=transfer, compute_start=start + transfer,
                compute_time=compute, exchange_time=0.0, finish_time=start + transfer + compute))
    return plan


def _best_feasible(candidates: list[tuple[float, int]], build) -> Plan | None:
    """Try candidates (time, key) from the fastest; the first feasible one wins (ties: smaller key)."""
    for _, key in sorted(candidates):
        plan = build(key)
        if plan is not None:
            return plan
    return None


def _prefix_times(inst: Instance, order: list[int], antenna: int) -> list[tuple[float, int]]:
    """T(top-n) by eq. (11) on one antenna for n = 1..|V|, in O(|V|)."""
    b, s = inst.bandwidths[antenna], inst.data_size
    growth = 0.0
    times = []
    for n, i in enumerate(order, start=1):
        growth += math.log1p(inst.capacities[i] / b)
        cap = capacity_from_log_growth(b, growth)
        halo = halo_ratio(inst.prefetch_ratio, n)
        times.append(((1.0 + n * halo) * (s / b + s / cap), n))
    return times


def thread_sa(inst: Instance) -> Plan:
    """THREAD-SA: the optimum on one antenna (the best one when antennas differ)."""
    order = inst.by_capacity()
    best: Plan | None = None
    for m in range(len(inst.bandwidths)):
        def build(n: int, m: int = m) -> Plan | None:
            groups = [[] for _ in inst.bandwidths]
            groups[m] = order[:n]
            return schedule_groups(inst, groups, "thread-sa")
        plan = _best_feasible(_prefix_times(inst, order, m), build)
        if plan is not None and (best is None or plan.completion_time < best.completion_time):
            best = plan
    assert best is not None, "a single server is always feasible"
    return best


def greedy_association(inst: Instance) -> tuple[list[int], list[int]]:
    """THREAD's association: servers strongest first, each to the antenna whose servers merge to the
    weakest c(G_m) (ties: lowest antenna). Returns (servers in selection order, antenna of each)."""
    order = inst.by_capacity()
    growth = [0.0] * len(inst.bandwidths)
    placed: list[int] = []
    for i in order:
        merged = [capacity_from_log_growth(b, g) if g > 0 else 0.0 for b, g in zip(inst.bandwidths, growth,
                                                                                   strict=True)]
        m = min(range(len(merged)), key=lambda a: (merged[a], a))
        growth[m] += math.log1p(inst.capacities[i] / inst.bandwidths[m])
        placed.append(m)
    return order, placed


def association_steps(inst: Instance, algorithm: str) -> list[list[list[int]]]:
    """The associations THREAD (or THREAD-SA, on its best antenna) considers, one per number of selected
    servers t = 1..|V|: ``steps[t-1][m]`` lists antenna m's servers in transfer order. A planner with an
    exact cost model evaluates each and keeps the best, as SSP does with eq. (11)."""
    if algorithm == "thread-sa":
        order = inst.by_capacity()
        best = min(range(len(inst.bandwidths)), key=lambda m: (-inst.bandwidths[m], m))
        steps = []
        for t in range(1, len(order) + 1):
            groups: list[list[int]] = [[] for _ in inst.bandwidths]
            groups[best] = order[:t]
            steps.append(groups)
        return steps
    order, placed = greedy_association(inst)
    steps = []
    for t in range(1, len(order) + 1):
        groups = [[] for _ in inst.bandwidths]
        for i, m in zip(order[:t], placed[:t], strict=True):
            groups[m].append(i)
        steps.append(groups)
    return steps


def thread(inst: Instance) -> Plan:
    """THREAD: strongest server first, each to the antenna whose servers merge to the weakest c(G_m)."""
    order, placed = greedy_association(inst)
    antennas = len(inst.bandwidths)
    growth = [0.0] * antennas
    members = [0] * antennas
    candidates = []
    for t, (i, m) in enumerate(zip(order, placed, strict=True), start=1):
        growth[m] += math.log1p(inst.capacities[i] / inst.bandwidths[m])
        members[m] += 1
        merged = [capacity_from_log_growth(inst.bandwidths[a], growth[a]) if members[a] else 0.0
                  for a in range(antennas)]
        total, ratios = equal_finish_merged(
            inst.data_size, halo_ratio(inst.prefetch_ratio, t),
            [(inst.bandwidths[a], merged[a], members[a]) for a in range(antennas)])
        if all(g >= -RATIO_EPS for g in ratios):
            candidates.append((total, t))

    def build(t: int) -> Plan | None:
        groups: list[list[int]] = [[] for _ in range(antennas)]
        for i, m in zip(order[:t], placed[:t], strict=True):
            groups[m].append(i)
        return schedule_groups(inst, groups, "thread")

    associated = _best_feasible(candidates, build)
    single = thread_sa(inst)
    if associated is None or single.completion_time < associated.completion_time * (1 - 1e-12):
        single.algorithm = "thread"
        return single
    return associated
