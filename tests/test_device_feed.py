"""A live source behind its queue of one frame (device/feed.py) and the pipeline that takes from it
(device/pipeline.py), without servers: frames are offered and runs end on events, never on sleeps; a paced
source runs on a fake clock."""

from __future__ import annotations

import io
import json
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from deepco_device.feed import Dropped, EndOfFeed, IterFeed, LiveFeed
from deepco_device.giveup import GiveUp
from deepco_device.pipeline import run_frames
from deepco_device.records import FrameResult, FrameTiming
from deepco_device.run_report import Report
from deepco_device.sources import drop_mode

from deepco.errors import UserError


class FakeClock:
    """A clock that moves only when waited on."""

    def __init__(self):
        self.now, self.waits = 100.0, []

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


def frame(k: int) -> np.ndarray:
    return np.full((1, 3, 2, 2), k, np.uint8)


def test_a_paced_late_feed_keeps_the_latest_frame_and_counts_every_frame_it_drops():
    clock = FakeClock()
    feed = LiveFeed("late", fps=10, clock=clock, wait=clock.wait)
    feed.pump(iter([frame(k) for k in range(5)]))  # nobody takes: each frame replaces the one waiting
    assert clock.waits == pytest.approx([0.1] * 4)  # frame i is due at start + i/10 on the source's clock
    drops = feed.drops()
    assert [d.index for d in drops] == [0, 1, 2, 3] and feed.dropped == 4
    assert [d.captured for d in drops] == pytest.approx([100.0, 100.1, 100.2, 100.3])
    assert [d.at for d in drops] == pytest.approx([100.1, 100.2, 100.3, 100.4])  # replaced when the next came
    assert drops[1].log_record(100.0) == {"dropped": 1, "captured": pytest.approx(0.1), "at": pytest.approx(0.2),
                                          "reason": "late: a newer frame came before the pipeline had room "
                                                    "(--drop late)"}
    latest = feed.take(0)
    assert (latest.index, latest.captured, int(latest.pixels[0, 0, 0, 0])) == (4, pytest.approx(100.4), 4)
    with pytest.raises(EndOfFeed):
        feed.take(0)
    assert feed.drops() == []  # drained


def test_a_source_that_fails_hands_over_the_frame_waiting_first_then_one_line():
    def broken():
        yield frame(0)
        raise RuntimeError("decoder crashed")

    feed = LiveFeed("late")
    feed.pump(broken())
    assert feed.take(0).index == 0
    with pytest.raises(UserError, match="^the frame source failed: RuntimeError: decoder crashed$"):
        feed.take(0)


def test_drop_defaults_to_late_for_live_sources_and_never_for_files(tmp_path):
    video = tmp_path / "clip.avi"
    assert drop_mode("0", None, None) == "late"
    assert drop_mode("rtsp://camera/stream", None, None) == "late"
    assert drop_mode(str(video), None, None) == "never"
    assert drop_mode(str(video), None, 30.0) == "late"  # played as a live source
    assert drop_mode(str(tmp_path), "late", None) == "late"
    with pytest.raises(UserError, match="^--source-fps plays a file, image or directory as a live source; '0' is a "
                                        "camera, with a clock of its own$"):
        drop_mode("0", None, 30.0)
    with pytest.raises(UserError, match="^--source-fps must be positive, got -1$"):
        drop_mode(str(video), None, -1.0)


class FakeRunner:
    """What the pipeline runs a frame on: ``on_frame(index)`` runs inside the frame, in its worker thread."""

    plan = None

    def __init__(self, on_frame):
        self.on_frame = on_frame

    def run_frame(self, x: np.ndarray):
        self.on_frame(int(x[0, 0, 0, 0]))
        return {"y": x.astype(np.float32) * 2}, FrameTiming(latency=0.0)


def fake_health(runner) -> SimpleNamespace:
    return SimpleNamespace(rejoin_soon=lambda: None, current=lambda: runner, observe=lambda current, timing: None,
                           waiting_for=lambda: "", device=SimpleNamespace(down=set()))


def pipeline(feed, runner, depth: int) -> list:
    inflight = SimpleNamespace(stopped=threading.Event(), cancel_all=lambda: set())
    return list(run_frames(fake_health(runner), feed, depth, GiveUp(), inflight))


