"""Plans made by the staged planner on real servers and saved as `deepco plan --save` saves them, for tests
that run them with `deepco run --plan`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from deepco_device.plan_command import save_plan
from deepco_device.session import Device
from deepco_device.staged import StagedPlanner

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
