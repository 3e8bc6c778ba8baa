"""Deep-Edge (Bhattacharjee et al.) Alg. 1 on hand-worked instances, the fitted models of this machine, and
the capacity the training leaves to the inference planner."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from deepco.cli import main
from deepco.cluster import parse_cluster
from deepco.errors import UserError
from deepco.scheduling.deep_edge import EdgeWorker, capacity_left, fair_plan, schedule_update
from deepco.scheduling.deep_edge_models import DEFAULT_PROFILE, DeepEdgeModels, Regression, load_models


def hand_models(params: int = 0) -> DeepEdgeModels:
    """t_step = (0.02 + 0.01 b) / q s; inference = (50 + 20 T) / q ms; batches 4, 8, 16."""
    return DeepEdgeModels(compute=Regression(np.array([0.02, 0.01, 0.0, 0.0]), 0, 0, 0),
                          exec_time=Regression(np.array([50.0, 0.0, 20.0, 0.0]), 0, 0, 0),
                          params=params, batches=(4, 8, 16), source={})


def per_sample(q: float, b: int = 16) -> float:
    return (0.02 + 0.01 * b) / q / b  # t^compute = step / b (eq. 5)


def test_alg1_balances_shards_and_drops_the_worker_that_would_break_its_slo():
    ws = [EdgeWorker("a", 1.0, slo_ms=None, link_mbps=None), EdgeWorker("b", 0.5, slo_ms=200, link_mbps=None),
          EdgeWorker("c", 1.0, slo_ms=60, link_mbps=None)]
    plan = schedule_update(ws, 300, hand_models())
    # c: (50 + 20) / 1 = 70 ms > 60 -> removed (lines 14-20); b: 140 ms <= 200 stays
    assert "c" in plan.removed and "SLO 60.0 ms" in plan.removed["c"]
    ta, tb = per_sample(1.0), per_sample(0.5)
    inv = 1 / ta + 1 / tb
    # line 10: d_i = |M| / (t_i sum_j 1/t_j) -> 200 and 100
    assert plan.shards == {"a": round(300 / (ta * inv)), "b": round(300 / (tb * inv))} == {"a": 200, "b": 100}
    assert plan.batch == {"a": 16, "b": 16}
    assert plan.epoch_s == pytest.approx(200 * ta)
    assert plan.inference_ms["b"] == pytest.approx(140)


def test_alg1_removes_the_slowest_worker_when_the_ps_link_is_the_bottleneck():
    m = hand_models(params=1_000_000)  # push + pull 2 x 4 MB over 100 Mbit/s: 0.64 s per worker per batch
    ws = [EdgeWorker("x", 1.0), EdgeWorker("y", 1.0), EdgeWorker("z", 0.25)]

    def epoch(qs: list[float]) -> float:
        t = [per_sample(q) + 0.64 * len(qs) / 16 for q in qs]
        return 300 / sum(1 / v for v in t)

    assert epoch([1.0, 1.0]) < epoch([1.0, 1.0, 0.25]) and epoch([1.0, 1.0]) < epoch([1.0])
    plan = schedule_update(ws, 300, m)
    assert plan.workers == ["x", "y"] and plan.shards == {"x": 150, "y": 150}
    assert plan.epoch_s == pytest.approx(epoch([1.0, 1.0]))
    assert "z" in plan.removed


def test_no_feasible_worker_is_a_clear_error():
    with pytest.raises(UserError, match="every worker would push its inference past its SLO"):
        schedule_update([EdgeWorker("a", 1.0, slo_ms=10)], 100, hand_models())
    with pytest.raises(UserError, match=">= 1 data sample"):
        schedule_update([EdgeWorker("a", 1.0)], 0, hand_models())


def test_fair_plan_ignores_interference_and_capacity_left_shrinks_trained_servers():
    ws = [EdgeWorker("a", 1.0, slo_ms=60, link_mbps=None), EdgeWorker("b", 1.0, slo_ms=None, link_mbps=None)]
    naive = fair_plan(ws, 100, hand_models())
    assert naive.shards == {"a": 50, "b": 50} and naive.inference_ms["a"] == pytest.approx(70)  # breaks 60
    plan = schedule_update(ws, 100, hand_models())
    assert plan.workers == ["b"]
    cluster = parse_cluster({"device": {"antennas": 1, "bandwidth": 1.0},
                             "servers": [{"name": "a", "capacity": 1.0}, {"name": "b", "capacity": 2.0}]})
    left = capacity_left(cluster, plan, ws, hand_models())
    assert [s.capacity for s in left.servers] == [1.0, pytest.approx(2.0 * 50 / 70)]


def test_profile_of_this_machine_is_real_and_the_fits_are_reported():
    doc = json.loads(Path(DEFAULT_PROFILE).read_text())
    assert doc["machine"] and doc["date"] and "EMULATED" in doc["what"]
    m = load_models()
    rows = [r for r in doc["rows"] if r["batch"]]
    assert len(rows) >= 12
    # measured, not invented: more quota -> faster steps; bigger batch -> longer steps
    by = {(r["quota"], r["load"], r["batch"]): r["step_s_median"] for r in rows}
    q = sorted(doc["quotas"])
    assert by[(q[0], 0.0, 16)] > by[(q[-1], 0.0, 16)]
    assert by[(q[-1], 0.0, 16)] > by[(q[-1], 0.0, 4)]
    s = m.summary()
    assert s["EstComputeTime"]["loo_mape_pct"] < 50 and s["EstExecTime"]["loo_mape_pct"] < 50
    assert m.step_time(q[0], 0.0, 8) > m.step_time(q[-1], 0.0, 8) > 0


def test_cli_deep_edge(tmp_path, capsys):
    toml = tmp_path / "c.toml"
    toml.write_text("[device]\nantennas = 1\nbandwidth = 1.0\n" + "".join(
        f'[[servers]]\nname = "s{k}"\ncapacity = 1.0\ncpus = {c}\n' for k, c in enumerate((1.0, 0.7, 0.4))))
    out = tmp_path / "p.json"
    assert main(["schedule", "--cluster", str(toml), "--policy", "deep-edge", "--samples", "500",
                 "--json", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert row["policy"] == "deep-edge" and sum(row["shards"].values()) == 500
    assert "deep-edge: 500 samples" in capsys.readouterr().out
    assert main(["schedule", "--cluster", str(toml), "--policy", "deep-edge", "--profile",
                 str(tmp_path / "none.json")]) == 2
    assert "none.json: no such profile" in capsys.readouterr().err
    toml.write_text(toml.read_text().replace("cpus = 0.4", "cpus = 64"))
    assert main(["schedule", "--cluster", str(toml), "--policy", "deep-edge"]) == 2
    assert "server s2: cpus 64 is outside the profiled CPU quotas [0.4, 1]" in capsys.readouterr().err


def test_sites_to_protect_follows_exec_time_model():
    from deepco.scheduling.deep_edge import sites_to_protect

    ws = [EdgeWorker("a", 1.0, slo_ms=60), EdgeWorker("b", 0.5, slo_ms=200), EdgeWorker("c", 1.0)]
    # a: (50 + 20) / 1 = 70 > 60; b: 140 <= 200; c: no latency-critical task
    assert sites_to_protect(ws, hand_models()) == {"a"}
