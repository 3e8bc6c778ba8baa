"""Eight devices at once against two servers: back-pressure, never a lost frame."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from load_test import load_test  # noqa: E402 - bench/ is not a package


def test_eight_concurrent_devices_lose_no_frame(tmp_path):
    result = load_test(devices=8, frames=6, input_size="64x80", time_limit=240, workdir=tmp_path)
    assert result["errors"] == [] and result["lost_frames"] == 0
    assert result["frames_out"] == 8 * 6
