"""Arrays a server reuses from frame to frame for the windows its split jobs assemble.

A window assembled into fresh memory takes fresh pages, and the kernel zeroes every one of them: on the camera
preset (ResNet-50 at 720x1280, servers under 0.35-0.45-core CPU quotas) a level's 12-18 MB window took 300-1000
page faults and 5-95 ms, frame after frame. A frame's job runs on whichever of the server's threads is free, and
each thread's malloc heap is its own, so the memory the last frame freed was seldom at hand. The same plan
assembles windows of the same shapes every frame: kept here, they are written again without a fault.

At most ``MAX_POOLED_BYTES`` are kept, the least recently given back dropped first, so a client's shapes bound
nothing but what a frame's windows already take. The pool outlives the gaps between a camera's frames (the
server gives its freed memory back after one quiet second, server.budgets; in `deepco bench`, whose algorithms
take turns frame by frame, every `auto` frame found the pool emptied that way) and is dropped once no window
was taken or given back for ``KEEP_SECONDS``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import numpy as np

MAX_POOLED_BYTES = 256 << 20  # ResNet-50 at 720x1280: a server's windows of one frame take 40-60 MB
KEEP_SECONDS = 60.0  # a camera's frames a minute apart still find their windows


class WindowBuffers:
    """Free arrays by (shape, dtype), up to ``max_bytes`` in all."""

    def __init__(self, max_bytes: int = MAX_POOLED_BYTES):
        self.max_bytes = max_bytes
        self._free: OrderedDict[tuple, list[np.ndarray]] = OrderedDict()
        self._bytes = 0
        self._used = time.monotonic()  # when an array was last taken or given back
        self._lock = threading.Lock()

    @property
    def pooled_bytes(self) -> int:
        """Bytes of the arrays kept now."""
        return self._bytes

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An array of ``shape`` and ``dtype`` (its contents whatever they were): one given back before, or new."""
        key = (tuple(shape), np.dtype(dtype).str)
        with self._lock:
            self._used = time.monotonic()
            free = self._free.get(key)
            if free:
                array = free.pop()
                if not free:
                    del self._free[key]
                self._bytes -= array.nbytes
                return array
        return np.empty(shape, dtype)

    def take_like(self, array: np.ndarray, rows: int) -> np.ndarray:
        """An array shaped like ``array`` (NCHW and the like: rows on axis 2) but with ``rows`` rows, of its type."""
        return self.take((*array.shape[:2], rows, *array.shape[3:]), array.dtype)

    def give(self, array: np.ndarray) -> None:
        """Keep ``array`` (one from `take`, no longer used) for a later `take`, dropping the least recently
        given ones if the pool would hold more than ``max_bytes``."""
        if array.nbytes > self.max_bytes or not array.flags.c_contiguous or array.base is not None:
            return
        key = (array.shape, array.dtype.str)
        with self._lock:
            self._used = time.monotonic()
            while self._free and self._bytes + array.nbytes > self.max_bytes:
                oldest, arrays = next(iter(self._free.items()))
                self._bytes -= arrays.pop(0).nbytes
                if not arrays:
                    del self._free[oldest]
            self._free.setdefault(key, []).append(array)
            self._free.move_to_end(key)
            self._bytes += array.nbytes

    def expire(self) -> bool:
        """Drop every array kept if none was taken or given back for ``KEEP_SECONDS``; whether any was dropped."""
        with self._lock:
            if not self._bytes or time.monotonic() - self._used <= KEEP_SECONDS:
                return False
            self._free.clear()
            self._bytes = 0
            return True