def test_the_pipeline_takes_the_latest_frame_and_loses_none_that_entered():
    feed = LiveFeed("late")

    def on_frame(index: int) -> None:  # the source outruns the engine while frames run
        if index == 0:
            for k in (1, 2, 3):  # 1 and 2 are replaced before the pipeline has room
                feed.offer(float(k), frame(k))
        elif index == 3:
            feed.offer(4.0, frame(4))
            feed.end()

    feed.offer(0.0, frame(0))
    results = pipeline(feed, FakeRunner(on_frame), depth=1)
    assert [r.index for r in results] == [0, 3, 4]
    assert [d.index for d in feed.drops()] == [1, 2]
    for r in results:  # every frame that entered left with its output, its capture time and its delivery
        assert r.error is None and np.array_equal(r.output, frame(r.index).astype(np.float32) * 2)
        assert r.captured == float(r.index)
        assert r.delivered is not None and r.capture_to_result == r.delivered - r.captured


def test_never_drop_lets_every_frame_of_a_fast_source_wait_its_turn():
    feed = LiveFeed("never").start(iter([frame(k) for k in range(6)]))  # read as fast as it offers
    results = pipeline(feed, FakeRunner(lambda index: None), depth=2)
    assert [r.index for r in results] == list(range(6))
    assert feed.dropped == 0 and all(r.error is None for r in results)


def test_a_result_leaves_while_the_source_has_no_frame_yet():
    """A frame that is done is delivered while the pipeline waits for the source's next frame (here the next
    one comes only once the first result is out; a watchdog ends the source if it never is)."""
    feed = LiveFeed("late")
    delivered = threading.Event()
    threading.Thread(target=lambda: delivered.wait(30) or feed.end(), daemon=True).start()
    feed.offer(0.0, frame(0))
    inflight = SimpleNamespace(stopped=threading.Event(), cancel_all=lambda: set())
    results = []
    for result in run_frames(fake_health(FakeRunner(lambda index: None)), feed, 2, GiveUp(), inflight):
        results.append(result.index)
        if result.index == 0:
            delivered.set()
            feed.offer(1.0, frame(1))
            feed.end()
    assert results == [0, 1]


def test_plain_frames_go_through_one_by_one_as_before():
    results = pipeline(IterFeed([frame(k) for k in range(3)]), FakeRunner(lambda index: None), depth=2)
    assert [r.index for r in results] == [0, 1, 2]
    assert all(r.captured is not None and r.capture_to_result >= 0 for r in results)


@pytest.mark.parametrize(("flags", "message"), [
    (["--objective", "slo"], "--objective slo needs --max-latency MS, a positive number of milliseconds"),
    (["--objective", "slo", "--max-latency", "100", "--algorithm", "thread"],
     "--objective slo chooses the plan itself: it goes with --algorithm auto, not with --plan or another --algorithm"),
    (["--max-latency", "100"], "--max-latency is the bound of --objective slo; give --objective slo too"),
    (["--source-fps", "30"], "--source-fps plays a file, image or directory as a live source; '0' is a camera, "
                             "with a clock of its own"),
])
def test_run_refuses_flags_that_do_not_go_together_in_one_line(capsys, tmp_path, flags, message):
    from deepco.cli import main

    code = main(["run", "--cluster", str(tmp_path / "absent.toml"), "--model", "resnet18", "--source", "0", *flags])
    assert (code, capsys.readouterr().err) == (2, f"deepco run: error: {message}\n")


