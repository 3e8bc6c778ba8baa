"""deepco.wire.watchdog: every call's deadline on one shared thread."""

from __future__ import annotations

import threading
import time

from deepco.wire.watchdog import Watchdog


def test_alarms_ring_in_deadline_order_on_one_thread_and_a_cancelled_one_never_rings():
    dog = Watchdog()
    rang: list[tuple[str, str]] = []
    before = threading.active_count()
    alarms = {name: dog.after(delay, lambda name=name: rang.append((name, threading.current_thread().name)))
              for name, delay in (("late", 0.3), ("early", 0.05), ("never", 0.1), ("middle", 0.15))}
    alarms["never"].cancel()
    assert threading.active_count() <= before + 1  # four alarms, one thread
    deadline = time.monotonic() + 5
    while len(rang) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert [name for name, _ in rang] == ["early", "middle", "late"]
    assert {thread for _, thread in rang} == {"deepco-watchdog"}


def test_an_alarm_that_fails_does_not_stop_the_others():
    dog = Watchdog()
    rang: list[str] = []
    dog.after(0.01, lambda: 1 / 0)
    dog.after(0.05, lambda: rang.append("after"))
    deadline = time.monotonic() + 5
    while not rang and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rang == ["after"]
