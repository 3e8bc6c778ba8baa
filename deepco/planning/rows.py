"""From a THREAD plan to integer rows on a real network: the exact cost model instead of the linear r_o.

The abstract planner decides *which* servers, on *which* antenna and in *which* order (THREAD's
association and TSP order). This module then sizes each server's slice in whole rows of the cut tensor,
using the partitioner's exact cost of every slice (input rows with their real halo, clipped at the image
edges; FLOPs including the redundant halo work; the bytes returned), so that all servers finish
together: the smallest T for which, walking the servers in image order, each takes as many rows as it
can finish by T, and the rows run out. Finish time of a server = when its antenna has sent the slices
before it + its own transfer + its compute + the return of its rows (+ a fixed per-request overhead).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from deepco.planning.plan import Instance, Plan, PlanningError


@dataclass(frozen=True)
class SliceBill:
    """What one slice costs: bytes sent, FLOPs computed, bytes returned."""

    input_bytes: int
    flops: int
    output_bytes: int


@dataclass(frozen=True)
class Node:
    """A server as the row planner sees it: its name and its measured speed on the head."""

    name: str
    flops_per_second: float


@dataclass
class RowSlice:
    """One server's slice: output rows [start, stop) of the cut and its predicted timeline (seconds)."""

    name: str
    antenna: int
    order: int
    start: int
    stop: int
    transfer_start: float
    transfer_time: float
    compute_time: float
    return_time: float
    finish_time: float


@dataclass
class RowPlan:
    """Integer slices for every selected server, and the predicted frame time."""

    algorithm: str
    rows: int
    slices: list[RowSlice] = field(default_factory=list)
    completion_time: float = 0.0  # slices done and returned
    tail_time: float = 0.0
    overhead: float = 0.0

    @property
    def frame_time(self) -> float:
        """Predicted end-to-end time of one frame: slices, then the tail."""
        return self.completion_time + self.tail_time

    def to_dict(self) -> dict:
        """JSON form."""
        return {"algorithm": self.algorithm, "rows": self.rows, "completion_time": self.completion_time,
                "tail_time": self.tail_time, "frame_time": self.frame_time, "overhead": self.overhead,
                "slices": [asdict(s) for s in self.slices]}


def abstract_instance(nodes: Sequence[Node], antenna_bytes_per_second: Sequence[float], image_bytes: int,
                      image_flops: int, halo_fraction: float) -> Instance:
    """The paper's instance for measured servers: s = image bytes, w = head FLOPs of the whole image,
    c(i) = measured FLOP/s x s / w, r_o = the cut's exact interior halo as a fraction of the image."""
    return Instance(
        names=tuple(n.name for n in nodes),
        capacities=tuple(n.flops_per_second * image_bytes / image_flops for n in nodes),
        antenna_names=tuple(f"a{m}" for m in range(len(antenna_bytes_per_second))),
        bandwidths=tuple(antenna_bytes_per_second), data_size=float(image_bytes),
        prefetch_ratio=min(1.0, halo_fraction))


def association(plan: Plan, inst: Instance) -> list[list[int]]:
    """The servers of an abstract plan, per antenna (all of ``inst``'s) in transfer order, as indices."""
    index = {name: i for i, name in enumerate(inst.names)}
    groups: list[list[int]] = [[] for _ in inst.antenna_names]
    for a in sorted(plan.servers, key=lambda a: a.order):
        groups[inst.antenna_names.index(a.antenna)].append(index[a.name])
    return groups


def _slice(node: Node, antenna: int, position: int, start: int, stop: int, sent: float, bandwidth: float,
           bill: Callable[[int, int], SliceBill], overhead: float) -> RowSlice:
    """The predicted timeline of rows [start, stop) on ``node``, whose transfer may start at ``sent``."""
    cost = bill(start, stop)
    transfer, compute = cost.input_bytes / bandwidth, cost.flops / node.flops_per_second
    back = cost.output_bytes / bandwidth
    return RowSlice(node.name, antenna, position, start, stop, sent, transfer, compute, back,
                    sent + overhead + transfer + compute + back)


