"""The demo's comparison reads the right way round (it once printed "auto's p50 is 4.37x local's (higher:
auto faster)")."""

from __future__ import annotations

from deepco_bench.demo import speed_ratio


def test_a_faster_auto_is_called_faster_and_a_slower_one_slower():
    assert speed_ratio(25.0, 100.0, "local").startswith("auto is 4.00x faster than local")
    assert speed_ratio(50.0, 40.0, "offload").startswith("auto is 1.25x slower than offload")
