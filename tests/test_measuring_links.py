"""Setup's link probe is kilobytes on a slow radio: it grows its payload only until the transfer is long beside
a round trip's jitter. One megabyte, three times per antenna, was seconds of setup at 8 Mbit/s. A real server on
loopback; the slow link is EMULATED by holding each echo for as long as its payload would take to cross."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from deepco_device.channels import Channels
from deepco_device.measuring import LINK_PROBE_SECONDS, LINK_PROBE_START, PROBE_BYTES, next_link_probe, probe_links
from deepco_server.app import ServeConfig, Server

from deepco.cluster import parse_cluster

RADIO = 1e6  # bytes/s: 8 Mbit/s, the camera preset's antennas


class SlowLink:
    """A client whose Echo payloads cross at ``rate`` bytes/s (EMULATED: held before the real call), and which
    records every payload's size."""

    def __init__(self, client, rate: float, sizes: list[int]):
        self.client, self.rate, self.sizes = client, rate, sizes

    def echo(self, payload_bytes: int) -> float:
        self.sizes.append(payload_bytes)
        time.sleep(payload_bytes / self.rate)  # the emulated transfer, not a wait for another thread
        return self.client.echo(payload_bytes)


@pytest.fixture(scope="module")
def channels():
    server = Server(ServeConfig(port=0, device="cpu", threads=1))
    cluster = parse_cluster({"device": {"antennas": 2, "bandwidth": 8.0},
                             "servers": [{"name": "s0", "address": server.address}]})
    pool = Channels(cluster)
    try:
        yield pool
    finally:
        pool.close()
        server.stop(grace=0)


def test_a_slow_radio_is_timed_on_kilobytes(channels):
    sizes: list[int] = []
    slow = SimpleNamespace(cluster=channels.cluster, client=lambda k, m: SlowLink(channels.client(k, m), RADIO, sizes))
    bandwidths, overhead = probe_links(slow, pace=False)
    # kilobytes: one payload size, or, where a burst of the other tests' load slowed every small echo beside it,
    # one step more (a CI run); never on to the megabyte
    assert LINK_PROBE_START <= 32 << 10 and max(sizes) <= 4 * LINK_PROBE_START < PROBE_BYTES, sizes
    assert sum(sizes) <= 2 * (20 + 3 * 5 * LINK_PROBE_START), sizes
    assert len(bandwidths) == 2 and overhead > 0
    for bandwidth in bandwidths:  # a loaded machine only makes the probe slower: never faster than the radio
        assert 0 < bandwidth <= 1.2 * RADIO, bandwidths


def test_a_fast_link_is_timed_on_a_payload_long_enough_to_time(channels):
    sizes: list[int] = []
    fast = SimpleNamespace(cluster=channels.cluster, client=lambda k, m: SlowLink(channels.client(k, m), 1e12, sizes))
    bandwidths, _ = probe_links(fast, pace=False)
    assert LINK_PROBE_START < max(sizes) <= PROBE_BYTES and all(b > 0 for b in bandwidths)


def test_the_next_payload_is_sized_from_the_last_ones_rate():
    assert next_link_probe(32 << 10, LINK_PROBE_SECONDS) is None  # long enough
    assert next_link_probe(PROBE_BYTES, 1e-4) is None  # the largest
    assert next_link_probe(32 << 10, 0.0) == next_link_probe(32 << 10, -1e-3) == PROBE_BYTES  # lost in the jitter
    # 40 Mbit/s: 32 KB crosses in 6.5 ms; the next takes about twice LINK_PROBE_SECONDS
    grown = next_link_probe(32 << 10, (32 << 10) / 5e6)
    assert grown / 5e6 == pytest.approx(2 * LINK_PROBE_SECONDS, rel=0.01)
    assert next_link_probe(32 << 10, 0.02) == 4 * (32 << 10)  # at least four times larger
