"""The MILP lower bound (HiGHS): exact on a hand instance, and below every policy on small random ones."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from test_scheduling_model import job, make_cluster

from deepco.scheduling import POLICIES, Job, bind_delays, make_policy, simulate
from deepco.scheduling.lower_bound import lower_bound


def test_single_worker_optimum_is_shortest_processing_time_first():
    # one worker, two jobs at t = 0 needing 1 and 3 slots: SPT gives JCTs 1 and 4, total 5 (the optimum)
    cl = make_cluster([(1, 1)])
    jobs = [job(0, 0, minibatches=3), job(1, 0, minibatches=1)]
    bind_delays(jobs, cl)
    lb = lower_bound(cl, jobs, upper=7)
    assert lb.total_jct == pytest.approx(5)
    assert simulate(cl, copy.deepcopy(jobs), make_policy("srtf")).total_jct == 5


def test_upload_delay_and_cloud_enter_the_bound():
    # edge: one worker, Delta = 0; cloud: Delta = 2, unbounded. Two jobs at t = 0 with D = 3 chunks of one
    # mini-batch (3 slots on one worker). Edge only: 3 + 6 = 9. Better: one on the edge (JCT 3), the other
    # on the cloud from slot 2 with 3 workers, done in one slot (JCT 3): total 6, the optimum.
    cl = make_cluster([(1, 1)], cloud_delay=2)
    jobs = [job(0, 0, chunks=3, minibatches=1), job(1, 0, chunks=3, minibatches=1)]
    bind_delays(jobs, cl)
    assert lower_bound(cl, jobs, upper=9).total_jct == pytest.approx(6)


@pytest.mark.parametrize("seed", [0, 1])
def test_bound_is_below_every_policy(seed):
    rng = np.random.default_rng(seed)
    cl = make_cluster([(2, 1), (2, 1)], edge_delay=1, cloud_delay=4)
    jobs = [Job(id=i, arrival=int(rng.integers(0, 5)), chunks=int(rng.integers(1, 4)),
                minibatches=int(rng.integers(2, 5)), epochs=int(rng.integers(1, 3)),
                worker_time=float(rng.uniform(0.2, 0.5)), ps_time=0.05, grad_size=1.0,
                bandwidth=float(rng.uniform(10, 40))) for i in range(5)]
    bind_delays(jobs, cl)
    totals = {n: simulate(cl, copy.deepcopy(jobs), make_policy(n)).total_jct for n in POLICIES}
    lb = lower_bound(cl, jobs, upper=min(totals.values()))
    assert lb.total_jct > 0
    for name, total in totals.items():
        assert total >= lb.total_jct - 1e-6, name
