"""Frames that ran while the device loaded a model do not feed live adaptation's rates: they share the
antennas and the device's CPU with its own upload. On the camera testbed at 8 Mbit/s a trial's upload read as
"antenna 0 3.24x slower, antenna 1 3.67x slower", the next candidate's upload as "antenna 1 16.00x faster", and
the frames of that run took 2.3 s instead of 0.15 for a minute while plans were uploaded for it."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from deepco_device.health import Health
from deepco_device.lifecycle import DERIVES, Uploads
from deepco_device.records import FrameTiming

from deepco.planning.staged import StagedPlan


class BlockingClient:
    """A server whose load takes until ``release`` is set."""

    address = "127.0.0.1:1"

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def load_model(self, model_bytes: bytes, name: str, sha256: str | None = None) -> None:
        self.started.set()
        self.release.wait(10)


def test_a_load_under_way_is_not_quiet_and_its_end_is_when_quiet_begins():
    uploads, client = Uploads(), BlockingClient()
    assert uploads.quiet_since() == 0.0  # nothing ever loaded
    loading = threading.Thread(target=uploads.upload, args=("s0", client, b"model", "m"))
    loading.start()
    assert client.started.wait(10)
    assert uploads.quiet_since() is None
    client.release.set()
    loading.join(10)
    assert uploads.quiet_since() > 0.0


class RecordingAdaptation:
    """Live adaptation that records the frames it is fed (and sees no change)."""

    def __init__(self) -> None:
        self.fed: list[float] = []
        self.slowed = None  # nor a change of the frames' own

    def observe(self, plan, timing: FrameTiming) -> list:
        self.fed.append(timing.latency)
        return []

    def recheck_due(self, now: float, running) -> bool:
        return False


def test_only_frames_that_ran_while_no_model_was_loading_feed_the_live_rates():
    uploads, client = Uploads(), BlockingClient()
    adapt = RecordingAdaptation()
    runner = SimpleNamespace(plan=SimpleNamespace(servers=[]))
    device = SimpleNamespace(uploads=uploads, events=[], log=print)
    health = Health(device, runner, make=None, replan=lambda down: None, ready=lambda s: True,
                    server_at=lambda a: None, adapt=adapt)
    health.observe(runner, FrameTiming(latency=0.010))  # before any load: fed
    loading = threading.Thread(target=uploads.upload, args=("s0", client, b"model", "m"))
    loading.start()
    assert client.started.wait(10)
    health.observe(runner, FrameTiming(latency=0.020))  # during the load: not fed
    client.release.set()
    loading.join(10)
    health.observe(runner, FrameTiming(latency=60.0))  # began before the load ended: not fed
    health.observe(runner, FrameTiming(latency=0.0))  # began after it: fed
    assert adapt.fed == [0.010, 0.0]


def test_a_joining_servers_measurement_is_not_quiet():
    """The testbed's server-join: measuring the server that came up beside the live frames read as "antenna 0
    7.76x slower" and a switch for it. While the measurement runs, frames measure nothing."""
    uploads = Uploads()
    device = SimpleNamespace(uploads=uploads, events=[], log=print, down=set())
    measuring, release = threading.Event(), threading.Event()

    def measure(server: str) -> None:
        measuring.set()
        release.wait(10)

    runner = SimpleNamespace(plan=StagedPlan("equal", "split", servers=["s0"], antennas=[0], levels=["layer1"]))
    health = Health(device, runner, make=lambda plan: SimpleNamespace(plan=plan), replan=lambda down: runner.plan,
                    ready=lambda s: True, server_at=lambda a: None, unreached=["s1"], measure=measure)
    health._probed = 0.0  # probe now
    joining = threading.Thread(target=health.rejoin)
    joining.start()
    assert measuring.wait(10)
    assert uploads.quiet_since() is None
    release.set()
    joining.join(10)
    assert uploads.quiet_since() > 0.0 and "s1" not in health.down


class HoldingClient:
    """A server that derives stage models and records the whole-model fetches it is asked for."""

    def __init__(self, name: str) -> None:
        self.address, self.fetched = f"addr-{name}", []

    def server_metadata(self) -> dict:
        return {"extensions": [DERIVES]}

    def load_model(self, model_bytes: bytes, name: str, sha256: str | None = None, whole: bool = False) -> None:
        pass

    def fetch_whole_model(self, name: str, digest: str, peer: str) -> None:
        self.fetched.append(peer)


def test_a_whole_model_is_fetched_from_a_server_the_frames_do_not_use():
    """A peer fetch costs the peer its CPU: on the testbed a 0.45-core server sending a 45 MB model to a joining
    server took the frames it ran from 80 ms to 1.3 s. A holder outside the running plan is asked first."""
    uploads = Uploads(peer_address=lambda name: f"peer-{name}")
    clients = {name: HoldingClient(name) for name in ("s0", "s1", "s2")}
    for name in ("s0", "s1"):
        uploads.hold_whole(name, clients[name], b"whole model", "m")
    for serving, want in ((set(), "peer-s0"), ({"s0"}, "peer-s1"), ({"s1"}, "peer-s0")):
        uploads.serving = serving
        uploads.forget("s2")
        uploads.hold_whole("s2", clients["s2"], b"whole model", "m")
        assert clients["s2"].fetched[-1] == want


def test_frames_while_a_trials_runner_is_made_are_not_quiet():
    """Making a trial's runner cuts and hashes its stage models on the device's own CPU, between the uploads: on
    the testbed's 0.1-core camera frames beside it read a link held at 10 Mbit/s as "16.00x faster". While the
    runner is made, frames measure nothing."""
    from deepco_device.adaptation import Trial

    uploads = Uploads()
    device = SimpleNamespace(uploads=uploads, events=[], log=print, down=set())
    running = SimpleNamespace(plan=StagedPlan("equal", "split", servers=["s0"], antennas=[0], levels=["layer1"]))
    candidate = StagedPlan("equal", "split", servers=["s1"], antennas=[0], levels=["layer1"])
    making, release = threading.Event(), threading.Event()

    def make(plan):
        making.set()
        release.wait(10)
        return SimpleNamespace(plan=plan)

    adapt = SimpleNamespace(candidate=lambda *args: Trial(candidate, "a test"), passed_over=[])
    health = Health(device, running, make=make, replan=lambda down: running.plan, ready=lambda s: True,
                    server_at=lambda a: None, adapt=adapt)
    proposing = threading.Thread(target=health._propose, args=(running, set(), "a test", None))
    proposing.start()
    assert making.wait(10)
    assert uploads.quiet_since() is None
    release.set()
    proposing.join(10)
    assert uploads.quiet_since() > 0.0 and health.trial is not None and health.trial.plan is candidate


def test_frames_beside_a_paced_search_go_on_measuring_and_beside_a_hurried_one_do_not():
    """A hurried search takes the weak camera's CPU from the frames (they would measure it, not the network); a
    paced one leaves them their CPU, so they go on measuring: a search that blinded them for its 4-12 s let every
    antenna rise tenfold unseen on the testbed."""
    from deepco_device.adaptation import Adaptation
    from deepco_device.cpu_share import Pacer

    from deepco.planning import pacing

    uploads = Uploads()
    searcher = SimpleNamespace(device=SimpleNamespace(uploads=uploads))
    with Adaptation._searching(searcher, gentle=True):
        assert uploads.quiet_since() is not None and isinstance(pacing._PACE.get(), Pacer)
    with pacing.paced(lambda: None), Adaptation._searching(searcher, gentle=False):
        assert uploads.quiet_since() is None and pacing._PACE.get() is None
    assert uploads.quiet_since() is not None
