"""The demo's weak camera is a device of a fixed speed, not a fixed share of whatever core the host has: on a
2-core Intel Xeon host the demo's old 0.2 core ran EfficientNet-Lite0 at 288x288 in 70-90 ms (twice the AMD EPYC
host's speed) and the camera alone won six of ten Quick starts."""

from __future__ import annotations

import pytest
from deepco_bench import camera

from deepco.partition.source import load_model


def test_the_camera_share_gives_the_camera_its_speed_on_this_host():
    model = load_model("resnet18", 64, 64)
    cores, host = camera.camera_share(model, 64, 64, cap=64.0)
    assert host > 0
    assert cores == pytest.approx(max(camera.SMALLEST_SHARE, camera.CAMERA_GFLOPS / host))


@pytest.mark.parametrize(("host", "cap", "share"), [
    (140.0, 0.2, 0.1),    # a host twice as fast as ...
    (70.0, 0.2, 0.2),     # ... this one gets half the share
    (30.0, 0.2, 0.2),     # a slow host: no more than the cap (the camera is then slower than its speed)
    (1000.0, 0.2, 0.05),  # a very fast one: no less than the smallest share
])
def test_a_faster_host_gives_the_camera_a_smaller_share_within_its_bounds(monkeypatch, host, cap, share):
    monkeypatch.setattr(camera, "host_gflops", lambda *args: host)
    assert camera.camera_share(None, 1, 1, cap) == (pytest.approx(share), host)
