"""The staged runtime: executes a `deepco.planning.staged.StagedPlan` (local, offload or split) frame by frame.

    dev = Device(cluster, "resnet18", 720, 1280); dev.setup()      # measure (and THREAD's head, as before)
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

import itertools
import json
import queue
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np

from deepco.errors import UserError
from deepco.planning.plan import PlanningError
from deepco.planning.staged import CostModel, StagedPlan, best_offload, search, throughput
from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire.client import ServerError
from deepco.wire.rows import decode_rows, encode_rows
from device.records import FrameResult
from device.session import BUSY_BACKOFF, Device, _session

MAX_RETRIES = 3  # a frame whose servers fail is tried again on a new plan this many times


class StagedPlanner:
    """The staged planner on a set-up Device's measurements and model (see deepco.planning.staged)."""

    def __init__(self, device: Device):
        if device.measured is None:
            raise UserError("StagedPlanner needs a Device that is set up (Device.setup())")
        self.device = device
        out = device.tail.get_outputs()[0] if device.tail is not None else None
        out_bytes = 4 * int(np.prod([d if isinstance(d, int) else 1 for d in out.shape])) if out else 4096
        image_bytes = device.channels * device.height * device.width * device.partitioner.graph.itemsize
        self.costs = CostModel(device.partitioner, image_bytes, out_bytes)
        self.step_overhead = 0.0
        self.trials: list[dict] = []  # what calibrate() timed

    def rates(self, exclude: Iterable[str] = ()):
        """The measured rates (with the fitted step overhead), without the servers in ``exclude``."""
        r = self.device.measured.rates()
        r.step_overhead = self.step_overhead
        for name in exclude:
            r.server_flops_per_second.pop(name, None)
        return r

    def servers(self, exclude: Iterable[str] = ()) -> list[str]:
        """Names of the usable servers, in cluster order."""
        skip = set(exclude)
        return [s.name for s in self.device.cluster.servers if s.name not in skip]

    def plans(self, objective: str = "latency", exclude: Iterable[str] = (), shapes: str = "all") -> list[StagedPlan]:
        """Every ranked candidate, best first."""
        servers = self.servers(exclude)
        if not servers and shapes != "all":
            raise UserError("no server is left: every server of the cluster is down")
        try:
            if not servers:
                from deepco.planning.staged import local_plan

                return [local_plan(self.costs, self.rates(exclude))]
            return search(self.costs, self.rates(exclude), servers, objective=objective, shapes=shapes)
        except PlanningError as exc:
            raise UserError(str(exc)) from None

    def best(self, objective: str = "latency", exclude: Iterable[str] = ()) -> StagedPlan:
        """The fastest plan for ``objective``."""
        return self.plans(objective, exclude)[0]

    def named(self, name: str) -> StagedPlan:
        """``local``, ``offload`` (the best single server, tail included) or ``auto``."""
        if name == "local":
            return next(p for p in self.plans() if p.kind == "local")
        if name == "offload":
            return best_offload(self.costs, self.rates(), self.servers())
        if name == "auto":
            return self.best()
        raise UserError(f"unknown staged plan {name!r}")

    def calibrate(self, objective: str = "latency", frames: int = 2, rounds: int = 3) -> StagedPlan:
        """Plan, time the plan on real frames, fit the per-step overhead the cost model lacks, plan again;
        stop when the plan repeats; time local and the best offload too. Returns the fastest *measured* of the
        plans tried, re-predicted with the fitted overhead (every trial is kept in ``trials``). The timing uses
        blank pixels: a CNN's work does not depend on what the image shows."""
        from deepco.planning.staged import predict, steps

        px = np.zeros((1, self.device.channels, self.device.height, self.device.width), np.uint8)
        measured: dict[str, tuple[float, StagedPlan]] = {}
        plan = self.best(objective)
        for _ in range(rounds):
            key = json.dumps(plan.to_dict() | {"predicted": 0, "breakdown": {}}, sort_keys=True)
            if key in measured:
                break
            runner = StagedRunner(self.device, plan)
            runner.run_frame(px)  # warm-up: first runs allocate
            times = [runner.run_frame(px)[1]["latency"] for _ in range(frames)]
            seconds = statistics.median(times)
            measured[key] = (seconds, plan)
            n = steps(plan)
            base = self.step_overhead
            self.step_overhead = 0.0
            unexplained = seconds - predict(plan, self.costs, self.rates())["frame"]
            self.step_overhead = max(0.0, unexplained / n) if n else base
            self.trials.append({"plan": plan.describe(), "predicted": plan.predicted, "measured": seconds,
                                "steps": n, "step_overhead": self.step_overhead})
            self.device.log(f"calibration: {plan.describe()}: predicted {plan.predicted * 1e3:.1f} ms, measured "
                            f"{seconds * 1e3:.1f} ms; step overhead {self.step_overhead * 1e3:.2f} ms")
            plan = self.best(objective)
        if objective != "latency":  # one frame's time says little about sustained fps: keep the last plan
            return self._repredict(plan)
        # The single fitted overhead can misjudge the plan kinds it was not fitted on (a weak camera's own
        # per-message CPU makes a split look slow, and the same overhead then sinks offload too): local and
        # the best offload are timed as contenders, so auto is never slower than them as measured.
        for contender in (self.named("local"), self.named("offload")):
            key = json.dumps(contender.to_dict() | {"predicted": 0, "breakdown": {}}, sort_keys=True)
            if key not in measured:
                runner = StagedRunner(self.device, contender)
                runner.run_frame(px)
                seconds = statistics.median(runner.run_frame(px)[1]["latency"] for _ in range(frames))
                measured[key] = (seconds, contender)
                self.trials.append({"plan": contender.describe(), "predicted": contender.predicted,
                                    "measured": seconds, "steps": steps(contender), "contender": True})
                self.device.log(f"calibration: {contender.describe()}: measured {seconds * 1e3:.1f} ms")
        return self._repredict(min(measured.values(), key=lambda v: v[0])[1])

    def _repredict(self, plan: StagedPlan) -> StagedPlan:
        from deepco.planning.staged import predict

        plan.breakdown = predict(plan, self.costs, self.rates())
        plan.predicted = plan.breakdown["frame"]
        return plan

    def fps(self, plan: StagedPlan) -> float:
        """Predicted sustained frames per second of ``plan`` with frames pipelined."""
        return throughput(plan, self.costs, self.rates())


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
        self._prepare()

    # ---- setup ----------------------------------------------------------------------------------------
    def _upload(self, server: str, data: bytes) -> str:
        """Load (content-addressed, reference-counted: see device.lifecycle) and remember for the device's close."""
        return self.device.uploads.upload(self.device.client(self.index[server], 0), data, self.device.tag)

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
            return
        segments = p.segments(plan.levels[-1], models=True, through=plan.levels[:-1])
        data = [seg.model.SerializeToString() for seg in segments]
        self.segment_names = []
        for server in plan.servers:
            self.segment_names = [self._upload(server, d) for d in data]
        _, tail = p.split(plan.levels[-1])
        tail_bytes = tail.SerializeToString()
        self.tail_shape = [d.dim_value or 1 for d in tail.graph.output[0].type.tensor_type.shape.dim]  # batch 1
        if plan.tail is None:
            self.tail = _session(tail_bytes)
            self.tail_input = self.tail.get_inputs()[0].name
            self.tail_name = ""
        else:
            self.tail_name = self._upload(plan.tail, tail_bytes)
        self.peers = [dev.cluster.address_on(dev.cluster.servers[self.index[s]], 0) for s in plan.servers]
        self.row_bytes = dev.channels * dev.width * p.graph.itemsize

    # ---- one frame ------------------------------------------------------------------------------------
    def run_frame(self, x: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        """One frame (1xCxHxW uint8 pixels): (the model's output, timing in seconds). Raises ServerError
        naming the server that failed. A busy server (RESOURCE_EXHAUSTED: back-pressure, e.g. while other
        frames' jobs hold its threads) is waited for with backoff, up to the runner's timeout."""
        give_up = time.perf_counter() + self.timeout
        pause = BUSY_BACKOFF
        while True:
            try:
                return self._run_frame(x)
            except ServerError as exc:
                if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.perf_counter() + pause > give_up:
                    raise
            time.sleep(pause)
            pause = min(2 * pause, 0.5)

    def _run_frame(self, x: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        start = time.perf_counter()
        if self.plan.kind == "local":
            output = self.whole.run(None, {self.whole_input: x})[0]
            return output, {"latency": time.perf_counter() - start, "compute": time.perf_counter() - start}
        if self.plan.kind == "offload":
            server = self.plan.servers[0]
            client = self.device.client(self.index[server], self.plan.antennas[0])
            handle = client.start_run(self.whole_name, {self.whole_input: x}, timeout=self.timeout)
            if self.device.pace:  # hold the antenna as a split plan's senders do (EMULATED bandwidth)
                pause = start + x.nbytes / self.device.measured.antenna_bytes_per_second[self.plan.antennas[0]] \
                    - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
            sent = time.perf_counter() - start
            outputs, compute, queued = handle.result()
            output = next(iter(outputs.values()))
            return output, {"latency": time.perf_counter() - start, "sent": sent, "compute": compute,
                            "queue": queued, "server": server}
        return self._split_frame(x, start)

    def _request(self, job: str, i: int, x: np.ndarray) -> dpb.ModnnRequest:
        plan = self.plan
        levels = []
        for j in range(len(plan.bands)):
            level = dpb.ModnnLevel(owned=[dpb.RowRange(start=a, stop=b) for a, b in plan.bands[j]])
            if j:
                level.window.extend(dpb.RowRange(start=a, stop=b) for a, b in plan.windows[j])
                level.crop.extend(plan.crops[j])
            levels.append(level)
        a, b = plan.windows[0][i]
        gather = plan.servers.index(plan.tail) + 1 if plan.tail else 0
        return dpb.ModnnRequest(job_id=job, segment_models=self.segment_names, server_index=i, peers=self.peers,
                                levels=levels, input=encode_rows(np.ascontiguousarray(x[:, :, a:b, :]), a),
                                exchange_timeout_seconds=self.exchange_timeout, lookahead=plan.lookahead,
                                gather_to=gather, tail_model=self.tail_name if gather == i + 1 else "")

    def _split_frame(self, x: np.ndarray, start: float) -> tuple[np.ndarray, dict[str, Any]]:
        dev, plan = self.device, self.plan
        job = uuid.uuid4().hex
        n = len(plan.servers)
        streams: dict[int, Any] = {}
        sent_at: dict[int, float] = {}
        failure: list[ServerError] = []
        lock = threading.Lock()
        by_antenna: dict[int, list[int]] = {}
        for i in sorted(range(n), key=lambda i: plan.order[i]):
            by_antenna.setdefault(plan.antennas[i], []).append(i)

        def sender(m: int) -> None:
            for i in by_antenna[m]:
                client = dev.client(self.index[plan.servers[i]], m)
                began = time.perf_counter()
                try:
                    events = client.deepco.ModnnRun(self._request(job, i, x), timeout=self.timeout)
                    with lock:
                        streams[i] = events
                    first = next(events)
                    if first.WhichOneof("event") != "received":
                        raise ServerError(client.address, grpc.StatusCode.INTERNAL, "answered out of order")
                except grpc.RpcError as exc:
                    failure.append(ServerError(client.address, exc.code(), exc.details() or ""))
                    return
                except ServerError as exc:
                    failure.append(exc)
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
        results: dict[int, tuple[dpb.ModnnResult, float]] = {}
        try:
            if failure:
                raise failure[0]
            for i in range(n):
                client = dev.client(self.index[plan.servers[i]], plan.antennas[i])
                try:
                    event = next(streams[i])
                except grpc.RpcError as exc:
                    raise ServerError(client.address, exc.code(), exc.details() or "") from None
                except StopIteration:
                    raise ServerError(client.address, grpc.StatusCode.INTERNAL, "job ended without a result") \
                        from None
                results[i] = (event.modnn_result, time.perf_counter() - start)
        except BaseException:
            for events in streams.values():
                events.cancel()
            raise
        collected = time.perf_counter()
        if plan.tail is not None:
            c = plan.servers.index(plan.tail)
            array, _ = decode_rows(results[c][0].output, f"output of {plan.tail}")
            output = array.reshape(self.tail_shape) if array.size == int(np.prod(self.tail_shape)) else None
            if output is None:
                raise ServerError(dev.client(self.index[plan.tail], 0).address, grpc.StatusCode.INTERNAL,
                                  f"returned an output of shape {list(array.shape)}, expected {self.tail_shape}")
            tail_seconds = 0.0
        else:
            pieces = []
            for i in range(n):
                array, row = decode_rows(results[i][0].output, f"band of {plan.servers[i]}")
                a, b = plan.bands[-1][i]
                if row != a or array.shape[2] != b - a:
                    raise ServerError(dev.client(self.index[plan.servers[i]], 0).address, grpc.StatusCode.INTERNAL,
                                      f"returned rows [{row}, {row + array.shape[2]}), expected [{a}, {b})")
                pieces.append(array)
            stitched = np.ascontiguousarray(np.concatenate(pieces, axis=2))
            began = time.perf_counter()
            output = self.tail.run(None, {self.tail_input: stitched})[0]
            tail_seconds = time.perf_counter() - began
        end = time.perf_counter()
        timing: dict[str, Any] = {"latency": end - start, "collected": collected - start, "tail": tail_seconds,
                                  "servers": []}
        for i in range(n):
            r, finish = results[i]
            timing["servers"].append({"name": plan.servers[i], "antenna": plan.antennas[i],
                                      "sent": sent_at.get(i, 0.0), "finish": finish, "compute": r.compute_seconds,
                                      "exchange_wait": r.exchange_wait_seconds, "queue": r.queue_seconds})
        return output, timing

    # ---- a stream of frames ---------------------------------------------------------------------------
    def run_frames(self, inputs: Iterable[np.ndarray], depth: int = 2,
                   replan: Callable[[set[str]], StagedPlan] | None = None) -> Iterator[FrameResult]:
        """Every input's result in order, ``depth`` frames in flight. A server that fails is left out of a new
        plan (``replan(down)``) and the frame is run again on it; a frame that fails MAX_RETRIES times (or
        with no server left) yields an explicit error. Nothing is lost."""
        down: set[str] = set()
        lock = threading.Lock()
        runner = [self]

        def one(index: int, x: np.ndarray) -> FrameResult:
            result = FrameResult(index)
            began = time.perf_counter()
            for _ in range(MAX_RETRIES + 1):
                with lock:
                    current = runner[0]
                try:
                    result.output, timing = current.run_frame(x)
                    result.error = None  # an earlier try's failure was recovered from
                    result.latency = time.perf_counter() - began
                    result.tail = timing.get("tail", 0.0)
                    return result
                except ServerError as exc:
                    failed = self._server_of(exc.address)
                    if replan is None:
                        result.error = str(exc)
                        break
                    with lock:
                        if failed and failed not in down:
                            down.add(failed)
                            self.log(f"server {failed} down ({exc.code.name}); replanning without it")
                        if runner[0] is current:
                            try:
                                runner[0] = StagedRunner(self.device, replan(set(down)), log=self.log)
                            except UserError as err:
                                result.error = f"{exc}; and no plan is left: {err}"
                                break
                    result.error = str(exc)
            result.latency = time.perf_counter() - began
            return result

        pending: queue.Queue = queue.Queue()
        with ThreadPoolExecutor(max_workers=depth) as pool:
            sources = iter(inputs)
            for index in itertools.count():
                try:
                    x = next(sources)
                except StopIteration:
                    break
                pending.put(pool.submit(one, index, x))
                while pending.qsize() >= depth:
                    yield pending.get().result()
            while not pending.empty():
                yield pending.get().result()

    def _server_of(self, address: str) -> str | None:
        """The server listening at ``address`` (on any antenna)."""
        cluster = self.device.cluster
        return next((s.name for s in cluster.servers for m in range(len(cluster.device.antennas))
                     if cluster.address_on(s, m) == address), None)


class RoundRobinRunner:
    """Whole frames dealt to the servers in turn (frame-level parallelism): each frame is an offload."""

    def __init__(self, device: Device, planner: StagedPlanner):
        from deepco.planning.staged import offload_plan

        self.runners = [StagedRunner(device, offload_plan(planner.costs, planner.rates(), s), log=device.log)
                        for s in planner.servers()]
        self._next = itertools.count()
        self._lock = threading.Lock()
        self.predicted = sum(r.predicted for r in self.runners) / len(self.runners)
        self.plan = self.runners[0].plan

    def run_frame(self, x: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        """The next server in turn runs the whole frame."""
        with self._lock:
            k = next(self._next) % len(self.runners)
        return self.runners[k].run_frame(x)
