"""The staged runtime: executes a `deepco.planning.staged.StagedPlan` (local, offload or split) frame by frame.
Every plan runs here: auto's, local, offload, the paper's (deepco.planning.paper_plans) and MoDNN's.

    dev = Device(cluster, "resnet18", 720, 1280); dev.setup()      # measure, and the paper's plan (dev.plan)
    planner = StagedPlanner(dev)                                   # the exact cost model on dev's measurements
    runner = StagedRunner(dev, planner.best())                     # uploads what the plan needs
    output, timing = runner.run_frame(px)                          # px: 1x3xHxW uint8 pixels
    for result in runner.run_frames(frames, depth=2): ...          # pipelined, with failover

A split plan runs as one ModnnRun job per participant (server/modnn.py): the device sends each participant
its input (the window of the image for segment 1 with lookahead, else its band) over its antenna, in the
plan's order; the servers run their segments, exchange halo rows directly, and either return their bands
(the device stitches them and runs the tail) or send them to the participant that runs the tail, which
returns the model's output. The device never re-derives the plan: rows, windows, crops, antennas and order
all come from it.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

import numpy as np
from deepco_device.backpressure import while_busy
from deepco_device.lifecycle import NoRoom
from deepco_device.runners import RUNNERS, StagedRunner, root_cause

from deepco.errors import UserError
from deepco.planning.calibration import Timed, choose, fidelity, fit, with_compute_scale
from deepco.planning.plan import PlanningError
from deepco.planning.staged import (
    CostModel,
    StagedPlan,
    best_offload,
    local_plan,
    models_per_server,
    offload_plan,
    search,
    steps,
    throughput,
)
from deepco.wire.client import ServerError

T = TypeVar("T")
SETTLE_SECONDS = 0.03  # three CFS periods between timed frames: every quota starts a frame refilled
RUNOFF_WITHIN = 0.25  # calibrated plans this close to the fastest are timed again side by side

if TYPE_CHECKING:
    from deepco_device.session import Device

__all__ = ["RUNNERS", "SETTLE_SECONDS", "StagedPlanner", "StagedRunner", "round_order", "root_cause"]


def _plan_key(plan: StagedPlan) -> str:
    """What identifies a plan: everything but its name, prediction and calibration report."""
    return json.dumps(plan.to_dict() | {"predicted": 0, "breakdown": {}, "algorithm": "", "fidelity": {}},
                      sort_keys=True)


def round_order(items: list[T], k: int) -> list[T]:
    """The order of the ``k``-th round when plans are timed side by side: a permutation of ``items`` drawn
    afresh for every round (seeded by ``k``, so runs repeat). A frame's time depends on what ran just before
    it (a CPU quota the previous frame drained, caches). A fixed order biases the plans that follow a heavy
    one, and so does a rotation, which keeps every item's predecessor (in the benchmark, offload always ran
    after local and auto after round-robin, and auto measured 3-6% slower than offload running the very
    same plan); a fresh permutation gives every item every predecessor alike."""
    order = list(items)
    random.Random(k).shuffle(order)
    return order


class StagedPlanner:
    """The staged planner on a set-up Device's measurements and model (see deepco.planning.staged)."""

    def __init__(self, device: Device):
        if device.measured is None:
            raise UserError("StagedPlanner needs a Device that is set up (Device.setup())")
        self.device = device
        out = device.reference_model.graph.output[0].type.tensor_type.shape.dim
        out_bytes = 4 * int(np.prod([d.dim_value or 1 for d in out]))  # float32 (batch 1)
        image_bytes = device.channels * device.height * device.width * device.partitioner.graph.itemsize
        self.costs = CostModel(device.partitioner, image_bytes, out_bytes)
        self.step_overhead = 0.0
        self.compute_scale = 1.0
        self.trials: list[dict] = []  # what calibrate() timed
        self.room: dict[str, int] | None = None  # free model slots per server (`free_slots`); None: not counted
        self.unfit_plans = 0  # candidates the last `plans` left out for want of model slots

    def rates(self, exclude: Iterable[str] = ()):
        """The measured rates (with the fitted step overhead), without the servers in ``exclude``."""
        r = with_compute_scale(self.device.measured.rates(), self.compute_scale)
        r.step_overhead = self.step_overhead
        for name in exclude:
            r.server_flops_per_second.pop(name, None)
        return r

    def servers(self, exclude: Iterable[str] = ()) -> list[str]:
        """Names of the usable servers, in cluster order."""
        skip = set(exclude)
        return [s.name for s in self.device.cluster.servers if s.name not in skip]

    def plans(self, objective: str = "latency", exclude: Iterable[str] = (), shapes: str = "all") -> list[StagedPlan]:
        """Every ranked candidate that fits the servers' free model slots (as `free_slots` last counted them),
        best first. ``shapes``: as `deepco.planning.staged.search`, or ``offload`` (the best single server)."""
        servers = self.servers(exclude)
        if not servers and shapes != "all":
            raise UserError("no server is left: every server of the cluster is down")
        try:
            if not servers:
                return [local_plan(self.costs, self.rates(exclude))]
            if shapes == "offload":
                ranked = sorted((offload_plan(self.costs, self.rates(exclude), s) for s in servers),
                                key=lambda p: p.predicted)
            else:
                ranked = search(self.costs, self.rates(exclude), servers, objective=objective, shapes=shapes)
        except PlanningError as exc:
            raise UserError(str(exc)) from None
        fitting = [p for p in ranked if self.fits(p)]
        self.unfit_plans = len(ranked) - len(fitting)
        if not fitting:
            raise UserError(f"no {shapes if shapes != 'all' else ''} plan fits the servers' free model slots "
                            f"({', '.join(f'{k}: {v}' for k, v in (self.room or {}).items())}); unload some "
                            "(`deepco models --cluster FILE --all`) or start them with a larger --max-models")
        return fitting

    def best(self, objective: str = "latency", exclude: Iterable[str] = ()) -> StagedPlan:
        """The fastest plan for ``objective``."""
        return self.plans(objective, exclude)[0]

    def named(self, name: str) -> StagedPlan:
        """``local``, ``offload`` (the best single server, tail included) or ``auto``."""
        if name == "local":
            return local_plan(self.costs, self.rates())
        if name == "offload":
            return best_offload(self.costs, self.rates(), self.servers())
        if name == "round-robin":
            from deepco.planning.staged import round_robin_plan

            return round_robin_plan(self.costs, self.rates(), self.servers())
        if name == "auto":
            return self.best()
        raise UserError(f"unknown staged plan {name!r}")

    def calibrate(self, objective: str = "latency", frames: int = 2, rounds: int = 3,
                  runoff_frames: int = 6) -> StagedPlan:
        """Plan, time the plan on real frames, fit the cost model's compute scale and per-step overhead
        (`deepco.planning.calibration.fit`), plan again; stop when the plan repeats. For latency, time local,
        the best offload and the paper's shape as contenders too, then run the plans within ``RUNOFF_WITHIN``
        of the fastest side by side (interleaved, settled, ``runoff_frames`` each) and return the one
        `calibration.choose` picks, re-predicted with the fitted model (every timing is kept in ``trials``).
        The timing uses blank pixels: a CNN's work does not depend on what the image shows.

        Only plans that fit the servers' free model slots are planned (`room`), a plan a server still refuses
        for want of room is skipped with a one-line note, and the models of every plan that cannot be chosen
        any more are unloaded at once: calibration never holds more than the finalists' models."""
        self.room = self.free_slots()
        every = len(self.plans(objective)) + self.unfit_plans
        if self.unfit_plans:
            self.device.log(f"calibration: {self.unfit_plans} of {every} candidate plans need more model slots than "
                            f"the servers have free ({', '.join(f'{k} {v}' for k, v in self.room.items())}): skipped")
        bench = _Calibration(self, np.zeros((1, self.device.channels, self.device.height, self.device.width),
                                            np.uint8), frames)
        try:
            return self._calibrate(bench, objective, rounds, runoff_frames)
        finally:
            bench.close()

    def _calibrate(self, bench: _Calibration, objective: str, rounds: int, runoff_frames: int) -> StagedPlan:
        plan = bench.first_new(self.plans(objective))
        for _ in range(rounds):
            if plan is None or _plan_key(plan) in bench.timed:
                break
            bench.time(plan, "planned")
            plan = bench.first_new(self.plans(objective))
        if not bench.timed:  # every planned candidate was refused for room: the device alone always fits
            bench.time(self.named("local"), "the only plan that fits")
        if objective != "latency":  # one frame's time says little about sustained fps: keep the last plan
            return bench.keep(self._repredict(bench.fastest().plan))
        # The fitted model can still misjudge plan kinds it was fitted on least (a weak camera's own
        # per-message CPU, a model whose layers run at another FLOP rate than the profiled head): local, the
        # best offload and the paper's shape (one lookahead stage, the tail on the device) are timed too, so
        # auto is never slower than them as measured.
        contenders = [self.named("local")]
        if self.servers():
            contenders += self._best_of("offload") + self._best_of("thread")
        for contender in contenders:
            if contender.kind == "local" and contender.predicted > 2 * bench.fastest().mean:
                continue  # the device alone is compute only, predicted well: far slower, not worth seconds here
            if _plan_key(contender) not in bench.timed and _plan_key(contender) not in bench.unfit:
                bench.time(contender, "contender")
        finalists = bench.finalists()
        if len(finalists) > 1:
            # Two frames each cannot tell plans 10% apart on a quota'd CPU: the close ones run again, side by
            # side as the benchmark runs them (interleaved in a fresh order every round, on refilled quotas).
            runoff = bench.runoff(finalists, runoff_frames)
            self._fit(bench.timed.values())
            chosen = bench.timed[_plan_key(choose(runoff).plan)]
        else:
            chosen = bench.timed[finalists[0]]
        plan = self._repredict(chosen.plan)
        plan.fidelity = fidelity(chosen, list(bench.timed.values()), self.costs, self.rates())
        if plan.fidelity["why"]:
            self.device.log(f"calibration: the prediction for the chosen plan does not hold "
                            f"(measured / predicted {plan.fidelity['ratio']:.2f}): {plan.fidelity['why']}")
        return bench.keep(plan)

    def _best_of(self, shapes: str) -> list[StagedPlan]:
        """The best plan of ``shapes`` that fits, as a list of at most one."""
        try:
            return self.plans(shapes=shapes)[:1]
        except UserError:
            return []

    def free_slots(self) -> dict[str, int] | None:
        """Free model slots of each server (`deepco serve --max-models` less what is loaded there), or None
        where a server does not say (not a DeepCo server) or cannot be asked; planning counts on no more."""
        room: dict[str, int] = {}
        for k, server in enumerate(self.device.cluster.servers):
            client = self.device.client(k, 0)
            try:
                limit = while_busy(client.server_metadata).get("deepco_max_models")
                loaded = len(while_busy(client.model_index)) if limit is not None else 0
            except ServerError:
                continue  # down: failover's business, not the planner's
            if limit is not None:
                room[server.name] = int(limit) - loaded
        return room or None

    def fits(self, plan: StagedPlan) -> bool:
        """Whether ``plan``'s models fit the servers' free slots as last counted (`free_slots`)."""
        room = self.room or {}
        return all(need <= room.get(server, need) for server, need in models_per_server(plan).items())

    def _fit(self, timed: Iterable[Timed]) -> None:
        self.compute_scale, self.step_overhead = fit(list(timed), self.costs, self.device.measured.rates())

    def _repredict(self, plan: StagedPlan) -> StagedPlan:
        from deepco.planning.staged import predict

        plan.breakdown = predict(plan, self.costs, self.rates())
        plan.predicted = plan.breakdown["frame"]
        return plan

    def fps(self, plan: StagedPlan) -> float:
        """Predicted sustained frames per second of ``plan`` with frames pipelined."""
        return throughput(plan, self.costs, self.rates())


