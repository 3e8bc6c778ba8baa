"""The live-rate estimator: a step change is seen within a few samples, a single outlier never is, and the rates
the planner gets move by the size of the change."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from deepco.planning.live_rates import WINDOW, ChangeDetector, LiveRates
from deepco.planning.staged import Rates


def noisy(level: float, n: int, seed: int) -> list[float]:
    """``n`` samples around ``level`` with 5% noise (a frame's time is never exact)."""
    return list(level * (1 + 0.05 * np.random.default_rng(seed).standard_normal(n)))


def first_change(detector: ChangeDetector, samples: list[float]) -> tuple[int, float] | None:
    for k, sample in enumerate(samples):
        factor = detector.add(sample)
        if factor is not None:
            return k, factor
    return None


def test_a_step_change_is_seen_within_a_few_samples_and_a_single_outlier_never():
    detector = ChangeDetector()
    assert first_change(detector, noisy(1.0, 20, 0)) is None
    # one frame 10x slower (a hiccup), then back: no change, however large
    assert first_change(detector, [10.0, *noisy(1.0, 10, 1)]) is None
    assert first_change(detector, [0.1, *noisy(1.0, 10, 2)]) is None
    # a real step to 4x slower: seen at its third sample (all recent ones agree), not after tens of frames
    seen = first_change(detector, noisy(4.0, 20, 3))
    assert seen is not None
    k, factor = seen
    assert k < WINDOW and factor == pytest.approx(4.0, rel=0.15) and detector.level == pytest.approx(4.0, rel=0.15)
    # once the new level has held a few frames, the step back is seen as quickly; the level is measured from
    # the first one
    assert first_change(detector, noisy(4.0, 6, 9)) is None
    k, factor = first_change(detector, noisy(1.0, 20, 4))
    assert k < WINDOW and factor == pytest.approx(0.25, rel=0.15) and detector.level == pytest.approx(1.0, rel=0.1)
    # a step back right after a change is seen too, a little later (against the few samples of the new level)
    assert first_change(detector, noisy(1.0, 6, 10)) is None
    k, factor = first_change(detector, [*noisy(4.0, 3, 11), *noisy(1.0, 10, 12)])
    assert k == WINDOW - 1 and factor == pytest.approx(4.0, rel=0.15)
    k, factor = first_change(detector, noisy(1.0, 10, 13))
    assert k < 2 * WINDOW and detector.level == pytest.approx(1.0, rel=0.1)


def test_bimodal_noise_is_no_change_but_a_step_out_of_it_is():
    """Frames that share a server take one or two units of time at random: no change point, however long;
    a step to four times slower than that still is one."""
    rng = np.random.default_rng(8)
    detector = ChangeDetector()
    assert first_change(detector, list(rng.choice([1.0, 2.0], 200))) is None
    seen = first_change(detector, list(rng.choice([4.0, 8.0], 20)))
    assert seen is not None and seen[0] < 10


def test_live_rates_rescale_only_the_rate_that_changed_and_keep_it_across_a_restart():
    live = LiveRates()
    base = Rates({"s0": 4e9, "s1": 4e9}, [1e6, 2e6], 0.001, 1e9, 1e7, 0.001)
    for sample in noisy(1.3, 10, 5):  # a steady bias (this plan's segments run slower than the probe): no change
        assert live.observe({"server s0": sample, "server s1": 1.0, "antenna 1": 1.0}) == []
    changes = []
    for sample in noisy(1.3 * 3, 3, 6):  # s0 three times slower
        changes += live.observe({"server s0": sample, "server s1": 1.0, "antenna 1": 1.0})
    assert [c.key for c in changes] == ["server s0"] and "slower" in changes[0].describe()
    rates = live.rates(base)
    assert rates.server_flops_per_second["s0"] == pytest.approx(4e9 / 3, rel=0.15)
    assert rates.server_flops_per_second["s1"] == 4e9 and rates.antenna_bytes_per_second == [1e6, 2e6]
    assert base.server_flops_per_second["s0"] == 4e9  # setup's rates are left as they were
    live.restart()  # a new plan: another bias, the factor found stays
    for sample in noisy(2.0, 10, 7):
        assert live.observe({"server s0": sample}) == []
    assert live.rates(base).server_flops_per_second["s0"] == pytest.approx(4e9 / 3, rel=0.15)


def test_a_link_that_got_faster_while_the_frames_measured_nothing_reads_faster_at_the_next_reference():
    """A new plan starts every stream again; the frames during the search after a switch measure nothing, so a
    rise then lands in the new plan's first reference and no change point ever comes (the testbed: a split at
    110-130 ms for 70 frames after a tenfold rise, beside an offload at 85). An antenna's sample is its fixed
    part plus its slowness, never below the slowness: a first reference below the factor believed is the link
    faster. One above it is the new plan's own fixed part, and the run's first reference is the plan as
    calibrated: neither is a change."""
    live = LiveRates()
    base = Rates({"s0": 4e9}, [1e6, 1e6], 0.001, 1e9, 1e7, 0.001)
    for sample in noisy(1.2, 10, 40):  # as calibrated, and the run's first reference: no change
        assert live.observe({"antenna 0": sample, "antenna 1": 0.5 * sample}) == []
    live.restart()  # a switch; then every antenna rises tenfold while the search runs
    changes = []
    for sample in noisy(0.2 + 0.1, 10, 41):  # the new plan's fixed part (0.2) plus the new slowness (0.1)
        changes += live.observe({"antenna 0": sample, "antenna 1": 1.5 + 0.1})  # antenna 1: a large fixed part
    assert [c.key for c in changes] == ["antenna 0"] and "faster" in changes[0].describe()
    assert live.rates(base).antenna_bytes_per_second == [pytest.approx(1e6 / 0.3, rel=0.1), 1e6]
    # the level found is the stream's origin from now on: a drop back reads as one change at its size
    changes = []
    for sample in noisy(0.2 + 1.0, 4, 42):
        changes += live.observe({"antenna 0": sample})
    assert [c.key for c in changes] == ["antenna 0"]
    assert live.factor("antenna 0") == pytest.approx(1.2, rel=0.1)

def test_a_new_plan_reading_its_link_where_the_last_plan_read_it_is_no_change_even_below_setups_probe():
    """A shaper's burst lets a frame's bytes through faster than setup's probe measured the link, all run long:
    the testbed's offload read its antenna at 0.54 of the probe. The offload a slowed server led to, on the same
    link, read there too, and was taken as "antenna 0 1.84x faster" (a probe and a search beside the frames).
    Against the level the last plan's frames showed it is nothing; a real rise during the search still is."""
    live = LiveRates()
    for sample in noisy(0.54, 10, 50):  # the run's first plan: below setup's probe from the start
        assert live.observe({"antenna 0": sample}) == []
    live.restart()  # a switch to a plan on the same link
    for sample in noisy(0.54, 10, 51):
        assert live.observe({"antenna 0": sample}) == []
    assert live.factor("antenna 0") == 1.0
    live.restart()  # another switch; the link rises fourfold while its search blinds the frames
    changes = []
    for sample in noisy(0.54 / 4, 10, 52):
        changes += live.observe({"antenna 0": sample})
    assert [c.key for c in changes] == ["antenna 0"]
    assert live.factor("antenna 0") == pytest.approx(1 / 4, rel=0.15)


def test_a_new_plan_is_read_against_its_own_level_from_its_trial_whatever_its_bias():
    """A split's band read its link 2.93x faster than the offload before it had, on the same link and rate
    (the testbed's server-slowdown): another plan, another bias. Where the new plan's trial measured its own level
    beside the old plan's frames, its first reference is read against that: at it, nothing; a tenfold rise while
    its search blinded the frames, a change of about tenfold (its fixed part cancels); and a link the old plan
    did not use is checked too."""
    live = LiveRates()
    for sample in noisy(1.0, 10, 60):  # the offload: antenna 0 at setup's level
        assert live.observe({"antenna 0": sample}) == []
    live.restart({"antenna 0": 0.34, "antenna 1": 0.5, "server s0": 2.0})  # its trial: a band, and antenna 1 too
    for sample in noisy(0.34, 10, 61):
        assert live.observe({"antenna 0": sample, "antenna 1": 0.5}) == []
    assert live.factor("antenna 0") == live.factor("antenna 1") == 1.0
    live.restart({"antenna 0": 0.34, "antenna 1": 0.3 + 1.0})  # the next plan: 0.3 of fixed part on antenna 1
    changes = []
    for sample in noisy(0.34, 10, 62):  # antenna 1 rises tenfold during the search: its fixed part stays
        changes += live.observe({"antenna 0": sample, "antenna 1": 0.3 + 0.1})
    assert [c.key for c in changes] == ["antenna 1"]
    assert live.factor("antenna 1") == pytest.approx(0.1, rel=0.35) and live.factor("antenna 0") == 1.0


@pytest.mark.parametrize(("before", "after"), [(1.0, 10.0), (1.0, 0.1)])
def test_a_links_fixed_cost_does_not_dilute_a_bandwidth_change(before, after):
    """An antenna's sample is its transfer over the bytes' time at setup's bandwidth: a fixed part (round trip,
    marshalling) as long as the bytes' time sits in every sample. A tenfold drop (or rise) still reads as
    tenfold, not as (1 + 10) / (1 + 1) = 5.5 (a rise: within the noise of a difference, which on a fixed part ten
    times the bytes' new time is a third of it)"""
    fixed = 1.0
    live = LiveRates()
    base = Rates({"s0": 4e9}, [1e6], 0.001, 1e9, 1e7, 0.001)
    for sample in noisy(fixed + before, 10, 20):
        assert live.observe({"antenna 0": sample}) == []
    changes = []
    for sample in noisy(fixed + after, 4, 21):
        changes += live.observe({"antenna 0": sample})
    assert [c.key for c in changes] == ["antenna 0"]
    assert changes[0].factor == pytest.approx(after / before, rel=0.35)
    assert live.rates(base).antenna_bytes_per_second[0] == pytest.approx(1e6 * before / after, rel=0.35)


@pytest.mark.parametrize(("before", "after"), [(76.0, 10.0), (10.0, 76.0)])
def test_a_link_faster_than_setup_measured_still_reads_a_change_at_its_size(before, after):
    """tc's token bucket lets a frame's first tens of kilobytes through at once, so a frame's transfer can take
    less than setup's bandwidth gives its bytes. The testbed's rise (bench/README.md, d4a4665): 150 KB that 124
    ms of setup's 9.7 Mbit/s gives took 76 ms, then 10 ms after a tenfold rise. A difference of medians from
    setup's level read that as 2.15x; the change is 7.6x, and the reverse (a drop) too."""
    given = 124.0
    live = LiveRates()
    base = Rates({"s0": 4e9}, [1e6], 0.001, 1e9, 1e7, 0.001)
    for sample in noisy(before / given, 10, 30):
        assert live.observe({"antenna 0": sample}) == []
    changes = []
    for sample in noisy(after / given, 4, 31):
        changes += live.observe({"antenna 0": sample})
    assert [c.key for c in changes] == ["antenna 0"]
    assert changes[0].factor == pytest.approx(after / before, rel=0.2)
    assert live.rates(base).antenna_bytes_per_second[0] == pytest.approx(1e6 * before / after, rel=0.2)


def test_a_reference_taken_beside_the_devices_own_work_does_not_make_the_next_level_read_infinitely_faster():
    """Seen on the testbed: frames beside the camera's own work (cutting a trial's models) took seconds where a
    10 Mbit/s link takes 80 ms; they became an antenna's reference, and the steady frames after them were read as
    "16.00x faster" (the floor), from a fixed part larger than the frames themselves. Where the fixed part the
    reference implies is contradicted so, the level moves by the plain ratio of the medians."""
    live = LiveRates()
    polluted = [2.9, 53.5, 9.3, 57.3, 5.5, 14.8, 4.8]
    steady = [1.7, 1.8, 1.75] * 4
    changes = []
    for x in polluted + steady:
        changes += live.observe({"antenna 1": x})
    assert [c.key for c in changes] == ["antenna 1"]
    reference = statistics.median(polluted[:5])  # the first reference: the origin its level is measured from
    recent = statistics.median(steady)  # the run that makes the change: some of the steady frames
    assert live.factor("antenna 1") == pytest.approx(recent / reference, rel=0.1)
    assert live.factor("antenna 1") > 1 / 16 * 1.5  # not the floor a negative level was clamped to
