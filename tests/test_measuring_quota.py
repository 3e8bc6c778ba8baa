"""Setup's compute probe measures the share of a core a server gets under a CPU quota, not the core's burst
speed. A probe run of a few milliseconds fits inside one quota period and runs unthrottled, so timing a few
short runs measured a 0.45-core server 2.75x too fast on the camera preset (and every prediction with it)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from deepco_bench.testbed import cgroup_root
from deepco_bench.testbed_servers import server_under_quota
from deepco_device.channels import Channels
from deepco_device.measuring import device_session, probe_model, probe_shape, server_rates, sustained_seconds

from deepco.cluster import parse_cluster

SHARE = 0.3
PERIOD_US = 100_000  # the kernel's default period: a 5 ms probe run always fits in one period's 30 ms


@pytest.mark.skipif(cgroup_root() is None, reason="needs root and a cpu cgroup")
def test_a_server_under_a_cpu_quota_is_measured_at_its_share():
    shape, flops = probe_shape(2e8)
    probe, x = device_session(probe_model().SerializeToString()), np.zeros(shape, np.float32)
    full_core = flops / sustained_seconds(lambda: probe.run(None, {"x": x}))  # this process: no quota
    with server_under_quota(SHARE, "--threads", "1", period_us=PERIOD_US) as address:
        cluster = parse_cluster({"device": {"antennas": 1, "bandwidth": 1000.0},
                                 "servers": [{"name": "s0", "address": address}]})
        rates = server_rates(Channels(cluster), SimpleNamespace(head_flops=2e8), "quota-test")
    # Within the share, give or take the machine's noise; the burst speed would be 1/0.3 = 3.3x the share.
    assert 0.6 < rates["s0"] / (SHARE * full_core) < 1.6, (rates["s0"], full_core)
