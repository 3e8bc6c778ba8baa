"""CONVENE planning: pure functions from a cluster instance to a `Plan`."""

from __future__ import annotations

from collections.abc import Callable

from deepco.planning.baselines import modnn_ma, modnn_sa, optimal, single
from deepco.planning.plan import Assignment, Instance, Plan, PlanningError
from deepco.planning.thread import thread, thread_sa

ALGORITHMS: dict[str, Callable[[Instance], Plan]] = {
    "thread": thread,
    "thread-sa": thread_sa,
    "modnn-sa": modnn_sa,
    "modnn-ma": modnn_ma,
    "single": single,
    "optimal": optimal,
}


def make_plan(inst: Instance, algorithm: str = "thread") -> Plan:
    """Plan ``inst`` with the named algorithm (one of ALGORITHMS)."""
    try:
        planner = ALGORITHMS[algorithm]
    except KeyError:
        raise PlanningError(f"unknown algorithm {algorithm!r} (choose from {', '.join(ALGORITHMS)})") from None
    return planner(inst)


__all__ = ["ALGORITHMS", "Assignment", "Instance", "Plan", "PlanningError", "make_plan"]
