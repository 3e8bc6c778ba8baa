"""Staged execution plans: local, offload, the paper's THREAD, MoDNN and fused hybrids as one kind of plan.

A plan is data (`StagedPlan`, JSON by `to_dict`). Its ``kind`` is
- ``local``: the device runs the whole model;
- ``offload``: one server runs the whole model, the device sends pixels and gets the output;
- ``split``: servers (the *participants*, in band order top to bottom) hold disjoint bands of a sequence of
  levels (level 0: the image; level j: the j-th chosen cut tensor). Segment j maps level j-1 to level j.
  With ``lookahead`` the device sends every participant the exact window of the image its first segment
  needs (THREAD's data lookahead: the halo travels with the slice, nobody waits for anybody); without it
  the device sends disjoint bands and the servers exchange the first halo too (MoDNN). Before every later
  segment the servers exchange only the halo rows, directly server to server. After the last level the
  bands are gathered on the device (``tail`` None), which runs the rest of the model, or on one
  participant (``tail`` its name), which runs the rest there and returns the model's output only.
  One split stage with the tail on the device is the paper's THREAD; a stage per block without lookahead
  is MoDNN; k blocks per stage with the tail on the strongest server is a fused hybrid.
- ``scales``: a split whose levels hold several tensors (a U-Net's or a detector's scales, skips included),
  its bands image rows and its per-tensor tables in ``tensors`` (deepco.planning.scales).

The cost model (`predict`) is an event simulation of one frame on the measured rates (`Rates`): the
device's CPU marshals each message (it is the bottleneck of a 0.1-core camera), each antenna sends its
participants' inputs one after another in plan order, every server computes as soon as it has its window,
exchanges cross the server-to-server links, and the tail runs where the plan puts it. `search` finds the
fastest plan: for every number of participants (strongest first, THREAD's association and transfer order),
tail placement and lookahead, a dynamic programme over the cut points picks the stage boundaries, and the
exact simulation ranks the candidates (local and every offload included), then the band sizes are refined
so that the first stage's participants finish together. `throughput` is the matching model of sustained
frames per second with frames pipelined (every resource's busy time per frame), and `pipelined` the latency
and fps of a given number of frames in flight.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

from deepco.errors import UserError
from deepco.planning import level_balance, scales
from deepco.planning import overlap as overlapping
from deepco.planning.bands import ownership, receives
from deepco.planning.pacing import pace
from deepco.planning.plan import PlanningError

Interval = tuple[int, int]
DEVICE = "@device"  # the device as a participant of a split stage: its band needs no transfer
MIN_STAGE_FLOPS = 0.01  # a level whose head has less than this share of the model's FLOPs is no stage boundary
REFINE_STEPS = 12


@dataclass
class Rates:
    """What the device measured (seconds, bytes, FLOPs)."""

    server_flops_per_second: dict[str, float]
    antenna_bytes_per_second: list[float]
    request_overhead: float  # one request's fixed cost, device to server and back (Echo of 1 byte)
    device_flops_per_second: float
    peer_bytes_per_second: float  # server to server (measured: servers probe each other)
    peer_overhead: float  # one server-to-server message's fixed cost
    device_seconds_per_byte: float = 0.0  # the device's own CPU time to marshal one byte sent or received
    paced: bool = False
    # fixed cost of one server step (a stage, a gather, an offload): the message, the ORT call and Python
    # under the server's CPU share; fitted at setup from timed frames (deepco.planning.calibration.calibrate)
    step_overhead: float = 0.0
    # how many times longer than its antenna's rate says the rest of a streamed window (`streamed`) takes to
    # reach its server: the server takes it on the CPU quota it computes its first sub-band on, and the
    # antenna waits for it meanwhile; fitted from frames (deepco.planning.links), 1 until then
    rest_slowdown: float = 1.0

    def to_dict(self) -> dict:
        """JSON form."""
        return asdict(self)

    def speed(self, participant: str) -> float:
        """FLOP/s of a participant of a split stage: a server, or the device itself (``DEVICE``)."""
        return self.device_flops_per_second if participant == DEVICE else self.server_flops_per_second[participant]


@dataclass(frozen=True)
class StagedPlan:
    """One frame's execution plan (see the module doc). Row tables are per level, then per participant. A value:
    a plan re-predicted, renamed or given its calibration report is a new plan (`dataclasses.replace`)."""

    algorithm: str
    kind: str  # "local" | "offload" | "split" | "round-robin" (whole frames dealt to ``servers`` in turn) | "scales"
    # (a split whose levels hold several tensors: deepco.planning.scales)
    servers: list[str] = field(default_factory=list)  # participants, band order
    antennas: list[int] = field(default_factory=list)  # antenna of each participant
    order: list[int] = field(default_factory=list)  # position of each participant in its antenna's sends
    levels: list[str] = field(default_factory=list)  # cut names of levels 1..n
    bands: list[list[Interval]] = field(default_factory=list)  # levels 0..n
    windows: list[list[Interval]] = field(default_factory=list)  # levels 0..n (level 0: what the device sends)
    crops: list[list[int]] = field(default_factory=list)  # levels 0..n (level 0 unused)
    lookahead: bool = True
    tail: str | None = None  # participant that gathers and runs the rest; None: the device
    # kind "scales": per level (0: the image), tensor name -> {"owned": band per participant, "crop": per
    # participant ([] when carried), "window": rows the next stage reads per participant ([] if none)}
    # (deepco.planning.scales); bands and windows are then image rows, per stage
    tensors: list = field(default_factory=list)
    # per level (0..n) and participant, its segment's parts in run order (deepco.planning.overlap: the interior
    # while the halo is in flight, then the borders), each ((rows), (window), crop); [] runs it once
    overlap: list = field(default_factory=list)
    # a split's crops and FLOPs are those of runs on open rows (deepco.partition.open_rows: a participant's model
    # of a level pads no side of its window that is not at the level's border); False for a plan saved before
    # open rows existed, which runs the models' own nodes, as its crops say
    open_rows: bool = True
    predicted: float = 0.0
    breakdown: dict = field(default_factory=dict)
    # set by calibration (`deepco.planning.calibration.fidelity`): measured against predicted, and why when
    # the prediction does not hold
    fidelity: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON form (tuples become lists)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> StagedPlan:
        """Inverse of `to_dict`."""
        tensors = data.get("tensors", [])
        if isinstance(tensors, dict) and tensors:  # its last level's only: no image table to run the first stage on
            raise ValueError("a plan across scales saved before stages across scales had per-level tables; plan "
                             "again")
        tensors = [{name: {"owned": [tuple(iv) for iv in t["owned"]], "crop": list(t["crop"]),
                           "window": [tuple(iv) for iv in t.get("window", [])]} for name, t in level.items()}
                   for level in tensors or []]
        overlap = [[[((int(r[0]), int(r[1])), (int(w[0]), int(w[1])), int(c)) for r, w, c in parts]
                     for parts in level] for level in data.get("overlap", [])]
        return cls(**data | {"open_rows": bool(data.get("open_rows", False)),
                              "bands": [[tuple(iv) for iv in level] for level in data.get("bands", [])],
                              "windows": [[tuple(iv) for iv in level] for level in data.get("windows", [])],
                              "tensors": tensors, "overlap": overlap})

    def describe(self) -> str:
        """One line: what runs where."""
        if self.kind == "local":
            return f"{self.algorithm}: the whole model on the device"
        if self.kind == "offload":
            return f"{self.algorithm}: the whole model on {self.servers[0]} (antenna {self.antennas[0]})"
        if self.kind == "round-robin":
            return f"{self.algorithm}: whole frames dealt in turn to {', '.join(self.servers)}"
        who = ", ".join(f"{s} (antenna {m})" if s != DEVICE else "the device" for s, m in
                        zip(self.servers, self.antennas, strict=True))
        stages = " | ".join(self.levels)
        where = f"tail on {self.tail}" if self.tail else "tail on the device"
        how = "lookahead" if self.lookahead else "bands exchanged from the image on"
        if any(streamed(self)):
            how += ", windows streamed in two sub-bands"
        if self.kind == "scales":
            return (f"{self.algorithm}: split across scales over {who}, stages ending at levels {stages} "
                    f"({len(self.tensors[-1]) if self.tensors else 0} tensors at the last), {how}, {where}")
        return (f"{self.algorithm}: split over {who}, stages ending at {stages}, {how}, {where}")

    def brief(self) -> str:
        """A few words for the one line a replan or a switch prints, e.g. ``offload to s1``, ``split over 3
        servers, rows 20/22/14, tail on s0``: the rows of each band of the last level, since a paper plan that
        adapts keeps its servers and moves its rows (`describe` says the rest)."""
        if self.kind == "local":
            return "local"
        if self.kind == "offload":
            return f"offload to {self.servers[0]}"
        if self.kind == "round-robin":
            return f"round-robin over {len(self.servers)} servers"
        onto = f"{len(self.servers)} servers" if DEVICE not in self.servers else \
            f"{len(self.servers) - 1} servers and the device"
        rows = f", rows {'/'.join(str(b - a) for a, b in self.bands[-1])}" if self.bands else ""
        stages = f", {len(self.levels)} stages" if len(self.levels) > 1 else ""
        return f"{self.kind} over {onto}{rows}{stages}" + (f", tail on {self.tail}" if self.tail else "")

    def brief_beside(self, other: StagedPlan) -> str:
        """`brief`, with the antennas where it would read as ``other``'s (e.g. an offload moved to another antenna:
        ``offload to s1 over antenna 1``), so that a switch or a trial line never names two plans alike."""
        mine = self.brief()
        if mine != other.brief() or self.antennas == other.antennas:
            return mine
        used = sorted({m for m in self.antennas if m >= 0})
        return f"{mine} over antenna{'s' if len(used) > 1 else ''} {', '.join(map(str, used))}"


def same_plan(a: dict, b: dict) -> bool:
    """Whether two plans (`StagedPlan.to_dict` form) run the same way: equal in everything but their name,
    prediction and calibration report."""
    volatile = {"algorithm", "predicted", "breakdown", "fidelity"}
    return {k: v for k, v in a.items() if k not in volatile} == {k: v for k, v in b.items() if k not in volatile}


class CostModel:
    """The model's exact costs for the planner: segments between any two cut points, cached.

    ``partitioner`` is a deepco.partition.Partitioner of the model the device runs (pixel input included)."""

    def __init__(self, partitioner, input_bytes: int, output_bytes: int):
        self.p = partitioner
        self.total_flops = partitioner.total_flops
        self.input_bytes = input_bytes
        self.output_bytes = output_bytes
        self.cuts = [c for c in partitioner.cuts if c.head_flops >= MIN_STAGE_FLOPS * self.total_flops]
        if not self.cuts:
            raise PlanningError("the model has no cut point with enough work before it to split")
        self._segments: dict[tuple[str, str], object] = {}
        self._windows: dict[tuple[str, str, int, int], object] = {}
        self._stages: dict[tuple, list] = {}
        self._stage_windows: dict[tuple, object] = {}
        self._balanced: dict[tuple, list[Interval]] = {}
        self.level = self._deepest_level()
        self.height = partitioner.height
        self.image_row_bytes = input_bytes // partitioner.height

    def segment(self, source: str | None, target: str):
        """The Segment from cut ``source`` (None: the image) to cut ``target``."""
        key = (source or "", target)
        if key not in self._segments:
            through = [] if source is None else [source]
            self._segments[key] = self.p.segments(target, models=False, through=through)[-1]
        return self._segments[key]

    def window(self, source: str | None, target: str, a: int, b: int, within: Interval | None = None):
        """The segment's Window for output rows [a, b) as the staged runtime runs it: on open rows
        (deepco.partition.open_rows), the sides of its own window, or of ``within`` (a participant's window of
        the level, whose runs of it share one model), that are not at the level's border open."""
        key = (source or "", target, a, b, within)
        if key not in self._windows:
            self._windows[key] = self.segment(source, target).open_window(a, b, within)
        return self._windows[key]

    def balanced(self, source: str | None, target: str, speeds: Sequence[float]) -> list[Interval]:
        """Bands of level ``target`` for participants of FLOP rates ``speeds`` (band order) on which they
        compute segment ``source`` -> ``target``, halo included, in equal time as near as whole rows allow
        (`deepco.planning.level_balance`), starting from bands in proportion to ``speeds``."""
        key = (source or "", target, tuple(speeds))
        if key not in self._balanced:
            height = self.height_of(target)
            self._balanced[key] = level_balance.balanced(
                lambda i, a, b: self.window(source, target, a, b).flops / speeds[i], height,
                ownership(list(speeds), [height])[0])
        return self._balanced[key]

    def _deepest_level(self):
        """The last level (deepco.partition.levels: the tensors alive at once, at several scales), if its head
        holds more of the model's FLOPs than any single-tensor cut's (a U-Net or a detector, whose skips end
        the single-tensor cuts early); else None."""
        try:
            levels = self.p.levels
            deepest = max(c.head_flops for c in self.p.cuts)
            if len(levels) < 2 or levels[-1].head_flops <= deepest:
                return None
            self.p.stages([levels[-1].index], models=False)
            return levels[-1]
        except UserError:  # the partitioner's PartitionError: no stage to it, the single-tensor cuts are what there is
            return None

    def stages(self, levels: Sequence[str]) -> list:
        """The stages (deepco.partition.levels.Stage) from the image through the levels named ``levels``."""
        key = tuple(levels)
        if key not in self._stages:
            self._stages[key] = self.p.stages(list(levels), models=False)
        return self._stages[key]

    def stage_window(self, levels: Sequence[str], j: int, top: int, bottom: int):
        """The StageWindow of image rows [top, bottom) of stage ``j`` (1..) of the chain ``levels``."""
        key = (*levels[:j], top, bottom)  # a stage depends only on its two levels, and those on the chain's start
        if key not in self._stage_windows:
            self._stage_windows[key] = self.stages(levels)[j - 1].window(top, bottom)
        return self._stage_windows[key]

    def tensor_row_bytes(self, tensor: str) -> int:
        """Bytes of one row of a tensor of a level."""
        g = self.p.graph
        return self.image_row_bytes if tensor == g.input_name else g.shapes[tensor][1] * g.hw[tensor][1] * 4

    def height_of(self, level: str | None) -> int:
        """Rows of a level (None: the image)."""
        return self.height if level is None else self.p.cut(level).height

    def row_bytes(self, level: str | None) -> int:
        """Bytes of one row of a level."""
        if level is None:
            return self.image_row_bytes
        c = self.p.cut(level)
        return c.channels * c.width * self.p.graph.feature_itemsize

    def tail_flops(self, level: str) -> int:
        """FLOPs after the cut ``level``, or after a level of several tensors of that name (a plan across scales)."""
        try:
            return self.p.cut(level).tail_flops
        except UserError:
            return self.total_flops - self.p.level(level).head_flops


