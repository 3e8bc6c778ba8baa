"""Setup never asks a server for more model slots than it has (`deepco serve --max-models`): calibration plans
only what fits, gives back the models of every plan it drops, skips a plan a server refuses for room with a
one-line note, and a forced plan that cannot fit fails at once with one line, leaving nothing loaded."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time

import numpy as np
import onnxruntime as ort
import pytest
from deepco_device.lifecycle import NoRoom
from deepco_device.preprocess import normalise
from deepco_device.session import Device
from deepco_device.staged import StagedPlanner, StagedRunner
from test_server_support import serve_process

from deepco.cluster import parse_cluster
from deepco.planning.staged import models_per_server, split_plan
from deepco.wire.client import InferenceClient

H, W = 96, 128


def cluster(servers) -> object:
    return parse_cluster({"device": {"antennas": 2, "bandwidth": 100.0},
                          "servers": [{"name": f"s{i}", "capacity": 1.0, "address": s.address}
                                      for i, s in enumerate(servers)]})


def loaded(servers) -> dict[str, list[str]]:
    out = {}
    for i, s in enumerate(servers):
        with InferenceClient(s.address) as c:
            out[f"s{i}"] = c.loaded_models()
    return out


def exact(dev: Device, plan) -> float:
    px = np.random.default_rng(3).integers(0, 256, (1, 3, H, W), dtype=np.uint8)
    whole = ort.InferenceSession(dev.reference_model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = whole.run(None, {whole.get_inputs()[0].name: normalise(px, dev.preprocessing)})[0]
    (got,) = StagedRunner(dev, plan).run_frame(px)[0].values()
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("flags", [(), ("--max-models", "3")], ids=["default-flags", "max-models-3"])
def test_calibration_fits_the_servers_and_keeps_only_the_chosen_plans_models(flags):
    lines: list[str] = []
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(serve_process("--threads", "1", *flags)) for _ in range(3)]
        with Device(cluster(servers), "resnet18", H, W, log=lines.append) as dev:
            dev.setup(rows=False)
            planner = StagedPlanner(dev)
            plan = planner.calibrate("latency")
            timed = [t for t in planner.trials if t.get("note") != "runoff"]
            assert len(timed) >= 2, lines  # more than one plan was timed, so more than one was uploaded
            need = models_per_server(plan) if plan.kind != "local" else {}
            # what is left on each server is exactly the chosen plan's models: every dropped plan gave its back
            assert {s: len(m) for s, m in loaded(servers).items()} == {f"s{i}": need.get(f"s{i}", 0)
                                                                        for i in range(3)}, lines
            if flags:
                assert all(n <= 3 for n in need.values())
            assert exact(dev, plan) <= 1e-4
        assert all(not m for m in loaded(servers).values())  # and the device's close took those back too


def test_a_forced_plan_that_cannot_fit_fails_at_once_and_leaves_nothing_loaded():
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(serve_process("--threads", "1", "--max-models", "3")) for _ in range(3)]
        with Device(cluster(servers), "resnet18", H, W, log=lambda _: None) as dev:
            dev.setup(rows=False)
            planner = StagedPlanner(dev)
            levels = ["maxpool", "layer1", "layer2", "layer3"]  # four stages: four models on every server
            plan = split_plan(planner.costs, planner.rates(), ["s0", "s1", "s2"], levels, True, None)
            assert plan is not None and models_per_server(plan) == {"s0": 4, "s1": 4, "s2": 4}
            began = time.monotonic()
            with pytest.raises(NoRoom) as refused:
                StagedRunner(dev, plan)
            assert time.monotonic() - began < 20  # not the minute a busy server is waited for
            assert "--max-models" in str(refused.value) and "\n" not in str(refused.value)
            assert all(not m for m in loaded(servers).values())  # the three it did load went back
            planner.room = planner.free_slots()
            assert planner.room == {"s0": 3, "s1": 3, "s2": 3} and not planner.fits(plan)


def test_the_demos_device_process_ends_an_error_with_one_line(tmp_path):
    import cv2

    (tmp_path / "frames").mkdir()
    cv2.imwrite(str(tmp_path / "frames" / "0.png"), np.zeros((64, 64, 3), np.uint8))
    (tmp_path / "cluster.toml").write_text('[device]\nantennas = 1\nbandwidth = 10.0\n[[servers]]\nname = "gone"\n'
                                           'capacity = 1.0\naddress = "127.0.0.1:9"\n')
    spec = {"cluster": str(tmp_path / "cluster.toml"), "model": "resnet18", "clip": str(tmp_path / "frames"),
            "frames": 1, "height": 64, "width": 64, "cgroup": None, "outputs": str(tmp_path / "o.npz"),
            "results": str(tmp_path / "r.json")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, "-m", "deepco_bench.demo", "--worker", str(tmp_path / "spec.json")],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "127.0.0.1:9" in done.stderr
