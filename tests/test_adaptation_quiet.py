"""Frames that ran while the device loaded a model do not feed live adaptation's rates: they share the
antennas and the device's CPU with its own upload. On the camera testbed at 8 Mbit/s a trial's upload read as
"antenna 0 3.24x slower, antenna 1 3.67x slower", the next candidate's upload as "antenna 1 16.00x faster", and
the frames of that run took 2.3 s instead of 0.15 for a minute while plans were uploaded for it."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from deepco_device.health import Health
from deepco_device.lifecycle import Uploads
from deepco_device.records import FrameTiming


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

    def observe(self, plan, timing: FrameTiming) -> list:
        self.fed.append(timing.latency)
        return []


def test_only_frames_that_ran_while_no_model_was_loading_feed_the_live_rates():
    uploads, client = Uploads(), BlockingClient()
    adapt = RecordingAdaptation()
    runner = SimpleNamespace(plan=None)
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
