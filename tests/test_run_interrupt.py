"""Ctrl-C on `deepco run`: exit 130, a summary of the frames done, the frames in flight reported as cancelled
(a line each and one JSON event in the log), no traceback. A real `deepco run` process on a real server."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from test_input_size import _conv_model
from test_server_support import ROOT, child_env, serve_process

PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def _drained(lines: queue.Queue, until_end: bool = False) -> str:
    """What a stream's reader (`_lines`) has put so far, or (``until_end``) up to its end."""
    got: list[str] = []
    while True:
        try:
            line = lines.get(timeout=10) if until_end else lines.get_nowait()
        except queue.Empty:
            return "".join(got)
        if line is None:
            return "".join(got)
        got.append(line)


def test_ctrl_c_exits_130_with_a_summary_and_the_frames_in_flight_cancelled(tmp_path):
    model = _conv_model(tmp_path / "small.onnx", 48, 64)
    log = tmp_path / "log.jsonl"
    with serve_process("--threads", "1") as server:
        cluster = tmp_path / "cluster.toml"
        cluster.write_text(f'[[servers]]\naddress = "{server.address}"\n')
        run = subprocess.Popen([sys.executable, "-m", "deepco", "run", "--cluster", str(cluster), "--model",
                                str(model), "--source", str(PHOTO), "--frames", "100000", "--algorithm", "offload",
                                "--json-log", str(log)], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_lines, args=(run.stdout, lines), daemon=True).start()
        errors: queue.Queue = queue.Queue()  # read beside it: a run that never exits fails the wait, not a read
        threading.Thread(target=_lines, args=(run.stderr, errors), daemon=True).start()
        seen: list[str] = []
        deadline = time.monotonic() + 120
        try:
            while not any(line.startswith("frame ") for line in seen):  # the first result is out
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
                assert line is not None and time.monotonic() < deadline, "".join(seen) + _drained(errors)
                seen.append(line)
            run.send_signal(signal.SIGINT)
            try:
                code = run.wait(timeout=60)
            except subprocess.TimeoutExpired:
                raise AssertionError("deepco run did not exit within 60 s of Ctrl-C\n" + _drained(errors)) from None
            stderr = _drained(errors, until_end=True)
            assert code == 130, stderr
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
    while (line := lines.get(timeout=10)) is not None:
        seen.append(line)
    out = "".join(seen)
    assert "Traceback" not in stderr and "Traceback" not in out, stderr
    assert stderr.strip().splitlines()[-1] == "deepco run: interrupted"
    assert " frames in " in out and "p50" in out  # the summary of the frames done
    summary = [line for line in seen if line.startswith("interrupted: ")]
    assert len(summary) == 1, out
    records = [json.loads(line) for line in log.read_text().splitlines()]
    event = records[-1]
    assert event["event"] == "interrupted" and event["reason"] == "SIGINT (Ctrl-C)"
    done = [r["frame"] for r in records[:-1] if "frame" in r]  # not live adaptation's events
    assert event["done"] == len(done) > 0 and event["failed"] == 0
    cancelled = len(event["cancelled"])
    assert summary[0].strip() == f"interrupted: {len(done)} frame(s) done, {cancelled} in flight cancelled"
    # every frame that entered came out or is cancelled: none lost, none twice
    assert sorted(done + event["cancelled"]) == list(range(len(done) + len(event["cancelled"])))
    assert [f"frame {i}: cancelled (interrupted)\n" for i in event["cancelled"]] == \
        [line for line in seen if "cancelled (interrupted)" in line]


def test_a_ctrl_c_during_a_frames_count_and_log_line_waits_until_both_are_done():
    """A loaded CI run logged a frame whose count the Ctrl-C cut off (the `interrupted` event said 1 done, the log
    held 2 frames): `run_report.whole` holds the interrupt back until the block ends, then raises it."""
    script = """
import os, signal
from deepco_device.run_report import whole
steps = []
try:
    with whole():
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler has run by now: nothing cut this block short
            steps.append(1)
        print("block done", len(steps), flush=True)
except KeyboardInterrupt:
    print("interrupted after", len(steps), flush=True)
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.splitlines() == ["block done 1000", "interrupted after 1000"], out.stderr
