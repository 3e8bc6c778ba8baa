"""Frames in flight for a live source that drops late frames: as few as keep the frame rate, by measurement.

A frame let in flight beyond what the plan's slowest step absorbs only waits, and on a live source every
wait is age. A second frame in flight pays only where it overlaps something with the server's compute (the
transfer, the device's own work); a server runs the frames it holds in turn, and its own message handling
shares its CPU share with the compute. On the camera preset at 224x224, offload with two frames in flight
measured 8-23% fewer fps than with one (issue 28; before servers took turns, two at once doubled each
frame's compute latency for no more fps).
So the depth is chosen the way `--objective slo` chooses: by what frames measure. `LeanDepth` starts at the
least depth, tries one more for a window of results, keeps it only when the measured rate rises by
``GAIN``, and stops at the first depth that does not pay (or at the most it may use).

The rate at ``d`` frames in flight is ``d`` over the median latency of the window (Little's law: the
pipeline is full whenever the source outruns it, which is when the depth matters). Each latency is a whole
measurement, so a few frames decide, and the trial of a depth that does not pay ages only those few frames:
timing the gaps between deliveries needed 8 frames a depth and put the capture-to-result p95 of a 300-frame
live run in the trial's frames. With a source slower than the pipeline a deeper pipeline lets no frame wait,
so keeping it costs nothing.
"""

from __future__ import annotations

import statistics

GAIN = 0.10  # one more frame in flight must buy this much more measured fps
WINDOW = 5  # results timed at each depth
SETTLE = 2  # results after a change of depth that are not timed (frames let in under the old depth)


class LeanDepth:
    """Fed each result's latency (seconds), it says how many frames to keep in flight (``depth``) and, once
    it has decided, a line saying what it measured."""

    def __init__(self, least: int, most: int, window: int = WINDOW, gain: float = GAIN, settle: int = SETTLE):
        if least < 1 or most < least:
            raise ValueError(f"LeanDepth: need 1 <= least <= most, got {least} and {most}")
        self.depth, self.most, self.window, self.gain, self.settle = least, most, window, gain, settle
        self.decided = least == most
        self.rates: dict[int, float] = {}  # measured fps per depth tried
        self._latencies: list[float] = []
        self._skip = settle

    def observe(self, latency: float, delivered: float | None = None) -> str | None:
        """Count one result of ``latency`` seconds (``delivered``, when it left, is not needed here); a line
        when the depth is settled, else None."""
        if self.decided:
            return None
        if self._skip > 0:
            self._skip -= 1
            return None
        self._latencies.append(latency)
        if len(self._latencies) < self.window:
            return None
        self.rates[self.depth] = self.depth / statistics.median(self._latencies)
        self._latencies, self._skip = [], self.settle
        before = self.rates.get(self.depth - 1)
        pays = before is None or self.rates[self.depth] >= (1 + self.gain) * before
        if pays and self.depth < self.most:
            self.depth += 1
            return None
        if not pays:
            self.depth -= 1
        self.decided = True
        tried = ", ".join(f"{d} in flight {fps:.2f} fps" for d, fps in sorted(self.rates.items()))
        return f"live source: {self.depth} frame(s) in flight, the fewest that keep the frame rate (measured: {tried})"