def _row_plan(algorithm: str, rows: int, slices: list[RowSlice], tail_time: float, overhead: float) -> RowPlan:
    plan = RowPlan(algorithm=algorithm, rows=rows, slices=slices, tail_time=tail_time, overhead=overhead)
    plan.completion_time = max(s.finish_time for s in slices)
    return plan


def size_rows(groups: Sequence[Sequence[int]], nodes: Sequence[Node], antenna_bytes_per_second: Sequence[float],
              rows: int, bill: Callable[[int, int], SliceBill], *, overhead: float = 0.0,
              tail_time: float = 0.0, algorithm: str = "thread") -> RowPlan:
    """The integer-row plan: the smallest T at which the servers, in this association (``groups[m]``:
    the servers on antenna m, in transfer order) cover all ``rows`` (to 1 microsecond), and the slices."""
    order = [(i, m, pos) for m, group in enumerate(groups) for pos, i in enumerate(group)]
    if not order:
        raise PlanningError("no server to plan on")

    def fill(total: float) -> list[RowSlice] | None:
        sent = [0.0] * len(antenna_bytes_per_second)
        cursor, out = 0, []
        for i, m, pos in order:
            if cursor >= rows:
                break

            def at(stop: int, i: int = i, m: int = m, pos: int = pos, cursor: int = cursor) -> RowSlice:
                return _slice(nodes[i], m, pos, cursor, stop, sent[m], antenna_bytes_per_second[m], bill, overhead)

            lo, hi = cursor, rows  # the largest stop in (cursor, rows] that finishes by `total`
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if at(mid).finish_time <= total:
                    lo = mid
                else:
                    hi = mid - 1
            if lo == cursor:
                continue  # not even one row in time: this server sits the frame out
            out.append(at(lo))
            sent[m] += overhead + out[-1].transfer_time
            cursor = lo
        return out if cursor >= rows else None

    i, m, pos = order[0]  # the first server, sent first, can take every row
    high = _slice(nodes[i], m, pos, 0, rows, 0.0, antenna_bytes_per_second[m], bill, overhead).finish_time
    low = 0.0
    best = fill(high)
    assert best is not None
    while high - low > 1e-6 and high - low > 1e-9 * high:
        mid = (low + high) / 2
        found = fill(mid)
        if found is None:
            low = mid
        else:
            high, best = mid, found
    # Renumber transfer order among the servers that kept rows.
    for m in range(len(antenna_bytes_per_second)):
        for pos, s in enumerate(sorted((s for s in best if s.antenna == m), key=lambda s: s.order)):
            s.order = pos
    return _row_plan(algorithm, rows, best, tail_time, overhead)


def equal_rows(nodes: Sequence[Node], antenna_bytes_per_second: Sequence[float], rows: int,
               bill: Callable[[int, int], SliceBill], *, overhead: float = 0.0, tail_time: float = 0.0) -> RowPlan:
    """The naive plan: every server, equal rows, server k on antenna k mod |A| (a baseline, and a way to
    force a multi-server split in tests)."""
    antennas = len(antenna_bytes_per_second)
    k = min(len(nodes), rows)
    bounds = [round(j * rows / k) for j in range(k + 1)]
    sent = [0.0] * antennas
    slices = []
    for j in range(k):
        m = j % antennas
        s = _slice(nodes[j], m, j // antennas, bounds[j], bounds[j + 1], sent[m], antenna_bytes_per_second[m],
                   bill, overhead)
        sent[m] += overhead + s.transfer_time
        slices.append(s)
    return _row_plan("equal", rows, slices, tail_time, overhead)


__all__ = ["Node", "RowPlan", "RowSlice", "SliceBill", "abstract_instance", "association", "equal_rows",
           "size_rows"]
