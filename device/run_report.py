"""What `deepco run` reports and keeps: per-frame counts and the summary line (`Report`: compute and
capture-to-result latency, drops, failures, the JSON log), and ``--save-outputs`` (`Saved`)."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
from deepco_device.feed import Dropped
from deepco_device.preprocess import normalise
from deepco_device.records import FrameResult

from deepco.modelcard import IMAGENET, Preprocessing

# of the device's health events, those the JSON log gets (a line each): servers down and up, and live
# adaptation's change points, the plans on the servers it passed over, searches that kept the plan and switches
# (no printed line says a change point or what was passed over)
LOGGED_EVENTS = ("down", "up", "change", "passed over", "kept", "switch", "recheck")


@contextlib.contextmanager
def whole() -> Iterator[None]:
    """Ctrl-C held back until the block ends: a frame's count and its log line go together (an interrupt between
    them made the `interrupted` event's count one less than the frames logged, on a loaded CI run). Off the main
    thread, where no handler can be set, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    before = signal.signal(signal.SIGINT, lambda number, frame: held.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        if held:
            if callable(before):
                before(signal.SIGINT, None)
            elif before == signal.SIG_DFL:
                raise KeyboardInterrupt


class Report:
    """What `deepco run` counts as frames come out (and drops are reported), writes to the JSON log, and
    sums up at the end."""

    def __init__(self, predicted: float, depth: int, log_file):
        self.predicted, self.depth, self.log_file = predicted, depth, log_file
        self.start = self.end = time.perf_counter()
        self.latencies: list[float] = []
        self.ages: list[float] = []  # capture to result
        self.failures = self.drops = 0
        self.out: set[int] = set()  # the frames that came out, done or failed
        self.events: list[dict] = []  # the device's health events (device.health), logged as they come
        self._logged_events = 0

    def fps(self) -> float:
        """Frames done per second so far."""
        return len(self.latencies) / max(1e-9, time.perf_counter() - self.start)

    def dropped(self, drops: list[Dropped], quiet: bool) -> None:
        """Count and log frames the feed dropped (device.feed.Dropped)."""
        with whole():
            self._dropped(drops, quiet)

    def _dropped(self, drops: list[Dropped], quiet: bool) -> None:
        for d in drops:
            self.drops += 1
            if self.log_file:
                self.log_file.write(json.dumps(d.log_record(self.start)) + "\n")
                self.log_file.flush()
            if not quiet:
                print(f"frame {d.index}: dropped (late: a newer frame came before the pipeline had room)", flush=True)

    def log_events(self) -> None:
        """Write the device's health events (`LOGGED_EVENTS`, device.health) that came since the last call to the
        JSON log, their times made seconds from the run's start like the frames'."""
        new, self._logged_events = self.events[self._logged_events:], len(self.events)
        new = [event for event in new if event["event"] in LOGGED_EVENTS]
        if self.log_file and new:
            for event in new:
                self.log_file.write(json.dumps(event | {"at": event["at"] - self.start}) + "\n")
            self.log_file.flush()

    def frame(self, result: FrameResult, predicted: float | None = None) -> None:
        """Count and log one frame's result (``predicted``: its plan's prediction, default the run's), after
        the health events that came before it; a Ctrl-C meanwhile waits until both are done (`whole`)."""
        with whole():
            self._frame(result, predicted)

    def _frame(self, result: FrameResult, predicted: float | None) -> None:
        self.out.add(result.index)
        self.log_events()
        if self.log_file:
            record = result.log_record(self.predicted if predicted is None else predicted, self.start)
            self.log_file.write(json.dumps(record) + "\n")
            self.log_file.flush()  # a line per frame as it comes: the log can be followed live
        if result.error is not None:
            self.failures += 1
            return
        self.latencies.append(result.latency)
        if result.capture_to_result is not None:
            self.ages.append(result.capture_to_result)

    def finish(self) -> None:
        """The last frame is out: the run's wall time ends here (not after the device's models are unloaded)."""
        self.end = time.perf_counter()

    def summary(self) -> int:
        """Print the summary line; the exit status."""
        done, elapsed = len(self.latencies), self.end - self.start
        if done:
            p50, p95 = np.percentile(self.latencies, [50, 95])
            a50, a95 = np.percentile(self.ages, [50, 95]) if self.ages else (np.nan, np.nan)
            print(f"{done} frames in {elapsed:.2f} s: {done / elapsed:.1f} fps; latency mean "
                  f"{np.mean(self.latencies) * 1e3:.1f} ms, p50 {p50 * 1e3:.1f}, p95 {p95 * 1e3:.1f}; capture to "
                  f"result p50 {a50 * 1e3:.1f}, p95 {a95 * 1e3:.1f}; predicted {self.predicted * 1e3:.1f} ms at "
                  f"{self.depth} frame(s) in flight; {self.drops} dropped; {self.failures} failed")
        elif self.drops:
            print(f"no frame done; {self.drops} dropped; {self.failures} failed")
        if self.failures:
            print(f"deepco run: {self.failures} frame(s) failed (see above)", file=sys.stderr)
            return 1
        return 0


    def interrupted(self, taken: set[int], quiet: bool) -> None:
        """Ctrl-C: the frames that entered (``taken``) and have no result are cancelled: a line each (unless
        ``quiet``) and one JSON event in the log; then the summary of the frames done, and one line saying so."""
        self.finish()
        self.log_events()
        cancelled = sorted(taken - self.out)
        if self.log_file:
            event = {"event": "interrupted", "reason": "SIGINT (Ctrl-C)", "done": len(self.latencies),
                     "failed": self.failures, "dropped": self.drops, "cancelled": cancelled,
                     "at": self.end - self.start}
            self.log_file.write(json.dumps(event) + "\n")
            self.log_file.flush()
        if not quiet:
            for index in cancelled:
                print(f"frame {index}: cancelled (interrupted)", flush=True)
        self.summary()
        print(f"interrupted: {len(self.latencies)} frame(s) done, {len(cancelled)} in flight cancelled", flush=True)


class Saved:
    """``--save-outputs``: the inputs of the frames that entered the pipeline (dropped ones never did) and
    their outputs (NaN rows for a failed frame), written as one .npz (`saved_outputs`). The inputs are written
    as the unpartitioned model takes them (``how``'s normalisation in float32)."""

    def __init__(self, path: str | None, how: Preprocessing = IMAGENET):
        self.path, self.how = path, how
        # Kept as the uint8 pixels and normalised only when written: a float32 copy of every frame costs a
        # weak camera's CPU on every frame (most runs save nothing) and takes four times the memory.
        self.pixels: list[np.ndarray] = []
        self.outputs: list[dict[str, np.ndarray] | None] = []  # per frame, None for a failed one

    def input(self, px: np.ndarray) -> None:
        """A frame's pixels entering (in order: the pipeline takes frames one at a time)."""
        if self.path:
            self.pixels.append(px)

    def output(self, result: FrameResult) -> None:
        """A frame's result, in order."""
        if self.path:
            self.outputs.append(result.outputs if result.error is None else None)

    def write(self, channels: int, height: int, width: int) -> None:
        """Write the file (nothing without ``--save-outputs``)."""
        if not self.path:
            return
        empty = np.zeros((0, channels, height, width))
        inputs = np.concatenate([normalise(px, self.how) for px in self.pixels]) if self.pixels else empty
        np.savez(self.path, inputs=inputs,
                 **saved_outputs(self.outputs))


def saved_key(name: str, outputs: int) -> str:
    """The --save-outputs key of output ``name`` of a model with ``outputs`` outputs (`saved_outputs` writes,
    readers of the file look up)."""
    return "outputs" if outputs == 1 else f"outputs/{name}"


def saved_outputs(frames: list[dict[str, np.ndarray] | None]) -> dict[str, np.ndarray]:
    """The --save-outputs arrays of every frame's outputs (None: a failed frame, NaN rows): ``outputs`` for a
    one-output model, else ``outputs/<name>`` for each output; nothing succeeded: ``outputs``, empty."""
    first = next((f for f in frames if f is not None), None)
    if first is None:
        return {"outputs": np.zeros((0,))}
    keys = {name: saved_key(name, len(first)) for name in first}

    def failed(like: np.ndarray) -> np.ndarray:
        return np.full(like.shape, np.nan, dtype=like.dtype if like.dtype.kind == "f" else np.float64)

    return {keys[name]: np.concatenate([f[name] if f is not None else failed(like) for f in frames])
            for name, like in first.items()}
