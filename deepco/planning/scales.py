"""Split plans across scales in several stages: the row tables and the cost of a chain of levels.

A level (deepco.partition.levels) is the set of tensors alive at once, at several strides; a stage maps one
level to the next. A plan of kind ``scales`` runs stages 1..n on bands of *image* rows (per stage, multiples
of its alignment), so that a participant's band of every tensor lines up with the same image rows. Its
``tensors`` table is per level (0: the image), then per tensor name:
``{"owned": band per participant, "crop": where it starts in the stage's output (made here; [] when
carried), "window": rows the next stage reads (per participant; [] when it reads none)}``. Between stages the
participants exchange, per tensor, the rows of their peers' windows they own; skip tensors stay on the band
(carried) until a stage reads them. Everything here is pure: the staged planner (deepco.planning.staged) does
the glue (sending, association, the search).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from deepco.errors import UserError
from deepco.planning.bands import ownership, receives
from deepco.planning.plan import PlanningError

Interval = tuple[int, int]
Tables = list[dict[str, dict[str, list]]]  # per level, tensor name -> {"owned", "crop", "window"}
MAX_CHAIN_LEVELS = 12  # levels the chain search considers as stage ends (spread over the FLOPs)


def stage_bands(weights: Sequence[float], align: int, height: int) -> list[Interval]:
    """Image-row bands in proportion to ``weights``, on multiples of ``align`` (the last ends at ``height``);
    PlanningError when there are fewer aligned units than participants."""
    units = ownership(list(weights), [-(-height // align)])[0]
    return [(a * align, min(b * align, height)) for a, b in units]


def tables(stages: Sequence, windows: Sequence[Sequence], image: str) -> Tables:
    """The per-level tensor tables (module doc) of ``stages`` (deepco.partition.levels.Stage, from the image)
    whose participants run the StageWindows ``windows[j]`` (per stage, per participant)."""
    levels: Tables = [{image: {"owned": [w.image_rows for w in windows[0]], "crop": [], "window": []}}]
    for stage, ws in zip(stages, windows, strict=True):
        before = levels[-1]
        for t in stage.inputs:
            before[t]["window"] = [w.input_rows[t] for w in ws]
        level = {t: {"owned": [w.output_rows[t] for w in ws], "crop": [w.crop[t][0] for w in ws], "window": []}
                 for t in stage.outputs}
        for t in stage.carried:
            if t == image:
                raise PlanningError("the image itself is kept past the first stage: not planned across scales")
            level[t] = {"owned": list(before[t]["owned"]), "crop": [], "window": []}
        levels.append(level)
    return levels


def halo_bytes(level: dict[str, dict[str, list]], row_bytes: Callable[[str], int], i: int) -> dict[int, int]:
    """Bytes participant ``i`` receives from each peer before the stage after ``level`` (its tensors' tables)."""
    got: dict[int, int] = {}
    for t, table in level.items():
        if not table["window"]:
            continue
        for k, (a, b) in receives([table["owned"]], [[], table["window"]], 0, i).items():
            got[k] = got.get(k, 0) + (b - a) * row_bytes(t)
    return got


def band_bytes(level: dict[str, dict[str, list]], row_bytes: Callable[[str], int], i: int) -> int:
    """Bytes of participant ``i``'s band of every tensor of ``level``."""
    return sum((t["owned"][i][1] - t["owned"][i][0]) * row_bytes(name) for name, t in level.items())


def stage_ends(times: Sequence[float], flops: Sequence[Sequence[int]], level_tables: Tables, speeds: Sequence[float],
               row_bytes: Callable[[str], int], link: float, hop: float, overhead: float,
               lookahead: bool) -> list[list[float]]:
    """When each participant ends each stage (an event simulation): it starts stage j once it has ended stage
    j-1 and every peer's halo rows have come over the server-to-server link (``hop`` per message).
    ``times``: when each has its input; ``flops[j][i]``: participant i's FLOPs of stage j+1."""
    done, ends = list(times), []
    for j, work in enumerate(flops):
        ready = list(done)
        if j or not lookahead:
            for i in range(len(done)):
                for k, nbytes in halo_bytes(level_tables[j], row_bytes, i).items():
                    ready[i] = max(ready[i], done[k] + hop + nbytes / link)
        done = [ready[i] + work[i] / speeds[i] + overhead for i in range(len(done))]
        ends.append(done)
    return ends


def chain_candidates(levels: Sequence, total_flops: int, most: int = MAX_CHAIN_LEVELS) -> list:
    """Up to ``most`` levels (beyond the image) spread evenly over the model's FLOPs, the deepest included."""
    inner = list(levels[1:])
    if len(inner) <= most:
        return inner
    chosen = {inner[-1].index: inner[-1]}
    for q in range(1, most):
        goal = total_flops * q / most
        best = min(inner, key=lambda lv: abs(lv.head_flops - goal))
        chosen.setdefault(best.index, best)
    return [chosen[k] for k in sorted(chosen)]


def best_chain(candidates: Sequence, stage_seconds: Callable[[object | None, object], float]) -> list:
    """The chain of ``candidates`` (levels, in order) from the image to the last one that minimises the sum of
    ``stage_seconds(source, target)`` (source None: the image), by dynamic programming; [] if none is finite."""
    best: list[tuple[float, list]] = []
    for k, target in enumerate(candidates):
        options = [(stage_seconds(None, target), [target])]
        for prev in range(k):
            cost, chain = best[prev]
            if math.isfinite(cost):
                options.append((cost + stage_seconds(candidates[prev], target), [*chain, target]))
        best.append(min(options, key=lambda o: o[0]))
    return best[-1][1] if best and math.isfinite(best[-1][0]) else []


def barrier_seconds(stage, weights: Sequence[float], speeds: Sequence[float], height: int,
                    row_bytes: Callable[[str], int], link: float, hop: float, exchange: bool) -> float:
    """One stage's time for the chain search: the slowest participant's halo (each input tensor's rows it
    does not own, as if every band were the stage's own) plus its compute; inf when it does not fit."""
    try:
        bands = stage_bands(weights, stage.align, height)
        windows = [stage.window(a, b) for a, b in bands]
    except UserError:  # PlanningError, PartitionError: too few aligned rows for these participants
        return math.inf
    worst = 0.0
    for i, w in enumerate(windows):
        seconds = w.flops / speeds[i]
        if exchange:
            (top, bottom), halo = w.image_rows, 0
            for t, (lo, hi) in w.input_rows.items():
                stride = height / max(stage.partitioner.graph.hw[t][0], 1)
                own = (top / stride, bottom / stride)
                halo += (max(0.0, own[0] - lo) + max(0.0, hi - own[1])) * row_bytes(t)
            seconds += (hop + halo / link) if halo else 0.0
        worst = max(worst, seconds)
    return worst
