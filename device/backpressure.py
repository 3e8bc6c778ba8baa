"""Back-pressure from a busy server: it answers RESOURCE_EXHAUSTED ("retry later") when its work slots are
held, for example by other devices' setups. Every call a device makes at setup (probes, uploads, profiles)
waits for a slot with backoff instead of failing the device; so does the frame path (`StagedRunner.run_frame`),
for at most the runner's timeout and only until the run stops.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from deepco.wire.client import ServerError

T = TypeVar("T")
BUSY_BACKOFF = 0.02  # first pause (s) after a RESOURCE_EXHAUSTED; doubles up to BUSY_BACKOFF_MAX
BUSY_BACKOFF_MAX = 0.5
SETUP_PATIENCE = 60.0  # s a setup call waits for a busy server before the error is the device's


def while_busy(call: Callable[[], T], patience: float = SETUP_PATIENCE, stop: threading.Event | None = None) -> T:
    """``call()``, retried with backoff while the server answers RESOURCE_EXHAUSTED, for at most ``patience``
    seconds, and with ``stop`` only until it is set; any other error, a wrong answer, or the last refusal is
    raised."""
    give_up = time.monotonic() + patience
    pause = BUSY_BACKOFF
    while True:
        try:
            return call()
        except ServerError as exc:
            if (exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED  # a wrong answer is INTERNAL: never asked again
                    or time.monotonic() + pause > give_up or (stop is not None and stop.is_set())):
                raise
            refused = exc
        if stop is None:
            time.sleep(pause)
        elif stop.wait(pause):
            raise refused
        pause = min(2 * pause, BUSY_BACKOFF_MAX)
