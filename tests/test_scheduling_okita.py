"""Okita (Han et al.): equations (4) and (6), PA, DTA, whole decisions on hand-worked instances, the engine's
checks, the exact optimum, and the ranking against FIFO/DRF/OASiS."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from deepco.cli import main
from deepco.scheduling.okita import (
    LatencyCost,
    Oasis,
    Okita,
    SlotDecision,
    UdlDrf,
    UdlError,
    UdlFifo,
    UdlInstance,
    UdlJob,
    run_udl,
)
from deepco.scheduling.okita.algorithms import deployment_metric, dta, pa
from deepco.scheduling.okita.engine import UdlJobState
from deepco.scheduling.okita.optimum import optimum, small_instance
from deepco.scheduling.okita.policy import priority
from deepco.scheduling.okita.workloads import synthetic

CLUSTER = str(Path(__file__).resolve().parents[1] / "bench" / "clusters" / "okita-edge.toml")
Q3 = np.array([[0, 0.01, 0.05], [0.01, 0, 0.05], [0.05, 0.05, 0]])


def job(jid: int = 0, data=(4, 0, 0), *, arrival: int = 0, per_worker: int = 2, m=(1.0,), n=(1.0,),
        param_mb: float = 100.0, chunk_mb: float = 10.0, cost: LatencyCost | None = None) -> UdlJob:
    return UdlJob(id=jid, arrival=arrival, data=np.array(data), worker_demand=np.array(m, float),
                  ps_demand=np.array(n, float), per_worker=per_worker, chunk_mb=chunk_mb, param_mb=param_mb,
                  cost=cost or LatencyCost("linear", tau=10.0))


def test_latency_cost_functions_of_sec_v_b():
    assert LatencyCost("sigmoid", tau=20)(4) == pytest.approx(20 * math.e)
    assert LatencyCost("linear", tau=30, b=50)(3) == 140
    step = LatencyCost("piecewise", tau=20, tau2=300, c=3)
    assert (step(2), step(3)) == (20, 300)
    with pytest.raises(ValueError, match="latency cost kind"):
        LatencyCost("cubic")


def test_priority_eq_4():
    a = UdlJobState(job=job(0, (12, 0, 0), cost=LatencyCost("sigmoid", tau=20)), remaining=np.array([6, 0, 0]))
    b = UdlJobState(job=job(1, (10, 0, 0), arrival=2, cost=LatencyCost("sigmoid", tau=50)),
                    remaining=np.array([10, 0, 0]))
    o = priority([a, b], t=4)
    # tau (t - a): 80 and 100, max 100; remaining share 6/12 and 10/10
    assert o[0] == pytest.approx(80 / 100 - 6 / 12)
    assert o[1] == pytest.approx(100 / 100 - 10 / 10)
    assert priority([a, b], t=4, alphas=(2.0, 1.0))[0] == pytest.approx(2 * 0.8 - 0.5)


def test_deployment_metric_eq_6():
    j = job()
    cap = np.array([[3.0], [2.0], [2.0]])
    avail = np.array([[3.0], [1.0], [2.0]])
    got = deployment_metric(j, avail, cap, Q3, np.array([2, 0, 0]))
    # beta = 1: U/C - sum_r' q pi / (R - 1) + M/D (0 where D = 0)
    want = [1 - (0.06 * 100) / 2 + 2 / 4, 0.5 - (0.06 * 100) / 2 + 0, 1 - (0.10 * 100) / 2 + 0]
    assert got == pytest.approx(want)


def test_pa_alg_2_hand_worked():
    j = job()
    cap = np.array([[3.0], [2.0], [2.0]])
    order = np.argsort(-deployment_metric(j, cap, cap, Q3, j.data), kind="stable")
    assert list(order) == [0, 1, 2]  # Q = -1, -2, -4
    # N = 4: PS at 0 leaves A = [2, 2, 2] -> y = [2, 2, 0], cost pi q10 2 = 2 per slot;
    # PS at 1: y = [3, 1, 0], cost pi q01 3 = 3; PS at 2: y = [3, 1, 0], cost pi (q02 3 + q12) = 20
    p = pa(j, cap, Q3, order, 4, window=3)
    assert p is not None and p.ps == 0 and list(p.y) == [2, 2, 0] and p.cost == pytest.approx(3 * 2.0)
    assert pa(j, cap, Q3, order, 7, window=1) is None  # 7 workers + 1 PS > 7 CPUs


def test_dta_alg_3_hand_worked():
    j = job(data=(4, 1, 0))
    cost, g = dta(j, np.array([0, 3, 2]), np.array([4, 1, 0]), Q3)
    # H = [4, -2, -2]: site 1 takes 2 from site 0 (q 0.01); site 2 takes the 2 site 0 still has (q 0.05)
    assert g.tolist() == [[0, 2, 2], [0, 1, 0], [0, 0, 0]]
    assert cost == pytest.approx(10 * (2 * 0.01 + 2 * 0.05))


def test_okita_picks_the_n_of_smallest_bandwidth_plus_latency():
    q = np.array([[0, 0.01], [0.01, 0]])
    j = job(data=(4, 0), n=(0.0,))
    # room for 2 workers at site 0: N = 1 costs f(2) = 20, N = 2 costs f(1) = 10 with no transfer
    r = run_udl(UdlInstance(capacity=np.array([[2.0], [2.0]]), q=q, jobs=[j]), Okita())
    assert (r.total_cost, r.bandwidth_cost, r.jobs[0].completion) == (10, 0, 1)
    # room for 1 at site 0: N = 2 puts a worker at site 1 (param pi q 1 = 1, 2 chunks moved delta q 2 = 0.2),
    # 1.2 + f(1) = 11.2 < f(2) = 20; the two PS sites tie and Alg. 2's "<=" keeps the last
    j = job(data=(4, 0), n=(0.0,))
    inst = UdlInstance(capacity=np.array([[1.0], [2.0]]), q=q, jobs=[j])
    okita = Okita()
    okita.reset(inst)
    from deepco.scheduling.okita.engine import UdlState
    dec = okita.schedule(0, UdlState(0, inst, {0: UdlJobState(job=j, remaining=j.data.copy())}))[0]
    assert list(dec.y) == [1, 1] and dec.ps == 1 and dec.g.tolist() == [[2, 2], [0, 0]]
    r = run_udl(inst, Okita())
    assert r.total_cost == pytest.approx(11.2) and r.bandwidth_cost == pytest.approx(1.2)


def test_conflict_delays_the_lower_priority_job():
    a = job(0, (4,), n=(0.0,), cost=LatencyCost("linear", tau=10.0))
    b = job(1, (4,), n=(0.0,), cost=LatencyCost("linear", tau=1.0))
    r = run_udl(UdlInstance(capacity=np.array([[2.0]]), q=np.zeros((1, 1)), jobs=[a, b]), Okita())
    # equal O at t = 0 (both just arrived, nothing trained): A first by arrival/id takes both workers; B fits
    # nowhere (migration impossible) so it waits one slot: costs 10 x 1 + 1 x 2
    assert [(x.start, x.completion) for x in r.jobs] == [(0, 1), (1, 2)]
    assert r.total_cost == 12 and r.jobs[1].idle == 0


def test_engine_rejects_broken_decisions():
    j = job(data=(4, 0), n=(0.0,))
    inst = UdlInstance(capacity=np.array([[1.0], [1.0]]), q=np.array([[0, 0.01], [0.01, 0]]), jobs=[j])

    class Greedy:
        name = "greedy"

        def reset(self, instance):
            pass

        def schedule(self, t, state):
            return {0: SlotDecision(y=np.array([2, 0]), ps=0, g=np.array([[4, 0], [0, 0]]))}

    with pytest.raises(UdlError, match=r"uses 2 of resource 0 at site 0 > C = 1 \(2d\)"):
        run_udl(inst, Greedy())

    class Fast(Greedy):
        def schedule(self, t, state):
            return {0: SlotDecision(y=np.array([1, 0]), ps=0, g=np.array([[4, 0], [0, 0]]))}

    with pytest.raises(UdlError, match=r"trains 4 chunks at site 0 with 1 workers x 2 \(2b\)"):
        run_udl(inst, Fast())


def test_optimum_hand_worked_and_below_every_policy():
    q = np.array([[0, 0.01], [0.01, 0]])
    inst = UdlInstance(capacity=np.array([[1.0], [2.0]]), q=q, jobs=[job(data=(4, 0), n=(0.0,))])
    # better than Okita's 11.2: both workers and the PS at site 1, all 4 chunks moved (10 x 0.01 x 4) + f(1)
    assert optimum(inst, horizon=4) == pytest.approx(0.4 + 10)
    for seed in (1, 5):
        inst = small_instance(seed, sites=2, jobs=3)
        opt = optimum(inst, horizon=7)
        assert opt is not None
        costs = {p.name: run_udl(inst, p).total_cost for p in (Okita(), UdlFifo(), UdlDrf(), Oasis())}
        assert all(c >= opt - 1e-6 for c in costs.values()), costs
        assert costs["okita"] / opt < 1.8


def test_okita_beats_the_baselines_on_a_synthetic_setup():
    inst = synthetic(sites=10, jobs=20, horizon=40, seed=3)
    costs = {p.name: run_udl(inst, p).total_cost for p in (Okita(), UdlFifo(), UdlDrf(), Oasis())}
    assert costs["okita"] < min(costs["okita-fifo"], costs["okita-drf"], costs["okita-oasis"]), costs


def test_cli_okita_json_and_errors(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert main(["schedule", "--cluster", CLUSTER, "--policy", "okita", "--jobs", "6", "--horizon", "9",
                 "--json", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert {"policy", "jobs", "avg_jct", "total_jct", "makespan", "total_cost", "bandwidth_cost"} <= set(row)
    assert row["jobs"] == 6 and row["total_cost"] == pytest.approx(row["bandwidth_cost"] + row["latency_cost"])
    assert "okita" in capsys.readouterr().out
    assert main(["schedule", "--cluster", CLUSTER, "--policy", "okita", "--jobs", "4", "--horizon", "6",
                 "--block-sites", "north,east"]) == 0
    assert main(["schedule", "--cluster", CLUSTER, "--policy", "okita", "--block-sites", "mars"]) == 2
    assert "--block-sites: unknown site 'mars'" in capsys.readouterr().err
    bad = tmp_path / "c.toml"
    text = Path(CLUSTER).read_text()
    first_link = 'from = "north"\nto = "south"\nbandwidth = 100.0\ncost = 0.02\n'
    assert first_link in text
    bad.write_text(text.replace("[[links]]\n" + first_link, ""))
    assert main(["schedule", "--cluster", str(bad), "--policy", "okita"]) == 2
    assert "okita needs a [[links]] cost between sites 'north' and 'south'" in capsys.readouterr().err


def test_blocked_sites_get_no_training_but_their_data_still_trains():
    q = np.array([[0, 0.01], [0.01, 0]])
    j = job(data=(4, 0), n=(0.0,))
    inst = UdlInstance(capacity=np.array([[2.0], [2.0]]), q=q, jobs=[j])
    # site 0 (where the data is) serves inference that training would slow past its SLO: with it blocked,
    # both workers go to site 1 and all 4 chunks move there (delta q 4 = 0.4) + f(1) = 10
    r = run_udl(inst, Okita(blocked=frozenset({0})))
    assert r.total_cost == pytest.approx(10.4) and r.bandwidth_cost == pytest.approx(0.4)
    with pytest.raises(ValueError, match="blocked site 5"):
        run_udl(inst, Okita(blocked=frozenset({5})))


def test_drf_progressive_filling_and_fixed_deployment():
    a = job(0, (40,), m=(1.0,), n=(0.0,))
    b = job(1, (40,), m=(2.0,), n=(0.0,))
    inst = UdlInstance(capacity=np.array([[6.0]]), q=np.zeros((1, 1)), jobs=[a, b])
    drf = UdlDrf()
    drf.reset(inst)
    from deepco.scheduling.okita.engine import UdlState
    states = {j.id: UdlJobState(job=j, remaining=j.data.copy()) for j in (a, b)}
    dec = drf.schedule(0, UdlState(0, inst, states))
    # dominant shares 1/6 and 2/6 per worker: A1, B1, A2, then A3 (tie at 2/6 goes to the earlier job);
    # B's third CPU pair no longer fits (1 CPU left), A takes it: A = 4 workers, B = 1
    assert (int(dec[0].y[0]), int(dec[1].y[0])) == (4, 1)
    r = run_udl(inst, UdlDrf())
    # fixed deployments, 2 chunks per worker per slot: A trains 8 a slot (40 / 8 = 5 slots), B 2 (20 slots)
    assert [(x.start, x.completion, x.idle) for x in r.jobs] == [(0, 40 // 8, 0), (0, 40 // 2, 0)]
    # utilization, as the simulator defines it: workers' use over capacity x (last completion - first arrival).
    # Slots 0-4: A's 4 workers x 1 + B's 1 x 2 = 6; slots 5-19: B's 2. (5 x 6 + 15 x 2) / (6 x 20) = 0.5
    row = r.to_dict()
    assert row["utilization"] == pytest.approx(0.5) and row["preemptions"] == 0 and row["cloud_jobs"] is None
