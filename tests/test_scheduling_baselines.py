"""FIFO, DRF, SRTF, Tiresias-L and BatchSche decisions on hand-worked instances."""

from __future__ import annotations

from test_scheduling_model import job, make_cluster

from deepco.scheduling import bind_delays, simulate
from deepco.scheduling.policies.baselines import BatchSche, Drf, Fifo, Srtf, TiresiasL
from deepco.scheduling.simulator import JobState, SimState


def completions(result):
    return {j.id: j.completion for j in result.jobs}


def test_fifo_blocks_behind_the_head_of_the_queue():
    # W = 3. A (2 workers, 6 mini-batches at 1/slot each -> 3 slots) runs 0-2; B (2 workers, 4 mini-batches)
    # does not fit beside A and waits; C (1 worker, 1 slot) would fit at slot 1 but FIFO keeps it behind B.
    cl = make_cluster([(3, 3)])
    a = job(0, 0, chunks=2, minibatches=3, demand=2)
    b = job(1, 0, chunks=2, minibatches=2, demand=2)
    c = job(2, 1, chunks=1, minibatches=1, demand=1)
    bind_delays([a, b, c], cl)
    assert completions(simulate(cl, [a, b, c], Fifo())) == {0: 3, 1: 5, 2: 4}


def test_srtf_preempts_for_the_shorter_remaining_job():
    cl = make_cluster([(1, 1)])
    a, b = job(0, 0, minibatches=5), job(1, 1, minibatches=3)
    bind_delays([a, b], cl)
    r = simulate(cl, [a, b], Srtf())
    # slot 1: A has 4 slots left, B 3 -> B runs 1-3 (c = 4), A resumes 4-7 (c = 8)
    assert completions(r) == {0: 8, 1: 4} and r.preemptions == 1


def test_tiresias_demotes_by_attained_service_then_fifo_within_a_queue():
    cl = make_cluster([(1, 1)])
    a, b = job(0, 0, minibatches=5), job(1, 1, minibatches=3)
    bind_delays([a, b], cl)
    r = simulate(cl, [a, b], TiresiasL(thresholds=(2,)))
    # slot 1: both in queue 0 (A attained 1 < 2), A arrived first -> A. Slot 2: A demoted (2 >= 2) -> B runs
    # 2-3 and is demoted too; slot 4: both in queue 1, A first -> A runs 4-6 (c = 7); B finishes in 7 (c = 8)
    assert completions(r) == {0: 7, 1: 8}


def drf_split(ps_slots: int) -> tuple[dict, dict]:
    cl = make_cluster([(4, ps_slots)])
    a, b = job(0, 0, chunks=4, minibatches=8, demand=4), job(1, 0, chunks=4, minibatches=8, demand=4)
    bind_delays([a, b], cl)
    pol = Drf()
    pol.plan(cl, [a, b])
    state = SimState(t=0, cluster=cl, active={0: JobState(a, a.total_work), 1: JobState(b, b.total_work)})
    out = pol.schedule(0, state)
    return out[0].workers, out[1].workers


def test_drf_fills_progressively_by_dominant_share():
    # P = 4: share = max(w/4, 1/4). One worker each (0.25, 0.25), then A -> 0.5, then B -> 0.5: 2 and 2
    assert drf_split(4) == ({0: 2}, {0: 2})
    # P = 2: the PS is the dominant resource, share = max(w/4, 1/2) stays 0.5 for A up to 2 workers, and
    # ties go to the earlier job: A 1, B 1, A 2 (0.5, tie), A 3 (0.75) -> 3 and 1
    assert drf_split(2) == ({0: 3}, {0: 1})


def test_batchsche_waits_for_the_batch_and_prefers_the_cheaper_site():
    cl = make_cluster([(2, 2)], cloud_delay=0)
    j = job(0, 1, chunks=2, minibatches=4, demand=2)
    bind_delays([j], cl)
    pol = BatchSche(interval=4)
    r = simulate(cl, [j], pol)
    # batch at slot 4. Idle edge: 2 workers x 4 slots x 0.5 * 8^(2/2)... the price at the load after
    # placing, 0.5 * 8^1 = 4 per worker-slot -> 32; the cloud: 2 x 4 x 1.0 = 8 -> cloud
    assert r.jobs[0].start == 4 and r.jobs[0].cloud and r.jobs[0].completion == 8
    one = job(1, 1, chunks=1, minibatches=4, demand=1)
    cl1 = make_cluster([(4, 2)], cloud_delay=0)
    bind_delays([one], cl1)
    r = simulate(cl1, [one], BatchSche(interval=4))
    # one worker on a 4-slot server: 0.5 * 8^(1/4) = 0.84 per worker-slot < 1.0 on the cloud -> edge
    assert not r.jobs[0].cloud and r.jobs[0].completion == 8


def test_ablations_cloud_decided_once_and_pinned_gang():
    # W = 1 edge server, edge delay 0, unbounded cloud with delay 2. A: 4 mini-batches (4 slots), B: 1 (1 slot),
    # both arrive at 0; SRTF runs B first (c = 1).
    # Default: A has no room at 0, the cloud is not ready before 2, so A takes the edge at 1: c = 5.
    # Cloud decided once: at 0 A finds no edge room, is sent to the cloud, waits for its upload: runs 2-5, c = 6.
    cl = make_cluster([(1, 1)], cloud_delay=2)
    jobs = [job(0, 0, minibatches=4), job(1, 0, minibatches=1)]
    bind_delays(jobs, cl)
    assert completions(simulate(cl, jobs, Srtf())) == {0: 5, 1: 1}
    r = simulate(cl, jobs, Srtf(cloud_at_arrival=True))
    assert completions(r) == {0: 6, 1: 1} and [j.cloud for j in r.jobs] == [True, False]
    # Pinned gang: two 1-worker servers, no cloud. A (5 slots) and X (10 slots) arrive at 0: A on e0 (best
    # fit, lower index), X on e1. B (1 slot) arrives at 1 and ranks first: it takes e0.
    # Free migration: A (4 left) moves to e1, X is preempted; A ends at 1 + 1 + 3 = 5, X runs 2-10, c = 11.
    # Pinned: A may only use e0, so it waits; X keeps e1 (8 left after slot 1, c = 10); A runs 2-5, c = 6.
    cl2 = make_cluster([(1, 1), (1, 1)])
    trio = [job(0, 0, minibatches=5), job(1, 0, minibatches=10), job(2, 1, minibatches=1)]
    bind_delays(trio, cl2)
    assert completions(simulate(cl2, trio, Srtf())) == {0: 5, 1: 11, 2: 2}
    assert completions(simulate(cl2, trio, Srtf(pinned=True))) == {0: 6, 1: 10, 2: 2}
