"""The device's health logic without servers: failover replans once per failure without the failed server,
liars are never probed back, and drift rescales a rate only when it stays off the plan."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
from deepco_device.health import DriftWatch, Health
from deepco_device.records import FrameTiming, Measurements, ServerStep

from deepco.partition import Partitioner, load_model
from deepco.partition.pixels import with_pixel_input
from deepco.planning.plan import PlanningError
from deepco.planning.staged import CostModel, StagedPlan
from deepco.wire.client import ServerError, WrongAnswer

H, W = 192, 64


class FakeDevice:
    def __init__(self):
        self.down, self.events, self.lines = set(), [], []
        self.uploads = SimpleNamespace(forget=lambda address: None)
        self.pool = SimpleNamespace(client=lambda name, antenna: SimpleNamespace(address=f"addr-{name}"))

    def log(self, line: str) -> None:
        self.lines.append(line)


def plan_on(servers: list[str]) -> StagedPlan:
    return StagedPlan("equal", "split", servers=list(servers), antennas=[0] * len(servers), levels=["layer1"])


def make_health(servers: list[str], ready=lambda name: True):
    device = FakeDevice()
    calls = []

    def replan(down: set[str]) -> StagedPlan:
        calls.append(set(down))
        left = [s for s in servers if s not in down]
        if not left:
            raise PlanningError("no server is left: every server of the cluster is down")
        return plan_on(left)

    first = SimpleNamespace(plan=plan_on(servers))
    health = Health(device, first, lambda plan: SimpleNamespace(plan=plan), replan, ready,
                    lambda address: address.removeprefix("addr-"))
    return health, device, calls, first


def test_a_failed_server_is_left_out_of_one_new_plan():
    health, device, calls, first = make_health(["s0", "s1", "s2"])
    assert health.failed(first, ServerError("addr-s1", grpc.StatusCode.UNAVAILABLE, "gone")) is None
    assert calls == [{"s1"}] and health.current().plan.servers == ["s0", "s2"]
    assert device.down == {"s1"} and any(line.startswith("server s1 down (UNAVAILABLE)") for line in device.lines)
    # a second frame that was in flight on the old plan fails on s1 too: no second replan
    assert health.failed(first, ServerError("addr-s1", grpc.StatusCode.UNAVAILABLE, "gone")) is None
    assert calls == [{"s1"}]


def test_with_no_server_left_the_frame_gets_an_explicit_error_and_a_liar_never_rejoins():
    health, device, calls, first = make_health(["s0"])
    why = health.failed(first, WrongAnswer("addr-s0", "the band of s0 has 3 rows, expected 4"))
    assert why is not None and "wrong answer" in why and "no plan is left" in why
    assert "for good: it answered wrongly" in device.lines[-1]
    health._probed = 0.0  # the probe is due
    health.rejoin()
    assert calls == [{"s0"}] and health.down == {"s0"}  # not asked back: it lied


def test_a_server_that_answers_again_rejoins_with_a_replan():
    health, device, calls, first = make_health(["s0", "s1"])
    health.failed(first, ServerError("addr-s1", grpc.StatusCode.UNAVAILABLE, "gone"))
    health._probed = 0.0
    health.rejoin()
    assert calls == [{"s1"}, set()] and health.current().plan.servers == ["s0", "s1"]
    assert device.down == set() and "server s1 is back" in device.lines[-1]


@pytest.fixture(scope="module")
def costs() -> CostModel:
    model = with_pixel_input(load_model("resnet18", H, W), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    return CostModel(Partitioner(model, H, W), 3 * H * W, 4000)


def test_drift_rescales_a_server_only_after_five_frames_off_the_plan(costs):
    measured = Measurements({"s0": 2e9, "s1": 2e9}, [1e6], 0.001, 1e8, paced=True)
    band = [(0, 24), (24, 48)]
    window = [costs.window(None, "layer1", a, b).input_rows for a, b in band]
    plan = StagedPlan("equal", "split", servers=["s0", "s1"], antennas=[0, 0], order=[0, 1], levels=["layer1"],
                      bands=[[(0, 96), (96, H)], band], windows=[window, window], crops=[[], [0, 0]])
    planned = [costs.window(None, "layer1", a, b).flops / 2e9 for a, b in band]
    watch = DriftWatch(costs, measured)

    def timing(slow: float) -> FrameTiming:
        return FrameTiming(latency=1.0, servers=tuple(
            ServerStep(s, 0, band[i], band[i], compute=planned[i] * (slow if s == "s0" else 1.0))
            for i, s in enumerate(["s0", "s1"])))

    for _ in range(4):
        assert watch.observe(plan, timing(3.0)) == []
    assert watch.observe(plan, timing(1.2)) == []  # one frame within 50%: the run of five starts again
    for _ in range(4):
        assert watch.observe(plan, timing(3.0)) == []
    changed = watch.observe(plan, timing(3.0))
    assert changed == ["server s0 at 3.00x the planned time"]
    assert measured.server_flops_per_second == pytest.approx({"s0": 2e9 / 3, "s1": 2e9})
