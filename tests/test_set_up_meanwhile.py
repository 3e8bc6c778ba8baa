"""While a plan's models cross a slow radio, live frames run on the device alone and give their results, in
order; the plan takes the frames left once it is set up. Where a set-up is quick, no frame goes to the device.
The runners are stand-ins (set-up time is what is under test); the planner's cost model and the feed are real."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from deepco_device import planner as planner_module
from deepco_device.feed import IterFeed
from deepco_device.records import FrameTiming

from deepco.partition import Partitioner, load_model
from deepco.partition.pixels import with_pixel_input
from deepco.planning.staged import CostModel, Rates, offload_plan

H, W = 64, 96


class _Measured:
    def __init__(self, rates: Rates):
        self._rates = rates

    def rates(self) -> Rates:
        return self._rates


class _Device:
    def __init__(self) -> None:
        model = with_pixel_input(load_model("resnet18", H, W), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
        self.costs = CostModel(Partitioner(model, H, W), 3 * H * W, 4000)
        self.measured = _Measured(Rates({"s0": 4e9}, [1e6], 0.001, 1e9, 1e8, 0.0005))
        self.lines: list[str] = []

    def log(self, line: str) -> None:
        self.lines.append(line)


@pytest.fixture(scope="module")
def device() -> _Device:
    return _Device()


def _runners(on_device: list[int], set_up_after: int):
    """A stand-in for StagedRunner: the device's runner answers at once (counting its frames in ``on_device``);
    any other plan's set-up lasts until the device has run ``set_up_after`` frames (at most 20 s)."""
    enough = threading.Event()

    class Runner:
        def __init__(self, device, plan, **_):
            self.plan = plan
            if plan.servers and set_up_after:
                assert enough.wait(20), "no frame ran on the device while the models were sent"

        def run_frame(self, x: np.ndarray):
            if not self.plan.servers:
                on_device.append(int(x[0, 0, 0, 0]))
                if len(on_device) >= set_up_after:
                    enough.set()
            return {"frame": x[0, 0, 0, 0].copy()}, FrameTiming(latency=0.001)

    return Runner


def _frames(n: int) -> IterFeed:
    return IterFeed(np.full((1, 3, H, W), i, np.uint8) for i in range(n))


def test_frames_run_on_the_device_while_a_plans_models_are_sent_and_the_plan_takes_the_rest(device, monkeypatch):
    on_device: list[int] = []
    monkeypatch.setattr(planner_module, "StagedRunner", _runners(on_device, set_up_after=3))
    monkeypatch.setattr(planner_module, "SET_UP_GRACE", 0.05)
    emitted: list[int] = []
    plan = offload_plan(device.costs, device.measured.rates(), "s0")
    runner, rest = planner_module.set_up_live(device, plan, _frames(10),
                                              lambda result, predicted: emitted.append(int(result.outputs["frame"])))
    assert runner.plan is plan
    # in order, each with its result (a loaded machine may run one more before the set-up thread returns)
    assert on_device == emitted == list(range(len(on_device))) and len(on_device) >= 3
    assert rest.take(0.1).index == len(on_device)  # the plan goes on from the next frame: none lost or repeated
    assert any("frames run on the device meanwhile" in line for line in device.lines), device.lines


def test_a_quick_set_up_spends_no_frame_on_the_device(device, monkeypatch):
    on_device: list[int] = []
    monkeypatch.setattr(planner_module, "StagedRunner", _runners(on_device, set_up_after=0))
    runner, rest = planner_module.set_up_live(device, offload_plan(device.costs, device.measured.rates(), "s0"),
                                              _frames(5), lambda result, predicted: None)
    assert on_device == []
    assert rest.take(0.1).index == 0


def test_while_a_contender_is_set_up_frames_run_on_the_fastest_plan_timed_so_far(device, monkeypatch):
    """Calibration timed one server plan (faster than the device alone is predicted); while the next candidate's
    models are sent, the live frames run on that plan, not on the device, in order and each with its result."""
    ran: list[tuple[str, int]] = []
    enough = threading.Event()

    class Runner:
        def __init__(self, dev, plan, **_):
            self.plan = plan
            if plan.servers == ["s1"]:  # the contender: its set-up lasts until 3 frames ran meanwhile
                assert enough.wait(20), "no frame ran while the contender's models were sent"

        def run_frame(self, x: np.ndarray):
            ran.append((self.plan.servers[0] if self.plan.servers else "device", int(x[0, 0, 0, 0])))
            if sum(where == "s0" for where, _ in ran) >= 5:
                enough.set()
            return {"frame": x[0, 0, 0, 0].copy()}, FrameTiming(latency=0.001)

    monkeypatch.setattr(planner_module, "StagedRunner", Runner)
    monkeypatch.setattr(planner_module, "SET_UP_GRACE", 0.05)
    monkeypatch.setattr(planner_module, "SETTLE_FRAMES", 0)
    monkeypatch.setattr(device, "progress", lambda what: None, raising=False)
    rates = Rates({"s0": 4e9, "s1": 4e9}, [1e6], 0.001, 1e9, 1e8, 0.0005)
    monkeypatch.setattr(device.measured, "_rates", rates)
    emitted: list[int] = []
    live = planner_module.LiveFrames(_frames(20),
                                     lambda result, predicted: emitted.append(int(result.outputs["frame"])))
    runs = planner_module._PlanRuns(device, live)
    runs.time(offload_plan(device.costs, rates, "s0"), frames=2, warm_up=False)
    runs.set_up(offload_plan(device.costs, rates, "s1"))
    assert [where for where, _ in ran] == ["s0"] * len(ran) and len(ran) >= 5  # none on the device
    assert [frame for _, frame in ran] == emitted == list(range(len(ran)))  # in order, each given out once
    assert any("frames run on offload" in line for line in device.lines), device.lines


