"""Property tests of the planners on random instances (hypothesis)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepco.planning import ALGORITHMS, Instance, Plan, PlanningError, make_plan
from deepco.planning.baselines import optimal

capacity = st.floats(min_value=0.05, max_value=500, allow_nan=False)
bandwidth = st.floats(min_value=0.5, max_value=500, allow_nan=False)


@st.composite
def instances(draw, max_servers: int = 7, max_antennas: int = 3, equal_bandwidth: bool | None = None):
    n = draw(st.integers(1, max_servers))
    a = draw(st.integers(1, max_antennas))
    caps = draw(st.lists(st.one_of(capacity, st.sampled_from([1.0, 5.0, 10.0])), min_size=n, max_size=n))
    equal = draw(st.booleans()) if equal_bandwidth is None else equal_bandwidth
    bws = [draw(bandwidth)] * a if equal else draw(st.lists(bandwidth, min_size=a, max_size=a))
    return Instance(
        names=tuple(f"s{i}" for i in range(n)), capacities=tuple(caps),
        antenna_names=tuple(f"a{m}" for m in range(a)), bandwidths=tuple(bws),
        data_size=draw(st.floats(min_value=0.1, max_value=100)),
        prefetch_ratio=draw(st.one_of(st.just(0.0), st.floats(min_value=0, max_value=1))),
        layers=draw(st.integers(0, 200)), exchange_time=draw(st.floats(min_value=0, max_value=1)))


def check_schedule(inst: Instance, plan: Plan) -> None:
    """Every invariant a plan must satisfy, recomputed from the instance (not from the planner)."""
    assert plan.servers, "a plan selects at least one server"
    assert all(a.ratio >= 0 for a in plan.servers)
    assert math.fsum(a.ratio for a in plan.servers) == pytest.approx(1.0, rel=1e-9)
    cap = dict(zip(inst.names, inst.capacities, strict=True))
    bw = dict(zip(inst.antenna_names, inst.bandwidths, strict=True))
    assert len({a.name for a in plan.servers}) == len(plan.servers)
    for antenna in {a.antenna for a in plan.servers}:
        mine = sorted((a for a in plan.servers if a.antenna == antenna), key=lambda a: a.order)
        assert [a.order for a in mine] == list(range(len(mine)))
        clock = 0.0
        for a in mine:  # one antenna sends to its servers one after another, without overlap
            assert a.transfer_start == pytest.approx(clock, rel=1e-9, abs=1e-12)
            received = (a.ratio + plan.halo_ratio) * inst.data_size
            assert a.transfer_time == pytest.approx(received / bw[antenna], rel=1e-9)
            clock = a.transfer_start + a.transfer_time
            assert a.compute_start >= clock * (1 - 1e-12)
            assert a.compute_time == pytest.approx(received / cap[a.name], rel=1e-9)
    for a in plan.servers:
        assert a.compute_start + a.compute_time + a.exchange_time == pytest.approx(a.finish_time, rel=1e-9)
        assert a.finish_time == pytest.approx(plan.completion_time, rel=1e-9)


@settings(max_examples=150, deadline=None)
@given(instances())
def test_every_plan_is_a_valid_schedule(inst):
    for algorithm in ALGORITHMS:
        if algorithm == "optimal":
            continue
        check_schedule(inst, make_plan(inst, algorithm))


@settings(max_examples=150, deadline=None)
@given(instances(max_servers=7, max_antennas=1))
def test_thread_sa_is_optimal_on_one_antenna(inst):
    best = optimal(inst)
    check_schedule(inst, best)
    assert make_plan(inst, "thread-sa").completion_time == pytest.approx(best.completion_time, rel=1e-9)


@settings(max_examples=150, deadline=None)
@given(instances(max_servers=6, max_antennas=3))
def test_thread_never_worse_than_thread_sa_nor_better_than_optimal(inst):
    t = make_plan(inst, "thread").completion_time
    assert t <= make_plan(inst, "thread-sa").completion_time * (1 + 1e-9)
    assert t >= optimal(inst).completion_time * (1 - 1e-9)


@settings(max_examples=100, deadline=None)
@given(instances(max_servers=7, max_antennas=2))
def test_no_data_lookahead_plan_beats_the_optimum(inst):
    best = optimal(inst).completion_time
    for algorithm in ("thread", "thread-sa", "single"):
        assert make_plan(inst, algorithm).completion_time >= best * (1 - 1e-9)


def test_optimal_refuses_instances_too_large_with_a_clear_error():
    inst = Instance(names=tuple(f"s{i}" for i in range(30)), capacities=(1.0,) * 30, antenna_names=("a0", "a1"),
                    bandwidths=(10.0, 10.0), data_size=1.0, prefetch_ratio=0.1)
    with pytest.raises(PlanningError, match="30 servers on 2 antennas"):
        optimal(inst)


def test_weak_server_that_would_get_a_negative_ratio_is_reordered_or_dropped():
    # With r_o = 0.4, strongest-first TSP gives the 3rd server (capacity 1) a negative ratio;
    # a plan must never contain one.
    inst = Instance(names=("big", "mid", "tiny"), capacities=(100.0, 30.0, 1.0), antenna_names=("a0",),
                    bandwidths=(50.0,), data_size=1.0, prefetch_ratio=0.4)
    for algorithm in ("thread", "thread-sa", "optimal"):
        check_schedule(inst, make_plan(inst, algorithm))


def test_ssp_keeps_looking_past_a_first_increase():
    # T(top-n) by eq. (11), computed here from the formula: it rises from n=1 to n=2, then falls below
    # T(1) at n=3. The paper's SSP would stop at one server; ours evaluates every prefix.
    caps, b, ro = [72.0, 59.6, 58.1, 28.1], 146.6, 0.32

    def t(n: int) -> float:
        if n == 1:
            return 1 / b + 1 / caps[0]
        prod = math.prod(b + c for c in caps[:n])
        merged = (prod - b**n) / b ** (n - 1)
        return (1 + n * ro) * (1 / b + 1 / merged)

    assert t(2) > t(1) > t(3)
    inst = Instance(names=("w", "x", "y", "z"), capacities=(28.1, 72.0, 59.6, 58.1), antenna_names=("a0",),
                    bandwidths=(b,), data_size=1.0, prefetch_ratio=ro)
    plan = make_plan(inst, "thread-sa")
    assert len(plan.servers) == 3 and plan.completion_time == pytest.approx(t(3))
