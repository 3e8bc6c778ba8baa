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
