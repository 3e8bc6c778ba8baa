"""The frames waiting to enter the pipeline: what sits between a source and the frames in flight.

A live source (a camera, a network stream, a file played with ``--source-fps``) makes frames on its own clock,
whether the engine keeps up or not. `LiveFeed` reads it on a thread of its own into a queue of one frame. With
``drop="late"`` a frame that arrives while another still waits replaces it, and the one replaced is counted
and reported as `Dropped`: the pipeline always takes the latest frame, so a slow engine never falls behind its
source. With ``drop="never"`` the reader waits for room instead, so a live source's frames wait their turn and
their capture-to-result latency grows for as long as the engine is slower than the source.

`IterFeed` hands over the frames of a file, an image, a directory or a list one by one as the pipeline has
room: none waits, none is dropped.

Each frame that enters is a `Frame`: its index in the source, its capture time and its pixels. The pipeline
(device/pipeline.py) asks `Feed.take` for the next one and calls `Feed.wake` when a frame in flight is done,
so that a result is never held back waiting for the source's next frame.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from deepco.errors import UserError

DROP_MODES = ("late", "never")
Clock = Callable[[], float]


@dataclass(frozen=True)
class Frame:
    """A frame entering the pipeline: its index in the source, when it was captured (the feed's clock,
    perf_counter by default) and its pixels as the runners take them."""

    index: int
    captured: float
    pixels: np.ndarray


@dataclass(frozen=True)
class Dropped:
    """A frame of the source that never entered the pipeline: a newer one came before there was room."""

    index: int
    captured: float
    at: float  # when it was replaced

    def log_record(self, start: float) -> dict:
        """The --json-log line of this frame (times in seconds from ``start``)."""
        return {"dropped": self.index, "captured": self.captured - start, "at": self.at - start,
                "reason": "late: a newer frame came before the pipeline had room (--drop late)"}


class EndOfFeed(Exception):
    """The source has no more frames (every frame it had was taken or dropped)."""


class Feed:
    """The pipeline's side of a source (see the module doc)."""

    def take(self, timeout: float) -> Frame | None:
        """The next frame; None when none came within ``timeout`` seconds or `wake` was called. Raises
        EndOfFeed when the source is done, or the source's UserError once the frames before it were taken."""
        raise NotImplementedError

    def wake(self) -> None:
        """End a `take` that is waiting (a frame in flight is done)."""

    def close(self) -> None:
        """Stop reading the source."""

    def drops(self) -> list[Dropped]:
        """The frames dropped since the last call."""
        return []


class WrappedFeed(Feed):
    """A feed that hands out the frames of another, ``feed``, and passes the rest of its calls on to it."""

    def __init__(self, feed: Feed):
        self.feed = feed

    def take(self, timeout: float) -> Frame | None:
        return self.feed.take(timeout)

    def wake(self) -> None:
        self.feed.wake()

    def close(self) -> None:
        self.feed.close()

    def drops(self) -> list[Dropped]:
        return self.feed.drops()


class TakenFeed(WrappedFeed):
    """``feed``, remembering the index of every frame it handed out (to calibration or to the pipeline): when
    the run is interrupted, those without a result yet are the frames in flight, reported as cancelled."""

    def __init__(self, feed: Feed):
        super().__init__(feed)
        self.taken: set[int] = set()

    def take(self, timeout: float) -> Frame | None:
        frame = self.feed.take(timeout)
        if frame is not None:
            self.taken.add(frame.index)
        return frame


class IterFeed(Feed):
    """Frames from an iterable, taken one by one when the pipeline has room; ``prepare`` turns each into the
    pixels the runners take. A frame is captured when it is read."""

    def __init__(self, frames: Iterable[np.ndarray], prepare: Callable[[np.ndarray], np.ndarray] = lambda x: x,
                 clock: Clock = time.perf_counter, first: int = 0):
        self._frames, self._prepare, self._clock = iter(frames), prepare, clock
        self._count = itertools.count(first)

    def take(self, timeout: float) -> Frame | None:
        try:
            raw = next(self._frames)
        except StopIteration:
            raise EndOfFeed from None
        return Frame(next(self._count), self._clock(), self._prepare(raw))

    def close(self) -> None:
        close = getattr(self._frames, "close", None)
        if close is not None:
            close()


