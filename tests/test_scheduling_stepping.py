"""Running several identical slots in one step (``stable_until``) must not change any result."""

from __future__ import annotations

import copy

import pytest

from deepco.cluster import parse_cluster
from deepco.scheduling import POLICIES, SimCluster, bind_delays, make_policy, simulate
from deepco.scheduling.synthetic import synthetic_jobs


@pytest.mark.parametrize("name", list(POLICIES))
def test_multi_slot_steps_equal_slot_by_slot(name):
    data = {"device": {"antennas": 1, "bandwidth": 1.0},
            "sites": [{"name": "edge", "upload_delay": 1, "upload_delay_max": 4},
                      {"name": "cloud", "kind": "cloud", "upload_delay": 10, "upload_delay_max": 40}],
            "servers": [{"name": f"e{i}", "capacity": 1.0, "site": "edge", "worker_slots": w, "ps_slots": p}
                        for i, (w, p) in enumerate([(8, 2), (4, 1), (2, 1), (6, 3)])]
            + [{"name": "cloud", "capacity": 1.0, "site": "cloud"}]}
    cl = SimCluster.from_cluster(parse_cluster(data))
    jobs = synthetic_jobs(25, seed=7, preset="she", horizon=60)
    for j in jobs:  # shorter jobs keep the test fast; the mix of sizes is what matters
        j.epochs = max(1, j.epochs // 10)
    bind_delays(jobs, cl, seed=7)
    fast = simulate(cl, copy.deepcopy(jobs), make_policy(name, 3))
    slow_policy = make_policy(name, 3)
    slow_policy.stable_until = lambda t, state: t  # one slot per step
    slow = simulate(cl, copy.deepcopy(jobs), slow_policy)
    assert [(j.id, j.start, j.completion, j.preemptions, j.cloud) for j in fast.jobs] == \
        [(j.id, j.start, j.completion, j.preemptions, j.cloud) for j in slow.jobs]
    assert fast.edge_busy == pytest.approx(slow.edge_busy)
