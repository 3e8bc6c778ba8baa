"""The staged runtime: executes a `deepco.planning.staged.StagedPlan` (local, offload or split) frame by frame.
Every plan runs here: auto's, local, offload, the paper's (deepco.planning.paper_plans) and MoDNN's.

    dev = Device(cluster, "resnet18", 720, 1280); dev.setup()      # measure, and the paper's plan (dev.plan)
    planner = StagedPlanner(dev)                                   # the exact cost model on dev's measurements
    runner = StagedRunner(dev, planner.best())                     # uploads what the plan needs
    output, timing = runner.run_frame(px)                          # px: 1x3xHxW uint8 pixels
    for result in runner.run_frames(frames, depth=2): ...          # pipelined, with failover

A split plan runs as one SplitRun job per participant (server/split_jobs.py): the device sends each participant
its input (the window of the image for segment 1 with lookahead, else its band) over its antenna, in the
plan's order; the servers run their segments, exchange halo rows directly, and either return their bands
(the device stitches them and runs the tail) or send them to the participant that runs the tail, which
returns the model's output. The device never re-derives the plan: rows, windows, crops, antennas and order
all come from it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np
from deepco_device import pipeline
from deepco_device.answers import check_rows, check_tensor, only_output, value_dtype, value_shape
from deepco_device.backpressure import while_busy
from deepco_device.giveup import GiveUp
from deepco_device.health import DriftWatch, Health
from deepco_device.lifecycle import NoRoom
from deepco_device.measuring import device_session as _session
from deepco_device.pipeline import RunStopped
from deepco_device.records import FrameResult

from deepco.errors import UserError
from deepco.planning.bands import NOT_A_SERVER
from deepco.planning.calibration import Timed, choose, fidelity, fit, with_compute_scale
from deepco.planning.plan import PlanningError
from deepco.planning.staged import (
    DEVICE,
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
from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire.client import ServerError, WrongAnswer
from deepco.wire.rows import encode_rows

T = TypeVar("T")
SETTLE_SECONDS = 0.03  # three CFS periods between timed frames: every quota starts a frame refilled
RUNOFF_WITHIN = 0.25  # calibrated plans this close to the fastest are timed again side by side

if TYPE_CHECKING:
    from deepco_device.session import Device


class _InFlight:
    """The gRPC calls of the frames in flight, so that a run that stops can cancel them all at once (a frozen
    server would otherwise hold each of them until its deadline)."""

    def __init__(self) -> None:
        self._calls: dict[Any, str] = {}  # call -> the server it waits on
        self._lock = threading.Lock()
        self.stopped = threading.Event()

    def add(self, call: Any, server: str) -> None:
        with self._lock:
            self._calls[call] = server
        if self.stopped.is_set():
            call.cancel()

    def discard(self, call: Any) -> None:
        with self._lock:
            self._calls.pop(call, None)

    def cancel_all(self) -> set[str]:
        """Cancel every call in flight, and every call started from now on; the servers they waited on."""
        self.stopped.set()
        with self._lock:
            calls = dict(self._calls)
        for call in calls:
            call.cancel()
        return set(calls.values())


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
        self.timed[key] = Timed(plan, [runner.run_frame(self.px)[1]["latency"] for _ in range(self.frames)])
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
                runoff[k].seconds.append(runners[k].run_frame(self.px)[1]["latency"])
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


class StagedRunner:
    """Runs one StagedPlan on a set-up Device's channels."""

    def __init__(self, device: Device, plan: StagedPlan, *, exchange_timeout: float = 30.0,
                 timeout: float | None = None, log: Callable[[str], None] | None = None):
        self.device, self.plan = device, plan
        self.exchange_timeout = exchange_timeout
        self.timeout = timeout or max(30.0, 20 * plan.predicted)
        self.log = log or device.log
        self.index = {s.name: k for k, s in enumerate(device.cluster.servers)}
        self.predicted = plan.predicted
        self._inflight = _InFlight()  # shared with the runners run_frames replans to
        self.held: list[tuple[str, str]] = []  # (address, model) this runner uploaded: `close` gives them back
        try:
            self._prepare()
        except BaseException:
            self.close()  # a plan that does not fit leaves nothing behind on the servers it did fit
            raise

    def close(self) -> None:
        """Give back the models this runner uploaded: those no other runner of the device uses are unloaded."""
        for turn in getattr(self, "turns", []):
            turn.close()
        held, self.held = self.held, []
        for problem in self.device.uploads.drop(held):
            self.log(f"warning: {problem}")

    # ---- setup ----------------------------------------------------------------------------------------
    def _upload(self, server: str, data: bytes) -> str:
        """Load (content-addressed, reference-counted: see device.lifecycle) and remember for the device's close."""
        client = self.device.client(self.index[server], 0)
        name = self.device.uploads.upload(client, data, self.device.tag)
        self.held.append((client.address, name))
        return name

    def _prepare(self) -> None:
        dev, plan = self.device, self.plan
        p = dev.partitioner
        if plan.kind == "local":
            self.whole = _session(dev.model.SerializeToString())
            self.whole_input = self.whole.get_inputs()[0].name
            return
        if plan.kind == "offload":
            self.whole_name = self._upload(plan.servers[0], p.whole().SerializeToString())
            self.whole_input = dev.model.graph.input[0].name
            self.output_shape = value_shape(dev.model.graph.output[0])  # what the server's answer must be
            self.output_dtype = value_dtype(dev.model.graph.output[0])
            return
        if plan.kind == "round-robin":
            from deepco.planning.staged import offload_plan_on

            self.turns = []
            for s, m in zip(plan.servers, plan.antennas, strict=True):
                self.turns.append(StagedRunner(dev, offload_plan_on(s, m), timeout=self.timeout, log=self.log))
            self._next = itertools.count()
            self._turn_lock = threading.Lock()
            return
        parts = _stage_models(dev, tuple(plan.levels))
        data = parts["segments"]
        self.segment_names = []
        for server in plan.servers:
            if server != DEVICE:
                self.segment_names = [self._upload(server, d) for d in data]
        if DEVICE in plan.servers:  # the device's own band: one stage (the planner allows no exchange with it)
            if "own" not in parts:
                parts["own"] = _session(data[0])
            self.own = parts["own"]
            self.own_input = self.own.get_inputs()[0].name
        tail = parts["tail"]
        # What the servers' answers must be: bands of the last level, or the tail's output (as NCHW on the wire)
        last = p.cut(plan.levels[-1])
        self.band_shape = (1, last.channels, None, last.width)
        self.band_dtype = value_dtype(tail.graph.input[0])
        self.output_shape = value_shape(tail.graph.output[0])
        self.output_dtype = value_dtype(tail.graph.output[0])
        if plan.tail is None:
            if "tail_session" not in parts:
                parts["tail_session"] = _session(parts["tail_bytes"])
            self.tail = parts["tail_session"]
            self.tail_input = self.tail.get_inputs()[0].name
            self.tail_name = ""
        else:
            self.tail_name = self._upload(plan.tail, parts["tail_bytes"])
        self.peers = [NOT_A_SERVER if s == DEVICE else dev.cluster.address_on(dev.cluster.servers[self.index[s]], 0)
                      for s in plan.servers]
        self.row_bytes = dev.channels * dev.width * p.graph.itemsize

    # ---- one frame ------------------------------------------------------------------------------------
    def run_frame(self, x: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        """One frame (1xCxHxW uint8 pixels): (the model's output, timing in seconds). Raises ServerError
        naming the server that failed. A busy server (RESOURCE_EXHAUSTED: back-pressure, e.g. while other
        frames' jobs hold its threads) is waited for with backoff, up to the runner's timeout."""
        try:
            return while_busy(lambda: self._run_frame(x), self.timeout, stop=self._inflight.stopped)
        except ServerError:
            if self._inflight.stopped.is_set():
                raise RunStopped("the run stopped") from None
            raise

    def _run_frame(self, x: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        if self.plan.kind == "round-robin":
            with self._turn_lock:
                turn = self.turns[next(self._next) % len(self.turns)]
            return turn._run_frame(x)
        start = time.perf_counter()
        if self.plan.kind == "local":
            output = self.whole.run(None, {self.whole_input: x})[0]
            return output, {"latency": time.perf_counter() - start, "compute": time.perf_counter() - start}
        if self.plan.kind == "offload":
            server = self.plan.servers[0]
            client = self.device.client(self.index[server], self.plan.antennas[0])
            calls: list[Any] = []
            try:
                handle = client.start_run(self.whole_name, {self.whole_input: x}, timeout=self.timeout,
                                          started=lambda call: (calls.append(call), self._inflight.add(call, server)))
                if self.device.pace:  # hold the antenna as a split plan's senders do (EMULATED bandwidth)
                    pause = start + x.nbytes / self.device.measured.antenna_bytes_per_second[self.plan.antennas[0]] \
                        - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)
                sent = time.perf_counter() - start
                outputs, compute, queued = handle.result()
            finally:
                for call in calls:
                    self._inflight.discard(call)
            what = f"the output of {server}"
            output = check_tensor(only_output(outputs, what, client.address), self.output_shape, self.output_dtype,
                                  what, client.address)
            return output, {"latency": time.perf_counter() - start, "sent": sent, "compute": compute,
                            "queue": queued, "server": server}
        return self._split_frame(x, start)

    def request(self, job: str, i: int, x: np.ndarray) -> dpb.SplitRequest:
        """The SplitRequest of participant ``i`` for frame ``x`` under job id ``job``."""
        plan = self.plan
        levels = []
        for j in range(len(plan.bands)):
            level = dpb.SplitLevel(owned=[dpb.RowRange(start=a, stop=b) for a, b in plan.bands[j]])
            if j:
                level.window.extend(dpb.RowRange(start=a, stop=b) for a, b in plan.windows[j])
                level.crop.extend(plan.crops[j])
            levels.append(level)
        a, b = plan.windows[0][i]
        gather = plan.servers.index(plan.tail) + 1 if plan.tail else 0
        return dpb.SplitRequest(job_id=job, segment_models=self.segment_names, server_index=i, peers=self.peers,
                                levels=levels, input=encode_rows(np.ascontiguousarray(x[:, :, a:b, :]), a),
                                exchange_timeout_seconds=self.exchange_timeout, lookahead=plan.lookahead,
                                gather_to=gather, tail_model=self.tail_name if gather == i + 1 else "")

    def _split_frame(self, x: np.ndarray, start: float) -> tuple[np.ndarray, dict[str, Any]]:
        with contextlib.ExitStack() as calls:
            return self._split_frame_tracked(x, start, calls)

    def _split_frame_tracked(self, x: np.ndarray, start: float,
                             calls: contextlib.ExitStack) -> tuple[np.ndarray, dict[str, Any]]:
        dev, plan = self.device, self.plan
        job = uuid.uuid4().hex
        n = len(plan.servers)
        streams: dict[int, Any] = {}
        sent_at: dict[int, float] = {}
        send_start: dict[int, float] = {}
        failure: list[ServerError] = []
        crashed: list[BaseException] = []  # a sender's own failure (not the server's): raised here
        lock = threading.Lock()
        by_antenna: dict[int, list[int]] = {}
        remote = [i for i in range(n) if plan.servers[i] != DEVICE]
        for i in sorted(remote, key=lambda i: plan.order[i]):
            by_antenna.setdefault(plan.antennas[i], []).append(i)

        def sender(m: int) -> None:
            for i in by_antenna[m]:
                client = dev.client(self.index[plan.servers[i]], m)
                began = time.perf_counter()
                send_start[i] = began - start
                try:
                    events = client.deepco.SplitRun(self.request(job, i, x), timeout=self.timeout)
                    self._inflight.add(events, plan.servers[i])
                    calls.callback(self._inflight.discard, events)
                    with lock:
                        streams[i] = events
                    first = next(events)
                    if first.WhichOneof("event") != "received":
                        raise WrongAnswer(client.address, "SplitRun answered out of order")
                except grpc.RpcError as exc:
                    failure.append(ServerError(client.address, exc.code(), exc.details() or ""))
                    return
                except ServerError as exc:
                    failure.append(exc)
                    return
                except BaseException as exc:  # noqa: BLE001 - the frame's thread raises it
                    crashed.append(exc)
                    return
                if dev.pace:  # hold the antenna for as long as these bytes take at its bandwidth (EMULATED)
                    a, b = plan.windows[0][i]
                    pause = began + (b - a) * self.row_bytes / dev.measured.antenna_bytes_per_second[m] \
                        - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)
                sent_at[i] = time.perf_counter() - start

        threads = [threading.Thread(target=sender, args=(m,), daemon=True) for m in by_antenna]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sent = time.perf_counter() - start
        results: dict[int, tuple[dpb.SplitResult, float]] = {}
        own_band = None
        if DEVICE in plan.servers and not failure:  # the device's band, while the servers compute theirs
            i = plan.servers.index(DEVICE)
            (lo, hi), (a, b) = plan.windows[1][i], plan.bands[1][i]
            began = time.perf_counter()
            y = self.own.run(None, {self.own_input: np.ascontiguousarray(x[:, :, lo:hi, :])})[0]
            crop = plan.crops[1][i]
            own_band = y[:, :, crop:crop + b - a]
            results[i] = (dpb.SplitResult(compute_seconds=time.perf_counter() - began), time.perf_counter() - start)

        def collect(i: int) -> tuple[dpb.SplitResult, float]:
            client = dev.client(self.index[plan.servers[i]], plan.antennas[i])
            try:
                event = next(streams[i])
            except grpc.RpcError as exc:
                raise ServerError(client.address, exc.code(), exc.details() or "") from None
            except StopIteration:
                raise ServerError(client.address, grpc.StatusCode.INTERNAL, "job ended without a result") from None
            if event.WhichOneof("event") != "split_result":
                raise WrongAnswer(client.address, "SplitRun answered out of order")
            return event.split_result, time.perf_counter() - start

        try:
            if crashed:
                raise crashed[0]
            if failure:
                raise failure[0]
            with ThreadPoolExecutor(max_workers=len(remote)) as pool:
                futures = {pool.submit(collect, i): i for i in remote}
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                errors = [f.exception() for f in done if f.exception() is not None]
                if errors:
                    raise root_cause(errors)
                for f, i in futures.items():
                    results[i] = f.result()
        except BaseException:
            for events in streams.values():
                events.cancel()
            raise
        collected = time.perf_counter()
        if plan.tail is not None:
            c = plan.servers.index(plan.tail)
            address = dev.client(self.index[plan.tail], 0).address
            rank = len(self.output_shape)  # Rows carry NCHW: a (1, classes) output travels as (1, classes, 1, 1)
            wire = (*self.output_shape, *([1] * (4 - rank)))
            array = check_rows(results[c][0].output, 0, wire, self.output_dtype, f"the output of {plan.tail}", address)
            output = array.reshape(array.shape[:rank])
            tail_seconds = 0.0
            began = collected
        else:
            pieces = []
            for i in range(n):
                if plan.servers[i] == DEVICE:
                    pieces.append(own_band)
                    continue
                a, b = plan.bands[-1][i]
                band = (*self.band_shape[:2], b - a, self.band_shape[3])
                what = f"the band of {plan.servers[i]}"
                pieces.append(check_rows(results[i][0].output, a, band, self.band_dtype, what,
                                         dev.client(self.index[plan.servers[i]], 0).address))
            stitched = np.ascontiguousarray(np.concatenate(pieces, axis=2))
            began = time.perf_counter()
            output = self.tail.run(None, {self.tail_input: stitched})[0]
            tail_seconds = time.perf_counter() - began
        end = time.perf_counter()
        timing: dict[str, Any] = {"latency": end - start, "sent": sent, "collected": collected - start,
                                  "stitch": began - collected, "tail": tail_seconds, "servers": []}
        for i in range(n):
            r, finish = results[i]
            timing["servers"].append({
                "name": plan.servers[i], "antenna": plan.antennas[i], "rows": list(plan.windows[0][i]),
                "band": list(plan.bands[-1][i]), "send_start": send_start.get(i, 0.0),
                "received": sent_at.get(i, 0.0), "finish": finish, "compute": r.compute_seconds,
                "exchange_wait": r.exchange_wait_seconds, "queue": r.queue_seconds,
                "messages_received": r.messages_received, "messages_sent": r.messages_sent,
                "bytes_received": r.bytes_received, "bytes_sent": r.bytes_sent})
        return output, timing

    # ---- a stream of frames ---------------------------------------------------------------------------
    def run_frames(self, inputs: Iterable[np.ndarray], depth: int = 2,
                   replan: Callable[[set[str]], StagedPlan] | None = None,
                   give_up: GiveUp | None = None, drift: DriftWatch | None = None) -> Iterator[FrameResult]:
        """Every input's result in order, ``depth`` frames in flight (device.pipeline). A server that fails,
        or answers wrongly (a tensor that does not fit the plan), is left out of a new plan (``replan(down)``)
        and the frame is run again on it; a frame that fails pipeline.MAX_RETRIES times (or with no server left) yields
        an explicit error. Nothing is lost. Down servers are probed and rejoin; with ``drift`` a server or
        antenna persistently off the plan is re-profiled and the device replans (device.health).

        Raises GaveUp (a UserError) when ``give_up`` (default: GiveUp()) says the run has failed for too long,
        after cancelling the calls in flight; a failure of the device's own code or of the frame source is a
        one-line UserError."""
        inflight = self._inflight

        def make(plan: StagedPlan) -> StagedRunner:
            runner = StagedRunner(self.device, plan, exchange_timeout=self.exchange_timeout, log=self.log)
            runner._inflight = inflight  # one set of calls to cancel, whichever runner started them
            return runner

        health = Health(self.device, self, make, replan, self._ready, self._server_of, drift)
        return pipeline.run_frames(health, inputs, depth, give_up or GiveUp(), inflight)

    def _ready(self, server: str) -> bool:
        return self.device.pool.ready(server)

    def _server_of(self, address: str) -> str | None:
        """The server listening at ``address`` (on any antenna)."""
        return self.device.pool.server_at(address)


def _stage_models(device: Device, levels: tuple[str, ...]) -> dict[str, Any]:
    """The segment models (bytes) and the tail (model, bytes; ORT sessions added by the runners) of a chain of
    levels, extracted once per device: a replan onto the same levels (failover, drift, rejoin) then costs
    no model extraction."""
    parts = device.stage_models.get(levels)
    if parts is None:
        p = device.partitioner
        segments = p.segments(levels[-1], models=True, through=list(levels[:-1]))
        _, tail = p.split(levels[-1])
        parts = {"segments": [seg.model.SerializeToString() for seg in segments], "tail": tail,
                 "tail_bytes": tail.SerializeToString()}
        device.stage_models[levels] = parts
    return parts


def root_cause(errors: list[BaseException]) -> BaseException:
    """Of several servers' failures, the one that names the cause rather than a consequence (a cancelled
    job, or a peer that stopped waiting because of it)."""
    def rank(exc: BaseException) -> int:
        code = getattr(exc, "code", None)
        return {grpc.StatusCode.CANCELLED: 2, grpc.StatusCode.DEADLINE_EXCEEDED: 1}.get(code, 0)

    return min(errors, key=rank)
