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

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
from deepco_device.backpressure import while_busy
from deepco_device.feed import EndOfFeed, Feed, Frame, IterFeed, ResumedFeed
from deepco_device.giveup import TICK
from deepco_device.lifecycle import NoRoom
from deepco_device.pipeline import timeline
from deepco_device.records import FrameResult, FrameTiming
from deepco_device.runners import RUNNERS, StagedRunner

from deepco.errors import UserError
from deepco.planning import calibration, slo
from deepco.planning.calibration import Unfit, plan_key
from deepco.planning.links import Links
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
AHEAD_KEPT = 40  # plans of `ahead`'s ranking kept: a join re-predicts each of them on the live rates


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
        self._unfit_told = False  # calibration said how many candidates the free slots leave out
        self.standby: list[StagedRunner] = []  # calibration's finalists kept loaded (`calibrate(standby=True)`)

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
              rates: Rates | None = None, servers: list[str] | None = None) -> list[StagedPlan]:
        """Every ranked candidate that fits the servers' free model slots (as `free_slots` last counted them),
        best first. ``shapes``: as `deepco.planning.staged.search`, or ``offload`` (the best single server).
        ``rates``: what to plan on (default: `rates` without ``exclude``); ``servers``: on which (default: those
        up at the start, less ``exclude``)."""
        servers = self.servers(exclude) if servers is None else servers
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

    def ahead(self, objective: str = "latency", kept: int = AHEAD_KEPT) -> tuple[list[StagedPlan], dict[str, float]]:
        """Plans for the whole cluster, the servers down since the start included, made now so that one joining
        later needs no search (on a 0.1-core camera a search beside the live frames took them from 90 to
        150-330 ms for 4 s): the ``kept`` best, and the rate each down server was assumed to have, as fast as
        the slowest server measured (a plan leans on it no more than on that one). Live adaptation re-predicts
        them on the joining server's measured rate (device.adaptation). No plans and no rates where every server
        answered at the start."""
        unreached = sorted(self.device.measurements.unreached)
        rates = self.rates()
        if not unreached or not rates.server_flops_per_second:
            return [], {}
        slowest = min(rates.server_flops_per_second.values())
        assumed = dict.fromkeys(unreached, slowest)
        rates.server_flops_per_second.update(assumed)
        everyone = [s.name for s in self.device.cluster.servers]
        return self.plans(objective, rates=rates, servers=everyone)[:kept], assumed

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
                  runoff_frames: int = 6, live: LiveFrames | None = None, standby: bool = False,
                  first_on_device: bool = False) -> StagedPlan:
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
        any more are unloaded at once: calibration never holds more than the finalists' models. With
        ``standby`` the finalists' models stay loaded for the run (`standby`, given back when the device closes):
        live adaptation switches to a plan on them without an upload from the device. With ``first_on_device``
        the first live frame runs on the device alone before the candidates are ranked (a weak camera ranks them
        for seconds, and no plan can run before the whole model sent ahead has landed)."""
        self.room, self._unfit_told = self.free_slots(), False
        dev = self.device
        balance = calibration.Balance(self.costs, dev.measured.rates())
        links = Links(self.costs, dev.measured.rates())
        runs = _PlanRuns(dev, live or _BlankFrames(self._blank()), balance, links)
        if live is not None and first_on_device:  # the first result does not wait for the ranking (`_plan`)
            runs.first_on_device()
        try:
            result = calibration.calibrate(
                self.costs, dev.measured.rates(), self._candidates, runs.time, runs.release, objective=objective,
                frames=frames, rounds=rounds, runoff_frames=runoff_frames, log=dev.log,
                compute_scale=self.compute_scale, step_overhead=self.step_overhead,
                spare=runs.spare if standby else None, balance=balance, links=links)
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
        dev.measurements.balance, dev.measurements.links = result.balance, result.links
        self.trials += result.trials
        self.standby += runs.spared
        if runs.spared:
            dev.log(f"calibration: the models of {len(runs.spared)} finalist(s) stay on the servers for live "
                    f"adaptation: {'; '.join(r.plan.describe() for r in runs.spared)}")
        return result.plan

    def _candidates(self, rates: Rates, objective: str, shapes: str) -> list[StagedPlan]:
        """Calibration's candidates: every ranked plan that fits (``all``), or the best of ``shapes`` that fits
        as a list of at most one."""
        if shapes == "all":
            fitting = self.plans(objective, rates=rates)
            if self.unfit_plans and not self._unfit_told:  # once: the first ranking is the one before any frame
                self._unfit_told = True
                self.device.log(f"calibration: {self.unfit_plans} of {len(fitting) + self.unfit_plans} candidate "
                                "plans need more model slots than the servers have free "
                                f"({', '.join(f'{k} {v}' for k, v in self.room.items())}): skipped")
            return fitting
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
        runs = _PlanRuns(self.device, _BlankFrames(self._blank()))
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
        runs = _PlanRuns(self.device, _BlankFrames(self._blank()))
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


class SourceEnded(Exception):
    """The source ran out of frames while calibration was timing plans on them."""


class LiveFrames:
    """The run's first frames, while calibration times plans on them (`StagedPlanner.calibrate`): each is taken
    from ``source`` (a device.feed.Feed, or frames, which become one), run on the plan being timed, and its
    result handed to ``emit(result, predicted)``; the frames left go on to the pipeline (`rest`: the same feed,
    with any frame a failed server gave back in front)."""

    def __init__(self, source: Feed | Iterable[np.ndarray], emit: Callable[[FrameResult, float], None]):
        self._feed = source if isinstance(source, Feed) else IterFeed(source)
        self.emit = emit
        self.taken = 0  # frames that gave a result
        self._current: Frame | None = None
        self._back: list[Frame] = []  # frames a failed server gave back, to run again first
        self.ended = False  # the source ran out before calibration settled
        self.stopped: str | None = None  # why calibration stopped before it settled (a server failed)

    @property
    def settled(self) -> bool:
        """Whether calibration ran to its end (its plan was measured against the others)."""
        return not self.ended and self.stopped is None

    def next(self) -> np.ndarray:
        """The next frame's pixels; SourceEnded when there are none."""
        if self._back:
            self._current = self._back.pop()
            return self._current.pixels
        try:
            frame = None
            while frame is None:  # a live source's next frame may not be there yet
                frame = self._feed.take(TICK)
        except EndOfFeed:
            self.ended = True
            raise SourceEnded from None
        self._current = frame
        return frame.pixels

    def put_back(self, x: np.ndarray) -> None:
        """A frame whose server failed: it is the next frame again."""
        assert self._current is not None and self._current.pixels is x
        self._back.append(self._current)

    def done(self, outputs: dict[str, np.ndarray], timing: FrameTiming, plan: StagedPlan) -> None:
        """A frame ran on ``plan``: hand its result on."""
        frame = self._current
        result = FrameResult(frame.index, outputs=outputs, latency=timing.latency, captured=frame.captured)
        timeline(result, timing, plan, 0.0, None)
        result.delivered = time.perf_counter()
        self.taken += 1
        self.emit(result, plan.predicted)

    def rest(self) -> Feed:
        """The frames calibration did not take."""
        return ResumedFeed(self._back[::-1], self._feed) if self._back else self._feed


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


