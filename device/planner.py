"""The staged planner on a set-up Device: the exact cost model on the device's measurements, within the servers'
free model slots, and calibration on the device's servers.

    planner = StagedPlanner(dev)                  # dev set up (Device.setup())
    live = LiveFrames(frames, emit)               # the run's frames: each result goes to emit as it comes
    plan = planner.calibrate("latency", live=live)  # deepco.planning.calibration.calibrate, timed on them
    runner = StagedRunner(dev, plan)              # device/runners.py
    for result in runner.run_frames(live.rest(), first=live.taken): ...

Calibration itself is planning (`deepco.planning.calibration.calibrate`): this module supplies what only the
device has, the candidates that fit its servers' free slots and a callback that times a plan on them
(`_PlanRuns`: a runner per plan, its models uploaded while calibration holds it, run on the run's own first
frames, `LiveFrames`, or on blank ones for a dry run).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np
from deepco_device.backpressure import while_busy
from deepco_device.lifecycle import NoRoom
from deepco_device.pipeline import timeline
from deepco_device.records import FrameResult, FrameTiming
from deepco_device.runners import StagedRunner

from deepco.errors import UserError
from deepco.planning import calibration
from deepco.planning.calibration import Unfit, plan_key
from deepco.planning.plan import PlanningError
from deepco.planning.staged import (
    Rates,
    StagedPlan,
    best_offload,
    local_plan,
    models_per_server,
    offload_plan,
    round_robin_plan,
    search,
    throughput,
)
from deepco.wire.client import ServerError

if TYPE_CHECKING:
    from deepco_device.session import Device


class StagedPlanner:
    """The staged planner on a set-up Device's measurements and model (see deepco.planning.staged)."""

    def __init__(self, device: Device):
        if device.measured is None:
            raise UserError("StagedPlanner needs a Device that is set up (Device.setup())")
        self.device = device
        self.costs = device.costs
        self.trials: list[dict] = []  # what calibrate() timed
        self.room: dict[str, int] | None = None  # free model slots per server (`free_slots`); None: not counted
        self.unfit_plans = 0  # candidates the last `plans` left out for want of model slots

    # calibration's fit lives with the device's measurements: every planner and the paper's plans share it
    compute_scale = property(lambda self: self.device.measurements.compute_scale,
                             doc="The servers' FLOP rate on this model against the profiled head (fitted).")
    step_overhead = property(lambda self: self.device.measurements.step_overhead,
                             doc="The fixed cost of one server step, seconds (fitted).")

    def rates(self, exclude: Iterable[str] = ()) -> Rates:
        """The measured rates (with the fitted compute scale and step overhead), without the servers in
        ``exclude``."""
        return self.device.rates(exclude)

    def servers(self, exclude: Iterable[str] = ()) -> list[str]:
        """Names of the usable servers, in cluster order."""
        return self.device.servers(exclude)

    def plans(self, objective: str = "latency", exclude: Iterable[str] = (), shapes: str = "all",
              rates: Rates | None = None) -> list[StagedPlan]:
        """Every ranked candidate that fits the servers' free model slots (as `free_slots` last counted them),
        best first. ``shapes``: as `deepco.planning.staged.search`, or ``offload`` (the best single server).
        ``rates``: what to plan on (default: `rates` without ``exclude``)."""
        servers = self.servers(exclude)
        if not servers and shapes != "all":
            raise UserError("no server is left: every server of the cluster is down")
        rates = rates or self.rates(exclude)
        try:
            if not servers:
                return [local_plan(self.costs, rates)]
            if shapes == "offload":
                ranked = sorted((offload_plan(self.costs, rates, s) for s in servers), key=lambda p: p.predicted)
            else:
                ranked = search(self.costs, rates, servers, objective=objective, shapes=shapes)
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
        """``local``, ``offload`` (the best single server, tail included), ``round-robin`` or ``auto``."""
        makers = {"local": lambda: local_plan(self.costs, self.rates()),
                  "offload": lambda: best_offload(self.costs, self.rates(), self.servers()),
                  "round-robin": lambda: round_robin_plan(self.costs, self.rates(), self.servers()),
                  "auto": self.best}
        if name not in makers:
            raise UserError(f"unknown staged plan {name!r}")
        return makers[name]()

    def calibrate(self, objective: str = "latency", frames: int = 2, rounds: int = 3,
                  runoff_frames: int = 6, live: LiveFrames | None = None) -> StagedPlan:
        """`deepco.planning.calibration.calibrate` on this device's servers: plans are timed on frames, the
        fitted compute scale and step overhead are kept here (`rates`), and every timing in ``trials``.

        The frames are ``live`` ones where given: the run's own, each one's result handed on as it comes (a
        CNN's work does not depend on what the image shows, so they time a plan as well as any), so the first
        result comes from the predicted best plan, with no frame spent on calibration alone. When a server
        fails one of them, the frame goes back to the source and the run goes on, uncalibrated, on the best
        plan without the servers that no longer answer (``live.stopped`` says why); when the source ends
        first, ``live.ended``.
        Without ``live`` (`deepco plan`), blank frames.

        Only plans that fit the servers' free model slots are planned (`room`), a plan a server still refuses
        for want of room is skipped with a one-line note, and the models of every plan that cannot be chosen
        any more are unloaded at once: calibration never holds more than the finalists' models."""
        self.room = self.free_slots()
        every = len(self.plans(objective)) + self.unfit_plans
        if self.unfit_plans:
            self.device.log(f"calibration: {self.unfit_plans} of {every} candidate plans need more model slots than "
                            f"the servers have free ({', '.join(f'{k} {v}' for k, v in self.room.items())}): skipped")
        dev = self.device
        runs = _PlanRuns(dev, live or _BlankFrames(np.zeros((1, dev.channels, dev.height, dev.width), np.uint8)))
        try:
            result = calibration.calibrate(
                self.costs, dev.measured.rates(), self._candidates, runs.time, runs.release, objective=objective,
                frames=frames, rounds=rounds, runoff_frames=runoff_frames, log=dev.log,
                compute_scale=self.compute_scale, step_overhead=self.step_overhead)
        except SourceEnded:
            return self.best(objective)  # no frame is left to run it on
        except ServerError as exc:
            if live is None:
                raise
            live.stopped = f"{exc}"
            # the run goes on where failover would take it: on the servers that still answer
            down = {name for name in self.servers() if not dev.pool.ready(name)} | {dev.pool.server_at(exc.address)}
            down.discard(None)
            dev.log(f"calibration stopped: {exc}; going on uncalibrated without {', '.join(sorted(down)) or 'it'}")
            return self.best(objective, exclude=down)
        dev.measurements.compute_scale, dev.measurements.step_overhead = result.compute_scale, result.step_overhead
        self.trials += result.trials
        return result.plan

    def _candidates(self, rates: Rates, objective: str, shapes: str) -> list[StagedPlan]:
        """Calibration's candidates: every ranked plan that fits (``all``), or the best of ``shapes`` that fits
        as a list of at most one."""
        if shapes == "all":
            return self.plans(objective, rates=rates)
        try:
            return self.plans(objective, shapes=shapes, rates=rates)[:1]
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

    def fps(self, plan: StagedPlan) -> float:
        """Predicted sustained frames per second of ``plan`` with frames pipelined."""
        return throughput(plan, self.costs, self.rates())


