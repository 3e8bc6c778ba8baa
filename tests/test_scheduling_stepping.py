"""Running several identical slots in one step (``stable_until``) must not change any result."""

from __future__ import annotations

import copy

import pytest

from deepco.cluster import parse_cluster
from deepco.scheduling import POLICIES, SimCluster, bind_delays, make_policy, simulate
from deepco.scheduling.policies.baselines import Srtf, TiresiasL
from deepco.scheduling.policies.online_batch import OnlineBatch
from deepco.scheduling.synthetic import synthetic_jobs


def same_slot_by_slot(make, cloud: dict | None = None, max_chunks: int | None = None) -> None:
    """``make()`` gives a fresh policy; run it with its steps and one slot per step, and compare."""
    data = {"device": {"antennas": 1, "bandwidth": 1.0},
            "sites": [{"name": "edge", "upload_delay": 1, "upload_delay_max": 4},
                      {"name": "cloud", "kind": "cloud", "upload_delay": 10, "upload_delay_max": 40}],
            "servers": [{"name": f"e{i}", "capacity": 1.0, "site": "edge", "worker_slots": w, "ps_slots": p}
                        for i, (w, p) in enumerate([(8, 2), (4, 1), (2, 1), (6, 3)])]
            + [{"name": "cloud", "capacity": 1.0, "site": "cloud", **(cloud or {})}]}
    cl = SimCluster.from_cluster(parse_cluster(data))
    jobs = synthetic_jobs(25, seed=7, preset="she", horizon=60)
    for j in jobs:  # shorter jobs keep the test fast; the mix of sizes is what matters
        j.epochs = max(1, j.epochs // 10)
        if max_chunks:
            j.chunks = min(j.chunks, max_chunks)
            j.demand = min(j.demand, j.chunks)
    bind_delays(jobs, cl, seed=7)
    fast = simulate(cl, copy.deepcopy(jobs), make())
    slow_policy = make()
    slow_policy.stable_until = lambda t, state: t  # one slot per step
    slow = simulate(cl, copy.deepcopy(jobs), slow_policy)
    assert [(j.id, j.start, j.completion, j.preemptions, j.cloud) for j in fast.jobs] == \
        [(j.id, j.start, j.completion, j.preemptions, j.cloud) for j in slow.jobs]
    assert fast.edge_busy == pytest.approx(slow.edge_busy)


@pytest.mark.parametrize("name", list(POLICIES))
def test_multi_slot_steps_equal_slot_by_slot(name):
    same_slot_by_slot(lambda: make_policy(name, 3))


@pytest.mark.parametrize("name", [n for n in POLICIES if n != "preemptive"])
def test_steps_equal_slot_by_slot_on_a_finite_cloud(name):
    # at most 3 chunks a job: with 20-50 each job would take the whole small cluster for the earliest
    # completion, and online-batch would accept one job per doubling round (exponential waits)
    same_slot_by_slot(lambda: make_policy(name, 3), {"worker_slots": 6, "ps_slots": 2}, max_chunks=3)


@pytest.mark.parametrize("make", [lambda: Srtf(gang="chunks", static=True, pinned=True),
                                  lambda: Srtf(gang="chunks", cloud_at_arrival=True),
                                  lambda: TiresiasL(gang="chunks", cloud_at_arrival=True),
                                  lambda: OnlineBatch(cj_loop=False)])
def test_steps_equal_slot_by_slot_for_the_ablations(make):
    same_slot_by_slot(make)
