"""The demo's comparison reads the right way round (it once printed "auto's p50 is 4.37x local's (higher:
auto faster)")."""

from __future__ import annotations

from deepco_bench.demo import speed_ratio, verdict


def test_a_faster_auto_is_called_faster_and_a_slower_one_slower():
    assert speed_ratio(25.0, 100.0, "local").startswith("auto is 4.00x faster than local")
    assert speed_ratio(50.0, 40.0, "offload").startswith("auto is 1.25x slower than offload")


def _rows(auto: str, p50: dict[str, float]) -> list[dict]:
    describe = {"local": "local: the whole model on the device",
                "offload": "offload: the whole model on s1 (antenna 0)", "auto": auto}
    return [{"plan": name, "p50_ms": p50[name], "describe": describe[name]} for name in ("local", "offload", "auto")]


def test_without_a_weak_camera_the_demo_claims_no_win():
    rows = _rows("auto: split over s1 (antenna 0), s2 (antenna 1), stages ending at layer2, lookahead, tail on the "
                 "device", {"local": 30.0, "offload": 40.0, "auto": 20.0})
    said = verdict(rows, emulated=False)
    assert len(said) == 1 and "claim no win" in said[0] and "faster" not in said[0]
    assert verdict(rows, emulated=True) == ["auto is 1.50x faster than local (p50 20.0 ms vs 30.0 ms)",
                                            "auto is 2.00x faster than offload (p50 20.0 ms vs 40.0 ms)"]


def test_an_auto_that_runs_the_offload_plan_says_so_instead_of_a_ratio():
    rows = _rows("auto: the whole model on s1 (antenna 0)", {"local": 90.0, "offload": 40.0, "auto": 41.0})
    said = verdict(rows, emulated=True)
    assert said[0].startswith("DeepCo's auto plan is the offload plan here") and len(said) == 2
    assert said[1] == "auto is 2.20x faster than local (p50 41.0 ms vs 90.0 ms)"
