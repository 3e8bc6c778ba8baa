"""She et al.'s A_online: geometric rounds, prices (7)-(8), the utility rule (6), COST_C and COST_D."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduling_model import job, make_cluster

from deepco.cluster import parse_cluster
from deepco.scheduling import SimCluster, SimulationError, bind_delays, make_policy, simulate
from deepco.scheduling.policies.online_batch import OnlineBatch, tau


def test_rounds_are_geometric():
    assert [tau(i) for i in range(6)] == [1, 1, 2, 4, 8, 16]


def test_price_functions_are_eqs_7_and_8():
    cl = make_cluster([(4, 2)])
    pol = OnlineBatch(horizon=10)
    pol.plan(cl, [])
    theta = 2 * 10 * 1 * 1 * 1.0 + 1  # 2 T S U F + 1 with T = 10, one edge server, one type, F = 1
    assert pol.theta1 == theta and pol.theta2 == theta
    prices = pol.worker_price(np.array([[0.0, 2.0, 4.0]]))[0]
    assert prices == pytest.approx([0.0, theta ** 0.5 - 1, theta - 1])
    assert pol.ps_price(np.array([[1.0]]))[0, 0] == pytest.approx(theta ** 0.5 - 1)


def test_jobs_wait_for_the_next_round_and_the_c_j_loop_keeps_the_earliest_completion():
    # one server, W = 2, P = 1, no delay, no cloud. A job: D = 2 chunks, M = 1, E = 2 -> 4 mini-batches
    # at p = 1/(n + H) = 2 per worker (co-located). Round 1 is [1, 2): only D_u = 2 (d = 4/(2*2) = 1 slot)
    # fits. Round 2 is [2, 4) on the idle server: D_u = 2 completes at c_j = 3, D_u = 1 (d = 2) at c_j = 4,
    # both at cost 0 (utility 1). Alg. 2 runs c_j upward and line 11 needs a strictly higher utility, so
    # c_j = 3 with 2 workers is kept (a plain D_u loop would keep D_u = 1 and finish at 4).
    cl = make_cluster([(2, 1)])
    a, b = (job(i, arrival=0, chunks=2, epochs=2, worker_time=0.5) for i in range(2))
    bind_delays([a, b], cl)
    pol = OnlineBatch(horizon=10)
    r = simulate(cl, [a, b], pol)
    log = {jid: (start, s) for start, jid, s in pol.accepted_log}
    assert log[0][0] == 1 and log[0][1].workers == {0: 2} and log[0][1].duration == 1
    # b finds no free worker in round 1 (a holds both), so it is accepted at tau_2 = 2 with both workers
    assert log[1][0] == 2 and log[1][1].workers == {0: 2} and log[1][1].duration == 1
    res = {j.id: j for j in r.jobs}
    assert (res[0].completion, res[1].completion) == (2, 3)
    assert r.total_jct == 2 + 3


def test_c_j_tie_goes_to_the_fewest_workers_that_reach_it():
    # W = 4, P = 1. One job: D = 4, M = 3, E = 1 -> 12 mini-batches, p = 2 per worker (grad 0: no comm term).
    # Round 1 [1, 2) needs 12 / (2 D_u) <= 1, D_u >= 6 > D: nothing. Round 2 [2, 4) (2 slots):
    # D_u = 2 -> d = 3 (too long); D_u = 3 -> d = 2; D_u = 4 -> d = ceil(1.5) = 2. Both end at c_j = 4 at
    # cost 0; D_u runs upward inside c_j, so 3 workers are kept. COST_D's one-server spread also costs 0,
    # and lines 7-9 take it only when strictly cheaper, so the schedule is COST_C's.
    cl = make_cluster([(4, 1)])
    j = job(0, arrival=0, chunks=4, minibatches=3, worker_time=0.5)
    bind_delays([j], cl)
    pol = OnlineBatch(horizon=10)
    r = simulate(cl, [j], pol)
    start, _, s = pol.accepted_log[0]
    assert start == 2 and s.workers == {0: 3} and s.ps == 0 and s.duration == 2
    assert r.jobs[0].completion == 4


def test_a_job_whose_cheapest_schedule_costs_at_least_one_is_postponed():
    # W = 2, P = 2. Job a (D = 1) takes one worker and one PS for the whole round [4, 8).
    # Job b (D = 1) alone on the half-used server would pay per slot lambda(1) + mu(1) =
    # 2 (theta^(1/2) - 1) >= 1, so eta_b = 1 - cost <= 0 and it waits for round [8, 16).
    cl = make_cluster([(2, 2)])
    a = job(0, arrival=3, minibatches=4)  # 4 mini-batches at 1 per slot: d = 4, ends at 8
    b = job(1, arrival=3, minibatches=2)  # d = 2
    bind_delays([a, b], cl)
    pol = OnlineBatch(horizon=10)
    r = simulate(cl, [a, b], pol)
    theta = 21.0
    price = 2 * (math.sqrt(theta) - 1)
    assert 1 - 2 * price <= 0  # the hand check of the rejection: two slots at that price
    log = {jid: (start, s) for start, jid, s in pol.accepted_log}
    assert log[0][0] == 4 and log[1][0] == 8
    res = {j.id: j for j in r.jobs}
    assert res[0].completion == 8 and res[1].completion == 10


def test_cost_d_spreads_workers_and_places_the_ps_on_a_used_server():
    # two servers with one worker each; 12 mini-batches; round [4, 8) has 4 slots.
    # D_u = 1 co-located: p = 1/(n + H) = 2 -> 6 slots, too long. D_u = 2 only fits spread (COST_D, xi = 0):
    # p = 1/(n + H + 2k/B) = 1/(0.5 + 2/12) = 1.5 per worker -> 12 / 3 = 4 slots: accepted, PS on s_1
    # (lines 13-17: a used server before the last one, cost 0 on idle servers).
    cl = make_cluster([(1, 1), (1, 1)])
    j = job(0, arrival=3, chunks=2, minibatches=6, epochs=1, worker_time=0.5, grad=1.0, bandwidth=12.0)
    bind_delays([j], cl)
    pol = OnlineBatch(horizon=10)
    r = simulate(cl, [j], pol)
    start, _, s = pol.accepted_log[0]
    assert start == 4 and s.workers == {0: 1, 1: 1} and s.ps == 0 and s.duration == 4
    assert r.jobs[0].completion == 8


def test_unbounded_cloud_is_free_but_only_after_the_upload_delay():
    # the edge server is too small (W = 1) for the job to finish within the round; the cloud (free: unbounded)
    # is used once a_j + Delta_cloud <= tau_i
    cl = make_cluster([(1, 1)], cloud_delay=3)
    j = job(0, arrival=0, chunks=4, minibatches=4, worker_time=0.5)  # 16 mini-batches
    bind_delays([j], cl)
    pol = OnlineBatch(horizon=10)
    r = simulate(cl, [j], pol)
    start, _, s = pol.accepted_log[0]
    # round [1,2): edge needs 16/2 = 8 slots, cloud not ready. Round [2,4): same. Round [4,8): cloud ready
    # (0 + 3 <= 4); on the cloud D_u = 2 ends at 4 + 16/(2*2) = 8, D_u = 3 at 4 + ceil(16/6) = 7, D_u = 4 at
    # 4 + 16/(4*2) = 6, all free: the earliest c_j = 6 wins.
    assert start == 4 and s.workers == {1: 4} and s.duration == 2
    assert r.jobs[0].completion == 6 and r.jobs[0].cloud


def priced_cloud(workers: int, ps: int) -> SimCluster:
    """Only a finite cloud (W, P given), no upload delay."""
    return SimCluster.from_cluster(parse_cluster({
        "sites": [{"name": "cloud", "kind": "cloud", "upload_delay": 0}],
        "servers": [{"name": "cloud", "capacity": 1.0, "site": "cloud", "worker_slots": workers,
                     "ps_slots": ps}]}, require_device=False))


@pytest.mark.parametrize(("f", "completions"), [(0.0105, (2, 2, 3)), (1.0, (2, 3, 5))])
def test_a_finite_cloud_is_priced_by_eqs_7_and_8(f, completions):
    # The cloud: W = 4, P = 2; S = 1 server, U = V = 1, T = 10, so theta = 2 * 10 * 1 * 1 * F + 1:
    # F = 0.0105 -> theta = 1.21, F = 1 -> theta = 21.
    # Three jobs at a = 0: D = 2, M = 1, E = 1, n = 1 -> 2 mini-batches at p = 1; only D_u = 2 (d = 1) fits
    # the 1-slot round [1, 2).
    # a: idle cloud, cost 0 -> runs slot 1 with 2 workers + 1 PS, c = 2.
    # b: the cloud is now at f = 2 of 4 workers, g = 1 of 2 PSs:
    #    cost = lambda(2) * 2 workers * 1 slot + mu(1) * 1 slot = 3 (theta^(1/2) - 1).
    #    theta = 1.21: 3 * 0.1 = 0.3 < 1 -> accepted (utility 0.7), c = 2.
    #    theta = 21: 3 * 3.583 = 10.7 >= 1 -> postponed.
    # c (theta = 1.21): the cloud's 4 workers are taken in slot 1 -> round 2 [2, 4), idle again: D_u = 2,
    #    c = 3.
    # theta = 21, round 2 [2, 4) with b and c: b gets D_u = 2 for slot 2 at cost 0, c = 3. For c, D_u = 2
    #    (ends 3) costs 10.7 again; D_u = 1 (d = 2, ends 4) on the cloud pays lambda(2) + lambda(0) for its
    #    worker and mu(1) + mu(0) for its PS = 2 * 3.583 = 7.2 >= 1 (COST_D, one server, the same).
    #    Postponed to round 3 [4, 8): idle, D_u = 2, c = 5.
    cl = priced_cloud(4, 2)
    jobs = [job(i, arrival=0, chunks=2) for i in range(3)]
    bind_delays(jobs, cl)
    pol = OnlineBatch(f1=f, f2=f, horizon=10)
    r = simulate(cl, jobs, pol)
    assert pol.theta1 == pytest.approx(1.21 if f < 1 else 21.0)
    assert tuple(j.completion for j in r.jobs) == completions
    assert all(j.cloud for j in r.jobs)
    if f < 1:
        b = next(s for _, jid, s in pol.accepted_log if jid == 1)
        assert b.cost == pytest.approx(3 * (1.21 ** 0.5 - 1))


def test_an_unbounded_cloud_costs_nothing_whatever_f():
    # the same three jobs on an unbounded cloud: all run in round 1 at cost 0 (c = 2 each), for any F
    for f in (0.0105, 1.0):
        cl = make_cluster([], cloud_delay=0)
        jobs = [job(i, arrival=0, chunks=2) for i in range(3)]
        bind_delays(jobs, cl)
        r = simulate(cl, jobs, OnlineBatch(f1=f, f2=f, horizon=10))
        assert [j.completion for j in r.jobs] == [2, 2, 2]


def test_baselines_respect_a_finite_cloud_and_preemptive_refuses_it():
    # FIFO: W = 4 on the cloud fits two 2-worker jobs at once; the third waits for a completion.
    # Each job: 2 mini-batches per worker... 2 chunks x 1 mini-batch at p = 1 with 2 workers: 1 slot.
    cl = priced_cloud(4, 2)
    jobs = [job(i, arrival=0, chunks=2, demand=2) for i in range(3)]
    bind_delays(jobs, cl)
    r = simulate(cl, jobs, make_policy("fifo"))
    assert [j.completion for j in r.jobs] == [1, 1, 2]
    with pytest.raises(SimulationError, match="unbounded cloud"):
        simulate(cl, jobs, make_policy("preemptive"))


def literal_cost_d(lam0, mu0, free_w, free_p, lam_d, mu_d, d_u):
    """Alg. 4 transcribed line by line (servers already sorted by lambda at tau_i); the minimum cost in L."""
    n = len(lam0)
    y, left = [0] * n, d_u
    for i in range(n):  # lines 4-7
        y[i] = min(free_w[i], left)
        left -= y[i]
    if left > 0:  # lines 8-10
        return math.inf
    last = max(i for i in range(n) if y[i] > 0)  # line 12
    cost_u = sum(y[i] * lam_d[i] for i in range(n))  # line 11
    costs = [cost_u + mu_d[i] for i in range(last) if free_p[i] >= 1]  # lines 13-17
    for i1 in range(last, n):  # lines 18-33
        room, ys, cost, recorded = free_w[i1] - y[i1], list(y), cost_u + mu_d[i1], False
        for i2 in range(last, -1, -1):
            if i2 == i1:
                continue
            delta = lam0[i1] - lam0[i2] - mu0[i1]
            if delta <= 0 and room > 0:
                move = min(ys[i2], room)
                room, cost = room - move, cost + delta * move
                ys[i2], ys[i1] = ys[i2] - move, ys[i1] + move
            else:
                if free_p[i1] >= 1:
                    costs.append(cost)
                recorded = True
                break
        if not recorded and free_p[i1] >= 1:
            costs.append(cost)
    return min(costs) if costs else math.inf


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 2), st.integers(0, 3),
                          st.integers(0, 3)), min_size=1, max_size=6),
       st.integers(1, 6))
def test_vectorised_cost_d_equals_the_literal_algorithm(servers, d_u):
    from deepco.scheduling.policies.online_batch import _View

    lam0 = np.sort(np.array([s[1] for s in servers], dtype=float))  # sorted: the order is the identity
    n = len(servers)
    free_w = np.array([s[0] for s in servers], dtype=float)
    free_p = np.array([s[3] % 2 for s in servers], dtype=float)
    mu0 = np.array([s[2] for s in servers], dtype=float)
    per_slot = np.array([s[4] for s in servers], dtype=float)
    pol = OnlineBatch(horizon=10)
    j = job(0, chunks=6, minibatches=1, epochs=1)  # 6 mini-batches at 1 per slot (no comm term)
    d = math.ceil(6 / d_u)
    pol.Lam = np.outer(per_slot, np.arange(d + 1))
    pol.Mu = np.outer(mu0 + 1, np.arange(d + 1))
    view = _View(rows=np.arange(n), ids=np.arange(n), delay=np.zeros(n), free_w=free_w, free_p=free_p,
                 lam0=lam0, mu0=mu0, order=np.arange(n))
    got = pol.cost_d(j, d_u, 100, view)
    want = literal_cost_d(lam0, mu0, free_w, free_p, per_slot * d, (mu0 + 1) * d, d_u)
    if math.isinf(want):
        assert got is None
    else:
        assert got is not None and got.cost == pytest.approx(want)
        assert sum(got.workers.values()) == d_u
