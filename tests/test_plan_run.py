"""bench/plan_run.py, the fixed-plan harness: the plan files it makes from a bench document, its figures from a
run's JSON log, and its one-line refusals (the testbed runs themselves take a minute each: bench/README.md)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepco.errors import UserError
from deepco.planning.staged import StagedPlan, streamed

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "plan_run.py"
STREAMED_REPEAT = ROOT / "bench" / "results" / "bench" / "camera-720x1280-dc62457.json"  # repeat 1 streams


def _module():
    spec = importlib.util.spec_from_file_location("plan_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_bench_repeats_auto_plan_becomes_a_plan_file_and_whole_sends_its_windows_whole(tmp_path):
    plan_run = _module()
    document = json.loads(STREAMED_REPEAT.read_text())
    recorded = document["points"][0]["runs"][0]["algorithms"]["auto"]["plan"]
    path, label = plan_run.plan_file(f"{STREAMED_REPEAT}@1", tmp_path, 0)
    written = json.loads(path.read_text())
    assert written["model"] == "resnet18" and written["input_size"] == [720, 1280]
    assert written["plan"]["windows"] == recorded["windows"] and label.endswith("@1")
    assert any(streamed(StagedPlan.from_dict(written["plan"])))
    whole, _ = plan_run.plan_file(f"{STREAMED_REPEAT}@1:whole", tmp_path, 1)
    plan = StagedPlan.from_dict(json.loads(whole.read_text())["plan"])
    assert not any(streamed(plan)) and plan.bands == StagedPlan.from_dict(recorded).bands
    with pytest.raises(UserError, match="repeat 9"):
        plan_run.plan_file(f"{STREAMED_REPEAT}@9", tmp_path, 2)


def _frame(latency: float, servers: list[tuple[str, float, float, float]]) -> dict:
    """A log line: per server (name, when its window was in, its step's origin, its level-1 compute end)."""
    return {"frame": 0, "error": None, "staged": {"latency": latency, "servers": [
        {"name": n, "received": got, "origin": origin, "send_start": 0.0, "finish": latency,
         "times": {"wall": latency - origin, "compute": end, "phases": [
             {"phase": "input", "level": 0, "start": 0.0, "end": 0.001},
             {"phase": "compute", "level": 1, "start": 0.002, "end": end}]}}
        for n, got, origin, end in servers]}}


def test_the_figures_leave_out_the_first_frames_and_take_medians_per_server():
    plan_run = _module()
    records = [_frame(5.0, [("a", 9.0, 9.0, 9.0)])]  # a first frame far off: left out with --skip 1
    records += [_frame(x, [("a", 0.1 * x, 0.05, 0.2 * x), ("b", 0.3, 0.1, 0.4)]) for x in (1.0, 2.0, 4.0)]
    figures = plan_run.summary(records, skip=1)
    assert figures["frames"] == 3 and figures["p50_ms"] == 2000.0
    assert figures["window_in_ms"] == {"a": 200.0, "b": 300.0}
    assert figures["first_level_end_ms"] == {"a": 450.0, "b": 500.0}  # origin + the compute's end
    with pytest.raises(UserError, match="more --frames"):
        plan_run.summary(records[:1], skip=1)


def test_a_bad_plan_reference_is_one_line_and_builds_no_testbed(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), f"{STREAMED_REPEAT}@1:halves", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0 and "':whole'" in done.stderr
    assert not (tmp_path / "server-0.log").exists()


def test_a_file_that_is_no_plan_is_named_in_one_line(tmp_path):
    bad = tmp_path / "notes.json"
    bad.write_text('{"points": []}')
    done = subprocess.run([sys.executable, str(SCRIPT), str(bad), str(tmp_path / "missing.json"), "--workdir",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "notes.json: not a plan file" in done.stderr and done.stderr.strip().count("\n") == 0
