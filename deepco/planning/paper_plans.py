"""The paper's plans (THREAD, THREAD-SA, single, and the naive ``equal``) as staged plans: their one home.

The paper's algorithms (`deepco.planning.thread`, `deepco.planning.baselines`) decide which servers take part,
on which antenna and in which transfer order, on the abstract instance of the measured rates;
`deepco.planning.rows` then sizes each server's slice of a cut tensor in whole rows on the exact cost model
(every server finishes together). Neither is changed here. This module only writes the result as a
`StagedPlan` of the paper's shape, which the staged runtime executes:

- one split stage from the image to the cut, with lookahead: each server is sent the exact window of the
  image its rows need (the halo travels with the slice);
- the tail on the device;
- participants in band order (top to bottom), their bands of the cut = the paper's rows, their antennas and
  positions in their antenna's sends = the paper's association and transfer order.

Servers the row sizing leaves without a row sit the frame out (they are not participants).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from deepco.planning import make_plan
from deepco.planning.bands import ownership
from deepco.planning.plan import PlanningError
from deepco.planning.rows import Node, RowPlan, SliceBill, abstract_instance, association, equal_rows, size_rows
from deepco.planning.staged import CostModel, Rates, StagedPlan, predict
from deepco.planning.thread import association_steps

ALGORITHMS = ("thread", "thread-sa", "single", "equal")


def slice_bill(costs: CostModel, cut: str) -> Callable[[int, int], SliceBill]:
    """What the staged runtime pays for cut rows [a, b) on one server: its window of the image sent, the
    segment's FLOPs on that window (halo work included), its band of the cut returned."""
    def bill(a: int, b: int) -> SliceBill:
        w = costs.window(None, cut, a, b)
        return SliceBill(w.input_bytes, w.flops, w.output_bytes)

    return bill


def row_plan(costs: CostModel, rates: Rates, servers: Sequence[str], algorithm: str, cut: str) -> RowPlan:
    """The paper's ``algorithm`` on ``servers`` at ``cut``, sized in whole rows of the cut tensor.

    THREAD and THREAD-SA: the association of the paper's plan and of every step of its loop over the number
    of servers (SSP), each sized on the exact cost model; the one that completes first wins. ``single``: the
    paper's plan. ``equal``: every server, equal rows, server k on antenna k mod |A|."""
    if algorithm not in ALGORITHMS:
        raise PlanningError(f"unknown algorithm {algorithm!r} (choose from {', '.join(ALGORITHMS)})")
    if not servers:
        raise PlanningError("no server is left: every server of the cluster is down")
    c = costs.p.cut(cut)
    nodes = [Node(s, rates.server_flops_per_second[s]) for s in servers]
    bandwidths = rates.antenna_bytes_per_second
    bill = slice_bill(costs, cut)
    tail_time = c.tail_flops / rates.device_flops_per_second
    if algorithm == "equal":
        return equal_rows(nodes, bandwidths, c.height, bill, overhead=rates.request_overhead, tail_time=tail_time)
    inst = abstract_instance(nodes, bandwidths, costs.input_bytes, c.head_flops, c.halo / costs.height)
    candidates = [association(make_plan(inst, algorithm), inst)]
    if algorithm in ("thread", "thread-sa"):
        # SSP's loop over the number of servers, judged by the exact cost model instead of eq. (11)/(14)
        candidates += association_steps(inst, algorithm)
    plans = [size_rows(groups, nodes, bandwidths, c.height, bill, overhead=rates.request_overhead,
                       tail_time=tail_time, algorithm=algorithm) for groups in candidates]
    return min(plans, key=lambda pl: pl.completion_time)


def as_staged(rows: RowPlan, costs: CostModel, cut: str) -> StagedPlan:
    """The row plan as a staged plan of the paper's shape (see the module doc); not yet predicted."""
    slices = sorted(rows.slices, key=lambda s: s.start)
    band = [(s.start, s.stop) for s in slices]
    windows = [costs.window(None, cut, a, b) for a, b in band]
    # level 0 must tile the image too (the servers check the tables); with lookahead nobody exchanges it
    image = ownership([b - a for a, b in band], [costs.height])[0]
    sent = [w.input_rows for w in windows]
    return StagedPlan(rows.algorithm, "split", servers=[s.name for s in slices], antennas=[s.antenna for s in slices],
                      order=[s.order for s in slices], levels=[cut], bands=[image, band], windows=[sent, list(sent)],
                      crops=[[], [w.crop[0] for w in windows]], lookahead=True, tail=None)


def paper_plan(costs: CostModel, rates: Rates, servers: Sequence[str], algorithm: str,
               cut: str | None = None) -> StagedPlan:
    """The paper's plan for ``algorithm`` on ``servers`` as a predicted StagedPlan, at ``cut`` or (None) at the
    candidate cut of least predicted frame time (`deepco.planning.staged.predict`; ties: the later cut).
    ``breakdown["rows"]`` keeps the row plan it came from."""
    cuts = [costs.p.cut(cut).name] if cut is not None else [c.name for c in costs.cuts]
    best: StagedPlan | None = None
    for name in cuts:
        rows = row_plan(costs, rates, servers, algorithm, name)
        plan = as_staged(rows, costs, name)
        breakdown = predict(plan, costs, rates) | {"rows": rows.to_dict()}
        plan = replace(plan, breakdown=breakdown, predicted=breakdown["frame"])
        if best is None or plan.predicted <= best.predicted:
            best = plan
    assert best is not None
    return best


__all__ = ["ALGORITHMS", "as_staged", "paper_plan", "row_plan", "slice_bill"]
