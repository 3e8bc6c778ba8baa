"""The policy interface the simulator drives (and a later real run would drive the same way)."""

from __future__ import annotations

from collections.abc import Sequence

from deepco.scheduling.jobs import Job
from deepco.scheduling.simulator import Allocation, SimState
from deepco.scheduling.topology import SimCluster


class Policy:
    """A scheduling policy: the simulator calls ``plan`` once, then per slot ``on_arrival``, ``schedule``,
    ``observe`` and ``on_complete``.

    ``fixed_allocation``: the policy promises (2c)-(2d), a job's workers and PS never change or pause once it
    starts; the simulator checks it. ``no_migration``: a job only ever runs on servers its data was sent to
    (``dispatched_servers``); the simulator checks it. ``needs_unbounded_cloud``: the policy's model has an
    unbounded cloud (Wang et al.) and refuses a cluster whose cloud has finite slots.
    """

    name = "policy"
    fixed_allocation = False
    no_migration = False
    needs_unbounded_cloud = False

    def plan(self, cluster: SimCluster, jobs: Sequence[Job]) -> None:
        """Planning-time hook, called once before the first slot. Online policies only keep ``cluster``."""
        self.cluster = cluster

    def on_arrival(self, t: int, jobs: list[Job]) -> None:
        """Jobs whose arrival slot is ``t`` (admission)."""

    def schedule(self, t: int, state: SimState) -> dict[int, Allocation]:
        """The allocation of every job that runs in slot ``t``; jobs left out do not run."""
        raise NotImplementedError

    def stable_until(self, t: int, state: SimState) -> int:
        """The last slot up to which the decision just made for slot ``t`` stays the same, unless a job
        arrives or completes first (the simulator then runs those slots in one step). Default: ``t``."""
        return t

    def observe(self, t: int, executed: dict[int, float]) -> None:
        """Mini-batches each running job trained since the last decision (one slot, or the several slots
        the decision was stable for)."""

    def on_complete(self, t: int, job: Job) -> None:
        """``job`` completed at time ``t``."""

    def dispatched_servers(self, job_id: int) -> set[int]:
        """Servers holding ``job_id``'s data (only asked when ``no_migration``)."""
        raise NotImplementedError
