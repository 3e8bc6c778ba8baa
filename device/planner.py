"""The staged planner on a set-up Device: the exact cost model on the device's measurements, within the servers'
free model slots, and calibration on the device's servers.

    planner = StagedPlanner(dev)                  # dev set up (Device.setup())
    plan = planner.calibrate("latency")           # deepco.planning.calibration.calibrate, timed on the servers
    runner = StagedRunner(dev, plan)              # device/runners.py

Calibration itself is planning (`deepco.planning.calibration.calibrate`): this module supplies what only the
device has, the candidates that fit its servers' free slots and a callback that times a plan on them
(`_PlanRuns`: a runner per plan, its models uploaded while calibration holds it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
from deepco_device.backpressure import while_busy
from deepco_device.lifecycle import NoRoom
from deepco_device.runners import RUNNERS, StagedRunner

from deepco.errors import UserError
from deepco.planning import calibration, slo
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

SLO_FRAMES = 10  # pipelined frames `--objective slo` measures each short-listed plan and depth on
SLO_PLANS = 3  # plans of each ranking (latency, throughput) `--objective slo` pairs with frames in flight


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
                  runoff_frames: int = 6) -> StagedPlan:
        """`deepco.planning.calibration.calibrate` on this device's servers: plans are timed on real frames
        (blank pixels: a CNN's work does not depend on what the image shows), the fitted compute scale and
        step overhead are kept here (`rates`), and every timing in ``trials``.

        Only plans that fit the servers' free model slots are planned (`room`), a plan a server still refuses
        for want of room is skipped with a one-line note, and the models of every plan that cannot be chosen
        any more are unloaded at once: calibration never holds more than the finalists' models."""
        self.room = self.free_slots()
        every = len(self.plans(objective)) + self.unfit_plans
        if self.unfit_plans:
            self.device.log(f"calibration: {self.unfit_plans} of {every} candidate plans need more model slots than "
                            f"the servers have free ({', '.join(f'{k} {v}' for k, v in self.room.items())}): skipped")
        dev = self.device
        runs = _PlanRuns(dev, self._blank())
        result = calibration.calibrate(
            self.costs, dev.measured.rates(), self._candidates, runs.time, runs.release, objective=objective,
            frames=frames, rounds=rounds, runoff_frames=runoff_frames, log=dev.log,
            compute_scale=self.compute_scale, step_overhead=self.step_overhead)
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

    def slo_options(self, fastest: StagedPlan | None = None) -> list[slo.Option]:
        """`--objective slo`'s candidates: the best plans of each ranking (latency, throughput) with each number
        of frames in flight worth trying (`deepco.planning.slo.options`), predicted on the calibrated model
        (``fastest``: calibration's plan when it ran already; else it runs now)."""
        fastest = fastest or self.calibrate("latency")
        plans = [fastest, *self.plans("latency")[:SLO_PLANS], *self.plans("throughput")[:SLO_PLANS]]
        return slo.options(plans, self.costs, self.rates(), least_depth)

    def choose_slo(self, bound: float, frames: int = SLO_FRAMES,
                   candidates: list[slo.Option] | None = None) -> slo.SloChoice:
        """`--objective slo`: measure the short list of ``candidates`` (default `slo_options`) on ``frames``
        pipelined blank frames each and choose (`deepco.planning.slo.choose`). The chosen plan's models stay
        uploaded for the run; the others are given back."""
        candidates = candidates or self.slo_options()
        runs = _PlanRuns(self.device, self._blank())
        choice = None
        try:
            choice = slo.choose(candidates, lambda option: self._trial(runs, option, frames), bound)
        finally:  # the chosen plan's models stay for the run (as calibration leaves its own plan's)
            kept = None if choice is None else plan_key(choice.option.plan)
            for option in candidates:
                if plan_key(option.plan) != kept:
                    runs.release(option.plan)
        return choice

    def measure_options(self, candidates: list[slo.Option], frames: int = SLO_FRAMES) -> list[slo.Trial]:
        """Every one of ``candidates`` measured as `choose_slo` measures them (the benchmark's yardstick); their
        models are given back after."""
        runs = _PlanRuns(self.device, self._blank())
        try:
            return [self._trial(runs, option, frames) for option in candidates]
        finally:
            for option in candidates:
                runs.release(option.plan)

    def _blank(self) -> np.ndarray:
        dev = self.device
        return np.zeros((1, dev.channels, dev.height, dev.width), np.uint8)

    def _trial(self, runs: _PlanRuns, option: slo.Option, frames: int) -> slo.Trial:
        trial = runs.pipelined(option, frames)
        self.device.log(f"slo: {option.describe()}: predicted {option.latency * 1e3:.1f} ms, {option.fps:.2f} fps; "
                        f"measured p95 {trial.p95 * 1e3:.1f} ms, {trial.fps:.2f} fps")
        return trial


def least_depth(plan: StagedPlan) -> int:
    """Frames in flight a runner of ``plan`` has at least."""
    return RUNNERS[plan.kind].least_depth(plan)


class _PlanRuns:
    """Calibration's ``time_plan`` and ``release`` on the device: a runner per plan, its models on the servers
    until the plan is released."""

    def __init__(self, device: Device, px: np.ndarray):
        self.device, self.px = device, px
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
            runner.run_frame(self.px)
        return [runner.run_frame(self.px)[1].latency for _ in range(frames)]

    def pipelined(self, option: slo.Option, frames: int) -> slo.Trial:
        """``option``'s plan with its frames in flight on ``frames`` frames (after untimed ones when its runner is
        new): the p95 of their latencies and their fps (frames / the run's wall time)."""
        key = plan_key(option.plan)
        runner = self._runners.get(key)
        if runner is None:
            try:
                runner = self._runners[key] = StagedRunner(self.device, option.plan)
            except NoRoom as exc:
                self.device.log(f"slo: skipped {option.plan.describe()}: {exc}")
                return slo.Trial(option, math.inf, 0.0)  # never meets a bound, never the least p95
            for _ in range(least_depth(option.plan)):  # first runs allocate (round-robin: on every server)
                runner.run_frame(self.px)
        start = time.perf_counter()
        results = list(runner.run_frames([self.px] * frames, depth=option.depth))
        seconds = time.perf_counter() - start
        failed = [r.error for r in results if r.error is not None]
        if failed:
            raise UserError(f"slo: {option.describe()} failed a frame while measured: {failed[0]}")
        return slo.Trial(option, float(np.percentile([r.latency for r in results], 95)), frames / seconds)

    def release(self, plan: StagedPlan) -> None:
        """Give back ``plan``'s models."""
        runner = self._runners.pop(plan_key(plan), None)
        if runner is not None:
            runner.close()