def tables(costs: CostModel, levels: Sequence[str], weights: Sequence[float],
           lookahead: bool, speeds: Sequence[float] = ()) -> tuple[list, list, list]:
    """(bands, windows, crops) for every level; windows[0] is what the device sends each participant. Bands in
    proportion to ``weights``; with ``speeds`` (the participants' FLOP rates), those of the levels after the
    first sized so that every participant computes its segment in equal time, halo included
    (`CostModel.balanced`)."""
    names: list[str | None] = [None, *levels]
    heights = [costs.height_of(n) for n in names]
    bands = ownership(weights, heights)
    for j in range(2, len(names)) if speeds else ():
        bands[j] = costs.balanced(names[j - 1], names[j], speeds)
    windows: list[list[Interval]] = [[]]
    crops: list[list[int]] = [[]]
    for j in range(1, len(names)):
        ws = [costs.window(names[j - 1], names[j], a, b) for a, b in bands[j]]
        windows.append([w.input_rows for w in ws])
        crops.append([w.crop[0] for w in ws])
    windows[0] = list(windows[1]) if lookahead else list(bands[0])
    return bands, windows, crops


def _send_schedule(plan: StagedPlan, sizes: Sequence[int], rates: Rates,
                   follow: Sequence[int] = ()) -> tuple[list[float], list[float]]:
    """When each participant's first message has arrived, and when its whole window has: the device's CPU
    marshals messages one at a time in send order (position, then antenna), each antenna sends its messages
    one after another, and a first message only once the one before it on the antenna was acknowledged (as
    the device's sender does: a request's round trip, ``request_overhead``, lies between two servers' windows).
    ``sizes``: each participant's first message; ``follow``: the bytes of its window that follow it (a
    streamed window, `streamed`; none by default), sent once every first message has gone, back to back, each
    ``rates.rest_slowdown`` times as long on its antenna as its bytes alone take."""
    follow = list(follow) or [0] * len(plan.servers)
    cpu = 0.0
    free = [0.0] * len(rates.antenna_bytes_per_second)
    arrived = [0.0] * len(plan.servers)
    whole = [0.0] * len(plan.servers)
    order = [i for i in sorted(range(len(plan.servers)), key=lambda i: (plan.order[i], plan.antennas[i]))
             if plan.servers[i] != DEVICE]
    for i, nbytes, times in [(i, sizes[i], arrived) for i in order] + [(i, follow[i], whole) for i in order
                                                                        if follow[i]]:
        cpu += nbytes * rates.device_seconds_per_byte
        m = plan.antennas[i]
        start = max(free[m], cpu)
        free[m] = start + nbytes / rates.antenna_bytes_per_second[m] * (1.0 if times is arrived else
                                                                          rates.rest_slowdown)
        times[i] = free[m] + rates.request_overhead
        if times is arrived:
            free[m] = times[i]
    for i, name in enumerate(plan.servers):
        if name == DEVICE:  # the device computes its own band once it has sent the others'
            arrived[i] = cpu
        if not follow[i]:
            whole[i] = arrived[i]
    return arrived, whole


