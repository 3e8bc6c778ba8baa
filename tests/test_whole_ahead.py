"""The whole model crosses the radio once (issue 27): a cold start sends it ahead of planning, in parts over every
antenna that reaches the server at an address of its own, and the other servers fetch it from there over their LAN;
servers that ask for it at once share one crossing. Real in-process servers on loopback, each reached at two
addresses (one per antenna: ``127.0.0.1:PORT`` and ``localhost:PORT``), real ONNX Runtime."""

from __future__ import annotations

import dataclasses
import threading

import grpc
import pytest
from deepco_device.runners import _whole_bytes, send_whole_early
from deepco_device.session import Device
from deepco_device.staged import StagedPlanner, StagedRunner
from plan_support import assert_frame_exact

from deepco.cluster import parse_cluster
from deepco.planning.staged import split_plan
from deepco.wire.client import InferenceClient, ServerError

H, W = 64, 80
LEVELS = ["layer1", "layer2"]
CALLS = ("load_model", "load_whole_part", "fetch_whole_model", "derive_model")


def addresses(port: int) -> list[str]:
    """The server's address on antenna 0 and on antenna 1: two names of the one loopback socket it listens on."""
    return [f"127.0.0.1:{port}", f"localhost:{port}"]


@pytest.fixture
def lines() -> list[str]:
    return []


@pytest.fixture
def dev(two_servers, lines):
    data = {"device": {"antennas": 2, "bandwidth": 100.0},
            "servers": [{"name": f"s{i}", "capacity": 1.0, "antenna_addresses": addresses(s.port)}
                        for i, s in enumerate(two_servers)]}
    device = Device(parse_cluster(data), "resnet18", H, W, log=lines.append)
    device.setup(rows=False)
    yield device
    device.close()
    for s in two_servers:  # nothing of this device is left on a server
        with InferenceClient(f"127.0.0.1:{s.port}", timeout=5) as client:
            assert client.loaded_models() == []


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, str, int]]:
    """Every model load the device makes: (call, address, bytes of model it carries; 0 for none)."""
    seen: list[tuple[str, str, int]] = []
    lock = threading.Lock()
    for call in CALLS:
        original = getattr(InferenceClient, call)

        def recorded(self, first, *args, _call=call, _original=original, **kwargs):
            carried = len(first) if _call in ("load_model", "load_whole_part") else 0
            with lock:
                seen.append((_call, self.address, carried))
            return _original(self, first, *args, **kwargs)

        monkeypatch.setattr(InferenceClient, call, recorded)
    return seen


def split(dev: Device):
    """A split of both servers, ``s1`` running the tail (most of ResNet-18's weights): both derive from the whole
    model."""
    planner = StagedPlanner(dev)
    plan = split_plan(planner.costs, planner.rates(), ["s0", "s1"], LEVELS, True, "s1")
    assert plan is not None
    return dataclasses.replace(plan, antennas=[0, 1], order=[0, 0])


def test_a_cold_start_sends_the_whole_model_once_in_parts_over_both_antennas(dev, calls, two_servers):
    """`send_whole_early` sends the whole model to one server in two parts, one over each of its addresses, which
    add up to the model; a split plan over both servers then sends no model bytes: the other server fetches the
    whole model from the first over their LAN, and every stage is derived. Its frames are the whole model's."""
    whole = len(_whole_bytes(dev))
    send_whole_early(dev).join()
    parts = [(address, n) for call, address, n in calls if call == "load_whole_part"]
    assert len(parts) == 2 and sum(n for _, n in parts) == whole
    target = next(s for s in two_servers if {a for a, _ in parts} == set(addresses(s.port)))
    # each part in proportion to the bandwidth the device measured for its antenna (loopback under a loaded
    # machine can measure the two unalike, so the measured rates are the reference, not "about half each")
    rates = dev.measured.antenna_bytes_per_second
    for address, n in parts:
        share = rates[addresses(target.port).index(address)] / sum(rates)
        assert abs(n / whole - share) < 0.01, (n / whole, share)
    assert [c for c in calls if c[0] == "load_model"] == []

    calls.clear()
    runner = StagedRunner(dev, split(dev))
    try:
        assert [c for c in calls if c[2]] == []  # no model bytes crossed the radio for the plan
        fetched = [address for call, address, _ in calls if call == "fetch_whole_model"]
        other = next(s for s in two_servers if s is not target)
        assert len(fetched) == 1 and fetched[0] in addresses(other.port)
        assert_frame_exact(runner, dev)
    finally:
        runner.close()


def test_servers_that_ask_for_the_whole_model_at_once_share_one_crossing(dev, calls):
    """Both servers asked to hold the whole model at the same moment: it crosses the radio to one of them (in
    parts) and the other fetches it from there, rather than crossing twice."""
    whole = _whole_bytes(dev)
    start = threading.Barrier(2)

    def hold(k: int) -> None:
        start.wait()
        dev.uploads.hold_whole(f"s{k}", dev.client(k, k), whole, dev.tag)

    threads = [threading.Thread(target=hold, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(n for _, _, n in calls) == len(whole)
    assert [call for call, _, _ in calls].count("fetch_whole_model") == 1


def test_a_part_that_fails_sends_the_whole_model_over_one_antenna(dev, calls, lines, monkeypatch):
    """An antenna whose part fails (here: its channel answers UNAVAILABLE) costs one warning line, and the whole
    model crosses the other antenna: the server holds it and derives from it."""
    original = InferenceClient.load_whole_part

    def flaky(self, part, *args, **kwargs):
        if self.address.startswith("localhost"):
            raise ServerError(self.address, grpc.StatusCode.UNAVAILABLE, "antenna down (test)")
        return original(self, part, *args, **kwargs)

    monkeypatch.setattr(InferenceClient, "load_whole_part", flaky)
    send_whole_early(dev).join()
    assert any("in parts over 2 antennas failed (UNAVAILABLE); sending it over one" in line for line in lines)
    assert [n for call, _, n in calls if call == "load_model"] == [len(_whole_bytes(dev))]
    runner = StagedRunner(dev, split(dev))
    try:
        assert_frame_exact(runner, dev)
    finally:
        runner.close()