class SourceEnded(Exception):
    """The source ran out of frames while calibration was timing plans on them."""


class LiveFrames:
    """The run's first frames, while calibration times plans on them (`StagedPlanner.calibrate`): each is taken
    from ``source``, run on the plan being timed, and its result handed to ``emit(result, predicted)``; the
    frames left go on to the pipeline (`rest`, numbered on from ``taken``)."""

    def __init__(self, source: Iterable[np.ndarray], emit: Callable[[FrameResult, float], None]):
        self._source = iter(source)
        self.emit = emit
        self.taken = 0  # frames that gave a result
        self._back: list[np.ndarray] = []  # frames a failed server gave back, to run again first
        self.ended = False  # the source ran out before calibration settled
        self.stopped: str | None = None  # why calibration stopped before it settled (a server failed)

    @property
    def settled(self) -> bool:
        """Whether calibration ran to its end (its plan was measured against the others)."""
        return not self.ended and self.stopped is None

    def next(self) -> np.ndarray:
        """The next frame's pixels; SourceEnded when there are none."""
        if self._back:
            return self._back.pop()
        try:
            return next(self._source)
        except StopIteration:
            self.ended = True
            raise SourceEnded from None

    def put_back(self, x: np.ndarray) -> None:
        """A frame whose server failed: it is the next frame again."""
        self._back.append(x)

    def done(self, outputs: dict[str, np.ndarray], timing: FrameTiming, plan: StagedPlan) -> None:
        """A frame ran on ``plan``: hand its result on."""
        result = FrameResult(self.taken, outputs=outputs, latency=timing.latency)
        timeline(result, timing, plan, 0.0, None)
        self.taken += 1
        self.emit(result, plan.predicted)

    def rest(self) -> Iterator[np.ndarray]:
        """The frames calibration did not take."""
        while self._back:
            yield self._back.pop()
        yield from self._source


class _BlankFrames:
    """`LiveFrames`' part for a dry run: the same blank frame every time, and no results to hand on."""

    def __init__(self, px: np.ndarray):
        self.px = px

    def next(self) -> np.ndarray:
        return self.px

    def put_back(self, x: np.ndarray) -> None:
        pass

    def done(self, outputs: dict[str, np.ndarray], timing: FrameTiming, plan: StagedPlan) -> None:
        pass


class _PlanRuns:
    """Calibration's ``time_plan`` and ``release`` on the device: a runner per plan, its models on the servers
    until the plan is released, and its frames from ``frames`` (`LiveFrames`, or `_BlankFrames`)."""

    def __init__(self, device: Device, frames: LiveFrames | _BlankFrames):
        self.device, self.frames = device, frames
        self._runners: dict[str, StagedRunner] = {}

    def time(self, plan: StagedPlan, frames: int, warm_up: bool) -> list[float]:
        """The latencies of ``frames`` frames of ``plan`` (after an untimed one when ``warm_up``: first runs
        allocate). Raises Unfit when a server has no room for its models."""
        key = plan_key(plan)
        runner = self._runners.get(key)
        if runner is None:
            try:
                runner = self._runners[key] = StagedRunner(self.device, plan)
            except NoRoom as exc:
                raise Unfit(str(exc)) from None
        if warm_up:
            self._frame(runner)
        return [self._frame(runner) for _ in range(frames)]

    def _frame(self, runner: StagedRunner) -> float:
        """Run the next frame on ``runner``; its latency. A frame whose server fails goes back to the frames."""
        x = self.frames.next()
        try:
            outputs, timing = runner.run_frame(x)
        except ServerError:
            self.frames.put_back(x)
            raise
        self.frames.done(outputs, timing, runner.plan)
        return timing.latency

    def release(self, plan: StagedPlan) -> None:
        """Give back ``plan``'s models."""
        runner = self._runners.pop(plan_key(plan), None)
        if runner is not None:
            runner.close()