def sends(plan: StagedPlan, costs: CostModel, rates: Rates) -> tuple[list[float], list[float]]:
    """A split's or a plan across scales' `_send_schedule`: when each participant's first message of the image
    has arrived, and when its whole window has (what the device's runner measures as ``received``)."""
    row = costs.row_bytes(None)
    if plan.kind == "scales":
        return _send_schedule(plan, [(b - a) * row for a, b in plan.windows[0]], rates)
    follow = [0 if r is None else (r[1] - r[0]) * row for r in streamed(plan)]
    sizes = [(b - a) * row - f for (a, b), f in zip(plan.windows[0], follow, strict=True)]
    return _send_schedule(plan, sizes, rates, follow)


def streamed(plan: StagedPlan) -> list[Interval | None]:
    """Per participant, the rows of its window of the image that the device sends after its first message (its
    first segment run in sub-bands, `deepco.planning.overlap.rest`), or None: sent whole."""
    if plan.kind != "split" or not plan.lookahead or not plan.overlap:
        return [None] * len(plan.servers)
    return [None if s == DEVICE else overlapping.rest(_parts(plan, 1, i), plan.windows[0][i])
            for i, s in enumerate(plan.servers)]


def steps(plan: StagedPlan) -> int:
    """Server steps on a frame's critical path, each paying ``Rates.step_overhead``."""
    if plan.kind == "local":
        return 0
    if plan.kind == "offload":
        return 1
    return len(plan.levels) + (1 if plan.tail else 0)


def models_per_server(plan: StagedPlan) -> dict[str, int]:
    """Model slots ``plan`` takes on each server (`deepco serve --max-models`): the whole model for offload and
    each round-robin server, one model per stage on every server of a split, and one more where a server runs
    the tail."""
    if plan.kind in ("offload", "round-robin"):
        return dict.fromkeys(plan.servers, 1)
    slots = {s: len(plan.levels) for s in plan.servers if s != DEVICE}
    if plan.tail is not None:
        slots[plan.tail] += 1
    return slots


def split_shares(plan: StagedPlan, costs: CostModel) -> dict[str, float]:
    """Shares of the model's FLOPs (0..1) that run on row bands: ``plan`` (its split stages; 0 for the
    others), the deepest single-tensor cut (what split plans can reach today), and stages across scales
    (levels of several tensors: deepco.partition.levels, where a U-Net's or a detector's skips stay alive)."""
    total = costs.total_flops or 1
    deepest = max(c.head_flops for c in costs.p.cuts)
    planned = {"split": lambda: costs.p.cut(plan.levels[-1]).head_flops,
               "scales": lambda: costs.p.level(plan.levels[-1]).head_flops}.get(plan.kind, lambda: 0)()
    return {"plan": planned / total, "single_tensor_cuts": deepest / total, "across_scales": costs.p.split_share()}