class LiveFeed(Feed):
    """A live source behind a queue of one frame (see the module doc). ``fps``: play the frames at that rate
    on ``clock`` (a file as a live source: frame i is captured at start + i / fps, whether it is read then or
    later), else each frame is captured when it is read. ``prepare`` runs on the frames taken only (a dropped
    frame costs no resizing). `start` reads the source on a thread; `pump` reads it in the calling thread."""

    def __init__(self, drop: str = "late", fps: float | None = None,
                 prepare: Callable[[np.ndarray], np.ndarray] = lambda x: x, clock: Clock = time.perf_counter,
                 wait: Callable[[float], object] | None = None):
        if drop not in DROP_MODES or fps is not None and not fps > 0:  # the flags were checked (sources.drop_mode)
            raise ValueError(f"LiveFeed: drop {drop!r}, fps {fps!r}")
        self.drop, self.fps, self._prepare, self._clock = drop, fps, prepare, clock
        self._stop = threading.Event()
        self._wait = wait or self._stop.wait  # pacing ends early when the feed is closed
        self._cond = threading.Condition()
        self._waiting: tuple[int, float, np.ndarray] | None = None
        self._woken = self._ended = False
        self._error: UserError | None = None
        self._dropped: list[Dropped] = []
        self.dropped = 0  # frames dropped so far
        self._count = itertools.count()

    # ---- the source's side ----------------------------------------------------------------------------
    def offer(self, captured: float, raw: np.ndarray) -> None:
        """A frame captured at ``captured``: it waits for the pipeline, replacing (and dropping) a frame still
        waiting with ``late``, or once the one waiting was taken with ``never``."""
        with self._cond:
            index = next(self._count)
            if self._waiting is not None and self.drop == "late":
                self._dropped.append(Dropped(self._waiting[0], self._waiting[1], self._clock()))
                self.dropped += 1
                self._waiting = None
            while self._waiting is not None and not self._stop.is_set():
                self._cond.wait()
            self._waiting = (index, captured, raw)
            self._cond.notify_all()

    def end(self, error: UserError | None = None) -> None:
        """The source is done (``error``: why it failed); the frame waiting still enters."""
        with self._cond:
            self._ended, self._error = True, error
            self._cond.notify_all()

    def pump(self, frames: Iterator[np.ndarray]) -> None:
        """Read ``frames`` into the queue, paced at ``fps`` if given, until they end or the feed is closed."""
        try:
            start = self._clock()
            for i, raw in enumerate(frames):
                if self._stop.is_set():
                    break
                if self.fps is None:
                    captured = self._clock()
                else:
                    captured = start + i / self.fps
                    if captured > self._clock():
                        self._wait(captured - self._clock())
                self.offer(captured, raw)
        except UserError as exc:
            self.end(exc)
        except Exception as exc:
            self.end(UserError(f"the frame source failed: {type(exc).__name__}: {exc}"))
        else:
            self.end()
        finally:
            close = getattr(frames, "close", None)
            if close is not None:
                close()

    def start(self, frames: Iterator[np.ndarray]) -> LiveFeed:
        """`pump` ``frames`` on a thread of its own; returns the feed."""
        threading.Thread(target=self.pump, args=(frames,), name="deepco-source", daemon=True).start()
        return self

    # ---- the pipeline's side --------------------------------------------------------------------------
    def take(self, timeout: float) -> Frame | None:
        with self._cond:
            if self._waiting is None and not self._ended and not self._woken:
                self._cond.wait(timeout)
            self._woken = False
            if self._waiting is None:
                if self._ended:
                    if self._error is not None:
                        raise self._error
                    raise EndOfFeed
                return None
            (index, captured, raw), self._waiting = self._waiting, None
            self._cond.notify_all()  # ``never``: the reader may offer the next one
        return Frame(index, captured, self._prepare(raw))

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def drops(self) -> list[Dropped]:
        with self._cond:
            out, self._dropped = self._dropped, []
        return out


class ResumedFeed(WrappedFeed):
    """``feed`` with ``first`` (frames already taken from it, in order) handed out again before its own: the
    frames a failed server gave back during calibration on live frames (device.planner.LiveFrames)."""

    def __init__(self, first: list[Frame], feed: Feed):
        super().__init__(feed)
        self._first = list(first)

    def take(self, timeout: float) -> Frame | None:
        return self._first.pop(0) if self._first else self.feed.take(timeout)
