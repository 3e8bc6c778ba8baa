"""THREAD and MoDNN end to end on the emulated testbed: every frame equals the whole model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from deepco_bench.testbed import kernel_emulation_available
from test_server_support import ROOT


@pytest.mark.skipif(kernel_emulation_available() is not None,
                    reason=f"kernel emulation unavailable: {kernel_emulation_available()}")
def test_thread_and_modnn_on_the_testbed_equal_the_whole_model(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "deepco", "bench", "--servers", "3", "--antennas", "2", "--bandwidth", "200",
         "--input-size", "128x160", "--frames", "2", "--cut", "layer2",
         "--algorithms", "thread,equal,modnn-sa,modnn-ma", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "EMULATED edge network" in result.stdout and "tc tbf" in result.stdout
    point = json.loads(out.read_text())["points"][0]
    assert set(point["algorithms"]) == {"thread", "equal", "modnn-sa", "modnn-ma"}
    for name, r in point["algorithms"].items():
        assert r["frames"] == 2
        assert r["max_relative_error"] <= 1e-4, name
    assert len(point["algorithms"]["equal"]["servers"]) == 3  # a real three-way split over the namespaces
    # the device's model is loaded at full speed, and everything measured runs under its quota (default 0.5)
    assert point["device_cpu_quota"] == pytest.approx(0.5)
