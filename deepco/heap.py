"""The interpreter's heap in a long-running process: the start-up objects left out of the collector's full passes.

A full pass of Python's cyclic garbage collector visits every object it tracks. After its imports (ONNX, ONNX
Runtime, gRPC, numpy) and set-up a server or a device tracks ~46,000 of them; a pass over them took 14 ms of a
free core, and on a server's 0.35-0.45 of a core, in a split's frames, 27-41 ms of CPU and 66-116 ms of wall time
(bench/gc_log in `deepco serve` on the camera preset, 2026-11-29): a frame's step stood still for that long.
Those objects live as long as the process, so once set up it collects once and freezes the rest (`gc.freeze`,
made for this): later passes visit only what came after. In the same 30-frame run with it, no server made a full
pass in the frames, and the one each made at exit took 1.8-18 ms of wall time (46-58 ms before).
"""

from __future__ import annotations

import gc


def freeze_long_lived() -> int:
    """Collect what is garbage now, then move every object still tracked out of the collector's passes; the
    number frozen in all."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
