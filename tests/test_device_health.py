"""The device's health logic without servers: failover replans once per failure without the failed server,
liars are never probed back, and a server back joins through a trial of the plan with it."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
from deepco_device.adaptation import Adaptation, Trial
from deepco_device.health import Health
from deepco_device.lifecycle import Uploads
from deepco_device.records import FrameTiming

from deepco.planning.live_rates import Change
from deepco.planning.plan import PlanningError
from deepco.planning.staged import StagedPlan
from deepco.wire.client import ServerError, WrongAnswer


class FakeDevice:
    def __init__(self):
        self.down, self.events, self.lines = set(), [], []
        self.uploads = Uploads()  # nothing loaded: forgetting a server is a no-op, and `busy` counts
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


def test_a_server_back_joins_through_a_trial_on_live_frames_and_one_line_says_so():
    health, device, calls, first = make_health(["s0", "s1", "s2"])
    tried, joined = [], []

    restarted = []

    class Adapt:  # live adaptation's answer: the plan with every server that is up, on trial
        passed_over: list = []  # the plans quick passed over (none here)
        live = SimpleNamespace(restart=restarted.append)
        known: list = []

        @staticmethod
        def samples(plan, timing):  # each plan's antenna read at its own level
            return {"antenna 0": 0.1 * len(plan.servers) + timing.latency}

        def candidate(self, running, down, why, margin=None, quick=True, gentle=False, back=(), search=True):
            tried.append(set(down))
            joined.append(list(back))
            return Trial(plan_on([s for s in ["s0", "s1", "s2"] if s not in down]), why)

    health.adapt = Adapt()
    health.background = lambda fn, *args: fn(*args)  # the trial's runner is made here, not on a thread
    health.device.uploads.quiet_since = lambda: 0.0  # the frames measure the network
    health.failed(first, ServerError("addr-s1", grpc.StatusCode.UNAVAILABLE, "gone"))
    running = health.current()
    assert running.plan.servers == ["s0", "s2"]
    health._probed = 0.0
    health.rejoin()
    assert calls == [{"s1"}] and tried == [set()] and "server s1 is back" in device.lines[-1]
    assert joined == [["s1"]]  # the servers back, for the plans made ahead for them
    assert health.current() is running  # not switched yet: the candidate is tried first
    ran = {"running": 0, "trial": 0}
    for _ in range(6):  # every other frame on the candidate, which is faster
        runner = health.current()
        on_trial = runner is not running
        ran["trial" if on_trial else "running"] += 1
        health.observe(runner, FrameTiming(latency=0.01 if on_trial else 0.02))
    assert ran == {"running": 3, "trial": 3}
    assert health.current().plan.servers == ["s0", "s1", "s2"]
    assert device.lines[-1] == "switch: split over 2 servers -> split over 3 servers: s1 back; measured 10.0 vs 20.0 ms"
    # the streams start again from the new plan's own level, which its trial's frames read beside the old plan's
    assert restarted == [{"antenna 0": pytest.approx(0.31)}]


def test_a_replan_is_one_short_line_even_with_host_port_names_and_many_servers():
    """Drift and failover once printed each plan in full (every server with its antenna, every stage): 250
    characters a line, several lines a minute. A replan's line names the plan in a few words."""
    names = [f"10.0.0.{k}:50051" for k in range(11, 15)]

    def banded(servers: list[str]) -> StagedPlan:
        rows = [(96 * k // len(servers), 96 * (k + 1) // len(servers)) for k in range(len(servers))]
        return StagedPlan("thread", "split", servers=list(servers), antennas=[0, 1] * (len(servers) // 2),
                          levels=["layer1", "layer2"], bands=[rows, rows, rows], tail=servers[0])

    device = FakeDevice()
    first = SimpleNamespace(plan=banded(names))
    health = Health(device, first, lambda plan: SimpleNamespace(plan=plan),
                    lambda down: banded([n for n in names if n not in down]), lambda name: True,
                    lambda address: address.removeprefix("addr-"))
    health.failed(first, ServerError(f"addr-{names[3]}", grpc.StatusCode.UNAVAILABLE, "gone"))
    assert len(device.lines) == 1 and len(device.lines[0]) <= 160, device.lines  # it was about 300
    assert device.lines[0].endswith("split over 3 servers, rows 32/32/32, 2 stages, tail on 10.0.0.11:50051")

def test_a_server_back_with_no_work_in_the_plan_is_one_line_not_silence():
    health, device, calls, first = make_health(["s0", "s1", "s2"])

    class Adapt:  # the plan with s2 back is the running one (e.g. two rows for three servers)
        passed_over: list = []  # the plans quick passed over (none here)
        live = SimpleNamespace(restart=lambda own=None: None)

        def candidate(self, running, down, why, margin=None, quick=True, gentle=False, back=(), search=True):
            return None

    health.adapt = Adapt()
    health.background = lambda fn, *args: fn(*args)
    health.failed(first, ServerError("addr-s2", grpc.StatusCode.UNAVAILABLE, "gone"))
    health._probed = 0.0
    health.rejoin()
    assert device.lines[-2:] == ["server s2 is back",
                                 "adapt: s2 back, but the plan with them is the running one: split over 2 servers"]
    assert health.current().plan.servers == ["s0", "s1"]


def test_a_change_point_seen_while_a_candidate_is_planned_is_planned_on_after_it():
    """A search takes seconds on a weak camera; a change point that comes meanwhile (the step after a blip) is
    seen once only, so it is planned on once the search ends, not dropped (the antennas dropped to a tenth,
    and the run kept its plan for good)."""
    health, device, calls, first = make_health(["s0", "s1"])
    asked, later = [], []

    class Adapt:
        passed_over: list = []  # the plans quick passed over (none here)
        def candidate(self, running, down, why, margin=None, quick=True, gentle=False, back=(), search=True):
            asked.append(why)
            return None  # the rates before the step: nothing better

    health.adapt = Adapt()
    health.background = lambda fn, *args: later.append((fn, args))  # the search runs when the test says
    health._consider("antenna 0 2.00x faster")
    health._consider("antenna 0 6.00x slower")  # while the first is planned
    fn, args = later.pop()
    fn(*args)
    assert asked == ["antenna 0 2.00x faster"] and len(later) == 1  # the second is planned on next
    fn, args = later.pop()
    fn(*args)
    assert asked == ["antenna 0 2.00x faster", "antenna 0 6.00x slower"] and not later


def test_a_trial_of_the_same_server_on_another_antenna_names_the_antennas():
    """The bandwidth-drop scenario printed 'kept offload to s1: tried offload to s1': the trial moved the
    offload to the other antenna, which the line must say."""
    on0 = StagedPlan("auto", "offload", servers=["s1"], antennas=[0], order=[0])
    on1 = StagedPlan("auto", "offload", servers=["s1"], antennas=[1], order=[0])
    assert on0.brief_beside(on1) == "offload to s1 over antenna 0"
    assert on1.brief_beside(on0) == "offload to s1 over antenna 1"
    assert on0.brief_beside(StagedPlan("auto", "offload", servers=["s0"], antennas=[1], order=[0])) == "offload to s1"


def test_a_frame_never_waits_for_the_servers_down_to_be_asked_and_measured():
    """Asking a server that came up, and measuring it, ran inside a frame: on the testbed's 0.1-core camera that
    frame took 1.3 s instead of 80 ms. `rejoin_soon` (what each frame calls) returns at once; the server joins
    when its probe is done."""
    import threading
    import time

    answering = threading.Event()
    health, device, calls, first = make_health(["s0", "s1"], ready=lambda name: answering.wait(10))
    health.failed(first, ServerError("addr-s1", grpc.StatusCode.UNAVAILABLE, "gone"))
    health._probed = 0.0
    began = time.perf_counter()
    health.rejoin_soon()
    health.rejoin_soon()  # one probe at a time
    assert time.perf_counter() - began < 1.0 and health.down == {"s1"}
    answering.set()
    deadline = time.monotonic() + 10
    while health.down and time.monotonic() < deadline:
        time.sleep(0.01)
    assert health.down == set() and calls == [{"s1"}, set()]
    assert health.current().plan.servers == ["s0", "s1"]


def test_the_search_yields_the_cpu_only_where_nothing_got_slower():
    """A search beside the frames on a 0.1-core camera took them from 80 to 190-360 ms. A server back, or a change
    that leaves the running plan no slower (live adaptation's `worse`), has its search paced (gentle); a change
    that makes it slower does not."""
    health, device, calls, first = make_health(["s0", "s1"])
    asked = []

    class Adapt:
        passed_over: list = []  # the plans quick passed over (none here)
        live = SimpleNamespace(restart=lambda own=None: None)

        def candidate(self, running, down, why, margin=None, quick=True, gentle=False, back=(), search=True):
            asked.append((why, gentle))
            return None

        worse, margin, _before, slowed = False, 0.15, None, None
        matters = Adaptation.matters
        recheck_due = staticmethod(lambda now, running: False)

        def observe(self, plan, timing):
            found, self.worse = changes.pop(0)
            return found

    health.adapt = Adapt()
    health.background = lambda fn, *args: fn(*args)
    health.device.uploads.quiet_since = lambda: 0.0
    # a change point too small to make any plan better by the margin (an antenna read as 1.06x) is no search
    changes = [([Change("antenna 0", 1.06)], False), ([Change("antenna 0", 0.1)], False),
               ([Change("server s0", 4.0), Change("antenna 0", 0.5)], True)]
    for _ in range(3):
        health.observe(health.current(), FrameTiming(latency=0.0))
    assert [e["what"] for e in device.events if e["event"] == "change"][0] == ["antenna 0 1.06x slower"]
    health.failed(health.current(), ServerError("addr-s1", grpc.StatusCode.UNAVAILABLE, "gone"))
    health._probed = 0.0
    health.rejoin()
    assert asked == [("antenna 0 10.00x faster", True), ("server s0 4.00x slower, antenna 0 2.00x faster", False),
                     ("s1 back", True)]


def test_a_periodic_look_at_the_antennas_that_finds_one_faster_starts_a_gentle_search_and_says_so():
    """Live adaptation's recheck (every RECHECK_EVERY of frames) runs beside the frames; what it finds faster
    is searched on without hurrying (the running plan got no slower), with one line; nothing found, no search."""
    health, device, calls, first = make_health(["s0", "s1"])
    asked, found, due = [], ["antenna 0 10.00x faster probed", None], [False, True, False, True]

    class Adapt:
        passed_over: list = []  # the plans quick passed over (none here)
        live = SimpleNamespace(restart=lambda own=None: None)
        slowed = None

        def candidate(self, running, down, why, margin=None, quick=True, gentle=False, back=(), search=True):
            asked.append((why, gentle))
            return None

        def recheck_due(self, now, running):
            return due.pop(0)

        def recheck(self):
            return found.pop(0)

        def observe(self, plan, timing):
            return []

    health.adapt = Adapt()
    health.background = lambda fn, *args: fn(*args)
    health.device.uploads.quiet_since = lambda: 0.0
    for _ in range(4):
        health.observe(health.current(), FrameTiming(latency=0.0))
    assert asked == [("antenna 0 10.00x faster probed", True)] and not found and not due
    assert "adapt: the antennas probed again: antenna 0 10.00x faster probed" in device.lines
    assert not health._considering
    # every recheck is an event for the JSON log, whatever it found, so a run's log says what they cost
    rechecks = [e for e in device.events if e["event"] == "recheck"]
    assert [e["found"] for e in rechecks] == ["antenna 0 10.00x faster probed", None]
    assert all(e["seconds"] >= 0 for e in rechecks)


@pytest.mark.parametrize("worse", [False, True])
def test_the_search_after_a_kept_quick_trial_hurries_only_where_the_change_made_the_running_plan_slower(worse):
    """A quick trial (a plan on the servers) is followed by the search for the best. Where the trial was kept
    and the change left the running plan no slower (a link read faster), that search has no slow frames to get
    out of: it is paced then (on the testbed a hurried one after such a trial had frames at 100-147 ms beside an
    offload at 78-105), and hurries only where the running plan got slower."""
    health, device, calls, first = make_health(["s0", "s1"])
    asked = []

    class Adapt:
        passed_over: list = []  # the plans quick passed over (none here)
        live = SimpleNamespace(restart=lambda own=None: None)
        known: list = []

        def candidate(self, running, down, why, margin=None, quick=True, gentle=False, back=(), search=True):
            asked.append((why, quick, gentle))
            return None

    health.adapt = Adapt()
    health.adapt.worse = worse
    health.background = lambda fn, *args: fn(*args)
    trial = Trial(plan_on(["s1"]), "antenna 0 1.84x faster; expected 87 ms", cause="antenna 0 1.84x faster")
    trial.runner = SimpleNamespace(plan=trial.plan, close=lambda: None)
    trial.tried, trial.running = [0.169] * trial.frames, [0.093] * trial.frames
    health.trial = trial
    health._decide(trial)
    assert health.current() is first and device.lines[-1].startswith("kept ")
    assert asked == [("antenna 0 1.84x faster", False, not worse)]


def test_frames_slower_with_no_rate_moved_try_the_plans_on_the_servers_without_a_search():
    """Another device on the same server spread the time over the transfer, the wait for the compute slot and
    the compute, each bimodal: no rate's change point came, while the offload went from 82 to 130-145 ms. The
    frames' own change point asks live adaptation for the plans on the servers only (no search), once."""
    health, device, calls, first = make_health(["s0", "s1"])
    asked = []

    class Adapt:
        passed_over: list = []  # the plans quick passed over (none here)
        live = SimpleNamespace(restart=lambda own=None: None)
        worse, margin, _before, slowed = False, 0.15, None, None
        recheck_due = staticmethod(lambda now, running: False)

        def candidate(self, running, down, why, margin=None, quick=True, gentle=False, back=(), search=True):
            asked.append((why, search))
            return None

        def observe(self, plan, timing):
            self.slowed = 1.6
            return []

    health.adapt = Adapt()
    health.background = lambda fn, *args: fn(*args)
    health.device.uploads.quiet_since = lambda: 0.0
    health.observe(health.current(), FrameTiming(latency=0.0))
    assert asked == [("its frames 1.60x slower, no rate moved", False)]
    assert [e["what"] for e in device.events if e["event"] == "change"] == [["its frames 1.60x slower, no rate moved"]]
