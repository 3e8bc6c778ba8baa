"""Setup's compute probe measures the share of a core a server gets under a CPU quota, not the core's burst
speed. A probe run of a few milliseconds fits inside one quota period and runs unthrottled, so timing a few
short runs measured a 0.45-core server 2.75x too fast on the camera preset (and every prediction with it)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from deepco_bench.testbed import cgroup_root
from deepco_device.channels import Channels
from deepco_device.measuring import device_session, probe_model, probe_shape, server_rates, sustained_seconds
from test_server_support import ROOT

from deepco.cluster import parse_cluster

SHARE = 0.3
PERIOD_US = 100_000  # the kernel's default period: a 5 ms probe run always fits in one period's 30 ms


@contextlib.contextmanager
def server_under_quota(share: float) -> Iterator[str]:
    """A `deepco serve` on loopback whose process runs in a cpu cgroup of its own with ``share`` of a core."""
    version, root = cgroup_root()
    group = Path(root) / f"deepco-test-quota-{os.getpid()}"
    group.mkdir()
    if version == "v1":
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(round(share * PERIOD_US)))
    else:
        (group / "cpu.max").write_text(f"{round(share * PERIOD_US)} {PERIOD_US}")
    procs = str(group / "cgroup.procs")
    proc = subprocess.Popen([sys.executable, "-m", "deepco", "serve", "--port", "0", "--threads", "1"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=lambda: Path(procs).write_text(str(os.getpid())))
    try:
        listening = re.search(r"listening on (\S+)", proc.stdout.readline())
        assert listening, "the server did not start"
        yield listening.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        group.rmdir()


@pytest.mark.skipif(cgroup_root() is None, reason="needs root and a cpu cgroup")
def test_a_server_under_a_cpu_quota_is_measured_at_its_share():
    shape, flops = probe_shape(2e8)
    probe, x = device_session(probe_model().SerializeToString()), np.zeros(shape, np.float32)
    full_core = flops / sustained_seconds(lambda: probe.run(None, {"x": x}))  # this process: no quota
    with server_under_quota(SHARE) as address:
        cluster = parse_cluster({"device": {"antennas": 1, "bandwidth": 1000.0},
                                 "servers": [{"name": "s0", "address": address}]})
        rates = server_rates(Channels(cluster), SimpleNamespace(head_flops=2e8), "quota-test")
    # Within the share, give or take the machine's noise; the burst speed would be 1/0.3 = 3.3x the share.
    assert 0.6 < rates["s0"] / (SHARE * full_core) < 1.6, (rates["s0"], full_core)
