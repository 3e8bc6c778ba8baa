"""Scheduling policies by name; each is an object the simulator drives (see ``base.Policy``)."""

from __future__ import annotations

from collections.abc import Callable

from deepco.scheduling.policies.base import Policy
from deepco.scheduling.policies.baselines import BatchSche, Drf, Fifo, Srtf, TiresiasL
from deepco.scheduling.policies.online_batch import OnlineBatch
from deepco.scheduling.policies.preemptive import Preemptive

POLICIES: dict[str, Callable[[int, str], Policy]] = {
    "online-batch": lambda seed, gang: OnlineBatch(),
    "preemptive": lambda seed, gang: Preemptive(seed=seed),
    "preemptive-edge": lambda seed, gang: Preemptive(edge_only=True, seed=seed),
    "fifo": lambda seed, gang: Fifo(gang=gang),
    "drf": lambda seed, gang: Drf(gang=gang),
    "srtf": lambda seed, gang: Srtf(gang=gang),
    "tiresias-l": lambda seed, gang: TiresiasL(gang=gang),
    "batchsche": lambda seed, gang: BatchSche(gang=gang),
}


def make_policy(name: str, seed: int = 0, gang: str = "demand") -> Policy:
    """A fresh policy object by name (KeyError for an unknown name); ``gang`` sizes the job-level baselines'
    gangs: the job's ``demand`` or all its ``chunks``."""
    return POLICIES[name](seed, gang)


__all__ = ["POLICIES", "Policy", "make_policy"]
