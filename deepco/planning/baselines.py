"""Baselines: MoDNN over one or several antennas, the single best server, and exhaustive `optimal`.

MoDNN (Mao et al., DATE'17) as the CONVENE paper models it (Example 1, Fig. 6): every server gets a
disjoint slice proportional to its capacity, no halo; the servers compute layer by layer and exchange
boundary rows with their neighbours before each layer, so none can run ahead of the slowest transfer:
T = (time until the last slice has arrived) + s / sum c(i) + |M| x exchange_time.
MoDNN-MA spreads the servers over the antennas to balance their computing overheads (footnote vii):
strongest first, each to the antenna whose transfer would end earliest.
"""

from __future__ import annotations

import itertools
import math

from deepco.planning.law import RATIO_EPS, equal_finish_time, halo_ratio
from deepco.planning.plan import Assignment, Instance, Plan, PlanningError
from deepco.planning.thread import schedule_groups

OPTIMAL_MAX_ASSIGNMENTS = 300_000


def _best_antenna(inst: Instance) -> int:
    return min(range(len(inst.bandwidths)), key=lambda m: (-inst.bandwidths[m], m))


def _modnn(inst: Instance, groups: list[list[int]], algorithm: str) -> Plan:
    total_capacity = math.fsum(inst.capacities)
    compute = inst.data_size / total_capacity  # r_i s / c(i) with r_i = c(i) / sum c
    servers = sum(len(g) for g in groups)
    exchange = inst.layers * inst.exchange_time if servers > 1 else 0.0
    sent = []
    for m, group in enumerate(groups):
        start = 0.0
        for pos, i in enumerate(group):
            ratio = inst.capacities[i] / total_capacity
            transfer = ratio * inst.data_size / inst.bandwidths[m]
            sent.append((m, pos, i, ratio, start, transfer))
            start += transfer
    all_arrived = max(start + transfer for _, _, _, _, start, transfer in sent)
    finish = all_arrived + compute + exchange
    plan = Plan(algorithm=algorithm, completion_time=finish, halo_ratio=0.0)
    for m, pos, i, ratio, start, transfer in sent:
        plan.servers.append(Assignment(
            name=inst.names[i], antenna=inst.antenna_names[m], order=pos, ratio=ratio,
            transfer_start=start, transfer_time=transfer, compute_start=all_arrived,
            compute_time=compute, exchange_time=exchange, finish_time=finish))
    return plan


def modnn_sa(inst: Instance) -> Plan:
    """MoDNN over the best antenna: every server, ratios proportional to capacity."""
    groups: list[list[int]] = [[] for _ in inst.bandwidths]
    groups[_best_antenna(inst)] = inst.by_capacity()
    return _modnn(inst, groups, "modnn-sa")


def modnn_ma(inst: Instance) -> Plan:
    """MoDNN with the servers spread over all antennas to balance their transfer (and compute) load."""
    groups: list[list[int]] = [[] for _ in inst.bandwidths]
    load = [0.0] * len(inst.bandwidths)
    for i in inst.by_capacity():
        m = min(range(len(load)), key=lambda a: ((load[a] + inst.capacities[i]) / inst.bandwidths[a], a))
        groups[m].append(i)
        load[m] += inst.capacities[i]
    return _modnn(inst, groups, "modnn-ma")


def single(inst: Instance) -> Plan:
    """The whole image on the one server (and antenna) that finishes first: no split, no halo."""
    i, m = min(itertools.product(range(len(inst.capacities)), range(len(inst.bandwidths))),
               key=lambda im: (inst.data_size / inst.bandwidths[im[1]]
                               + inst.data_size / inst.capacities[im[0]], im))
    groups: list[list[int]] = [[] for _ in inst.bandwidths]
    groups[m] = [i]
    plan = schedule_groups(inst, groups, "single")
    assert plan is not None
    return plan


def optimal(inst: Instance, limit: int = OPTIMAL_MAX_ASSIGNMENTS) -> Plan:
    """Exhaustive search over server subsets and antenna associations (small instances only).

    Each server is unused or on one of the antennas: (|A| + 1)^|V| associations. For each, the
    equal-finish time of eq. (14) is the best that association can do; it counts only if some transfer
    order keeps every ratio >= 0 (checked by `schedule_groups`).
    """
    n, a = len(inst.capacities), len(inst.bandwidths)
    count = (a + 1) ** n
    if count > limit:
        raise PlanningError(f"optimal: {n} servers on {a} antennas means {count} associations, above the "
                            f"limit of {limit}; use --algorithm thread for instances this large")
    order = inst.by_capacity()
    best: Plan | None = None
    for choice in itertools.product(range(a + 1), repeat=n):
        groups: list[list[int]] = [[] for _ in range(a)]
        for i, m in zip(order, choice, strict=True):
            if m:
                groups[m - 1].append(i)
        selected = sum(len(g) for g in groups)
        if not selected:
            continue
        total, ratios = equal_finish_time(
            inst.data_size, halo_ratio(inst.prefetch_ratio, selected),
            [(inst.bandwidths[m], [inst.capacities[i] for i in g]) for m, g in enumerate(groups)])
        if any(g < -RATIO_EPS for g in ratios):
            continue
        if best is not None and total >= best.completion_time:
            continue
        plan = schedule_groups(inst, groups, "optimal")
        if plan is not None:
            best = plan
    assert best is not None, "a single server is always feasible"
    return best
