"""The CONVENE paper's worked examples (Tables I-V, Examples 1-4), checked against its printed numbers."""

from pathlib import Path

import pytest

from deepco.cluster import load_cluster
from deepco.planning import Instance, make_plan
from deepco.planning.law import completion_time, cumulative_capacity, equal_finish_time

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "paper-example1.toml"
PAPER_ROUNDING = 1e-3  # the paper prints three decimals


@pytest.fixture(scope="module")
def inst() -> Instance:
    return Instance.from_cluster(load_cluster(EXAMPLE))


def ratios(plan) -> dict[str, float]:
    return {a.name: a.ratio for a in plan.servers}


def test_cumulative_server_law_matches_example_1_and_2():
    # Example 2: ((60+10)(60+10) - 60^2) / 60 ~ 21.667; Example 1: ((60+10)^2 (60+7) - 60^3) / 60^2 ~ 31.194
    assert cumulative_capacity(60, [10, 10]) == pytest.approx(21.667, abs=PAPER_ROUNDING)
    assert cumulative_capacity(60, [10, 10, 7]) == pytest.approx(31.194, abs=PAPER_ROUNDING)
    assert cumulative_capacity(60, []) == 0
    assert cumulative_capacity(60, [7]) == pytest.approx(7)


def test_ssp_completion_times_of_example_2():
    # Server 1 alone: 10/60 + 10/10 = 1.167 (the whole image, no prefetch); then eq. (11).
    assert completion_time(10, 60, [10], 1.0, 0.0) == pytest.approx(1.167, abs=PAPER_ROUNDING)
    assert completion_time(10, 60, [10, 10], 1.0, 0.4) == pytest.approx(1.131, abs=PAPER_ROUNDING)
    assert completion_time(10, 60, [10, 10, 7], 1.0, 0.4) == pytest.approx(1.072, abs=PAPER_ROUNDING)
    assert completion_time(10, 60, [10, 10, 7, 3], 1.0, 0.4) == pytest.approx(1.161, abs=PAPER_ROUNDING)


def test_thread_sa_reproduces_table_iii(inst):
    plan = make_plan(inst, "thread-sa")
    assert plan.completion_time == pytest.approx(1.072, abs=PAPER_ROUNDING)
    assert ratios(plan) == pytest.approx({"s1": 0.519, "s2": 0.387, "s3": 0.094}, abs=PAPER_ROUNDING)
    first = plan.servers[0]
    # Example 3: tau^2 = 0 + (0.519 + 0.4) x 10/60 ~ 0.153
    assert plan.servers[1].transfer_start == pytest.approx(0.153, abs=PAPER_ROUNDING)
    assert first.transfer_start == 0


def test_thread_reproduces_tables_iv_and_v(inst):
    plan = make_plan(inst, "thread")
    assert plan.completion_time == pytest.approx(0.977, abs=PAPER_ROUNDING)
    assert ratios(plan) == pytest.approx({"s1": 0.4375, "s2": 0.4375, "s3": 0.125}, abs=1e-4)
    # s1 and s2 (equal capacities) sit on different antennas; s3 joins one of them (Table IV).
    antenna = {a.name: a.antenna for a in plan.servers}
    assert antenna["s1"] != antenna["s2"]
    assert antenna["s3"] in (antenna["s1"], antenna["s2"])


def test_thread_iterations_of_example_4():
    # 2nd iteration: one server per antenna, ratios 0.5/0.5, T = 1.05
    total, g = equal_finish_time(10, 0.4, [(60, [10]), (60, [10])])
    assert total == pytest.approx(1.05, abs=PAPER_ROUNDING)
    assert g == pytest.approx([0.5, 0.5])
    # 3rd iteration: {1}, {2, 3}: 0.4375 / 0.5625, T = 0.977
    total, g = equal_finish_time(10, 0.4, [(60, [10]), (60, [10, 7])])
    assert total == pytest.approx(0.977, abs=PAPER_ROUNDING)
    assert g == pytest.approx([0.4375, 0.5625], abs=1e-4)
    # 4th iteration: server 4 joins antenna 1 (c({1}) = 10 < c({2,3}) = 18.167) and T rises, so THREAD
    # stops at 3 servers. The paper prints T = 1.075 here, but its own eq. (14) gives 1.041 for this
    # association (and 1.052 for the other one), so we check the equation, solved by hand:
    # (10 g + 8) K1 = (10 (1 - g) + 8) K2 with K = 1/60 + 1/c(G), c({1,4}) = 13.5, c({2,3}) = 109/6.
    k1, k2 = 1 / 60 + 1 / 13.5, 1 / 60 + 1 / (109 / 6)
    g1 = (18 * k2 - 8 * k1) / (10 * (k1 + k2))
    total, _ = equal_finish_time(10, 0.4, [(60, [10, 3]), (60, [10, 7])])
    assert total == pytest.approx((10 * g1 + 8) * k1)
    assert total > 0.977


def test_modnn_sa_of_example_1(inst):
    plan = make_plan(inst, "modnn-sa")
    # 10/60 + 10/30 + 30 x 0.05 = 2.0
    assert plan.completion_time == pytest.approx(2.0, abs=PAPER_ROUNDING)
    assert ratios(plan) == pytest.approx({"s1": 1 / 3, "s2": 1 / 3, "s3": 0.233, "s4": 0.1}, abs=PAPER_ROUNDING)
    assert all(a.exchange_time == pytest.approx(1.5) for a in plan.servers)


def test_modnn_ma_uses_both_antennas_and_beats_modnn_sa(inst):
    sa, ma = make_plan(inst, "modnn-sa"), make_plan(inst, "modnn-ma")
    assert {a.antenna for a in ma.servers} == {"a0", "a1"}
    # Compute and exchange are the same; only the transfer (the slowest antenna's share) shrinks.
    slowest_antenna_share = max(sum(a.ratio for a in ma.servers if a.antenna == m) for m in ("a0", "a1"))
    assert ma.completion_time == pytest.approx(slowest_antenna_share * 10 / 60 + 10 / 30 + 1.5)
    assert ma.completion_time < sa.completion_time


def test_single_and_optimal_on_example_1(inst):
    assert make_plan(inst, "single").completion_time == pytest.approx(10 / 60 + 10 / 10)
    assert make_plan(inst, "optimal").completion_time == pytest.approx(make_plan(inst, "thread").completion_time)