def set_up_live(device: Device, plan: StagedPlan, feed: Feed,
                emit: Callable[[FrameResult, float], None]) -> tuple[StagedRunner, Feed]:
    """``plan``'s runner, set up while the frames of ``feed`` that come meanwhile run on the device alone
    (`_PlanRuns.set_up`; their results to ``emit``), and the frames left."""
    live = LiveFrames(feed, emit)
    return _PlanRuns(device, live).set_up(plan), live.rest()


SET_UP_GRACE = 2.0  # seconds a plan's set-up may take before live frames run on the device meanwhile
# Live frames the first plan calibration timed runs before a contender is set up: a contender's set-up slows the
# frames meanwhile (its models are made on the device and sent), so a cold start's first results come from the
# predicted best plan, steadily, and calibration goes on after them (issue 27).
SETTLE_FRAMES = 20


class _PlanRuns:
    """Calibration's ``time_plan`` and ``release`` on the device: a runner per plan, its models on the servers
    until the plan is released, and its frames from ``frames`` (`LiveFrames`, or `_BlankFrames`)."""

    def __init__(self, device: Device, frames: LiveFrames | _BlankFrames, balance: calibration.Balance | None = None,
                 links: Links | None = None):
        self.device, self.frames, self.balance, self.links = device, frames, balance, links
        self._runners: dict[str, StagedRunner] = {}
        self.spared: list[StagedRunner] = []
        self._local: StagedRunner | None = None  # the device alone, for live frames while models are sent
        self._timed: dict[str, float] = {}  # plan key -> median latency of its timed frames (`_meanwhile`)
        self._settled = False  # the first plan timed has run its SETTLE_FRAMES
        # a plan's frame during another's set-up was slower than the device alone: a weak device's CPU goes to
        # making and sending the models (a 0.1-core camera: 2.5-4.3 s against 0.3 s on its own)
        self._busy = False

    def time(self, plan: StagedPlan, frames: int, warm_up: bool) -> list[float]:
        """The latencies of ``frames`` frames of ``plan`` (after an untimed one when ``warm_up``: first runs
        allocate). Raises Unfit when a server has no room for its models."""
        key = plan_key(plan)
        self.device.progress(f"calibrating: timing {plan.brief()}")
        runner = self._runners.get(key)
        if runner is None:
            try:
                runner = self._runners[key] = self.set_up(plan)
            except NoRoom as exc:
                raise Unfit(str(exc)) from None
        if warm_up:
            self._frame(runner)
        latencies = [self._frame(runner, timed=True) for _ in range(frames)]
        if latencies:
            self._timed[key] = float(np.median(latencies))
        return latencies

    def set_up(self, plan: StagedPlan) -> StagedRunner:
        """``plan``'s runner. Setting it up sends its models to the servers (and makes them on the device), which
        over a slow radio, or on a weak camera, takes many frames' time: with live frames, those that come
        meanwhile run on the fastest plan timed so far whose models are on the servers, else on the device alone
        (`_meanwhile`), and give their results as they go (the camera's first results do not wait for the radio,
        and a contender's set-up does not send the frames back to the device). The first plan timed runs
        `SETTLE_FRAMES` more before the first contender is set up. Only once a set-up has taken
        `SET_UP_GRACE` seconds, or one frame on the device if longer: where models arrive sooner, the run waits
        for them, and calibration's frames are not spent elsewhere."""
        if not isinstance(self.frames, LiveFrames):
            return StagedRunner(self.device, plan)
        if self._timed and not self._settled:  # the first plan timed runs a while before any contender
            self._settled = True
            runner = self._meanwhile()
            with contextlib.suppress(SourceEnded):
                for _ in range(SETTLE_FRAMES):
                    self._frame(runner)
        grace = max(SET_UP_GRACE, self._local_seconds())
        told = False
        with ThreadPoolExecutor(1, thread_name_prefix="deepco-set-up") as pool:
            building = pool.submit(StagedRunner, self.device, plan)
            while True:
                try:
                    return building.result(timeout=grace)
                except TimeoutError:
                    runner = self._meanwhile()
                    if not told:
                        told = True
                        where = "the device" if runner is self._local else runner.plan.brief()
                        self.device.log(f"models on their way to the servers for {plan.brief()}: frames run on "
                                        f"{where} meanwhile")
                    try:
                        latency = self._frame(runner)
                    except SourceEnded:
                        return building.result()
                    if runner is not self._local and latency > self._local_seconds():
                        self._busy = True  # a set-up starves this device: its frames go to the device alone

    def first_on_device(self) -> None:
        """Run the next live frame on the device alone, its result handed on (nothing once the source has
        ended)."""
        with contextlib.suppress(SourceEnded):
            self._frame(self._meanwhile())

    def _meanwhile(self) -> StagedRunner:
        """Where a live frame runs while a plan is set up: the fastest plan timed so far (set up, not released),
        where it measured faster than the device alone is predicted; else the device alone."""
        timed = [(self._timed[key], runner) for key, runner in self._runners.items() if key in self._timed]
        best = min(timed, key=lambda t: t[0], default=None)
        if best is not None and best[0] < self._local_seconds() and not self._busy:
            return best[1]
        if self._local is None:
            self._local = StagedRunner(self.device, local_plan(self.device.costs, self.device.measured.rates()))
        return self._local

    def _local_seconds(self) -> float:
        """The device alone's predicted latency."""
        return local_plan(self.device.costs, self.device.measured.rates()).predicted

    def _frame(self, runner: StagedRunner, timed: bool = False) -> float:
        """Run the next frame on ``runner``; its latency. A frame whose server fails goes back to the frames. A
        ``timed`` one's server compute times go to the balance and its windows' arrivals to the links (not a frame
        beside a set-up: the servers it loads models on compute slower meanwhile)."""
        x = self.frames.next()
        try:
            outputs, timing = runner.run_frame(x)
        except ServerError:
            self.frames.put_back(x)
            raise
        self.frames.done(outputs, timing, runner.plan)
        if timed and self.balance is not None:
            self.balance.add(runner.plan, {step.name: step.compute for step in timing.servers},
                             {step.name: sum(b - a for phase, level, a, b in step.times.phases
                                             if phase == "compute" and level == 1) for step in timing.servers})
        if timed and self.links is not None:
            self.links.add(runner.plan, {step.name: step.received for step in timing.servers})
        return timing.latency

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
                runner.run_frame(self.frames.next())
        start = time.perf_counter()
        results = list(runner.run_frames([self.frames.next() for _ in range(frames)], depth=option.depth))
        seconds = time.perf_counter() - start
        failed = [r.error for r in results if r.error is not None]
        if failed:
            raise UserError(f"slo: {option.describe()} failed a frame while measured: {failed[0]}")
        return slo.Trial(option, float(np.percentile([r.latency for r in results], 95)), frames / seconds)

    def spare(self, plan: StagedPlan) -> None:
        """Keep ``plan``'s runner, its models on the servers, in ``spared`` (calibration's finalists)."""
        runner = self._runners.pop(plan_key(plan), None)
        if runner is not None:
            self.spared.append(runner)

    def release(self, plan: StagedPlan) -> None:
        """Give back ``plan``'s models."""
        runner = self._runners.pop(plan_key(plan), None)
        if runner is not None:
            runner.close()
