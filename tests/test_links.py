"""Each antenna's rate fitted to the windows' measured arrivals (deepco.planning.links), on real servers."""

from __future__ import annotations

import statistics
from dataclasses import replace

import numpy as np
import pytest
from deepco_device.runners import StagedRunner
from deepco_device.session import Device

from deepco.cluster import parse_cluster
from deepco.planning.links import REST, Links, with_links
from deepco.planning.staged import refine, sends, split_plan, streamed

MBPS = 2.0  # paced (EMULATED): slow enough that the bytes, not the requests' fixed cost, set the arrivals (at 8
# Mbit/s a request's round trip on a machine busy with other tests read as a fifth more antenna time)


@pytest.fixture(scope="module")
def paced_device(two_servers):
    data = {"device": {"antennas": 1, "bandwidth": MBPS},
            "servers": [{"name": f"s{i}", "capacity": 1.0, "address": s.address} for i, s in enumerate(two_servers)]}
    with Device(parse_cluster(data), "resnet18", 96, 128, log=lambda _: None, pace=True) as dev:
        dev.setup()
        yield dev


def test_the_fit_finds_how_much_slower_an_antenna_carries_windows_than_the_rates_it_is_given(paced_device):
    """Both servers on the one antenna, one after the other. Told the antenna is 3x faster than the pace the
    device holds it to, the fit multiplies its time by about 3, and the send model then meets every server's
    measured arrival, the second's (which starts after the first's window was acknowledged) included."""
    dev = paced_device
    measured = dev.measured.rates()
    plan = split_plan(dev.costs, measured, ["s0", "s1"], ["layer1"], True, None, stream=False)
    assert plan is not None and plan.antennas == [0, 0] and sorted(plan.order) == [0, 1]
    runner = StagedRunner(dev, plan)
    arrivals: dict[str, list[float]] = {"s0": [], "s1": []}
    told = replace(measured, antenna_bytes_per_second=[3 * b for b in measured.antenna_bytes_per_second])
    links = Links(dev.costs, told)
    try:
        x = np.random.default_rng(0).integers(0, 256, (1, 3, 96, 128), dtype=np.uint8)
        runner.run_frame(x)  # the first run allocates
        for _ in range(4):
            _, timing = runner.run_frame(x)
            received = {step.name: step.received for step in timing.servers}
            links.add(plan, received)
            for name, seconds in received.items():
                arrivals[name].append(seconds)
    finally:
        runner.close()
    factors = links.factors()
    assert set(factors) == {0}
    assert 2.4 <= factors[0] <= 3.6, factors
    predicted = sends(plan, dev.costs, with_links(told, factors))[1]
    for i, name in enumerate(plan.servers):
        want = statistics.median(arrivals[name])
        assert abs(predicted[i] / want - 1) <= 0.2, (name, predicted[i], want)
    # the probe's own rates were right here: a fit from them stays near 1
    honest = Links(dev.costs, measured)
    honest.add(plan, {name: statistics.median(v) for name, v in arrivals.items()})
    assert 0.8 <= honest.factors()[0] <= 1.25, honest.factors()


def test_offloads_are_not_fitted_and_streamed_windows_fit_their_rests_not_the_antennas(paced_device):
    """An offload's runner does not see its input arrive, and a streamed window's rest is acknowledged when its
    server, busy on its first sub-band, takes it: that says how slowly rests cross (``REST``), not what the
    antenna carries."""
    from deepco.planning.staged import offload_plan_on, streaming

    dev = paced_device
    measured = dev.measured.rates()
    links = Links(dev.costs, measured)
    links.add(offload_plan_on("s0", 0), {"s0": 0.5})
    assert links.factors() == {}
    plan = split_plan(dev.costs, measured, ["s0", "s1"], ["layer1"], True, None, stream=False)
    parted = streaming(plan, dev.costs, 0.5)
    assert all(streamed(parted)), parted.describe()
    links.add(parted, {"s0": 5.0, "s1": 5.0})
    assert set(links.factors()) == {REST} and links.factors()[REST] > 1
    links.add(plan, {"s0": 5.0, "s1": 5.0})  # the same windows sent whole: the antenna is fitted
    assert links.factors()[0] > 1 and REST in links.factors()


def test_the_rests_slowdown_is_found_on_top_of_the_antennas_and_makes_the_unstreamed_twin_the_faster():
    """Arrivals made by the send model itself with an antenna 1.5x slower than probed and rests that hold it
    2.5x as long as their bytes: the fit finds both (within two grid steps), and on the fitted rates the plan
    that sends its windows whole is predicted faster than its streamed twin, which on the probe's rates was
    predicted the faster (ResNet-18's first two stages at 720x128, four servers on two antennas)."""
    from deepco.partition import Partitioner, load_model
    from deepco.planning.staged import CostModel, Rates, predict, streaming, unstreamed

    costs = CostModel(Partitioner(load_model("resnet18", 720, 128), 720, 128), 3 * 720 * 128, 4000)
    probe = Rates(dict.fromkeys(["s0", "s1", "s2", "s3"], 2e9), [2.5e5, 2.5e5], 0.005, 1e9, 1e8, 0.001)
    plan = refine(split_plan(costs, probe, ["s0", "s1", "s2", "s3"], ["layer1", "layer2"], True, "s0", stream=False),
                  costs, probe, stream=False)
    parted = streaming(plan, costs, 0.5)
    assert any(streamed(parted)) and unstreamed(parted).overlap != parted.overlap, parted.describe()
    assert predict(parted, costs, probe)["frame"] < predict(plan, costs, probe)["frame"]
    truth = with_links(probe, {0: 1.5, 1: 1.5, REST: 2.5})
    links = Links(costs, probe)
    for p in (plan, parted):
        links.add(p, dict(zip(p.servers, sends(p, costs, truth)[1], strict=True)))
    fit = links.factors()
    step = (4.0 / 0.25) ** (2 / 159)
    assert all(k / step <= fit[m] <= k * step for m, k in ((0, 1.5), (1, 1.5), (REST, 2.5))), fit
    fitted = with_links(probe, fit)
    assert predict(plan, costs, fitted)["frame"] < predict(parted, costs, fitted)["frame"]


def test_bands_sized_on_the_fitted_antennas_are_faster_on_them_than_bands_sized_on_the_probes():
    """What the fit is for: the first stage is sized to the windows' arrivals (`refine`: the servers whose
    windows come first take more rows). Where the antennas carry windows otherwise than probed, the plan made on
    the fitted rates is predicted faster on them than the plan made on the probe's (four servers, two antennas,
    ResNet-18's first two stages at 720x128)."""
    from deepco.partition import Partitioner, load_model
    from deepco.planning.staged import CostModel, Rates, predict

    costs = CostModel(Partitioner(load_model("resnet18", 720, 128), 720, 128), 3 * 720 * 128, 4000)
    probe = Rates(dict.fromkeys(["s0", "s1", "s2", "s3"], 2e9), [2.5e6, 2.5e6], 0.005, 1e9, 1e8, 0.001)
    for factors in ({1: 2.0}, {0: 1.5, 1: 1.5}, {0: 0.6}):
        truth = with_links(probe, factors)
        made = {}
        for name, rates in (("probe", probe), ("fitted", truth)):
            plan = split_plan(costs, rates, ["s0", "s1", "s2", "s3"], ["layer1", "layer2"], True, "s0", stream=False)
            made[name] = refine(plan, costs, rates, stream=False)
        assert made["fitted"].bands[1] != made["probe"].bands[1], factors
        assert predict(made["fitted"], costs, truth)["frame"] < predict(made["probe"], costs, truth)["frame"], factors