class _Calibration:
    """The plans one calibration has timed, and the runners (with their models on the servers) of those that
    can still be chosen: a plan too slow to reach the runoff gives its models back at once."""

    def __init__(self, planner: StagedPlanner, px: np.ndarray, frames: int):
        self.planner, self.px, self.frames = planner, px, frames
        self.timed: dict[str, Timed] = {}
        self.unfit: set[str] = set()  # plans a server refused for want of room
        self._runners: dict[str, StagedRunner] = {}
        self._kept: str | None = None

    def first_new(self, ranked: list[StagedPlan]) -> StagedPlan | None:
        """The best of ``ranked`` not refused for room (timed or not: the caller stops when it repeats)."""
        return next((p for p in ranked if _plan_key(p) not in self.unfit), None)

    def fastest(self) -> Timed:
        """The timed plan of least mean latency."""
        return min(self.timed.values(), key=lambda t: t.mean)

    def finalists(self) -> list[str]:
        """Keys of the timed plans within ``RUNOFF_WITHIN`` of the fastest."""
        fastest = self.fastest().mean
        return [k for k, t in self.timed.items() if t.mean <= fastest * (1 + RUNOFF_WITHIN)]

    def runner(self, plan: StagedPlan) -> StagedRunner | None:
        """``plan``'s runner (its models uploaded), or None with a note when a server has no room for them even
        after the other candidates gave theirs back."""
        key = _plan_key(plan)
        if key not in self._runners:
            try:
                self._runners[key] = StagedRunner(self.planner.device, plan)
            except NoRoom:
                self._give_back(lambda k: k != key)  # the held candidates may be what fills the server
                try:
                    self._runners[key] = StagedRunner(self.planner.device, plan)
                except NoRoom as exc:
                    self.unfit.add(key)
                    self.planner.device.log(f"calibration: skipped {plan.describe()}: {exc}")
                    return None
        return self._runners[key]

    def time(self, plan: StagedPlan, note: str) -> None:
        """Time ``plan`` on ``frames`` frames after a warm-up, refit the cost model, and log it."""
        runner = self.runner(plan)
        if runner is None:
            return
        planner, key = self.planner, _plan_key(plan)
        runner.run_frame(self.px)  # warm-up: first runs allocate
        self.timed[key] = Timed(plan, [runner.run_frame(self.px)[1].latency for _ in range(self.frames)])
        planner._fit(self.timed.values())
        planner.trials.append({"plan": plan.describe(), "predicted": plan.predicted, "measured": self.timed[key].mean,
                               "steps": steps(plan), "step_overhead": planner.step_overhead,
                               "compute_scale": planner.compute_scale, "note": note})
        planner.device.log(f"calibration ({note}): {plan.describe()}: predicted {plan.predicted * 1e3:.1f} ms, "
                           f"measured {self.timed[key].mean * 1e3:.1f} ms; now compute scale "
                           f"{planner.compute_scale:.2f}, step overhead {planner.step_overhead * 1e3:.2f} ms")
        finalists = set(self.finalists())
        self._give_back(lambda k: k not in finalists)

    def runoff(self, finalists: list[str], frames: int) -> list[Timed]:
        """The ``finalists`` run again side by side, interleaved in a fresh order every round on refilled
        quotas; their timings (added to ``timed`` too). A finalist whose models no longer fit is left out."""
        runners = {k: self.runner(self.timed[k].plan) for k in finalists}
        runners = {k: r for k, r in runners.items() if r is not None}
        runoff = {k: Timed(self.timed[k].plan, []) for k in runners}
        for i in range(frames):
            for k in round_order(list(runners), i):
                time.sleep(SETTLE_SECONDS)
                runoff[k].seconds.append(runners[k].run_frame(self.px)[1].latency)
        for k, t in runoff.items():
            self.timed[k] = Timed(t.plan, self.timed[k].seconds + t.seconds)
            self.planner.trials.append({"plan": t.plan.describe(), "measured": t.mean, "steps": steps(t.plan),
                                        "note": "runoff", "frames": len(t.seconds)})
            self.planner.device.log(f"calibration (runoff, {len(t.seconds)} frames): {t.plan.describe()}: "
                                    f"{t.mean * 1e3:.1f} ms")
        return list(runoff.values())

    def keep(self, plan: StagedPlan) -> StagedPlan:
        """``plan`` is the one chosen: its models stay on the servers for the run; the rest go on `close`."""
        self._kept = _plan_key(plan)
        return plan

    def close(self) -> None:
        """Give back the models of every timed plan but the one kept."""
        self._give_back(lambda k: k != self._kept)

    def _give_back(self, drop: Callable[[str], bool]) -> None:
        for key in [k for k in self._runners if drop(k)]:
            self._runners.pop(key).close()
