"""When a run stops trying: a frozen or lying server must end a run with a clear message, not stall it.

The frame pipeline (device.pipeline, behind device.staged.StagedRunner.run_frames) feeds every frame's
result to a :class:`GiveUp` and ask it, while they wait, whether to stop; it raises :class:`GaveUp` (a
UserError: `deepco run` prints one line and exits non-zero).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from deepco.errors import UserError

if TYPE_CHECKING:  # `deepco run`'s flags import this module; keep the CLI's start light
    from deepco_device.records import FrameResult

GIVE_UP_AFTER = 60.0  # seconds with frames in flight and none succeeding (above every server deadline)
MAX_FAILED_FRAMES = 10  # failed frames in a row
TICK = 0.25  # how often a waiting runtime looks at the clock (seconds)
# a gap this long between two looks at the clock (a waiting runtime looks every TICK) is time the device itself
# did not run (suspended, or its cgroup frozen): no server kept it waiting then, so it does not count
STALLED = 10.0


class GaveUp(UserError):
    """The run stopped: no frame succeeded for too long, or too many failed in a row."""


class GiveUp:
    """Stop after ``seconds`` with frames in flight and none succeeding, or after ``frames`` failed frames in
    a row; 0 (or None) turns a bound off."""

    def __init__(self, seconds: float | None = GIVE_UP_AFTER, frames: int | None = MAX_FAILED_FRAMES):
        if seconds is not None and seconds < 0:
            raise UserError(f"--give-up-after must be >= 0 seconds, got {seconds:g}")
        if frames is not None and frames < 0:
            raise UserError(f"--max-failed-frames must be >= 0, got {frames}")
        self.seconds, self.frames = seconds or 0.0, frames or 0
        self.failed_in_a_row = 0
        self.last_error: str | None = None
        self._since = time.monotonic()
        self._looked: float | None = None  # the last `check`

    def seen(self, result: FrameResult) -> None:
        """Count a frame's result (in order), then raise GaveUp if it was one failure too many."""
        if result.error is None:
            self.failed_in_a_row = 0
            self._since = time.monotonic()
            return
        self.failed_in_a_row += 1
        self.last_error = result.error
        if self.frames and self.failed_in_a_row >= self.frames:
            raise GaveUp(f"gave up after {self.failed_in_a_row} failed frames in a row (--max-failed-frames "
                         f"{self.frames}); last error: {self.last_error}")

    def check(self, in_flight: bool, waiting_for: str = "") -> None:
        """Raise GaveUp if frames have been in flight for ``seconds`` with none succeeding (``waiting_for``:
        what they wait on, for the message). With nothing in flight the clock does not run, nor while the device
        did not run itself (a gap of STALLED since the last look)."""
        now = time.monotonic()
        if self._looked is not None and now - self._looked > STALLED:
            self._since += now - self._looked
        self._looked = now
        if not in_flight:
            self._since = now
            return
        if self.seconds and now - self._since > self.seconds:
            why = f"; waiting for {waiting_for}" if waiting_for else ""
            last = f"; last error: {self.last_error}" if self.last_error else ""
            raise GaveUp(f"gave up: no frame succeeded for {self.seconds:g} s (--give-up-after {self.seconds:g})"
                         f"{why}{last}")