def test_the_run_report_logs_drops_and_capture_to_result_and_counts_them_in_the_summary(capsys):
    log = io.StringIO()
    report = Report(predicted=0.05, depth=1, log_file=log)
    t0 = report.start
    report.dropped([Dropped(1, t0 + 0.1, t0 + 0.2)], quiet=False)
    for index, latency, captured, delivered in [(0, 0.04, 0.0, 0.06), (2, 0.05, 0.2, 0.3)]:
        report.frame(FrameResult(index, outputs={"y": np.zeros(3)}, latency=latency, captured=t0 + captured,
                                 delivered=t0 + delivered))
    report.finish()
    assert report.summary() == 0
    out = capsys.readouterr().out
    assert out.startswith("frame 1: dropped (late: a newer frame came before the pipeline had room)\n")
    # latencies 40, 50 ms; capture to result 60, 100 ms (p95 by linear interpolation: 98)
    assert ("latency mean 45.0 ms, p50 45.0, p95 49.5; capture to result p50 80.0, p95 98.0; predicted 50.0 ms at 1 "
            "frame(s) in flight; 1 dropped; 0 failed") in out
    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    assert [("dropped" in line, line.get("frame")) for line in lines] == [(True, None), (False, 0), (False, 2)]
    assert lines[0]["captured"] == pytest.approx(0.1) and lines[0]["at"] == pytest.approx(0.2)
    assert lines[2]["captured"] == pytest.approx(0.2) and lines[2]["capture_to_result"] == pytest.approx(0.1)


def test_fewer_frames_in_flight_when_the_slo_watch_says_so():
    """`--objective slo`'s watch lowers the frames in flight: with one allowed of three, frame 1 does not start
    while frame 0 runs (frame 0 waits 0.2 s for it to start, in vain) and the frames still come out in order."""
    second_started = threading.Event()
    overlapped, deadline = [], [0.2]

    def on_frame(index: int) -> None:
        if index == 0:
            overlapped.append(second_started.wait(deadline[0]))
        elif index == 1:
            second_started.set()

    inflight = SimpleNamespace(stopped=threading.Event(), cancel_all=lambda: set())
    feed = IterFeed([frame(k) for k in range(4)])
    results = list(run_frames(fake_health(FakeRunner(on_frame)), feed, 3, GiveUp(), inflight, in_flight=lambda: 1))
    assert [r.index for r in results] == [0, 1, 2, 3] and overlapped == [False]
    second_started.clear()
    deadline[0] = 30.0  # the same with three allowed: frame 1 starts beside frame 0 (at once; 30 s at most)
    feed = IterFeed([frame(k) for k in range(4)])
    list(run_frames(fake_health(FakeRunner(on_frame)), feed, 3, GiveUp(), inflight, in_flight=lambda: 3))
    assert overlapped == [False, True]


def test_give_up_does_not_count_time_the_device_itself_was_frozen(monkeypatch):
    """A device frozen (suspended, its cgroup frozen) for minutes with a frame in flight must not give up on
    waking: its servers did not keep it waiting. Time it waited while running still counts."""
    import deepco_device.giveup as giveup

    clock = [1000.0]
    monkeypatch.setattr(giveup.time, "monotonic", lambda: clock[0])
    give_up = GiveUp(seconds=60)
    give_up.check(True)
    clock[0] += 600  # frozen: no look at the clock for ten minutes
    give_up.check(True)
    for _ in range(200):  # then 50 s of waiting, looked at every TICK: under the bound
        clock[0] += giveup.TICK
        give_up.check(True)
    with pytest.raises(giveup.GaveUp, match="no frame succeeded for 60 s"):
        for _ in range(80):  # 20 s more: over it
            clock[0] += giveup.TICK
            give_up.check(True)


def test_lines_from_two_threads_never_share_a_line(monkeypatch):
    """Live adaptation's lines come from threads of their own beside the frames': a run once printed
    "... the running one: offload to s1frame 135: ..." (print writes a line and its newline apart)."""
    import sys
    import threading
    import time

    from deepco_device.progress import Progress

    class SlowStdout:  # a terminal or pipe that lets the other thread in between two writes
        def __init__(self) -> None:
            self.text = ""

        def write(self, s: str) -> int:
            self.text += s
            time.sleep(0.0005)
            return len(s)

        def flush(self) -> None:
            pass

    out = SlowStdout()
    monkeypatch.setattr(sys, "stdout", out)
    progress = Progress(enabled=False)

    def write(tag: str) -> None:
        for k in range(100):
            progress.write(f"{tag} {k}")

    threads = [threading.Thread(target=write, args=(tag,)) for tag in ("adapt:", "frame")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = out.text.splitlines()
    assert len(lines) == 200 and all(line.count(" ") == 1 for line in lines)
