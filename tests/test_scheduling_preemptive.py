"""Wang et al.'s A_online: eq. (5) by hand, the dispatch rule, HAPRF preemption without migration, A_ps."""

from __future__ import annotations

import pytest
from test_scheduling_model import job, make_cluster

from deepco.scheduling import bind_delays, simulate
from deepco.scheduling.policies.preemptive import Chunk, Preemptive, q_value


def chunk(j, gamma: float, remaining_time: float, rate: float = 1.0) -> Chunk:
    return Chunk(job=j, index=0, gamma=gamma, release=0, remaining=remaining_time * rate, plan_rate=rate,
                 seq=0)


def eq5(delta, d, proc, ahead_remaining, behind_weights):
    """Eq. (5) written out: dispatch + waiting + processing + delay caused to lower-rate chunks."""
    return delta / d + sum(ahead_remaining) / d + proc / d + proc * sum(behind_weights)


def test_q_value_matches_eq_5_for_higher_and_lower_rate_queues():
    # job: D = 2 chunks of M = 4 mini-batches, E = 1, rate n = 1/0.5 = 2 -> a chunk takes E M / n = 2 slots,
    # gamma = n / (E D M) = 2 / 8 = 0.25; Delta = 1, arriving now (t = 0), so t0 = 1
    j = job(0, chunks=2, minibatches=4, worker_time=0.5)
    other = job(9, chunks=4)
    # a queued chunk with a higher rate (0.5) and 3 slots left: after the 1 slot before t0, 2 are left
    q, start = q_value(j, 1, 0, [chunk(other, 0.5, 3.0)], j.rate(False))
    assert q == pytest.approx(eq5(1, 2, 2.0, [2.0], []))  # 0.5 + 1 + 1 = 2.5
    assert start == pytest.approx(1 + 2.0)
    # a lower-rate chunk (0.1) of a 4-chunk job, still pending at t0: delays it by the new chunk's 2 slots
    q, start = q_value(j, 1, 0, [chunk(other, 0.1, 3.0)], j.rate(False))
    assert q == pytest.approx(eq5(1, 2, 2.0, [], [1 / 4]))  # 0.5 + 1 + 2 * 0.25 = 2.0
    assert start == pytest.approx(1.0)
    # a chunk that completes before t0 is not in A(t0)
    q, _ = q_value(j, 1, 0, [chunk(other, 0.5, 0.5)], j.rate(False))
    assert q == pytest.approx(eq5(1, 2, 2.0, [], []))


def test_haprf_preempts_the_slower_chunk_which_resumes_on_its_own_worker():
    # one edge worker and PS, no upload delay; the cloud 10 slots away
    cl = make_cluster([(1, 1)], cloud_delay=10)
    # A: one chunk of 10 mini-batches at 2/slot = 5 slots, gamma_A = 2/10 = 0.2
    # B arrives at 1: 4 mini-batches = 2 slots, gamma_B = 2/4 = 0.5 > gamma_A
    a = job(0, arrival=0, minibatches=10, worker_time=0.5)
    b = job(1, arrival=1, minibatches=4, worker_time=0.5)
    bind_delays([a, b], cl)
    pol = Preemptive(seed=0)
    r = simulate(cl, [a, b], pol)
    # A on the edge: Q_edge = 0 + 0 + 5/1 = 5 < Q_cloud = 10 + 5 = 15.
    # B: Q_edge = 0 + 0 + 2 + 2 * (1/D_A = 1) = 4 (A is pending at t0 = 1 with 4 slots left and a lower
    # rate) < Q_cloud = 10 + 2 = 12, so B goes to the edge worker and preempts A.
    assert pol.alpha[(0, 0)] == pytest.approx(5.0)
    assert pol.alpha[(1, 0)] == pytest.approx(4.0)
    res = {j.id: j for j in r.jobs}
    # A runs slot 0; B runs slots 1-2 (c_B = 3, JCT 2); A resumes in slots 3-6 (c_A = 7, JCT 7)
    assert (res[1].completion, res[1].jct) == (3, 2)
    assert (res[0].completion, res[0].jct) == (7, 7)
    assert res[0].preemptions == 1 and res[1].preemptions == 0
    assert pol.dispatched_servers(0) == {0} and pol.dispatched_servers(1) == {0}  # data never moved


def test_a_job_whose_first_chunk_is_best_on_the_cloud_goes_wholly_to_the_cloud():
    # edge worker busy with a long higher-rate queue; cloud 2 slots away: Q_cloud = 2/3 + (E M / n)/3
    cl = make_cluster([(1, 1)], cloud_delay=2)
    long_ = job(0, arrival=0, minibatches=2, epochs=20, worker_time=0.5)  # 40 mini-batches, 20 slots
    j = job(1, arrival=0, chunks=3, minibatches=4, worker_time=0.5)  # 3 chunks of 2 slots each
    bind_delays([long_, j], cl)
    pol = Preemptive(seed=0)
    r = simulate(cl, [long_, j], pol)
    # j: gamma = 2/12 > gamma_long = 2/40, so on the edge it would wait for nothing but delay long_ by
    # 2 slots per chunk: Q_edge = 0 + 0 + 2/3 + 2 * 1 = 2.67 > Q_cloud = 2/3 + 2/3 = 1.33 -> cloud,
    # all three chunks (Alg. 2 lines 12-16), run from slot 2 in parallel for 2 slots: c = 4.
    assert pol.alpha[(1, 0)] == pytest.approx(2 / 3 + 2 / 3)
    assert pol.dispatched_servers(1) == {1}
    res = {x.id: x for x in r.jobs}
    assert res[1].completion == 4 and res[1].cloud
    assert res[0].completion == 20 and not res[0].cloud


def test_edge_only_variant_never_uses_the_cloud_and_ps_is_kept_while_running():
    cl = make_cluster([(2, 2), (2, 2)], cloud_delay=0)
    jobs = [job(i, arrival=i, chunks=3, minibatches=3, worker_time=0.5, grad=1.0, bandwidth=4.0)
            for i in range(6)]
    bind_delays(jobs, cl)
    pol = Preemptive(edge_only=True, seed=1)
    r = simulate(cl, jobs, pol)
    assert not any(j.cloud for j in r.jobs)
    assert all(pol.dispatched_servers(j.id) <= {0, 1} for j in jobs)
