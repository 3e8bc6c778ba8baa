"""The row tables of a split plan (every split DeepCo runs, MoDNN's included): who owns which rows of every
level, and which rows flow between servers.

Pure functions shared by the device (which builds the tables) and the servers (which read them to know
what to send to whom and what to wait for), so that both sides compute every exchange identically.

A level is a tensor the servers hold in disjoint bands (level 0: the image; see
deepco.partition.segments). ``windows[j][i]`` is the rows [lo, hi) of level j-1 that server i runs
segment j on to produce its band of level j; the rows of that window it does not own come from the
servers that own them.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepco.planning.plan import PlanningError

Interval = tuple[int, int]
NOT_A_SERVER = "-"  # a participant's address in ``peers`` that servers never dial: the device computing a band


def ownership(weights: Sequence[float], heights: Sequence[int]) -> list[list[Interval]]:
    """Bands [start, stop) per level (rows ``heights[j]``) and server: proportional to ``weights``, the same
    fractions at every level, contiguous, in server order top to bottom, at least one row each.

    Boundaries are the rounded cumulative fractions, then pushed apart so that every band has a row."""
    n = len(weights)
    if n == 0 or any(not w > 0 for w in weights):
        raise PlanningError(f"a split needs at least one server and positive capacities, got {list(weights)}")
    total = sum(weights)
    cumulative = [sum(weights[:i]) / total for i in range(n + 1)]
    tables = []
    for h in heights:
        if h < n:
            raise PlanningError(f"a level of {h} rows cannot give each of {n} servers a row; use fewer servers "
                                "or an earlier cut")
        bounds = [round(f * h) for f in cumulative]
        bounds[0], bounds[-1] = 0, h
        for i in range(1, n):  # at least one row each: forwards, then backwards from the bottom
            bounds[i] = max(bounds[i], bounds[i - 1] + 1)
        for i in range(n - 1, 0, -1):
            bounds[i] = min(bounds[i], bounds[i + 1] - 1)
        tables.append([(bounds[i], bounds[i + 1]) for i in range(n)])
    return tables


def overlap(x: Interval, y: Interval) -> Interval | None:
    """The common rows of two intervals, or None."""
    lo, hi = max(x[0], y[0]), min(x[1], y[1])
    return (lo, hi) if lo < hi else None


def sends(bands: Sequence[Sequence[Interval]], windows: Sequence[Sequence[Interval]], level: int,
          sender: int) -> dict[int, Interval]:
    """Rows of level ``level`` that ``sender`` sends to each other server for segment ``level`` + 1."""
    out = {}
    for receiver, window in enumerate(windows[level + 1]):
        if receiver != sender and (rows := overlap(window, bands[level][sender])) is not None:
            out[receiver] = rows
    return out


def receives(bands: Sequence[Sequence[Interval]], windows: Sequence[Sequence[Interval]], level: int,
             receiver: int) -> dict[int, Interval]:
    """Rows of level ``level`` that ``receiver`` gets from each other server for segment ``level`` + 1."""
    out = {}
    for sender, band in enumerate(bands[level]):
        if sender != receiver and (rows := overlap(windows[level + 1][receiver], band)) is not None:
            out[sender] = rows
    return out


def check_tables(bands: Sequence[Sequence[Interval]], windows: Sequence[Sequence[Interval]],
                 heights: Sequence[int]) -> None:
    """Raise PlanningError unless ``bands`` tile every level and every window lies inside its level.

    ``windows[0]`` is unused (the image has no segment before it) and may be empty."""
    if len(bands) != len(heights) or len(windows) != len(heights):
        raise PlanningError(f"tables for {len(bands)} / {len(windows)} levels, expected {len(heights)}")
    servers = len(bands[0]) if bands else 0
    for j, (level, h) in enumerate(zip(bands, heights, strict=True)):
        if len(level) != servers:
            raise PlanningError(f"level {j} has bands for {len(level)} servers, level 0 for {servers}")
        cursor = 0
        for i, (a, b) in enumerate(level):
            if a != cursor or b <= a:
                raise PlanningError(f"level {j}: band {i} is [{a}, {b}), expected a non-empty band from {cursor}")
            cursor = b
        if cursor != h:
            raise PlanningError(f"level {j}: the bands cover {cursor} of its {h} rows")
        if j == 0:
            continue
        if len(windows[j]) != servers:
            raise PlanningError(f"level {j} has windows for {len(windows[j])} servers, expected {servers}")
        for i, (lo, hi) in enumerate(windows[j]):
            if not 0 <= lo < hi <= heights[j - 1]:
                raise PlanningError(f"level {j}: window {i} [{lo}, {hi}) is not inside the {heights[j - 1]} "
                                    f"rows of level {j - 1}")