def predict(plan: StagedPlan, costs: CostModel, rates: Rates) -> dict:
    """Predicted timeline of one frame (seconds): ``frame`` and its parts."""
    out_bytes = costs.output_bytes
    if plan.kind == "local":
        compute = costs.total_flops / rates.device_flops_per_second
        return {"frame": compute, "device_compute": compute}
    if plan.kind == "round-robin":  # a frame is an offload to one of the servers: the mean of theirs
        frames = [predict(offload_plan_on(s, m), costs, rates)["frame"]
                  for s, m in zip(plan.servers, plan.antennas, strict=True)]
        return {"frame": sum(frames) / len(frames), "per_server": frames}
    if plan.kind == "offload":
        name, m = plan.servers[0], plan.antennas[0]
        arrive = _send_schedule(plan, [costs.input_bytes], rates)[0][0]
        compute = costs.total_flops / rates.server_flops_per_second[name] + rates.step_overhead
        back = out_bytes / rates.antenna_bytes_per_second[m] + out_bytes * rates.device_seconds_per_byte
        return {"frame": arrive + compute + back, "transfer": arrive, "compute": compute, "return": back}
    if plan.kind == "scales":
        return _predict_scales(plan, costs, rates)
    n = len(plan.servers)
    names: list[str | None] = [None, *plan.levels]
    speed = [rates.speed(s) for s in plan.servers]
    first, arrived = sends(plan, costs, rates)
    done = list(first)
    link, hop = rates.peer_bytes_per_second, rates.peer_overhead
    stages = []
    for j in range(1, len(names)):
        halo = list(arrived) if j == 1 else [0.0] * n  # a streamed window's rest, to the first stage, is a halo
        if j > 1 or not plan.lookahead:
            row = costs.row_bytes(names[j - 1])
            for i in range(n):
                for k, (a, b) in receives(plan.bands, plan.windows, j - 1, i).items():
                    halo[i] = max(halo[i], done[k] + hop + (b - a) * row / link)
        done = [_stage_done(plan, costs, j, i, done[i], halo[i], speed[i], rates.step_overhead) for i in range(n)]
        stages.append(max(done))
    last = plan.levels[-1]
    row = costs.row_bytes(last)
    tail_flops = costs.tail_flops(last)
    if plan.tail is None:
        backs = []
        for i in range(n):
            if plan.servers[i] == DEVICE:
                backs.append(done[i])
                continue
            nbytes = (plan.bands[-1][i][1] - plan.bands[-1][i][0]) * row
            backs.append(done[i] + rates.request_overhead
                         + nbytes / rates.antenna_bytes_per_second[plan.antennas[i]])
        received = max(backs) + sum((b - a) * row for (a, b), s in zip(plan.bands[-1], plan.servers, strict=True)
                                    if s != DEVICE) * rates.device_seconds_per_byte
        tail = tail_flops / rates.device_flops_per_second
        return {"frame": received + tail, "arrived": arrived, "stages": stages, "gathered": received, "tail": tail}
    c = plan.servers.index(plan.tail)
    gathered = done[c]
    for i in range(n):
        if i != c:
            gathered = max(gathered, done[i] + hop + (plan.bands[-1][i][1] - plan.bands[-1][i][0]) * row / link)
    tail = tail_flops / speed[c] + rates.step_overhead
    back = rates.request_overhead + out_bytes / rates.antenna_bytes_per_second[plan.antennas[c]]
    return {"frame": gathered + tail + back, "arrived": arrived, "stages": stages, "gathered": gathered,
            "tail": tail, "return": back}


def _parts(plan: StagedPlan, j: int, i: int) -> list:
    """Participant ``i``'s parts of segment ``j`` (`StagedPlan.overlap`; [] when it runs once)."""
    return plan.overlap[j][i] if plan.overlap and j < len(plan.overlap) else []


def _stage_done(plan: StagedPlan, costs: CostModel, j: int, i: int, own: float, halo: float, speed: float,
                overhead: float) -> float:
    """When participant ``i`` ends segment ``j``: own rows ready at ``own``, the halo at ``halo``
    (`deepco.planning.overlap.finish`, with or without parts)."""
    names: list[str | None] = [None, *plan.levels]
    whole = costs.window(names[j - 1], names[j], *plan.bands[j][i]).flops / speed
    parts = _parts(plan, j, i)
    if not parts:
        return overlapping.finish(own, halo, whole, None, 0.0, 1, overhead)
    seconds = [costs.window(names[j - 1], names[j], *rows, plan.windows[j][i]).flops / speed for rows, _, _ in parts]
    return overlapping.finish(own, halo, whole, seconds[0], sum(seconds[1:]), len(parts), overhead)


def _stage_work(plan: StagedPlan, costs: CostModel, j: int, i: int) -> tuple[int, float]:
    """(FLOPs, seconds of extra ORT runs) of participant ``i``'s segment ``j``: its parts' or its band's."""
    names: list[str | None] = [None, *plan.levels]
    parts = _parts(plan, j, i)
    if not parts:
        return costs.window(names[j - 1], names[j], *plan.bands[j][i]).flops, 0.0
    flops = sum(costs.window(names[j - 1], names[j], *rows, plan.windows[j][i]).flops for rows, _, _ in parts)
    return flops, (len(parts) - 1) * overlapping.PART_OVERHEAD


def _scales_work(plan: StagedPlan, costs: CostModel) -> list[list[int]]:
    """FLOPs of every stage (rows) of a plan across scales, per participant."""
    return [[costs.stage_window(plan.levels, j, *band).flops for band in plan.bands[j]]
            for j in range(1, len(plan.levels) + 1)]


def _predict_scales(plan: StagedPlan, costs: CostModel, rates: Rates) -> dict:
    """`predict` of a plan across scales (deepco.planning.scales): windows of the image sent, stages run with
    each tensor's halo exchanged between them, then every tensor's bands returned to the device, which runs
    the rest, or gathered on the ``tail`` participant, which runs it there."""
    arrived = sends(plan, costs, rates)[0]
    speeds = [rates.speed(s) for s in plan.servers]
    rb = costs.tensor_row_bytes
    ends = scales.stage_ends(arrived, _scales_work(plan, costs), plan.tensors, speeds, rb, rates.peer_bytes_per_second,
                             rates.peer_overhead, rates.step_overhead, plan.lookahead)
    done, last = ends[-1], plan.tensors[-1]
    rest = costs.total_flops - costs.p.level(plan.levels[-1]).head_flops
    stages = [max(e) for e in ends]
    if plan.tail is None:
        sizes = [scales.band_bytes(last, rb, i) for i in range(len(done))]
        backs = [done[i] + rates.request_overhead + sizes[i] / rates.antenna_bytes_per_second[plan.antennas[i]]
                 for i in range(len(done))]
        received = max(backs) + sum(sizes) * rates.device_seconds_per_byte
        tail = rest / rates.device_flops_per_second
        return {"frame": received + tail, "arrived": arrived, "stages": stages, "gathered": received, "tail": tail}
    c = plan.servers.index(plan.tail)
    gathered = max(done[i] + (0.0 if i == c else rates.peer_overhead + scales.band_bytes(last, rb, i)
                              / rates.peer_bytes_per_second) for i in range(len(done)))
    tail = rest / speeds[c] + rates.step_overhead
    back = rates.request_overhead + costs.output_bytes / rates.antenna_bytes_per_second[plan.antennas[c]]
    return {"frame": gathered + tail + back, "arrived": arrived, "stages": stages, "gathered": gathered,
            "tail": tail, "return": back}


