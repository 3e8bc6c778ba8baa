"""Issue 30's step timelines on real `deepco serve` processes: every server step of a split frame carries its
timeline (StepTimes.phases), disjoint phases in order within the step's wall time, whose sums are the
StepTimes fields; the device places it on the frame's clock; the JSON log's form gives the per-step split and
a Gantt chart of the frame."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from deepco_device.staged import StagedPlanner, StagedRunner
from test_server_support import serve_process
from test_staged_runtime import make_device, pixels, reference

from deepco.planning.staged import split_plan
from deepco.timelines import by_level, gantt, gantt_bars, row_delays, segment_steps, step_split

ROOT = Path(__file__).resolve().parent.parent
SLACK = 1e-3  # seconds: the device's estimate of a step's start comes from its own clock


@pytest.fixture(scope="module")
def device():
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(serve_process("--threads", "1", "--max-models", "16")) for _ in range(2)]
        yield stack.enter_context(make_device(servers, "resnet18", 64, 80))


def check_timeline(step: dict) -> None:
    times = step["times"]
    phases = times["phases"]
    assert phases and times["wall"] > 0
    assert [p["phase"] for p in phases].count("compute") >= 1
    end = 0.0
    for p in phases:
        assert end - 1e-9 <= p["start"] <= p["end"] <= times["wall"] + 1e-9, (p, times["wall"])
        end = p["end"]
    for name in ("input", "halo", "queue", "compute", "encode", "send", "assemble"):
        total = sum(p["end"] - p["start"] for p in phases if p["phase"] == name)
        assert abs(total - times[name]) < 1e-9
    assert sum(p["end"] - p["start"] for p in phases) <= times["wall"] + 1e-9
    assert step["send_start"] <= step["origin"] + 1e-9
    assert step["origin"] + times["wall"] <= step["finish"] + SLACK


def test_a_split_frames_steps_carry_timelines_within_their_wall_time_and_draw_a_gantt(device, tmp_path):
    planner = StagedPlanner(device)
    # two stages with an exchange between them and the tail gathered on s0: every phase a split step has
    plan = split_plan(planner.costs, planner.rates(), ["s0", "s1"], ["layer1", "layer3"], True, "s0")
    runner = StagedRunner(device, plan)
    px = pixels(64, 80, 1)
    want = reference(device, px)
    records = []
    for _ in range(3):
        outputs, timing = runner.run_frame(px)
        (got,) = outputs.values()
        assert float(np.abs(got - want).max()) / float(np.abs(want).max()) < 1e-4
        records.append(json.loads(json.dumps({"frame": len(records), "error": None, "staged": timing.to_dict()})))
    for record in records:
        steps = record["staged"]["servers"]
        assert len(steps) == 2
        for step in steps:
            check_timeline(step)
            segments = segment_steps(step["times"])
            assert sum(s["wall"] for s in segments) == pytest.approx(step["times"]["wall"], abs=1e-9)
        gatherer, other = steps
        assert {p["phase"] for p in gatherer["times"]["phases"]} >= {"input", "halo", "compute", "encode"}
        # the copies into one array are timed too: the second stage's window (its rows and the peer's), the
        # gathered last level before the tail
        assembled = {p["level"] for p in gatherer["times"]["phases"] if p["phase"] == "assemble"}
        assert assembled >= {2, 3}, gatherer["times"]["phases"]
        assert [s["level"] for s in segment_steps(gatherer["times"])] == [1, 2, 3]  # two segments and the tail
        assert {p["phase"] for p in other["times"]["phases"]} >= {"encode", "send", "compute"}
    split = step_split(records)
    assert split["frames"] == 3 and split["server_steps"] == 6 and split["segment_steps"] == 15
    assert 0 < split["segment"]["compute"] < split["segment"]["wall"]
    assert split["segment"]["overhead"] == pytest.approx(split["segment"]["wall"] - split["segment"]["compute"],
                                                         abs=split["segment"]["wall"])
    bars = gantt_bars(records[0]["staged"])
    s0 = next(label for label in bars if label.startswith("s0 (antenna "))
    assert "device" in bars and any(label.startswith("s1 (antenna ") for label in bars)
    assert any(what == "exchange wait" for what, _, _ in bars[s0])
    assert any(what == "compute" for what, _, _ in bars[s0])
    assert any(what == "copy" for what, _, _ in bars[s0])
    path = tmp_path / "frame.png"
    gantt(records[0]["staged"], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "step_split.py"), str(log), "--gantt",
                           str(tmp_path / "again.png"), "--levels"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "segment step: wall" in done.stdout and (tmp_path / "again.png").exists()
    # per level and server, the median of each frame's compute there, as the segment steps cut it
    table = by_level(records)
    assert set(table) == {"s0", "s1"} and list(table["s0"]) == [1, 2, 3]
    for name, index in (("s0", 0), ("s1", 1)):
        for level, spent in table[name].items():
            per_frame = [sum(seg["compute"] for seg in segment_steps(r["staged"]["servers"][index]["times"])
                             if seg["level"] == level) for r in records]
            assert spent["compute"] == pytest.approx(float(np.median(per_frame)))
            assert spent["halo"] >= 0
    slowest = sum(max(table[n][level]["compute"] for n in table if level in table[n]) for level in (1, 2, 3))
    assert f"the slowest server's compute, summed over levels: {slowest * 1e3:.1f} ms" in done.stdout
    # a bench document: the frames of the algorithm named (auto by default), not another's
    document = {"points": [{"runs": [{"algorithms": {
        "auto": {"timelines": [r["staged"] for r in records[:1]]},
        "auto-whole": {"timelines": [r["staged"] for r in records]}}}]}]}
    (tmp_path / "bench.json").write_text(json.dumps(document))
    for flags, frames in (([], 1), (["--algorithm", "auto-whole"], 3)):
        done = subprocess.run([sys.executable, str(ROOT / "bench" / "step_split.py"), str(tmp_path / "bench.json"),
                               "--levels", *flags], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.startswith(f"{frames} frames"), done


def test_step_split_refuses_a_missing_log_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "step_split.py"), str(tmp_path / "none.jsonl")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "none.jsonl" in done.stderr and "Traceback" not in done.stderr


def test_an_offloaded_frame_carries_its_servers_timeline(device):
    runner = StagedRunner(device, StagedPlanner(device).named("offload"))
    _, timing = runner.run_frame(pixels(64, 80, 2))
    times = json.loads(json.dumps(timing.to_dict()))["times"]
    assert [p["phase"] for p in times["phases"]] == ["input", "queue", "compute", "encode"]
    assert times["compute"] > 0 and times["wall"] <= timing.latency
    assert sum(p["end"] - p["start"] for p in times["phases"]) <= times["wall"] + 1e-9
    assert 0 <= timing.servers[0].origin <= timing.latency - times["wall"] + 1e-9


def test_row_delays_time_a_wait_from_the_later_neighbours_queueing_on_the_frames_clock():
    """`row_delays`: a wait for rows ends some time after the later of the two neighbours (band order, whatever
    order the frame lists the servers in) queued its rows of that level; short waits and the first level's
    (the device's window) are left out; each server's phases are on its own clock, placed by its origin."""
    def step(name, rows, origin, phases):
        return {"name": name, "rows": rows, "origin": origin,
                "times": {"wall": 1.0, "phases": [{"phase": p, "level": lv, "start": a, "end": b}
                                                  for p, lv, a, b in phases]}}

    frame = {"servers": [
        step("bottom", [20, 30], 0.05, [("send", 2, 0.065, 0.070), ("halo", 2, 0.070, 0.071)]),  # a short wait
        step("top", [0, 10], 0.0, [("send", 2, 0.105, 0.110), ("send", 3, 0.2, 0.21)]),
        step("middle", [10, 20], 0.02, [("halo", 1, 0.0, 0.05), ("send", 2, 0.075, 0.08),
                                        ("halo", 2, 0.080, 0.110)]),
    ]}
    # the middle's wait ended at 0.13 on the frame's clock; its neighbours queued at 0.110 and 0.120
    assert row_delays([{"staged": frame}]) == [pytest.approx(0.010)]
    assert row_delays([{"staged": frame}], least=0.05) == []
    assert row_delays([{"staged": frame, "error": "lost"}]) == []
