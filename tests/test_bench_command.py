"""`deepco bench`'s bookkeeping around the measured points (the measurements themselves: test_testbed_e2e)."""
import argparse
import copy
import json
from pathlib import Path

import pytest
from deepco_bench import bench_command

from deepco.errors import UserError

RECORDED = Path(__file__).resolve().parents[1] / "bench" / "results" / "bench" / "sweep-servers-camera-224.json"


def test_an_interrupted_run_keeps_the_repeats_it_finished(tmp_path, monkeypatch):
    """A ResNet-50 point takes 18 minutes a repeat: stopping the third must not lose the first two."""
    runs = json.loads(RECORDED.read_text())["points"][0]["runs"]
    measured = iter(runs[:2])

    def one_point(*_args):
        try:
            return copy.deepcopy(next(measured))
        except StopIteration:
            raise KeyboardInterrupt from None

    monkeypatch.setattr(bench_command, "one_point", one_point)
    parser = argparse.ArgumentParser()
    bench_command.add_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(["--preset", "camera", "--input-size", "224x224", "--repeat", "3", "--json", str(out)])
    with pytest.raises(KeyboardInterrupt):
        bench_command.run(args)
    [point] = json.loads(out.read_text())["points"]
    assert point["repeats"] == 2 and len(point["runs"]) == 2
    assert point["algorithms"].keys() == runs[0]["algorithms"].keys()