def _scales_busy(plan: StagedPlan, costs: CostModel, rates: Rates) -> dict[str, float]:
    """`throughput`'s busy time per frame of every resource for a plan across scales."""
    bw, rb = rates.antenna_bytes_per_second, costs.tensor_row_bytes
    rest = costs.total_flops - costs.p.level(plan.levels[-1]).head_flops
    work = _scales_work(plan, costs)
    busy = {"device": 0.0 if plan.tail else rest / rates.device_flops_per_second}
    for i, s in enumerate(plan.servers):
        a, b = plan.windows[0][i]
        nbytes = (b - a) * costs.row_bytes(None) + (0 if plan.tail else scales.band_bytes(plan.tensors[-1], rb, i))
        busy["device"] += nbytes * rates.device_seconds_per_byte
        key = f"antenna {plan.antennas[i]}"
        busy[key] = busy.get(key, 0.0) + nbytes / bw[plan.antennas[i]]
        busy[s] = sum(w[i] for w in work) / rates.speed(s) + len(work) * rates.step_overhead
        if plan.tail == s:
            busy[s] += rest / rates.speed(s) + rates.step_overhead
    return busy


def throughput(plan: StagedPlan, costs: CostModel, rates: Rates) -> float:
    """Predicted sustained frames per second with frames pipelined: 1 / the busiest resource's time per frame
    (the device's CPU, each antenna, each server). A server's time counts its FLOPs and the fixed cost of
    every step it takes (``Rates.step_overhead``: its own message handling and ORT call, which pipelining
    does not hide; a ResNet-50 plan of 16 stages measured 0.29 fps where 0.79 was predicted without it)."""
    busy: dict[str, float] = {"device": 0.0}
    bw = rates.antenna_bytes_per_second
    if plan.kind == "local":
        return rates.device_flops_per_second / costs.total_flops
    if plan.kind == "round-robin":
        return round_robin_fps(costs, rates, plan.servers)
    if plan.kind == "offload":
        s, m = plan.servers[0], plan.antennas[0]
        busy["device"] = costs.input_bytes * rates.device_seconds_per_byte
        busy[f"antenna {m}"] = costs.input_bytes / bw[m]
        busy[s] = costs.total_flops / rates.server_flops_per_second[s] + rates.step_overhead
        return 1.0 / max(busy.values())
    if plan.kind == "scales":
        return 1.0 / max(_scales_busy(plan, costs, rates).values())
    names: list[str | None] = [None, *plan.levels]
    for i, s in enumerate(plan.servers):
        work = [_stage_work(plan, costs, j, i) for j in range(1, len(names))]
        flops, extra = sum(f for f, _ in work), sum(e for _, e in work)
        if s == DEVICE:
            busy["device"] += flops / rates.device_flops_per_second
            continue
        a, b = plan.windows[0][i]
        nbytes = (b - a) * costs.row_bytes(None)
        busy["device"] += nbytes * rates.device_seconds_per_byte
        key = f"antenna {plan.antennas[i]}"
        busy[key] = busy.get(key, 0.0) + nbytes / bw[plan.antennas[i]]
        taken = len(plan.levels)
        if plan.tail == s:
            flops += costs.tail_flops(plan.levels[-1])
            taken += 1
        busy[s] = flops / rates.server_flops_per_second[s] + taken * rates.step_overhead + extra
    if plan.tail is None:
        busy["device"] += costs.tail_flops(plan.levels[-1]) / rates.device_flops_per_second
    return 1.0 / max(busy.values())


def pipelined(plan: StagedPlan, costs: CostModel, rates: Rates, depth: int) -> tuple[float, float]:
    """Predicted ``(latency, fps)`` of ``plan`` with ``depth`` frames in flight, a new frame entering as one
    leaves (`deepco run --depth`). Alone a frame takes L (``plan.predicted``, `predict`'s frame time); the
    busiest resource takes B = 1 / `throughput` per frame. ``depth`` frames circulate through those
    resources, so the fps is min(depth / L, 1 / B) and each frame takes depth / fps = max(L, depth * B):
    once the busiest resource is saturated, more frames in flight only queue in front of it."""
    if depth < 1:
        raise PlanningError(f"frames in flight must be >= 1, got {depth}")
    alone, busiest = plan.predicted, 1.0 / throughput(plan, costs, rates)
    fps = min(depth / alone, 1.0 / busiest) if alone > 0 else 1.0 / busiest
    return max(alone, depth * busiest), fps


def round_robin_fps(costs: CostModel, rates: Rates, servers: Sequence[str]) -> float:
    """Frames per second of whole frames dealt to ``servers`` in turn: each server gets 1/n of the frames,
    so the slowest one (its FLOPs and its one step) sets the pace (and the antennas and the device's CPU
    bound it)."""
    n = len(servers)
    compute = n / max(costs.total_flops / rates.server_flops_per_second[s] + rates.step_overhead for s in servers)
    link = sum(rates.antenna_bytes_per_second) / costs.input_bytes
    cpu = math.inf if rates.device_seconds_per_byte <= 0 else 1.0 / (costs.input_bytes * rates.device_seconds_per_byte)
    return min(compute, link, cpu)


# ---- search --------------------------------------------------------------------------------------------

def _participants(rates: Rates, servers: Sequence[str]) -> list[str]:
    """Servers strongest first (ties: the given order)."""
    return sorted(servers, key=lambda s: -rates.server_flops_per_second[s])


