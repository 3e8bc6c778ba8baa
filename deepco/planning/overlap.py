"""Overlap a stage's compute with its halo exchange: the interior of a band while its halo rows are in flight.

Before segment j of a split plan a server needs rows of level j-1 that its neighbours own (the halo). Most of
its band of level j does not depend on them: the *interior*, the output rows whose window of level j-1 lies
inside the server's own band. Run as *parts* the segment computes the interior first, from rows the server
already holds, while the halo is in flight, then each *border* (the rows above and below the interior) once
its neighbour's rows land, and the server stitches the parts in row order (HPC stencil codes do the same).

Every part is the same segment model (it runs on any height) on a sub-window of rows, so no extra model is
built, uploaded or held; each part's window and crop come from the exact row analysis
(`deepco.partition.segments.Segment.window`), so the stitched band equals the whole segment's. The price is
an ORT run per part and the border parts' recomputed rows of the segment's inner layers (their FLOPs are in
the windows, so the cost model counts them).

The first segment of a plan with lookahead has no halo to wait for, but its window crosses the radio: there
the parts are *sub-bands* in row order (`stream_parts`). The device sends the rows the first one reads in the
job's request and the rest of the window after it (`rest`; every participant's first message on an antenna
goes before any rest), so a server computes its first sub-band while the rest of its window is on the air.

A plan carries the choice as data (`StagedPlan.overlap`): per level and participant, its parts in run order,
each ((rows), (window), crop); an empty list runs the segment once on its whole window. `finish` is the one
formula for when a stage ends, with or without parts: a halo and the rest of a streamed window are alike to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from deepco.planning.bands import receives

Interval = tuple[int, int]
Part = tuple[Interval, Interval, int]  # output rows of level j, window of level j-1, crop in the run's output
WindowOf = Callable[[int, int], object]  # output rows [a, b) -> a Window (input_rows, crop, flops)
# One more ORT run of a stage (Python, the call, small-tensor inefficiency) on top of the step's fixed cost.
PART_OVERHEAD = 0.002
MAX_PARTS = 3  # a segment's runs on one server: the interior, the border above, the border below
STREAM_SHARES = (1 / 3, 1 / 2)  # the first sub-band's share of a streamed band, as the planner tries them


def interior(window: WindowOf, band: Interval, own: Interval) -> Interval | None:
    """The largest output rows [ia, ib) of ``band`` whose window lies inside ``own`` (rows of the level before
    that the server holds itself), or None when there are none (a thin band: every row needs the halo)."""
    a, b = band

    def start(x: int) -> int:
        return window(x, x + 1).input_rows[0]

    def stop(x: int) -> int:
        return window(x, x + 1).input_rows[1]

    lo, hi = a, b  # smallest row whose window starts inside own (windows move down with the rows)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if start(mid) >= own[0] else (mid + 1, hi)
    ia = lo
    lo, hi = a, b  # first row whose window ends below own
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if stop(mid) <= own[1] else (lo, mid)
    ib = lo
    if ia >= ib:
        return None
    rows = window(ia, ib).input_rows
    return (ia, ib) if own[0] <= rows[0] and rows[1] <= own[1] else None


def parts(window: WindowOf, band: Interval, own: Interval) -> list[Part]:
    """``band``'s segment run in parts (interior, then the borders above and below it), or [] when the band has
    no interior or needs no halo (then it runs once)."""
    inner = interior(window, band, own)
    if inner is None or inner == band:
        return []
    out = []
    for rows in (inner, (band[0], inner[0]), (inner[1], band[1])):
        if rows[0] < rows[1]:
            w = window(*rows)
            out.append((rows, w.input_rows, w.crop[0]))
    return out


def stream_parts(window: WindowOf, band: Interval, share: float) -> list[Part]:
    """``band``'s first segment run as two sub-bands in row order, the first over ``share`` of its rows (the
    device streams its window: see the module doc); [] where either would be empty."""
    a, b = band
    c = a + round((b - a) * share)
    if not a < c < b:
        return []
    return [(rows, w.input_rows, w.crop[0]) for rows in ((a, c), (c, b)) for w in [window(*rows)]]


def rest(parts: Sequence[Part], window: Interval) -> Interval | None:
    """The rows of ``window`` (a participant's window of the image, its first segment's with lookahead) that
    follow its first message where that segment runs in ``parts``: those after the first part's window; None
    when nothing follows (one run, or a first part that reads the whole window)."""
    if len(parts) < 2:
        return None
    m = parts[0][1][1]
    return (m, window[1]) if window[0] < m < window[1] else None


def plan_parts(window_of: Callable[[int, int], WindowOf], bands: Sequence[Sequence[Interval]],
               windows: Sequence[Sequence[Interval]], lookahead: bool, participants: Sequence[str],
               device: str) -> list[list[list[Part]]]:
    """`StagedPlan.overlap` for a split's tables: parts for every server at every level it receives a halo
    for (``window_of(j, i)`` gives segment j's windows as participant i runs them); none for the device (it
    exchanges nothing)."""
    out: list[list[list[Part]]] = [[[] for _ in participants]]
    for j in range(1, len(bands)):
        level: list[list[Part]] = []
        for i, name in enumerate(participants):
            exchanged = (j > 1 or not lookahead) and receives(bands, windows, j - 1, i)
            mine = parts(window_of(j, i), bands[j][i], bands[j - 1][i]) if exchanged and name != device else []
            lo, hi = windows[j][i]  # every part reads rows the server has anyway: its window's
            level.append(mine if all(lo <= w[0] and w[1] <= hi for _, w, _ in mine) else [])
        out.append(level)
    return out


def finish(own: float, halo: float, whole: float, inner: float | None, borders: float, runs: int,
           overhead: float) -> float:
    """When a server's stage ends (seconds), the one formula: its own rows of the level before are ready at
    ``own``, its neighbours' halo rows at ``halo``. Run once (``inner`` None) the stage waits for both and
    computes its window (``whole`` seconds); run in ``runs`` parts it computes the interior (``inner``) as
    soon as its own rows are there, overlapping the halo's flight, then the borders (``borders``). Either
    way the step's fixed cost ``overhead`` is paid once, and each part beyond the first PART_OVERHEAD."""
    if inner is None:
        return max(own, halo) + whole + overhead
    return max(own + inner, halo) + borders + overhead + (runs - 1) * PART_OVERHEAD
