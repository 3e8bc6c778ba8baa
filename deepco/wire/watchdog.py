"""One thread for every call's client-side deadline.

A `threading.Timer` per call is a thread started per call, and on a weak camera starting a thread is not free:
on the testbed's 0.1-core camera an offloaded ResNet-18 frame at 224x224 spent 2.9 ms of the camera's CPU, a
thread start among it, and `Thread.start` waits until the new thread has run. `Watchdog.after` puts the
deadline on one heap that a single daemon thread, started on first use, sleeps on.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable


class Alarm:
    """One scheduled call; `cancel` it before it is due and it never runs."""

    __slots__ = ("fn", "cancelled")

    def __init__(self, fn: Callable[[], object]):
        self.fn, self.cancelled = fn, False

    def cancel(self) -> None:
        """Do not run it (a no-op once it ran)."""
        self.cancelled = True


class Watchdog:
    """Calls ``fn`` after ``seconds`` (`after`) on one shared thread, unless cancelled first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Alarm]] = []
        self._order = itertools.count()  # ties on the deadline: first scheduled, first run
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def after(self, seconds: float, fn: Callable[[], object]) -> Alarm:
        """Run ``fn`` in ``seconds`` (on the watchdog's thread: it must be quick and must not raise)."""
        alarm = Alarm(fn)
        with self._wake:
            heapq.heappush(self._heap, (time.monotonic() + seconds, next(self._order), alarm))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="deepco-watchdog", daemon=True)
                self._thread.start()
            elif self._heap[0][2] is alarm:  # due before everything the thread sleeps on
                self._wake.notify()
        return alarm

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._heap and self._heap[0][2].cancelled:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._wake.wait()
                    continue
                due = self._heap[0][0] - time.monotonic()
                if due > 0:
                    self._wake.wait(due)
                    continue
                _, _, alarm = heapq.heappop(self._heap)
            if not alarm.cancelled:
                with contextlib.suppress(Exception):  # a failing alarm must not take the others' thread down
                    alarm.fn()


WATCHDOG = Watchdog()  # the process's: every client's calls share its thread