def _associate(chosen: Sequence[str], rates: Rates, sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """(antenna, position) per participant: strongest first, each onto the antenna whose queue of sends
    ends earliest (THREAD's association of a selection, weighted by the bytes each one is sent)."""
    clock = [0.0] * len(rates.antenna_bytes_per_second)
    antennas, order, count = [], [], [0] * len(clock)
    for i, name in enumerate(chosen):
        if name == DEVICE:  # sends nothing
            antennas.append(-1)
            order.append(-1)
            continue
        m = min(range(len(clock)), key=lambda m: (clock[m] + sizes[i] / rates.antenna_bytes_per_second[m], m))
        clock[m] += sizes[i] / rates.antenna_bytes_per_second[m]
        antennas.append(m)
        order.append(count[m])
        count[m] += 1
    return antennas, order


def local_plan(costs: CostModel, rates: Rates) -> StagedPlan:
    """The device alone."""
    plan = StagedPlan("local", "local")
    return _finish(plan, costs, rates)


def offload_plan_on(server: str, antenna: int) -> StagedPlan:
    """The whole model on ``server`` over ``antenna`` (not yet predicted)."""
    return StagedPlan("offload", "offload", servers=[server], antennas=[antenna], order=[0])


def _fastest_antenna(rates: Rates) -> int:
    return max(range(len(rates.antenna_bytes_per_second)), key=lambda m: rates.antenna_bytes_per_second[m])


def offload_plan(costs: CostModel, rates: Rates, server: str) -> StagedPlan:
    """The whole model on ``server``, over the fastest antenna."""
    return _finish(offload_plan_on(server, _fastest_antenna(rates)), costs, rates)


def round_robin_plan(costs: CostModel, rates: Rates, servers: Sequence[str]) -> StagedPlan:
    """Whole frames dealt to ``servers`` in turn, each over an antenna of its own where there are enough."""
    antennas = [k % len(rates.antenna_bytes_per_second) for k in range(len(servers))]
    plan = StagedPlan("round-robin", "round-robin", servers=list(servers), antennas=antennas,
                      order=[0] * len(servers))
    return _finish(plan, costs, rates)


def best_offload(costs: CostModel, rates: Rates, servers: Sequence[str]) -> StagedPlan:
    """Offload to the server that finishes a frame first."""
    return min((offload_plan(costs, rates, s) for s in servers), key=lambda p: p.predicted)


def _finish(plan: StagedPlan, costs: CostModel, rates: Rates) -> StagedPlan:
    breakdown = predict(plan, costs, rates)
    return replace(plan, breakdown=breakdown, predicted=breakdown["frame"])


def split_plan(costs: CostModel, rates: Rates, chosen: Sequence[str], levels: Sequence[str],
               lookahead: bool, tail: str | None, weights: Sequence[float] | None = None,
               algorithm: str = "auto", stream: bool = True, balance: bool = True) -> StagedPlan | None:
    """A split plan over ``chosen`` (band order) at ``levels``; None where a level has too few rows. Its stages
    run in parts, its levels after the first are sized to the participants' speeds halo included (``balance``;
    `tables`), and with lookahead its windows stream in sub-bands (``stream``): each where predicted faster."""
    speeds = [rates.speed(s) for s in chosen]
    weights = list(weights or speeds)
    made = []
    for level_speeds in ([], speeds) if balance and len(levels) > 1 else ([],):
        try:
            bands, windows, crops = tables(costs, levels, weights, lookahead, level_speeds)
        except PlanningError:
            return None
        sizes = [(b - a) * costs.row_bytes(None) for a, b in windows[0]]
        antennas, order = _associate(chosen, rates, sizes)
        made.append(_finish(StagedPlan(algorithm, "split", servers=list(chosen), antennas=antennas, order=order,
                                       levels=list(levels), bands=bands, windows=windows, crops=crops,
                                       lookahead=lookahead, tail=tail), costs, rates))
    plan = best = min(made, key=lambda p: p.predicted)
    parted = in_parts(plan, costs)
    if parted.overlap:
        parted = _finish(parted, costs, rates)  # kept only where the model says it pays
        best = parted if parted.predicted < best.predicted else best
    if lookahead and stream:  # the window streamed in two sub-bands: where and whether the model says it pays
        trials = [_finish(t, costs, rates) for share in overlapping.STREAM_SHARES
                  if (t := streaming(best, costs, share)) is not best]
        best = min([best, *trials], key=lambda p: p.predicted)
    return best


def in_parts(plan: StagedPlan, costs: CostModel) -> StagedPlan:
    """``plan`` (a split) with every stage that can overlap its halo run in parts (`deepco.planning.overlap`),
    not re-predicted; its ``overlap`` stays [] where no stage can."""
    names: list[str | None] = [None, *plan.levels]
    def window_of(j: int, i: int):
        return lambda a, b: costs.window(names[j - 1], names[j], a, b, plan.windows[j][i])

    parts = overlapping.plan_parts(window_of, plan.bands, plan.windows, plan.lookahead, plan.servers, DEVICE)
    return replace(plan, overlap=parts if any(p for level in parts for p in level) else [])


def unstreamed(plan: StagedPlan) -> StagedPlan:
    """``plan`` with its windows sent whole (its first stage run once), not re-predicted; ``plan`` itself where
    it streams none."""
    if not any(streamed(plan)):
        return plan
    levels = [list(level) for level in plan.overlap]
    levels[1] = [[] for _ in plan.servers]
    return replace(plan, overlap=levels if any(p for level in levels for p in level) else [])


def streaming(plan: StagedPlan, costs: CostModel, share: float) -> StagedPlan:
    """``plan`` (a split with lookahead) with each server's first segment run in two sub-bands, the first over
    ``share`` of its band, and its window streamed (`deepco.planning.overlap.stream_parts`), not re-predicted;
    ``plan`` itself where no server's band can be."""
    names: list[str | None] = [None, *plan.levels]

    first = []
    for i, s in enumerate(plan.servers):
        def window(a: int, b: int, within: Interval = plan.windows[1][i]):
            return costs.window(names[0], names[1], a, b, within)

        mine = [] if s == DEVICE else overlapping.stream_parts(window, plan.bands[1][i], share)
        first.append(mine if overlapping.rest(mine, plan.windows[0][i]) else [])
    if not any(first):
        return plan
    levels = [list(level) for level in plan.overlap] or [[[] for _ in plan.servers] for _ in plan.bands]
    levels[1] = first
    return replace(plan, overlap=levels)


def scales_plan(costs: CostModel, rates: Rates, chosen: Sequence[str], weights: Sequence[float] | None = None,
                algorithm: str = "auto", levels: Sequence[str] | None = None, lookahead: bool = True,
                tail: str | None = None) -> StagedPlan | None:
    """A split across scales (deepco.planning.scales) over ``chosen`` (band order): stages from the image
    through the levels named ``levels`` (default: the deepest level of several tensors, `CostModel.level`, in
    one stage), each on bands of image rows in proportion to ``weights`` (default: speeds) on multiples of
    its alignment; with ``lookahead`` the device sends each participant the image window of its first stage,
    else its band and the servers exchange the halo from the image on; the rest of the model runs on the
    device (``tail`` None) or on participant ``tail``. None when there is no such level, the device is a
    participant, or a stage has too few aligned rows for ``chosen``."""
    if levels is None:
        levels = [costs.level.name] if costs.level is not None else []
    if not levels or DEVICE in chosen or tail is not None and tail not in chosen:
        return None
    weights = list(weights or [rates.speed(s) for s in chosen])
    try:
        stages = costs.stages(levels)
        bands = [scales.stage_bands(weights, stage.align, costs.height) for stage in stages]
        windows = [[costs.stage_window(levels, j, a, b) for a, b in bands[j - 1]] for j in range(1, len(stages) + 1)]
        tensors = scales.tables(stages, windows, costs.p.graph.input_name)
    except UserError:  # PlanningError, PartitionError: too few aligned rows for these participants
        return None
    if tail is not None and costs.p.level_tail(levels[-1]) is None:
        return None  # nothing left to run after the last level: there is no tail to gather for
    image = costs.p.graph.input_name
    sent = tensors[0][image]["window"] if lookahead else tensors[0][image]["owned"]
    antennas, order = _associate(chosen, rates, [(b - a) * costs.row_bytes(None) for a, b in sent])
    plan = StagedPlan(algorithm, "scales", servers=list(chosen), antennas=antennas, order=order,
                      levels=list(levels), bands=[bands[0], *bands],
                      windows=[list(sent), [w.input_rows[image] for w in windows[0]],
                               *([w.image_rows for w in ws] for ws in windows[1:])],
                      crops=[[] for _ in range(len(levels) + 1)], lookahead=lookahead, tail=tail, tensors=tensors)
    return _finish(plan, costs, rates)


def scales_chain(costs: CostModel, rates: Rates, chosen: Sequence[str], lookahead: bool) -> list[str]:
    """The levels a plan across scales over ``chosen`` should end its stages at (deepco.planning.scales
    .best_chain on the barrier model: each stage's slowest participant, halo exchanges included); [] when no
    chain fits."""
    if costs.level is None or DEVICE in chosen:
        return []
    p = costs.p
    speeds = [rates.speed(s) for s in chosen]
    candidates = scales.chain_candidates(p.levels, costs.total_flops)

    def seconds(source, target) -> float:
        try:
            stage = p.stages([target.index] if source is None else [source.index, target.index], models=False)[-1]
        except UserError:
            return math.inf
        # each stage also pays a server step's fixed cost: with a large one (a loaded host) fewer stages win
        return rates.step_overhead + scales.barrier_seconds(stage, speeds, speeds, costs.height,
                                                            costs.tensor_row_bytes, rates.peer_bytes_per_second,
                                                            rates.peer_overhead, source is not None or not lookahead)

    return [lv.name for lv in scales.best_chain(candidates, functools.cache(seconds))]


def _stage_seconds(costs: CostModel, rates: Rates, chosen: Sequence[str], source: str | None, target: str,
                   first: bool, lookahead: bool) -> float:
    """The barrier model of one stage for the dynamic programme: the slowest participant's exchange plus
    compute, on capacity-proportional bands, plus the step's fixed cost that `predict` charges every stage
    (``Rates.step_overhead``; the exact simulation ranks the finished plans)."""
    weights = [rates.server_flops_per_second[s] for s in chosen]
    try:
        bands = ownership(weights, [costs.height_of(source), costs.height_of(target)])
    except PlanningError:
        return math.inf
    worst = 0.0
    row = costs.row_bytes(source)
    for i, s in enumerate(chosen):
        w = costs.window(source, target, *bands[1][i])
        seconds = w.flops / rates.server_flops_per_second[s]
        if not (first and lookahead):
            lo, hi = w.input_rows
            own = bands[0][i]
            halo = max(0, own[0] - lo) + max(0, hi - own[1])
            if halo:
                seconds += rates.peer_overhead + halo * row / rates.peer_bytes_per_second
        worst = max(worst, seconds)
    # Without the fixed cost the programme saw a stage as free beyond its work and offered only chains of
    # many stages, which the simulation then charged a step each (scales_chain's programme charges it too).
    return worst + rates.step_overhead


def _best_levels(costs: CostModel, rates: Rates, chosen: Sequence[str], lookahead: bool,
                 max_stages: int | None) -> list[list[str]]:
    """Stage boundaries by dynamic programming over the cut points (barrier model): for each possible last
    cut, the cheapest chain of stages from the image to it; returns one candidate per last cut, and with
    lookahead and no limit on the stages also one per first cut (`_first_stage_chains`)."""
    cuts = [c.name for c in costs.cuts]
    n_cuts = len(cuts)
    inf = math.inf
    # best[k][s]: least time to have level cuts[k] in bands after s stages
    limit = max_stages or n_cuts
    # a stage's time does not depend on how many came before it: computed once per pair, not once per depth
    stage = functools.cache(lambda prev, k: _stage_seconds(costs, rates, chosen, cuts[prev], cuts[k], False,
                                                          lookahead))
    best = [[inf] * (limit + 1) for _ in range(n_cuts)]
    back: dict[tuple[int, int], int | None] = {}
    for k in range(n_cuts):
        pace()
        best[k][1] = _stage_seconds(costs, rates, chosen, None, cuts[k], True, lookahead)
        back[(k, 1)] = None
    for s in range(2, limit + 1):
        for k in range(n_cuts):
            for prev in range(k):
                if best[prev][s - 1] == inf:
                    continue
                pace()  # a stage's time is computed once per pair, a millisecond or so
                t = best[prev][s - 1] + stage(prev, k)
                if t < best[k][s]:
                    best[k][s], back[(k, s)] = t, prev
    out = []
    for k in range(n_cuts):
        s = min(range(1, limit + 1), key=lambda s: best[k][s])
        if best[k][s] == inf:
            continue
        chain, at, depth = [], k, s
        while at is not None:
            chain.append(cuts[at])
            at, depth = back[(at, depth)], depth - 1
        out.append(chain[::-1])
    if lookahead and max_stages is None:
        slack = costs.input_bytes / sum(rates.antenna_bytes_per_second)
        out += [c for c in _first_stage_chains(cuts, lambda k: best[k][1], stage, slack) if c not in out]
    return out


def _first_stage_chains(cuts: Sequence[str], first: Callable[[int], float], stage: Callable[[int, int], float],
                        slack: float) -> list[list[str]]:
    """For every first cut, the cheapest chain from it to the deepest cut (barrier model: ``first`` stage,
    then ``stage``), where it costs at most ``slack`` seconds more than the cheapest chain of all. With
    lookahead the first stage's length is a trade the barrier model cannot see: a longer one computes more
    rows twice but absorbs the staggered arrival of the windows over shared antennas (`refine`) and has the
    compute to hide a streamed window's rest under. What it can win back is at most the windows' time on the
    air (``slack``); the exact simulation ranks the chains kept."""
    last = len(cuts) - 1
    to_end, after = [0.0] * len(cuts), [None] * len(cuts)
    for k in range(last - 1, -1, -1):
        pace()
        to_end[k], after[k] = min((stage(k, m) + to_end[m], m) for m in range(k + 1, len(cuts)))
    total = [first(k) + to_end[k] for k in range(last)]
    out = []
    for k in range(last):
        if total[k] == math.inf or total[k] > min(total) + slack:
            continue
        chain, at = [], k
        while at is not None:
            chain.append(cuts[at])
            at = after[at]
        out.append(chain)
    return out


def refine(plan: StagedPlan, costs: CostModel, rates: Rates, stream: bool = True) -> StagedPlan:
    """Re-weight the bands so that the participants finish their work together (transfers are staggered,
    so an early receiver can take more rows); keeps the best predicted plan (`split_plan`'s ``stream``)."""
    best = plan
    weights = [rates.speed(s) for s in plan.servers]
    for _ in range(REFINE_STEPS):
        pace()
        stages = best.breakdown.get("stages")
        if not stages:
            break
        trial_plan = split_plan(costs, rates, best.servers, best.levels, best.lookahead, best.tail, weights,
                                best.algorithm, stream)
        if trial_plan is None:
            break
        # the first stage's finish per participant: arrival + its compute
        names: list[str | None] = [None, *best.levels]
        finish = []
        arrived = trial_plan.breakdown["arrived"]
        for i, s in enumerate(best.servers):
            w = costs.window(names[0], names[1], *trial_plan.bands[1][i])
            finish.append(arrived[i] + w.flops / rates.speed(s))
        mean = sum(finish) / len(finish)
        weights = [w * (mean / f) ** 0.5 for w, f in zip(weights, finish, strict=True)]
        if trial_plan.predicted < best.predicted:
            best = trial_plan
    return best


def refit(plan: StagedPlan, costs: CostModel, rates: Rates) -> StagedPlan:
    """``plan``'s shape (participants, levels, lookahead, tail) with its bands sized for ``rates`` (by speed, then
    `refine` or `refine_scales`), where that is predicted faster than ``plan`` as it stands on ``rates``: a plan
    made on rates that turned out otherwise, fitted without a search. Plans without bands are re-predicted."""
    now = _finish(plan, costs, rates)
    if plan.kind == "split":
        fitted = split_plan(costs, rates, plan.servers, plan.levels, plan.lookahead, plan.tail,
                            algorithm=plan.algorithm)
        fitted = refine(fitted, costs, rates) if fitted is not None and fitted.lookahead else fitted
    elif plan.kind == "scales":
        fitted = refine_scales(now, costs, rates)
    else:
        return now
    return fitted if fitted is not None and fitted.predicted < now.predicted else now


def _scales_candidates(costs: CostModel, rates: Rates, chosen: Sequence[str], algorithm: str) -> list[StagedPlan]:
    """Plans across scales over ``chosen``: one stage to the deepest level, and the chain of levels the barrier
    model prefers (`scales_chain`), with and without lookahead, the rest on the device or the first server."""
    out = []
    chains = [None]
    for lookahead in (True, False):
        if (chain := scales_chain(costs, rates, chosen, lookahead)) and chain not in chains:
            chains.append(chain)
    for levels in chains:
        for lookahead in (True, False):
            for tail in (None, chosen[0]):
                if levels is None and (tail or not lookahead):
                    continue
                plan = scales_plan(costs, rates, chosen, algorithm=algorithm, levels=levels, lookahead=lookahead,
                                   tail=tail)
                if plan is not None:
                    out.append(plan)
    return out


def refine_scales(plan: StagedPlan, costs: CostModel, rates: Rates) -> StagedPlan:
    """Re-weight the bands of a plan across scales so that its participants end their stages together (a
    band's FLOPs grow with its halo, so proportional bands leave the middle ones last); the best predicted."""
    best, weights = plan, [rates.speed(s) for s in plan.servers]
    for _ in range(REFINE_STEPS):
        trial = scales_plan(costs, rates, best.servers, weights, best.algorithm, best.levels, best.lookahead, best.tail)
        if trial is None:
            break
        work = _scales_work(trial, costs)
        finish = [trial.breakdown["arrived"][i] + sum(w[i] for w in work) / rates.speed(s)
                  for i, s in enumerate(trial.servers)]
        mean = sum(finish) / len(finish)
        weights = [w * (mean / f) ** 0.5 for w, f in zip(weights, finish, strict=True)]
        if trial.predicted < best.predicted:
            best = trial
    return best


def search(costs: CostModel, rates: Rates, servers: Sequence[str], *, objective: str = "latency",
           algorithm: str = "auto", shapes: str = "all") -> list[StagedPlan]:
    """Every candidate worth ranking, best first by ``objective`` (``latency``: predicted frame time;
    ``throughput``: predicted frames per second). ``shapes``: ``all``, or ``thread`` (one split stage with
    lookahead and the tail on the device: the paper's shape) or ``modnn`` (a stage per cut, no lookahead)."""
    if objective not in ("latency", "throughput"):
        raise PlanningError(f"unknown objective {objective!r} (latency or throughput)")
    candidates: list[StagedPlan] = []
    if shapes == "all":
        candidates.append(local_plan(costs, rates))
        candidates += [offload_plan(costs, rates, s) for s in servers]
        if objective == "throughput" and len(servers) > 1:  # frame-level parallelism only pays with frames in flight
            candidates.append(round_robin_plan(costs, rates, servers))
    ordered = _participants(rates, servers)
    for k in range(1, len(ordered) + 1):
        pace()  # a caller beside live frames may yield the CPU here (deepco.planning.pacing)
        chosen = ordered[:k]
        if shapes == "all":
            candidates += _scales_candidates(costs, rates, chosen, algorithm)
        for lookahead in (True, False):
            if shapes == "thread" and not lookahead or shapes == "modnn" and lookahead:
                continue
            if shapes == "modnn":
                cuts = [c.name for c in costs.cuts]
                chains = [cuts[:i + 1] for i in range(len(cuts))]
            else:
                chains = _best_levels(costs, rates, chosen, lookahead, 1 if shapes == "thread" else None)
            for tail in (None, chosen[0]):
                if shapes in ("thread", "modnn") and tail is not None:
                    continue
                for levels in chains:
                    pace()
                    plan = split_plan(costs, rates, chosen, levels, lookahead, tail, algorithm=algorithm,
                                      stream=shapes == "all",  # the paper's shapes send windows whole,
                                      balance=shapes == "all")  # and size every level alike
                    if plan is not None:
                        candidates.append(plan)
                    if shapes == "all" and lookahead and tail is None and len(levels) == 1:
                        # the device computes a band too (one stage: it exchanges nothing with the servers)
                        plan = split_plan(costs, rates, [*chosen, DEVICE], levels, lookahead, tail,
                                          algorithm=algorithm)
                        if plan is not None:
                            candidates.append(plan)
    if not candidates:
        raise PlanningError("no plan fits: every split needs more rows than a level has")
    candidates = [replace(p, algorithm=algorithm) if p.kind in ("split", "scales") else p for p in candidates]
    candidates = [p for p in candidates if p.kind != "round-robin"] if objective == "latency" else candidates
    if objective == "latency":
        candidates.sort(key=lambda p: p.predicted)
    else:
        candidates.sort(key=lambda p: -throughput(p, costs, rates))
    refined = {"split": lambda p: refine(p, costs, rates, shapes == "all") if p.lookahead else p,
               "scales": lambda p: refine_scales(p, costs, rates)}
    top = [refined.get(p.kind, lambda p: p)(p) for p in candidates[:5]]
    key = (lambda p: p.predicted) if objective == "latency" else (lambda p: -throughput(p, costs, rates))
    return sorted(top, key=key) + candidates[5:]
