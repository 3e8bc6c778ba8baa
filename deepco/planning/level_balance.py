"""Bands sized level by level, halo included, so that the servers of a split finish each level together.

`deepco.planning.bands.ownership` gives every level the same fractions of its rows. A server's work at a level
is its band *and the halo* it computes again to produce it: a server in the middle pays a halo on both sides,
the top and bottom ones on one, and deep in a network the halo is as large as the band (ResNet-18 at 720x1280
over four servers: 4-8 rows of `layer4` owned, 7-10 computed). With one fraction per server at every level, the
middle servers are the slowest at the deep levels, and every neighbour waits for their rows before the next
level. (On the camera preset the servers' compute per level is uneven by about a tenth; sizing the levels to
their halos moved a row or two per level and measured no faster there: most of that unevenness is the servers'
speeds, not the halo. bench/README.md, 06e6854.)

`balanced` sizes one level's bands so that its slowest server is as fast as the rows allow: a bisection on the
time, each step filling the servers top to bottom with as many rows as fit in it. Rows are whole, so at the
deepest levels (5-8 rows a server) a row is still a sixth of a server's work; what `balanced` removes is the
halo's share of the imbalance, not the rounding.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

Interval = tuple[int, int]
PRECISION = 0.005  # the bisection stops when the time is known within this share of it
SECONDS_FLOOR = 0.5  # the balanced time is at least this share of the proportional bands' slowest


def balanced(seconds: Callable[[int, int, int], float], height: int, start: Sequence[Interval]) -> list[Interval]:
    """Contiguous bands over ``height`` rows for the servers of ``start`` (in its order, one row at least each)
    whose largest ``seconds(i, a, b)`` (server ``i`` computing the output rows [a, b): non-decreasing in b,
    non-increasing in a) is least, within ``PRECISION``; ``start`` itself where nothing is faster.

    Filling the servers in order with as many rows as a time allows is exact for whether that time can be met
    (a server that takes more rows leaves its successors fewer, which never makes them slower), so a bisection
    on the time between ``start``'s slowest and ``SECONDS_FLOOR`` of it finds the least."""
    n = len(start)
    if n < 2:
        return list(start)

    def slowest(bands: Sequence[Interval]) -> float:
        return max(seconds(i, a, b) for i, (a, b) in enumerate(bands))

    best, low, high = None, slowest(start) * SECONDS_FLOOR, slowest(start)
    while high - low > PRECISION * high:
        mid = (low + high) / 2
        bands = _fill(seconds, height, n, mid)
        if bands is None:
            low = mid
        else:
            best, high = bands, slowest(bands)
    if best is None:
        return list(start)
    # Filled top down, the bottom server gets what the time leaves (it idles, and the rates it was sized on are
    # estimates); filled bottom up, the top one. Between the two, each boundary halfway, where that meets it.
    upward = _fill(lambda i, a, b: seconds(n - 1 - i, height - b, height - a), height, n, high)
    if upward is None:
        return best
    lows = [height - b for _, b in reversed(upward)]
    middle = [0, *((lo + hi) // 2 for lo, (hi, _) in zip(lows[1:], best[1:], strict=True)), height]
    halfway = list(itertools.pairwise(middle))
    return halfway if all(a < b for a, b in halfway) and slowest(halfway) <= high else best


def _fill(seconds: Callable[[int, int, int], float], height: int, n: int, limit: float) -> list[Interval] | None:
    """Servers top to bottom, each with the most rows it computes within ``limit`` seconds (one at least, and
    one left for each server after it), the last with the rest; None where one of them exceeds ``limit``."""
    bands, a = [], 0
    for i in range(n - 1):
        low, high = a + 1, height - (n - 1 - i)
        if high < low or seconds(i, a, low) > limit:
            return None
        while low < high:  # the largest end within the limit
            mid = (low + high + 1) // 2
            if seconds(i, a, mid) <= limit:
                low = mid
            else:
                high = mid - 1
        bands.append((a, low))
        a = low
    if seconds(n - 1, a, height) > limit:
        return None
    return [*bands, (a, height)]