def _two_plans(device, monkeypatch, latency: float, contender_set_up: threading.Event | None = None):
    """A stand-in runner whose every frame takes ``latency`` s (on the device: 1 ms); the contender (on s1) is set
    up once ``contender_set_up`` is set (at once without it). Its frames' (where, index) list, and the two plans."""
    ran: list[tuple[str, int]] = []

    class Runner:
        def __init__(self, dev, plan, **_):
            self.plan = plan
            if plan.servers == ["s1"]:
                ran.append(("set-up", -1))
                if contender_set_up is not None:
                    assert contender_set_up.wait(20)

        def run_frame(self, x: np.ndarray):
            where = self.plan.servers[0] if self.plan.servers else "device"
            ran.append((where, int(x[0, 0, 0, 0])))
            if contender_set_up is not None and len(ran) >= 12:
                contender_set_up.set()
            return {"frame": x[0, 0, 0, 0].copy()}, FrameTiming(latency=0.001 if where == "device" else latency)

    monkeypatch.setattr(planner_module, "StagedRunner", Runner)
    monkeypatch.setattr(planner_module, "SET_UP_GRACE", 0.05)
    monkeypatch.setattr(device, "progress", lambda what: None, raising=False)
    rates = Rates({"s0": 4e9, "s1": 4e9}, [1e6], 0.001, 1e9, 1e8, 0.0005)
    monkeypatch.setattr(device.measured, "_rates", rates)
    return ran, offload_plan(device.costs, rates, "s0"), offload_plan(device.costs, rates, "s1")


def test_the_first_plan_timed_runs_its_settle_frames_before_a_contender_is_set_up(device, monkeypatch):
    """A cold start's first results come from the predicted best plan, steadily: once it is timed, it runs
    SETTLE_FRAMES more live frames before the next candidate's set-up begins."""
    monkeypatch.setattr(planner_module, "SETTLE_FRAMES", 5)
    ran, first, contender = _two_plans(device, monkeypatch, latency=1e-5)
    runs = planner_module._PlanRuns(device, planner_module.LiveFrames(_frames(20), lambda result, predicted: None))
    runs.time(first, frames=2, warm_up=False)
    runs.set_up(contender)
    assert ran == [("s0", i) for i in range(2 + 5)] + [("set-up", -1)]


def test_a_plan_slower_than_the_device_meanwhile_sends_the_frames_to_the_device(device, monkeypatch):
    """Where a frame of the plan timed takes longer during a set-up than the device alone is predicted to (a weak
    device's CPU goes to the models), the next frames of that set-up run on the device alone."""
    monkeypatch.setattr(planner_module, "SETTLE_FRAMES", 0)
    ran, first, contender = _two_plans(device, monkeypatch, latency=1e-5, contender_set_up=threading.Event())
    runs = planner_module._PlanRuns(device, planner_module.LiveFrames(_frames(30), lambda result, predicted: None))
    runs.time(first, frames=2, warm_up=False)
    slow = planner_module.local_plan(device.costs, device.measured.rates()).predicted * 2
    monkeypatch.setattr(runs, "_timed", {k: 1e-5 for k in runs._timed})  # timed fast; slow from now on
    original = runs._frame

    def slowed(runner):
        original(runner)
        return slow if runner.plan.servers else 0.001

    monkeypatch.setattr(runs, "_frame", slowed)
    runs.set_up(contender)
    meanwhile = [where for where, _ in ran[3:]]
    assert meanwhile[0] == "s0" and set(meanwhile[1:]) == {"device"}, ran


def test_the_first_frame_can_run_on_the_device_before_any_plan(device, monkeypatch):
    """`first_on_device` (a cold start whose whole model is still on its way): the first live frame runs on the
    device alone and gives its result at once, before any plan is set up; with no frame left it does nothing."""
    ran, first, _ = _two_plans(device, monkeypatch, latency=1e-5)
    emitted: list[int] = []
    runs = planner_module._PlanRuns(device, planner_module.LiveFrames(
        _frames(1), lambda result, predicted: emitted.append(int(result.outputs["frame"]))))
    runs.first_on_device()
    assert ran == [("device", 0)] and emitted == [0]
    runs.first_on_device()  # the source has ended
    assert ran == [("device", 0)]
