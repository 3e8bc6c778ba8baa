"""Calibration of the staged cost model: the fit recovers a known compute scale and step overhead from timings
made by hand with the closed forms, and the choice among timed plans."""

from __future__ import annotations

import pytest

from deepco.partition import Partitioner, load_model
from deepco.partition.pixels import with_pixel_input
from deepco.planning.calibration import Timed, choose, fidelity, fit
from deepco.planning.staged import CostModel, Rates, StagedPlan, local_plan, offload_plan, predict, split_plan

H, W = 64, 96
IN, OUT = 3 * H * W, 4000


@pytest.fixture(scope="module")
def costs() -> CostModel:
    model = with_pixel_input(load_model("resnet18", H, W), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    return CostModel(Partitioner(model, H, W), IN, OUT)


def rates() -> Rates:
    # s0 4 GFLOP/s, s1 1 GFLOP/s, device 1 GFLOP/s, 1 MB/s antennas, 1 ms per request
    return Rates({"s0": 4e9, "s1": 1e9}, [1e6, 1e6], 0.001, 1e9, 1e8, 0.0005)


def test_fit_recovers_the_scale_and_overhead_the_timings_were_made_with(costs):
    scale, overhead, flops = 2.0, 0.003, costs.total_flops
    r = rates()
    # the closed forms by hand: the model's layers run on the servers at half the rate of the head they were
    # profiled on, and each server step costs 3 ms
    offload = {s: IN / 1e6 + 0.001 + flops * scale / f + overhead + OUT / 1e6 for s, f in (("s0", 4e9), ("s1", 1e9))}
    timed = [Timed(offload_plan(costs, r, "s0"), [offload["s0"]]), Timed(offload_plan(costs, r, "s1"), [offload["s1"]]),
             Timed(local_plan(costs, r), [flops / 1e9])]  # the device's rate was timed on the whole model
    got_scale, got_overhead = fit(timed, costs, r)
    assert got_scale == pytest.approx(scale, rel=1e-2)
    assert got_overhead == pytest.approx(overhead, rel=5e-2, abs=2e-4)


def test_two_plans_of_different_step_counts_tell_a_slower_model_from_a_step_overhead(costs):
    """Calibration's first two plans are typically a split of several steps and offload. Their timings, made
    with the model's layers at half the profiled FLOP rate and 3 ms per step, must be read as that: fitting
    the overhead alone (issue 29: yolov8n fitted ~250 ms per step) made every deeper split look slower."""
    from dataclasses import replace

    from deepco.planning.calibration import with_compute_scale
    from deepco.planning.staged import split_plan

    r = rates()
    true = replace(with_compute_scale(r, 2.0), step_overhead=0.003)
    split = split_plan(costs, r, ["s0", "s1"], ["layer1", "layer2", "layer3"], False, "s0")
    offload = offload_plan(costs, r, "s0")
    assert split is not None and len(split.levels) + 1 == 4
    timed = [Timed(p, [predict(p, costs, true)["frame"]]) for p in (split, offload)]
    scale, overhead = fit(timed, costs, r)
    assert scale == pytest.approx(2.0, rel=2e-2)
    assert overhead == pytest.approx(0.003, rel=0.1, abs=3e-4)
    # local depends on neither term: with offload it still cannot tell them apart
    only = fit([timed[1], Timed(local_plan(costs, r), [costs.total_flops / 1e9])], costs, r)
    assert only[0] == 1.0


def test_with_one_kind_of_plan_only_the_overhead_is_fitted(costs):
    r = rates()
    measured = IN / 1e6 + 0.001 + costs.total_flops / 4e9 + 0.005 + OUT / 1e6
    scale, overhead = fit([Timed(offload_plan(costs, r, "s0"), [measured])], costs, r)
    assert scale == 1.0 and overhead == pytest.approx(0.005, rel=1e-6)


def test_choose_takes_the_fastest_unless_a_simpler_plan_is_within_three_percent(costs):
    r = rates()
    local, offload = local_plan(costs, r), offload_plan(costs, r, "s0")
    assert choose([Timed(local, [0.100, 0.110]), Timed(offload, [0.080, 0.090])]).plan is offload
    # 0.1025 vs 0.1000: within 3%, and local has no server step
    assert choose([Timed(local, [0.1025]), Timed(offload, [0.095, 0.105])]).plan is local
    assert choose([Timed(local, [0.1040]), Timed(offload, [0.095, 0.105])]).plan is offload


def test_between_plans_of_as_many_steps_within_three_percent_the_one_that_leaves_the_device_idle_wins(costs):
    r = rates()
    offload = offload_plan(costs, r, "s0")
    # the paper's shape on one server: one server step like offload, but the tail runs on the device
    head_on_s0 = StagedPlan("auto", "split", servers=["s0"], antennas=[0], order=[0], levels=["layer4"], tail=None)
    assert choose([Timed(offload, [0.0808]), Timed(head_on_s0, [0.0801])]).plan is offload  # 0.9% apart
    assert choose([Timed(offload, [0.0840]), Timed(head_on_s0, [0.0801])]).plan is head_on_s0  # 4.9% apart


def test_a_prediction_that_holds_needs_no_reason_and_one_that_does_not_gets_one(costs):
    r = rates()
    offload, local = offload_plan(costs, r, "s0"), local_plan(costs, r)
    predicted = predict(offload, costs, r)["frame"]  # the cost model's own tests check this number
    held = fidelity(Timed(offload, [1.1 * predicted] * 4), [], costs, r)
    assert held["within"] and held["ratio"] == pytest.approx(1.1) and held["why"] == ""
    # 1.5x slower than predicted, steady frames: the reason lists every timed plan's ratio
    off = Timed(offload, [1.5 * predicted] * 4)
    steady = fidelity(off, [off, Timed(local, [costs.total_flops / 1e9])], costs, r)
    assert not steady["within"] and "1.50 for" in steady["why"] and "1.00 for" in steady["why"]
    # every timed plan 1.5x slower than predicted and too few plans to fit a scale: a common factor, said so
    common = fidelity(off, [off, Timed(local, [1.5 * costs.total_flops / 1e9])], costs, r)
    assert not common["within"] and "the same way" in common["why"] and "these were 2" in common["why"]
    # frames 0.5x-2.5x the prediction: the mean itself is uncertain, and the reason says so
    noisy = fidelity(Timed(offload, [0.5 * predicted, 2.5 * predicted]), [], costs, r)
    assert not noisy["within"] and "varied by 67%" in noisy["why"]


def test_round_order_gives_every_plan_every_predecessor():
    """Plans timed side by side: a rotation kept offload always right after local; a fresh permutation per
    round must let every plan follow every other one, about equally often."""
    from collections import Counter

    from deepco_device.staged import round_order

    items = ["local", "offload", "round-robin", "auto", "thread"]
    sequence = [a for k in range(200) for a in round_order(items, k)]
    assert all(sorted(round_order(items, k)) == sorted(items) for k in range(20))
    follows = Counter(zip(sequence, sequence[1:], strict=False))
    pairs = [(a, b) for a in items for b in items if a != b]
    # 999 adjacent pairs; a uniform design gives each of the 20 ordered pairs of distinct plans ~40
    assert min(follows[p] for p in pairs) >= 25, follows
    assert max(follows[p] for p in pairs) <= 60, follows


def _fake_bench(costs, seconds_of, unfit=()):
    """A calibration without servers: ``seconds_of(plan)`` is a plan's frame time, plans whose description is
    in ``unfit`` never fit, and what is held and released is recorded."""
    from deepco.planning.calibration import Unfit, plan_key

    held: dict[str, str] = {}
    released: list[str] = []

    def time_plan(plan, frames, warm_up):
        if plan.describe() in unfit:
            raise Unfit(f"no room for {plan.describe()}")
        held[plan_key(plan)] = plan.describe()
        return [seconds_of(plan)] * frames

    def release(plan):
        released.append(held.pop(plan_key(plan)))

    def candidates(r, objective, shapes):
        from deepco.planning.staged import search

        ranked = search(costs, r, ["s0", "s1"], objective=objective, shapes=shapes)
        return ranked if shapes == "all" else ranked[:1]

    return time_plan, release, candidates, held, released


def test_calibrate_picks_the_measured_fastest_skips_what_does_not_fit_and_gives_back_the_rest(costs):
    """The loop with a fake 'time this plan' callback and no servers: offload to s1 (the weaker server by the
    rates) measures fastest by far, so it is chosen although predicted slow; the plan refused for room is
    skipped with a note; every plan but the chosen one is given back, and nothing else stays held."""
    from deepco.planning.calibration import calibrate
    from deepco.planning.staged import offload_plan

    r = rates()
    slow_offload = offload_plan(costs, r, "s1")
    first = calibrate(costs, r, lambda *a: [], lambda plan, frames, warm_up: [0.5] * frames, lambda plan: None,
                      log=lambda _: None, settle=0)
    assert first.plan.describe() == local_plan(costs, r).describe()  # no candidate at all: the device alone

    def seconds_of(plan):
        return 0.001 if plan.describe() == slow_offload.describe() else 1.0

    best = _fake_bench(costs, seconds_of)[2](r, "latency", "all")[0]  # the first plan planned: it will not fit
    time_plan, release, candidates, held, released = _fake_bench(costs, seconds_of, {best.describe()})
    lines: list[str] = []

    def with_offloads(rr, objective, shapes):
        return [offload_plan(costs, rr, "s1")] if shapes == "offload" else candidates(rr, objective, shapes)

    got = calibrate(costs, r, with_offloads, time_plan, release, log=lines.append, settle=0)
    assert got.plan.describe() == slow_offload.describe()
    assert got.plan.predicted == pytest.approx(predict(got.plan, costs, replace_rates(r, got))["frame"])
    assert got.plan.fidelity["measured"] == pytest.approx(0.001)
    assert any(line == f"calibration: skipped {best.describe()}: no room for {best.describe()}" for line in lines)
    assert list(held.values()) == [slow_offload.describe()]  # only the chosen plan's resources stay held
    assert released and slow_offload.describe() not in released
    assert all(t["measured"] > 0 for t in got.trials) and len(got.trials) >= 2


def replace_rates(r, calibrated):
    from dataclasses import replace

    from deepco.planning.calibration import with_compute_scale

    return replace(with_compute_scale(r, calibrated.compute_scale), step_overhead=calibrated.step_overhead)


def test_plans_a_runoff_cannot_tell_apart_are_named_and_clearly_slower_ones_are_not(costs):
    from deepco.planning.calibration import plan_key, too_close

    r = rates()
    steady = Timed(local_plan(costs, r), [0.100, 0.101, 0.099, 0.100, 0.102, 0.098])
    noisy = Timed(offload_plan(costs, r, "s0"), [0.070, 0.140, 0.095, 0.110, 0.080, 0.125])  # mean 0.103
    slow = Timed(offload_plan(costs, r, "s1"), [0.150, 0.151, 0.149, 0.150, 0.152, 0.148])
    assert sorted(too_close([steady, noisy, slow])) == sorted([plan_key(steady.plan), plan_key(noisy.plan)])
    assert too_close([steady, slow]) == []  # 50 ms apart, a millisecond of noise: told apart
    assert too_close([steady]) == []


def test_a_runoff_within_the_noise_runs_as_many_frames_again_before_choosing(costs):
    """Every plan measures the same mean with a wide spread: after the first runoff they are within the noise of
    each other, so they run a second one and are chosen on twice the frames."""
    from deepco.planning.calibration import calibrate

    spread = iter([0.05, 0.15] * 1000)
    time_plan, release, candidates, held, released = _fake_bench(costs, lambda plan: 0.1)

    def noisy(plan, frames, warm_up):
        return [next(spread) for _ in time_plan(plan, frames, warm_up)]

    def with_offloads(rr, objective, shapes):
        return [offload_plan(costs, rr, "s1")] if shapes == "offload" else candidates(rr, objective, shapes)

    lines: list[str] = []
    got = calibrate(costs, rates(), with_offloads, noisy, release, log=lines.append, settle=0, runoff_frames=3)
    assert any(line.endswith("within the noise of each other: a longer runoff") for line in lines), lines
    runoffs = [t for t in got.trials if t["note"] == "runoff"]
    assert runoffs and max(t["frames"] for t in runoffs) == 6, runoffs


def test_a_plan_left_out_against_the_fastests_lucky_first_frames_runs_once_the_runoff_shows_them_lucky(costs):
    """The first planned split times 100 ms on its calibration frames and 130 ms ever after; offload times 141 ms
    (out of the runoff at 1.41x) and then 110; the paper's shape 120 throughout. The first runoff shows the
    split's luck, offload is a finalist against what the split ran there, runs beside the runoff's leader, and
    is chosen: the fastest as measured side by side."""
    from deepco.planning.calibration import calibrate, plan_key

    r = rates()
    time_plan, release, candidates, held, released = _fake_bench(costs, lambda plan: 0.2)
    first = candidates(r, "latency", "all")[0]
    paper = candidates(r, "latency", "thread")[0]
    assert plan_key(first) != plan_key(paper)
    lucky = iter([0.100, 0.100] + [0.130] * 1000)
    late = iter([0.141, 0.141] + [0.110] * 1000)

    def timed(plan, frames, warm_up):
        out = time_plan(plan, frames, warm_up)
        if plan_key(plan) == plan_key(first):
            return [next(lucky) for _ in out]
        if plan.describe() == offload_plan(costs, r, "s1").describe():
            return [next(late) for _ in out]
        return [0.120 for _ in out] if plan_key(plan) == plan_key(paper) else out

    def with_offloads(rr, objective, shapes):
        return [offload_plan(costs, rr, "s1")] if shapes == "offload" else candidates(rr, objective, shapes)

    lines: list[str] = []
    got = calibrate(costs, r, with_offloads, timed, release, log=lines.append, settle=0, runoff_frames=4)
    assert any("left out against its first frames: they run beside it" in line for line in lines), "\n".join(lines)
    assert got.plan.describe() == offload_plan(costs, r, "s1").describe()
    assert got.plan.fidelity["measured"] == pytest.approx((2 * 0.141 + 4 * 0.110) / 6)
    assert list(held.values()) == [got.plan.describe()]


def test_a_finalist_refused_for_room_in_the_runoff_is_not_tried_again_as_a_late_one(costs):
    """Offload times 105 ms on its calibration frames but cannot be set up beside the runoff's plans (refused for
    room): it is skipped once, with a note, and not tried again as a late finalist."""
    from deepco.planning.calibration import Unfit, calibrate

    r = rates()
    time_plan, release, candidates, held, released = _fake_bench(costs, lambda plan: 0.2)
    first = candidates(r, "latency", "all")[0]
    crowded = offload_plan(costs, r, "s1")

    def timed(plan, frames, warm_up):
        if plan.describe() == crowded.describe() and frames == 0:  # the runoff's set-up
            raise Unfit("no room beside the runoff's plans")
        out = time_plan(plan, frames, warm_up)
        return {crowded.describe(): [0.105] * frames, first.describe(): [0.100] * frames}.get(plan.describe(), out)

    def with_offloads(rr, objective, shapes):
        return [offload_plan(costs, rr, "s1")] if shapes == "offload" else candidates(rr, objective, shapes)

    lines: list[str] = []
    got = calibrate(costs, r, with_offloads, timed, release, log=lines.append, settle=0, runoff_frames=2)
    skipped = [line for line in lines if line.startswith(f"calibration: skipped {crowded.describe()}")]
    assert len(skipped) == 1, "\n".join(lines)
    assert not any("left out against its first frames" in line for line in lines), "\n".join(lines)
    assert got.plan.describe() == first.describe()


def test_calibration_in_a_world_of_slower_layers_fits_it_and_ends_on_the_truly_fastest_plan(costs):
    """Frames timed exactly as the cost model predicts them with the model's layers at half the profiled FLOP
    rate and 3 ms per step: calibration must fit that model and choose the plan that is fastest in it, having
    timed the plan its final fit ranks first (not one ruled out by the first rounds' misfit)."""
    from dataclasses import replace

    from deepco.planning.calibration import calibrate, with_compute_scale
    from deepco.planning.staged import search

    r = rates()
    true = replace(with_compute_scale(r, 2.0), step_overhead=0.003)
    time_plan, release, candidates, held, _ = _fake_bench(costs, lambda p: predict(p, costs, true)["frame"])
    got = calibrate(costs, r, candidates, time_plan, release, log=lambda _: None, settle=0)
    assert got.compute_scale == pytest.approx(2.0, rel=5e-2)
    assert got.step_overhead == pytest.approx(0.003, rel=0.2, abs=5e-4)
    timed = {t["plan"] for t in got.trials}
    assert search(costs, replace_rates(r, got), ["s0", "s1"])[0].describe() in timed
    fastest = search(costs, true, ["s0", "s1"])[0]
    # choose: a plan of fewer steps within SIMPLER_MARGIN of the fastest wins
    assert predict(got.plan, costs, true)["frame"] <= 1.03 * fastest.predicted + 1e-9
    assert got.plan.fidelity["within"]


def test_with_spare_the_finalists_still_held_at_the_end_are_kept_not_released(costs):
    """Live adaptation's standby: two plans measure alike (both finalists of the runoff); the one not chosen
    goes to ``spare`` with its resources still held, and no finalist is released."""
    from deepco.planning.calibration import calibrate, plan_key
    from deepco.planning.staged import offload_plan

    r = rates()
    first = _fake_bench(costs, lambda plan: 1.0)[2](r, "latency", "all")[0]  # the first plan planned and timed
    twins = {first.describe(), offload_plan(costs, r, "s1").describe()}
    time_plan, release, candidates, held, released = _fake_bench(
        costs, lambda plan: 0.010 if plan.describe() in twins else 1.0)

    def with_offloads(rr, objective, shapes):
        return [offload_plan(costs, rr, "s1")] if shapes == "offload" else candidates(rr, objective, shapes)

    spared = []
    got = calibrate(costs, r, with_offloads, time_plan, release, log=lambda _: None, settle=0, spare=spared.append)
    # (a twin may be timed twice, in two band weightings of the same shape: both are finalists, both spared)
    assert got.plan.describe() in twins and {p.describe() for p in spared} == twins - {got.plan.describe()}
    assert sorted(held) == sorted([plan_key(got.plan), *map(plan_key, spared)])  # chosen and spares stay held
    assert not twins & set(released)


def test_finalists_that_do_not_fit_together_are_not_swapped_in_and_out_every_runoff_frame(costs):
    """Servers with room for two plans' models and four finalists that measure alike: the runoff holds the
    fastest that fit together and leaves the rest out, instead of setting a plan up again (an upload on real
    servers) for every frame of an interleaved runoff. No plan is set up more than twice in all: once when
    first timed, once more if it was given back to make room before the runoff."""
    from collections import Counter

    from deepco.planning.calibration import Unfit, calibrate, plan_key

    r = rates()
    held: set[str] = set()
    setups: Counter = Counter()
    spread = iter([0.09, 0.11] * 1000)

    def time_plan(plan, frames, warm_up):
        key = plan_key(plan)
        if key not in held:
            if len(held) >= 2:
                raise Unfit("the servers' model slots are full")
            held.add(key)
            setups[plan.describe()] += 1
        return [next(spread) for _ in range(frames)]

    def candidates(rr, objective, shapes):
        from deepco.planning.staged import search

        ranked = search(costs, rr, ["s0", "s1"], objective=objective, shapes=shapes)
        return [offload_plan(costs, rr, "s1")] if shapes == "offload" else ranked if shapes == "all" else ranked[:1]

    lines: list[str] = []
    got = calibrate(costs, r, candidates, time_plan, lambda plan: held.discard(plan_key(plan)),
                    log=lines.append, settle=0, runoff_frames=6)
    runoffs = [t for t in got.trials if t["note"] == "runoff"]
    assert runoffs, lines  # the plans measured alike: there was a runoff
    assert len(setups) >= 3, setups  # more finalists than the two that fit together
    assert max(setups.values()) <= 2, setups
    assert plan_key(got.plan) in held


def _split_computes(plan, costs, truth):
    """Each server's compute seconds in a frame of ``plan`` in a world of rates ``truth``."""
    from deepco.planning.live_rates import work_of

    return {name: work.flops / truth.server_flops_per_second[name]
            for name, work in zip(plan.servers, work_of(plan, costs), strict=True)}


def test_balance_puts_each_servers_rate_in_proportion_to_the_others_from_split_frames_only(costs):
    """s1 computes at half the rate setup measured, s0 at it: s1's slowness against the other is 2, so the
    factors (over their geometric mean) are sqrt(2) and 1/sqrt(2). An offload's frame and a frame of one server
    say nothing of the servers against each other; outliers beyond 3x are bounded."""
    from dataclasses import replace

    from deepco.planning.calibration import BALANCE_BOUNDS, Balance, with_balance

    r = rates()
    truth = replace(r, server_flops_per_second={"s0": 4e9, "s1": 0.5e9})
    split = split_plan(costs, r, ["s0", "s1"], ["layer1", "layer3"], True, "s0")
    balance = Balance(costs, r)
    balance.add(offload_plan(costs, r, "s1"), {"s1": 9.0})
    assert balance.factors() == {}
    for _ in range(3):
        balance.add(split, _split_computes(split, costs, truth))
    factors = balance.factors()
    assert factors == pytest.approx({"s0": 2 ** -0.5, "s1": 2 ** 0.5})
    balanced = with_balance(r, factors)
    assert balanced.server_flops_per_second["s0"] / balanced.server_flops_per_second["s1"] == pytest.approx(8.0)
    far = Balance(costs, r)
    far.add(split, {"s0": 1e-6, "s1": 10.0})
    assert far.factors() == pytest.approx({"s0": BALANCE_BOUNDS[0], "s1": BALANCE_BOUNDS[1]})
    # servers a thousand times faster: a stage takes microseconds, which time ONNX Runtime's calls, not the rate
    quick = replace(r, server_flops_per_second={"s0": 4e12, "s1": 1e12})
    short = Balance(costs, quick)
    short.add(split, _split_computes(split, costs, replace(quick, server_flops_per_second={"s0": 4e12, "s1": 5e11})))
    assert short.factors() == {}


def test_balance_leaves_out_the_first_level_where_the_frame_says_what_it_took(costs):
    """s1 computes every later level at 1.25x s0's speed (against setup's rates), but its first level, which runs
    while the device still sends, takes so much longer that over the whole frame both look alike. Told each
    server's first-level seconds, Balance finds s1 faster; counting the whole frame it cannot."""
    from dataclasses import replace

    from deepco.planning.calibration import Balance
    from deepco.planning.live_rates import stage_flops

    r = rates()
    split = split_plan(costs, r, ["s0", "s1"], ["layer1", "layer3"], True, "s0")
    speeds = r.server_flops_per_second
    later = replace(r, server_flops_per_second={"s0": speeds["s0"], "s1": 1.25 * speeds["s1"]})
    computes = _split_computes(split, costs, later)
    first = {name: stage_flops(split, costs, 1, i) / later.server_flops_per_second[name]
             for i, name in enumerate(split.servers)}
    # s1's first level slowed until its whole frame takes as long against setup's rate as s0's
    setup = _split_computes(split, costs, r)
    extra = computes["s0"] / setup["s0"] * setup["s1"] - computes["s1"]
    assert extra > 0
    computes["s1"] += extra
    first["s1"] += extra
    whole, leaving_out = Balance(costs, r), Balance(costs, r)
    for _ in range(3):
        whole.add(split, computes)
        leaving_out.add(split, computes, first)
    assert whole.factors() == pytest.approx({"s0": 1.0, "s1": 1.0})
    factors = leaving_out.factors()
    assert factors["s0"] / factors["s1"] == pytest.approx(1.25)


@pytest.mark.parametrize("balanced", [True, False])
def test_calibration_sizes_the_bands_on_the_servers_speeds_the_frames_measured(costs, balanced):
    """Setup's probe swapped the two servers (s0 probed at 1 GFLOP/s runs this model at 2, s1 the reverse), as
    the testbed's probe rated a 0.35-core server above its 0.45-core neighbours: a split sized on the probe
    gives s1 rows that keep s0 waiting. With the servers' compute times of the split frames (`Balance`),
    calibration plans on their real speeds and ends on a plan within 3% of the fastest in the true world;
    without them (the second case, the code before) it cannot: a compute scale slows both servers alike."""
    from dataclasses import replace

    from deepco.planning.calibration import Balance, calibrate
    from deepco.planning.staged import search

    # slow enough that each server's stages of a split are long enough to time (BALANCE_LEAST_STAGE_SECONDS)
    probed = replace(rates(), server_flops_per_second={"s0": 1e9, "s1": 2e9})
    truth = replace(probed, server_flops_per_second={"s0": 2e9, "s1": 1e9})
    balance = Balance(costs, probed) if balanced else None

    def frame_seconds(plan):
        if balance is not None:
            balance.add(plan, _split_computes(plan, costs, truth))
        return predict(plan, costs, truth)["frame"]

    time_plan, release, candidates, held, _ = _fake_bench(costs, frame_seconds)
    got = calibrate(costs, probed, candidates, time_plan, release, log=lambda _: None, settle=0, balance=balance)
    fastest = search(costs, truth, ["s0", "s1"])[0].predicted
    took = predict(got.plan, costs, truth)["frame"]
    if balanced:
        assert got.balance == pytest.approx({"s0": 0.5, "s1": 2.0})
        assert took <= 1.03 * fastest
    else:
        assert got.balance == {}
        assert took > 1.03 * fastest, (got.plan.describe(), took, fastest)


def test_a_streamed_plan_that_measures_slower_than_its_twin_sending_whole_windows_loses_the_runoff(costs):
    """Frames timed as the cost model predicts them, but each window streamed in sub-bands costs 10 ms more (a
    weak camera's message per server that the model does not charge): the plan ranked first streams, its twin
    that sends its windows whole is timed beside it, and calibration ends on a plan that streams nothing."""
    from deepco.planning.calibration import calibrate
    from deepco.planning.staged import streamed, unstreamed

    # slow radios and a quick round trip (a window's rest waits for one): streaming predicted to pay
    r = Rates({"s0": 4e9, "s1": 1e9}, [3e5, 3e5], 0.0005, 1e8, 1e8, 0.0005)

    def seconds_of(plan):
        return predict(plan, costs, r)["frame"] + 0.01 * sum(x is not None for x in streamed(plan))

    time_plan, release, candidates, _, _ = _fake_bench(costs, seconds_of)

    def with_offloads(rr, objective, shapes):  # the contenders as the device's planner gives them
        return [offload_plan(costs, rr, "s0")] if shapes == "offload" else candidates(rr, objective, shapes)

    first = candidates(r, "latency", "all")[0]
    assert any(streamed(first)), first.describe()
    got = calibrate(costs, r, with_offloads, time_plan, release, log=lambda _: None, settle=0)
    timed = {t["plan"] for t in got.trials}
    assert first.describe() in timed and unstreamed(first).describe() in timed
    assert not any(streamed(got.plan)), got.plan.describe()
