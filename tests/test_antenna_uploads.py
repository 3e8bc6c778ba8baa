"""Models cross each server's own antenna (issue 27): a runner's set-up loads a server's models over the antenna the
plan sends that server's frames on, the servers' at once, and the device keeps one account of what a server holds
whichever of its addresses a model crossed. Real in-process servers on loopback, each reached at two addresses (one
per antenna: ``127.0.0.1:PORT`` and ``localhost:PORT``), real ONNX Runtime."""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import pytest
from deepco_device.runners import warm
from deepco_device.session import Device
from deepco_device.staged import StagedPlanner, StagedRunner
from plan_support import assert_frame_exact

from deepco.cluster import parse_cluster
from deepco.planning.staged import split_plan
from deepco.wire.client import InferenceClient, ServerError

H, W = 64, 80
LEVELS = ["layer1", "layer2"]


def addresses(port: int) -> list[str]:
    """The server's address on antenna 0 and on antenna 1: two names of the one loopback socket it listens on."""
    return [f"127.0.0.1:{port}", f"localhost:{port}"]


@pytest.fixture
def dev(two_servers):
    data = {"device": {"antennas": 2, "bandwidth": 100.0},
            "servers": [{"name": f"s{i}", "capacity": 1.0, "antenna_addresses": addresses(s.port)}
                        for i, s in enumerate(two_servers)]}
    device = Device(parse_cluster(data), "resnet18", H, W, log=lambda _: None)
    device.setup(rows=False)
    yield device
    device.close()


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, str, str]]:
    """Every model load, derivation and unload the device makes: (call, address, model name)."""
    seen: list[tuple[str, str, str]] = []
    lock = threading.Lock()
    for call in ("load_model", "derive_model", "unload_model"):
        original = getattr(InferenceClient, call)

        def recorded(self, data_or_name, *args, _call=call, _original=original, **kwargs):
            name = data_or_name if _call == "unload_model" else args[0]
            with lock:
                seen.append((_call, self.address, name))
            return _original(self, data_or_name, *args, **kwargs)

        monkeypatch.setattr(InferenceClient, call, recorded)
    return seen


def split_on(dev: Device, antennas: list[int]):
    """A split of both servers (``s1`` runs the tail), ``s0`` sending over ``antennas[0]`` and ``s1`` over
    ``antennas[1]``."""
    planner = StagedPlanner(dev)
    plan = split_plan(planner.costs, planner.rates(), ["s0", "s1"], LEVELS, True, "s1")
    assert plan is not None
    return dataclasses.replace(plan, antennas=antennas, order=[0, 0])


def listed(servers) -> list[list[str]]:
    out = []
    for s in servers:
        with InferenceClient(f"127.0.0.1:{s.port}", timeout=5) as client:
            out.append(client.loaded_models())
    return out


def test_each_servers_models_cross_its_own_antenna_once(dev, calls, two_servers):
    """Set-up loads s0's models at its antenna-1 address and s1's at its antenna-0 one; the outputs are the whole
    model's; a second runner whose plan reaches the servers over the other antennas sends nothing (the models are
    held by server, not by address); closing both leaves no model on either server."""
    crossed = split_on(dev, [1, 0])
    runner = StagedRunner(dev, crossed)
    loads = [(address, name) for call, address, name in calls if call != "unload_model"]
    assert loads and {address for address, _ in loads} == {addresses(two_servers[0].port)[1],
                                                            addresses(two_servers[1].port)[0]}
    assert {address for address, name in loads if name == runner.tail_name} == {addresses(two_servers[1].port)[0]}

    assert_frame_exact(runner, dev)

    straight = split_on(dev, [0, 1])
    assert warm(dev, straight)
    calls.clear()
    second = StagedRunner(dev, straight)
    assert calls == []  # held already: nothing sent, whichever antenna it crossed
    held = sorted(name for _, name in runner.held)
    runner.close()
    assert calls == []  # the second runner still uses them
    second.close()
    assert listed(two_servers) == [[], []]
    assert sorted(name for call, _, name in calls if call == "unload_model") == held  # each once


def test_a_down_servers_models_are_not_asked_for_on_close(dev, calls, two_servers):
    """A server marked down is asked nothing on close, whichever antenna its models crossed (a frozen one would
    cost a timeout per model); the other one's models are unloaded."""
    runner = StagedRunner(dev, split_on(dev, [0, 1]))
    on_s1 = {name for call, address, name in calls if address == addresses(two_servers[1].port)[1]}
    try:
        assert on_s1 and {address for call, address, _ in calls} == {addresses(two_servers[0].port)[0],
                                                                     addresses(two_servers[1].port)[1]}
        dev.down.add("s1")
        calls.clear()
        dev.close()
        assert {address for call, address, _ in calls if call == "unload_model"} == {addresses(two_servers[0].port)[0]}
        left = listed(two_servers)
        assert left[0] == [] and left[1]
    finally:
        runner.held = []  # dropped with the device's release already
        with InferenceClient(f"127.0.0.1:{two_servers[1].port}", timeout=5) as client:
            for name in on_s1:  # a whole model held to derive from included: it is not listed
                with contextlib.suppress(ServerError):
                    client.unload_model(name, force=True)
