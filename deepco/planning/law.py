"""The CONVENE closed forms, each written once: cumulative server law, completion time, TSP.

Notation of the paper (Hsu et al., "Cooperative CNN Deployment over Mobile Networks"):
``s`` data size of an image, ``b`` bandwidth of an antenna, ``c(i)`` normalised capacity of server i
(data units per time unit), ``r_o`` prefetched-data (halo) ratio of one block.

Numerics: eq. (9) as printed multiplies |S| factors (b + c(i)) and overflows for large |S|; we use the
identical form c(S) = b * (prod(1 + c(i)/b) - 1), evaluated in log space.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# A ratio above -RATIO_EPS is rounding noise of eqs. (12)-(13) and is treated as zero.
RATIO_EPS = 1e-12


def log_growth(bandwidth: float, capacities: Sequence[float]) -> float:
    """sum(log(1 + c(i)/b)): the log of prod(b + c(i)) / b^|S|, the heart of eq. (9)."""
    return math.fsum(math.log1p(c / bandwidth) for c in capacities)


def cumulative_capacity(bandwidth: float, capacities: Sequence[float]) -> float:
    """Eq. (9), the cumulative server law: the capacity of the virtual server that merges S.

    c(S) = (prod(b + c(i)) - b^|S|) / b^(|S|-1)  (the printed denominator b^|S| - 1 is a typo;
    Example 1 divides by 60^2 for three servers), and c(empty) = 0.
    """
    if not capacities:
        return 0.0
    return capacity_from_log_growth(bandwidth, log_growth(bandwidth, capacities))


def capacity_from_log_growth(bandwidth: float, growth: float) -> float:
    """c(S) from ``log_growth``: b * (exp(growth) - 1), inf when it overflows."""
    try:
        return bandwidth * math.expm1(growth)
    except OverflowError:
        return math.inf


def antenna_time_factor(data_size: float, bandwidth: float, capacity: float) -> float:
    """s/b + s/c(S): the time one unit of ratio costs on an antenna whose servers merge to c(S)."""
    return data_size / bandwidth + data_size / capacity


def completion_time(data_size: float, bandwidth: float, capacities: Sequence[float],
                    total_ratio: float, halo: float) -> float:
    """Eq. (10): T(S) = (sum r_i + |S| r_o) (s/b + s/c(S)); eq. (11) is the case sum r_i = 1."""
    factor = antenna_time_factor(data_size, bandwidth, cumulative_capacity(bandwidth, capacities))
    return (total_ratio + len(capacities) * halo) * factor


def halo_ratio(prefetch_ratio: float, selected: int) -> float:
    """The halo each block carries: r_o when the image is split, none when one server takes it all.

    The paper's Example 2 times a lone server on the whole image without prefetch (1.167, not
    (1 + r_o) x 1.167), which is also what a real partition does: an unsplit image needs no halo.
    """
    return prefetch_ratio if selected > 1 else 0.0


def equal_finish_time(data_size: float, halo: float,
                      antennas: Sequence[tuple[float, Sequence[float]]]) -> tuple[float, list[float]]:
    """Eq. (14) for antennas given as (bandwidth, capacities of its servers); see `equal_finish_merged`."""
    return equal_finish_merged(data_size, halo, [(b, cumulative_capacity(b, caps), len(caps))
                                                 for b, caps in antennas])


def equal_finish_merged(data_size: float, halo: float,
                        antennas: Sequence[tuple[float, float, int]]) -> tuple[float, list[float]]:
    """Eq. (14): the common completion time T and each antenna's ratio g_m.

    ``antennas`` lists (bandwidth b_m, merged capacity c(G_m), number of servers n_m); antennas without
    servers get g_m = 0. From T = (g_m + n_m r_o) K_m with K_m = s/b_m + s/c(G_m) and sum g_m = 1:
    T = (1 + r_o sum n_m) / sum(1 / K_m).  A negative g_m means the association is infeasible.
    """
    factors = [antenna_time_factor(data_size, b, c) if n else None for b, c, n in antennas]
    inverse = math.fsum(1.0 / k for k in factors if k is not None)
    blocks = sum(n for _, _, n in antennas)
    if blocks == 0:
        raise ValueError("no server is associated to any antenna")
    total = (1.0 + halo * blocks) / inverse
    ratios = [0.0 if k is None else total / k - n * halo for k, (_, _, n) in zip(factors, antennas, strict=True)]
    return total, ratios


def transfer_schedule(data_size: float, bandwidth: float, capacities: Sequence[float],
                      total_time: float, halo: float) -> list[tuple[float, float]]:
    """TSP, eqs. (12)-(13): (ratio r_i, transfer start tau_i) for servers sent to in this order.

    Each server's data (r_i + r_o) s arrives right after its predecessor's, and it finishes computing
    exactly at ``total_time``.
    """
    schedule = []
    start = 0.0
    for c in capacities:
        received = (total_time - start) / antenna_time_factor(data_size, bandwidth, c)  # r_i + r_o
        schedule.append((received - halo, start))
        start += received * data_size / bandwidth
    return schedule

