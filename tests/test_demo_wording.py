"""The demo's words: its comparison reads the right way round (it once printed "auto's p50 is 4.37x local's
(higher: auto faster)"), its picture's title agrees with auto's choice, its errors have one prefix, and its
defaults are the `demo` preset of `deepco bench`."""

from __future__ import annotations

import argparse
import subprocess
import sys

from deepco_bench.bench_command import PRESETS
from deepco_bench.camera import CAMERA, CAMERA_CAP
from deepco_bench.demo import add_arguments, setting, shown_plan, speed_ratio, title_setting, verdict
from test_server_support import ROOT, child_env


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


def _plan(kind: str, predicted_ms: float) -> dict:
    return {"kind": kind, "predicted": predicted_ms / 1e3}


def test_the_picture_draws_auto_and_a_split_not_chosen_only_with_predictions_that_agree_with_the_choice():
    split = _plan("split", 36.6)
    chose_split = {"plans": {"auto": {"plan": split}}, "best_split": split}
    assert shown_plan(chose_split) == (split, "DeepCo's plan (auto)")
    # the run: auto chose offload (by measurement), the split not chosen was predicted faster
    offload = {"plans": {"auto": {"plan": _plan("offload", 46.5)}}, "best_split": split}
    shown, title = shown_plan(offload)
    assert shown is split and title == ("auto chose offload; shown: the best split plan, not chosen (predicted "
                                        "36.6 ms vs 46.5 ms, but slower than offload when calibration timed them)")
    slower = {"plans": {"auto": {"plan": _plan("local", 30.0)}}, "best_split": split}
    assert shown_plan(slower)[1].endswith("not chosen (predicted 36.6 ms vs 30.0 ms)")
    alone = {"plans": {"auto": {"plan": _plan("local", 30.0)}}, "best_split": None}
    assert shown_plan(alone)[0]["kind"] == "local"


def test_a_refused_flag_is_one_line_with_one_prefix():
    """It once printed `deepco demo: error: demo: ...`."""
    done = subprocess.run([sys.executable, "-m", "deepco", "demo", "--servers", "0"], capture_output=True,
                          text=True, cwd=ROOT, env=child_env(), timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == ["deepco demo: error: --servers must be in 1..16, got 0"]


def test_the_demos_defaults_are_the_bench_demo_preset():
    """A benchmark row backs the demo's claim: `deepco bench --preset demo` measures the demo's setting."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    demo, preset = p.parse_args([]), PRESETS["demo"]
    assert (demo.servers, demo.antennas, demo.bandwidth, demo.model, demo.input_size) == (
        preset["servers"], preset["antennas"], preset["bandwidth"], preset["model"], preset["input_size"])
    # the camera: not a fixed share of whatever core runs it, but measured on the host the same way by both
    assert demo.camera_cpu is None and preset["device_share"] == CAMERA
    # the demo's edge boxes are the testbed's CPU shares (both in cores), and fit this 2-core machine with the camera
    assert demo.server_cpu > 0 and preset["shares"] == ",".join([f"{demo.server_cpu:g}"] * demo.servers)
    assert demo.servers * demo.server_cpu + CAMERA_CAP <= 2 + 1e-9


def test_the_title_and_the_servers_line_name_the_cpu_quotas_that_ran():
    """The picture once titled only the camera's quota; the servers' quotas, or their absence, are named too."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--camera-cpu", "0.2"])  # the camera's share as the demo measured it (size_camera)
    assert title_setting(args, camera=True, boxes=True) == ("camera 0.2 core, servers 0.6 core each (cgroup CPU "
                                                            "quotas, EMULATED)")
    assert "servers share" in title_setting(args, camera=True, boxes=False)
    assert title_setting(args, camera=False, boxes=False) == "camera and servers at full speed (no cgroup)"
    assert setting(args, camera=True, boxes=True).startswith("each server is an edge box under a cgroup CPU quota "
                                                              "of 0.6 core (EMULATED)")
    assert setting(args, camera=False, boxes=False).endswith("(their CPU quota needs root and a cpu cgroup, as the "
                                                              "camera's)")
    assert setting(p.parse_args(["--server-cpu", "0"]), camera=True, boxes=False).endswith("cores")
