"""Plans made by the staged planner on real servers and saved as `deepco plan --save` saves them, for tests
that run them with `deepco run --plan`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
from deepco_device.plan_command import save_plan
from deepco_device.preprocess import normalise
from deepco_device.session import Device
from deepco_device.staged import StagedPlanner, StagedRunner

from deepco.cluster import parse_cluster


def saved_plans(servers, model: str, height: int, width: int, folder: Path,
                make: Callable[[StagedPlanner, list[str]], dict]) -> dict[str, Path]:
    """``make(planner, server names)``'s plans for ``model`` on ``servers`` (measured first), each saved in
    ``folder``; by name. Every plan must exist."""
    data = {"servers": [{"name": f"s{i}", "address": s.address} for i, s in enumerate(servers)]}
    with Device(parse_cluster(data), model, height, width, log=lambda _: None) as dev:
        dev.setup(rows=False)
        plans = make(StagedPlanner(dev), [f"s{i}" for i in range(len(servers))])
    saved = {}
    for i, (what, plan) in enumerate(plans.items()):
        assert plan is not None, what
        saved[what] = folder / f"plan-{i}.json"
        save_plan(str(saved[what]), model, height, width, plan)
    return saved


def assert_frame_exact(runner: StagedRunner, dev: Device) -> None:
    """One random frame through ``runner`` equals ORT on ``dev``'s whole model within 1e-4 (relative to its
    largest value)."""
    px = np.random.default_rng(0).integers(0, 256, (1, dev.channels, dev.height, dev.width), dtype=np.uint8)
    outputs, _ = runner.run_frame(px)
    (got,) = outputs.values()
    session = ort.InferenceSession(dev.reference_model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, {session.get_inputs()[0].name: normalise(px, dev.preprocessing)})[0]
    assert float(np.abs(got - want).max()) / float(np.abs(want).max()) <= 1e-4
