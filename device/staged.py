"""The staged runtime and its planner, in one import: every plan runs here (auto's, local, offload, round-robin,
the paper's (deepco.planning.paper_plans) and MoDNN's).

    dev = Device(cluster, "resnet18", 720, 1280); dev.setup()      # measure, and the paper's plan (dev.plan)
    planner = StagedPlanner(dev)                                   # the exact cost model on dev's measurements
    runner = StagedRunner(dev, planner.best())                     # uploads what the plan needs
    outputs, timing = runner.run_frame(px)                         # every output of the model, by name
    for result in runner.run_frames(frames, depth=2): ...          # pipelined, with failover

The runners, one per plan kind, are in device/runners.py; the planner and calibration's callbacks in
device/planner.py; the calibration loop itself is planning (deepco/planning/calibration.py).
"""

from __future__ import annotations

from deepco_device.planner import StagedPlanner
from deepco_device.runners import RUNNERS, StagedRunner, root_cause

from deepco.planning.calibration import RUNOFF_WITHIN, SETTLE_SECONDS, round_order

__all__ = ["RUNNERS", "RUNOFF_WITHIN", "SETTLE_SECONDS", "StagedPlanner", "StagedRunner", "round_order",
           "root_cause"]