def test_a_plot_that_cannot_be_written_is_a_one_line_error(tmp_path):
    document = json.loads(RECORDED.read_text())
    bench_command.plot(document, str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")
    with pytest.raises(UserError, match="cannot write the plot"):
        bench_command.plot(document, str(tmp_path / "no-such-folder" / "sweep.png"))


def test_frames_until_adapted_is_the_first_frame_from_which_every_ten_stay_at_most_15_percent_slower():
    from deepco_bench.scenarios import frames_until_adapted

    fresh = 0.100
    # 8 slow frames after the change: the windows of ten from frames 0..3 hold 5+ slow ones (their p50 is slow,
    # or halfway), from frame 4 on at most 4 of ten are and the p50 is the fresh level's; a later hiccup moves
    # nothing
    after = [0.400] * 8 + [0.105] * 20 + [0.900] + [0.098] * 15
    assert frames_until_adapted(after, fresh) == 4
    assert frames_until_adapted([0.400] * 30, fresh) is None  # never adapted within the phase
    assert frames_until_adapted([0.400] * 8 + [0.105] * 20 + [0.400] * 12, fresh) is None  # and fell back
    # faster than a fresh setup under the same conditions is adapted (a fresh setup still calibrating, say)
    assert frames_until_adapted([0.040] * 30, fresh) == 0
    assert frames_until_adapted([0.400] * 3 + [0.050] * 27, fresh) == 0  # 3 slow of 10: the p50 is fast


def test_a_scenario_finds_the_end_of_calibration_and_reports_medians_over_its_repeats(tmp_path, monkeypatch):
    """The scenario's phase 1 starts where `deepco run` announces its plan (live calibration's frames come
    first); the report and plot take medians over the repeats, a repeat that never adapted counting as its
    whole second phase."""
    from deepco_bench.scenarios import STATICS, _adaptation_lines, calibration_frames, plot, report, run_repeats

    printed = "preprocessing: x\nframe 0: 9 ms\nframe 1: 8 ms\nplan: P; predicted with 1 frame(s) in flight: 7 ms\n"
    assert calibration_frames(printed) == 2 and calibration_frames("frame 0: 9 ms\n") is None
    # a server back that the plan gives no work is reported, not silent (the scenario server-join)
    idle = "adapt: s3 back, but the plan with them is the running one: offload to s0"
    joined = _adaptation_lines(printed + "frame 2: 7 ms\nserver s3 is back\n" + idle + "\nframe 3: 7 ms\n")
    assert joined == [{"after_frame": 2, "line": "server s3 is back"}, {"after_frame": 2, "line": idle}]

    def run(p50: float, adapted: int | None) -> dict:
        row = {"frames": 20, "failed": 0, "p50": p50, "p95": 2 * p50}
        phases = {phase: {name: dict(row) for name in (*STATICS, "fresh")} for phase in ("before", "after")}
        return {"change": "every antenna from 100 to 10 Mbit/s", "label": "EMULATED", "calibration_frames": 12,
                "changed_after": 32, "auto": {"before": row, "after": row}, "phases": phases, "fresh_p50": p50,
                "frames_until_adapted": adapted, "lost": {"before": 0, "after": 0}, "in_order": True,
                "max_relative_error": 1e-6, "switches": [], "adaptation": joined, "latencies": [p50] * 54,
                "bound": {"before": p50 / 2, "after": p50 / 4}, "phase_frames": 20}

    from deepco_bench import scenarios

    made = iter([run(0.1, 3), run(0.2, None), run(0.3, 5)])
    args = type("Args", (), {"model": "m.onnx", "repeat": 3, "scenario": "bandwidth-drop"})()
    monkeypatch.setattr(scenarios, "run_scenario", lambda args, here: next(made))
    result = run_repeats(args, tmp_path)
    m = result["median"]
    assert m["before"]["offload"]["p50"] == 0.2 and m["frames_until_adapted"] == 5  # 3, 22 (never), 5
    assert "frames until adapted: 5 (per repeat: 3, not within the phase, 5)" in report(result)
    assert f"repeat 2, after frame 2: {idle}" in report(result)
    # each phase's physical bound, a median over the repeats too: auto's p50 0.2 s over 0.1 and over 0.05
    assert "physical bound 100.0 ms; auto's p50 over it 2.00x" in report(result)
    assert "physical bound 50.0 ms; auto's p50 over it 4.00x" in report(result)
    assert "WARNING" not in report(result)
    # a phase shorter than --phase-frames (calibration ate into a run of fixed length) is said, not hidden
    result["runs"][1]["auto"] = dict(result["runs"][1]["auto"], after={"frames": 13, "failed": 0, "p50": 0.2})
    assert "WARNING: repeat 2 has 13 frames on one side of the change, fewer than --phase-frames" in report(result)
    plot(result, str(tmp_path / "scenario.png"))
    assert (tmp_path / "scenario.png").read_bytes().startswith(b"\x89PNG")


def test_the_live_and_slo_runs_are_medians_over_the_repeats_and_said_in_the_table():
    runs = copy.deepcopy(json.loads(RECORDED.read_text())["points"][0]["runs"][:3])
    for k, run in enumerate(runs):  # capture-to-result p95 of 100, 120, 140 ms against a p50 of 50 ms
        live = {"depth": 1, "capture_to_result_p50": 0.08, "capture_to_result_p95": 0.1 + 0.02 * k,
                "first_third_p95": 0.1, "last_third_p95": 0.1, "latency_p50": 0.05, "latency_p95": 0.06,
                "dropped": 140 + k, "done": 160 - k, "source_fps": 30.0, "engine_fps": 15.0,
                "single_frame_p50": 0.05}
        run["live"] = {"late": live, "never": live | {"last_third_p95": 5.0 + k, "dropped": 0}}
        run["slo"] = {"bound": 0.3, "met": True, "chosen": "offload, 2 frame(s) in flight", "chosen_fps": 9.0 + k,
                      "chosen_p95": 0.25, "best_fps": 10.0, "chosen_over_best_fps": 0.9 + 0.1 * k}
    point = bench_command.aggregate(runs)
    assert point["live"]["late"]["capture_to_result_p95"] == pytest.approx(0.12)
    assert point["live"]["late"]["dropped"] == 141 and point["live"]["never"]["last_third_p95"] == 6.0
    assert point["slo"]["chosen_over_best_fps"] == pytest.approx(1.0) and point["slo"]["met"] == [True] * 3
    text = bench_command.table(point)
    assert ("live, --drop late, 1 in flight: source at 30.00 fps (2x the engine's 15.00), 159 frames done, 141 "
            "dropped; capture to result p50 80.0 ms, p95 120.0 ms = 2.40x auto's single-frame p50 (50.0 ms)") in text
    assert "p95 of the first third 100.0 ms, of the last 6000.0 ms" in text  # never: the queue grew
    assert ("slo, bound 300.0 ms: chose offload, 2 frame(s) in flight (met: [True, True, True]): 10.00 fps, p95 "
            "250.0 ms = 1.00 of the most fps measured within the bound (10.00)") in text


def test_gantt_draws_autos_median_frame_and_prints_its_step_split(tmp_path, monkeypatch, capsys):
    """The bookkeeping of --gantt (real timelines: test_step_timelines): auto's frame of median latency of
    the first repeat is drawn, and the split covers every repeat's frames."""
    runs = copy.deepcopy(json.loads(RECORDED.read_text())["points"][0]["runs"][:2])

    def frame(latency: float) -> dict:
        phases = [{"phase": "input", "level": 0, "start": 0.0, "end": 0.001},
                  {"phase": "compute", "level": 1, "start": 0.001, "end": 0.005},
                  {"phase": "encode", "level": 1, "start": 0.006, "end": 0.007}]
        times = {"input": 0.001, "halo": 0.0, "queue": 0.0, "compute": 0.004, "encode": 0.001, "send": 0.0,
                 "wall": 0.007, "phases": phases}
        step = {"name": "s0", "antenna": 0, "send_start": 0.0, "received": 0.002, "finish": latency - 0.001,
                "origin": 0.002, "times": times}
        return {"latency": latency, "sent": 0.002, "collected": latency - 0.001, "stitch": 0.0, "tail": 0.001,
                "servers": [step]}

    for run in runs:
        run["algorithms"]["auto"]["timelines"] = [frame(0.012), frame(0.010), frame(0.014)]
    measured = iter(runs)
    monkeypatch.setattr(bench_command, "one_point", lambda *_args: copy.deepcopy(next(measured)))
    parser = argparse.ArgumentParser()
    bench_command.add_arguments(parser)
    path = tmp_path / "gantt.png"
    args = parser.parse_args(["--preset", "camera", "--input-size", "224x224", "--repeat", "2", "--gantt", str(path)])
    bench_command.run(args)
    assert path.read_bytes().startswith(b"\x89PNG")
    out = capsys.readouterr().out
    assert "auto's step split: 6 frames, 6 server steps" in out
    assert "segment step: wall 7.00  compute 4.00" in out
    args = parser.parse_args(["--algorithms", "local,offload", "--gantt", str(path)])
    with pytest.raises(UserError, match="--gantt draws auto's frame"):
        bench_command.run(args)


def test_a_runs_log_is_read_from_where_the_last_look_ended(tmp_path):
    """Waiting on a scenario's run, the bench reads only what its log gained (whole lines): it once parsed the
    whole log every 50 ms, outside the testbed's quotas."""
    from deepco_bench.scenarios import Tail

    log = tmp_path / "run.jsonl"
    tail = Tail(log)
    assert tail.read() == []  # not written yet
    log.write_text('{"frame": 0}\n{"fra')
    assert tail.read() == ['{"frame": 0}']  # the half-written line waits
    with log.open("a") as f:
        f.write('me": 1}\n')
    assert tail.read() == ['{"frame": 0}', '{"frame": 1}']


def test_live_adaptations_change_points_reach_the_json_log_and_the_scenario_report(tmp_path):
    """A change point prints no line (a search that keeps the plan says nothing): the JSON log gets it, and the
    scenario report lists it with the frame it came after."""
    import io

    from deepco_bench.scenarios import _logged_events
    from deepco_device.run_report import Report

    log = io.StringIO()
    report = Report(0.1, 1, log)
    report.events = [{"event": "change", "what": ["server s0 4.00x slower"], "at": report.start + 1.0},
                     {"event": "trial", "at": report.start + 1.1}]  # not a logged kind
    report.log_events()
    path = tmp_path / "run.jsonl"
    path.write_text('{"frame": 0}\n' + log.getvalue() + '{"frame": 1}\n')
    assert _logged_events(path) == [{"after_frame": 0, "what": ["server s0 4.00x slower"]}]


def test_the_timed_bound_takes_each_servers_rate_from_its_whole_model_frames():
    """The bound on the servers' rates as they ran the model in the run (offload and round-robin frames), not as
    setup's 0.3 s probe read them; a server no such frame ran on keeps its probe times what the timed servers'
    model rate is over their probe. Rates here: model 1 GFLOP; s0 probed at 10 GFLOP/s, computed it in 50 ms
    (20 GFLOP/s, twice its probe), so s1 (probed 10, never timed) counts 20; the device's local frames took 1 s
    (1 GFLOP/s). Compute: 41 GFLOP/s, 24.4 ms a frame, above the wire's 1 MB at 100 MB/s (10 ms)."""
    from deepco_bench.benchmark import timed_bound

    limits = {"model_flops": 1e9, "input_bytes": 1e6, "output_bytes": 4e3, "link_bytes_per_second": 1e8}
    measured = {"server_flops_per_second": {"s0": 1e10, "s1": 1e10}, "device_flops_per_second": 5e8}
    algorithms = {"local": {"timelines": [{"latency": 1.0, "compute": 1.0}]},
                  "offload": {"timelines": [{"server": "s0", "compute": c} for c in (0.05, 0.05, 0.9)]},
                  "round-robin": {"timelines": [{"server": "s0", "compute": 0.05}]}}
    timed = timed_bound(limits, measured, algorithms)
    assert timed["server_flops_per_second"] == pytest.approx({"s0": 2e10, "s1": 2e10})
    assert timed["device_flops_per_second"] == pytest.approx(1e9)
    assert timed["latency"] == pytest.approx(1e9 / 41e9)
    assert timed["servers_timed"] == ["s0"] and timed["device_timed"]
    # without a whole-model frame on any server there is nothing to time them by
    assert timed_bound(limits, measured, {"local": algorithms["local"]}) is None
