"""`deepco schedule` end to end: table, JSON, plot, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

from deepco.cli import main

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "edge-cloud.toml")


def test_synthetic_run_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    code = main(["schedule", "--cluster", EXAMPLE, "--format", "synthetic", "--trace", "wang", "--jobs", "12",
                 "--horizon", "30", "--seed", "4", "--json", str(out), "--plot", str(png)])
    assert code == 0
    table = capsys.readouterr().out
    rows = json.loads(out.read_text())["results"]
    assert [r["policy"] for r in rows] == ["online-batch", "preemptive", "preemptive-edge", "fifo", "drf",
                                           "srtf", "tiresias-l", "batchsche"]
    for r in rows:
        assert {"policy", "jobs", "avg_jct", "total_jct", "makespan", "preemptions", "utilization"} <= set(r)
        assert r["jobs"] == 12 and r["avg_jct"] * 12 == r["total_jct"] and 0 <= r["utilization"] <= 1
        assert r["policy"] in table
    assert png.stat().st_size > 1000


def test_one_policy_on_a_trace(tmp_path, capsys):
    trace = tmp_path / "t.trace"
    rows = [f"LM\tcmd\t-n\t1\t{100 * (i + 1)}\t{600.0 * i}\t{1 + i % 2}\n" for i in range(6)]
    trace.write_text("".join(rows))
    assert main(["schedule", "--cluster", EXAMPLE, "--trace", str(trace), "--policy", "preemptive"]) == 0
    assert "preemptive" in capsys.readouterr().out


def test_user_errors_are_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.trace"
    bad.write_text("LM\tcmd\t-n\t1\t100\t0.0\t1\nLM\tcmd\t-n\t1\t100\tsoon\t1\n")
    assert main(["schedule", "--cluster", EXAMPLE, "--trace", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"deepco schedule: error: {bad}:2: field 'arrival_time': must be a number, got 'soon'"
    assert main(["schedule", "--cluster", EXAMPLE, "--format", "synthetic", "--trace", "nobody"]) == 2
    assert "must be omitted or one of she, wang" in capsys.readouterr().err
    assert main(["schedule", "--cluster", str(tmp_path / "none.toml")]) == 2
    assert "none.toml: no such file" in capsys.readouterr().err
    assert main(["schedule", "--cluster", EXAMPLE, "--jobs", "0"]) == 2
    assert main(["schedule", "--cluster", EXAMPLE, "--format", "gavel"]) == 2
    assert "--format gavel: give the trace file with --trace" in capsys.readouterr().err


def test_the_shipped_example_runs_every_kind_of_policy(tmp_path, capsys):
    # the example has no [device] table: scheduling must not need one
    assert "\n[device]" not in Path(EXAMPLE).read_text()
    assert main(["schedule", "--cluster", EXAMPLE, "--policy", "okita", "--jobs", "5", "--horizon", "10"]) == 0
    assert main(["schedule", "--cluster", EXAMPLE, "--policy", "deep-edge"]) == 0
    assert main(["schedule", "--cluster", EXAMPLE, "--policy", "fifo", "--jobs", "5"]) == 0
    out = tmp_path / "o.json"
    assert main(["schedule", "--cluster", EXAMPLE, "--policy", "okita", "--jobs", "5", "--horizon", "10",
                 "--json", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert row["cloud_jobs"] is None and 0 <= row["utilization"] <= 1 and row["preemptions"] >= 0


def test_a_folder_trace_and_deep_edge_with_a_trace_are_one_line_errors(tmp_path, capsys):
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "a.trace").write_text("x\n")
    capsys.readouterr()
    for policy in ("fifo", "okita"):
        assert main(["schedule", "--cluster", EXAMPLE, "--trace", str(folder), "--policy", policy]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"deepco schedule: error: --trace {folder}: is a folder; give one trace file (it holds: a.trace)"
    assert main(["schedule", "--cluster", EXAMPLE, "--policy", "deep-edge", "--trace", str(folder / "a.trace")]) == 2
    assert "reads no trace" in capsys.readouterr().err


def test_a_finite_cloud_is_refused_by_preemptive_and_skipped_by_all(tmp_path, capsys):
    text = Path(EXAMPLE).read_text()
    assert text.rstrip().endswith('site = "cloud"')
    finite = tmp_path / "finite.toml"
    finite.write_text(text.rstrip() + "\nworker_slots = 16\nps_slots = 4\n")
    assert main(["schedule", "--cluster", str(finite), "--policy", "preemptive", "--jobs", "5"]) == 2
    assert "assumes an unbounded cloud" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert main(["schedule", "--cluster", str(finite), "--jobs", "8", "--horizon", "20", "--json", str(out)]) == 0
    assert "skipping preemptive" in capsys.readouterr().err
    rows = json.loads(out.read_text())["results"]
    assert [r["policy"] for r in rows] == ["online-batch", "preemptive-edge", "fifo", "drf", "srtf", "tiresias-l",
                                           "batchsche"]
