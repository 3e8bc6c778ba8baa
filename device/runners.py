"""The staged runtime: a runner per plan kind executes a `deepco.planning.staged.StagedPlan` frame by frame.

    runner = StagedRunner(dev, plan)                 # the runner of plan.kind (RUNNERS); uploads what it needs
    outputs, timing = runner.run_frame(px)           # px: 1x3xHxW uint8 pixels; outputs: every output by name
    for result in runner.run_frames(frames, depth=2): ...          # pipelined, with failover

`LocalRunner` runs the whole model on the device, `OffloadRunner` on one server, `RoundRobinRunner` deals
whole frames to its servers in turn (an offload runner each), and `SplitRunner` runs a split plan as one
SplitRun job per participant (server/split_jobs.py): the device sends each participant its input (the window of
the image for segment 1 with lookahead, else its band) over its antenna, in the plan's order; the servers run
their segments, exchange halo rows directly, and either return their bands (the device stitches them and
runs the tail) or send them to the participant that runs the tail, which returns the model's outputs. Every
runner returns every output of the model, by name, each checked against the model when a server made it
(device/answers.py). The device never re-derives the plan: rows, windows, crops, antennas and order all come from it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import grpc
import numpy as np
from deepco_device import pipeline
from deepco_device.adaptation import Adaptation
from deepco_device.answers import Outputs, check_named_rows, check_outputs, check_rows, output_specs, value_dtype
from deepco_device.backpressure import while_busy
from deepco_device.feed import Feed
from deepco_device.giveup import GiveUp
from deepco_device.health import Health
from deepco_device.lifecycle import NoRoom, StageSource
from deepco_device.measuring import device_session as _session
from deepco_device.pipeline import RunStopped
from deepco_device.records import FrameResult, FrameTiming, ServerStep, StepTimes

from deepco.errors import UserError
from deepco.partition.derive import Dims, open_segment
from deepco.partition.open_rows import CLOSED, Sides, sides_bits, sides_for
from deepco.planning.bands import NOT_A_SERVER
from deepco.planning.staged import DEVICE, StagedPlan, offload_plan_on, streamed
from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire.client import ServerError, SplitJob, WrongAnswer
from deepco.wire.split_jobs import input_rows, job_request, job_skeleton, request_bytes, rest_bytes
from deepco.wire.step_times import StepClock

if TYPE_CHECKING:
    from deepco_device.session import Device


def paced(began: float, nbytes: int, bytes_per_second: float) -> None:
    """EMULATED bandwidth (app-level pacing on a fast link): wait until ``nbytes`` sent from ``began`` would have
    arrived, before sending them. Sent first and held after, the server would compute while the link was
    still "carrying" its input, hiding its compute behind the transfer: an offload on a slow link measured about
    the transfer time alone, where a real link adds the two (and the cost model does)."""
    pause = began + nbytes / bytes_per_second - time.perf_counter()
    if pause > 0:
        time.sleep(pause)


EVICTED_RETRIES = 2  # a frame whose models were gone from a server is run again after reloading them, this often


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


class StagedRunner:
    """Runs one StagedPlan on a set-up Device's channels. ``StagedRunner(dev, plan)`` makes the runner of the
    plan's kind (`RUNNERS`), which uploads what the plan needs; a plan that does not fit leaves nothing behind
    on the servers it did fit."""

    kind: ClassVar[str] = ""

    @classmethod
    def least_depth(cls, plan: StagedPlan) -> int:
        """Frames a runner of ``plan`` has in flight at least (round-robin: one a server)."""
        return 1

    @property
    def frames_at_once(self) -> int:
        """Frames this runner can usefully have in flight by itself (`least_depth` of its plan)."""
        return self.least_depth(self.plan)

    def __new__(cls, device: Device, plan: StagedPlan, **kwargs: Any) -> StagedRunner:
        if cls is StagedRunner:
            cls = RUNNERS[plan.kind]
        return super().__new__(cls)

    def __init__(self, device: Device, plan: StagedPlan, *, exchange_timeout: float = 30.0,
                 timeout: float | None = None, log: Callable[[str], None] | None = None):
        self.device, self.plan = device, plan
        self.exchange_timeout = exchange_timeout
        self.timeout = timeout or max(30.0, 20 * plan.predicted)
        self.log = log or device.log
        self.index = {s.name: k for k, s in enumerate(device.cluster.servers)}
        self.predicted = plan.predicted
        self._inflight = _InFlight()  # shared with the runners run_frames replans to
        self.held: list[tuple[str, str]] = []  # (server, model) this runner uploaded: `close` gives them back
        self.loads: list[tuple[Any, str, bytes]] = []  # (client, name, bytes) of each: loaded again if evicted
        self._reloading = threading.Lock()  # one reload at a time (frames in flight may all find models gone)
        self._skeletons: dict[int, bytes] = {}  # a split's serialized requests but job id and rows, by participant
        try:
            self._prepare()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Give back the models this runner uploaded: those no other runner of the device uses are unloaded."""
        held, self.held, self.loads = self.held, [], []
        for problem in self.device.uploads.drop(held):
            self.log(f"warning: {problem}")

    def _upload(self, server: str, data: bytes, source: StageSource | None = None) -> str:
        """Load ``data`` on ``server`` (content-addressed, reference-counted, derived by the server from ``source``
        where it can: see device.lifecycle) over the plan's antenna to it, and remember it for `close`."""
        return self._upload_all([(server, data, source)])[0]

    def _upload_all(self, loads: list[tuple[str, bytes, StageSource | None]]) -> list[str]:
        """`_upload` each (server, bytes, source) of ``loads``; their names, in order. A server's models go one
        after another over the antenna the plan sends that server's frames on, the servers' all at once: a slow
        radio's set-up is then its share of the bytes on each antenna rather than all of them on the first (at
        8 Mbit/s a ResNet-18 split's models took 107 s over one of two antennas). After a failure no server
        starts another model (the runner is closed: it would only be unloaded again); the first failure is raised
        once every server's uploads have ended, with what did load in `held` for `close`."""
        by_server: dict[str, list[int]] = {}
        for k, (server, _, _) in enumerate(loads):
            by_server.setdefault(server, []).append(k)
        # opened here, not on the threads: Channels.client is not for threads
        clients = {server: self.device.client(self.index[server], self._antenna(server)) for server in by_server}
        names = [""] * len(loads)
        failed = threading.Event()

        def upload(server: str) -> None:
            for k in by_server[server]:
                if failed.is_set():
                    return
                _, data, source = loads[k]
                try:
                    names[k] = self.device.uploads.upload(server, clients[server], data, self.device.tag, source)
                except BaseException:
                    failed.set()
                    raise
                self.held.append((server, names[k]))
                self.loads.append((clients[server], names[k], data))

        if len(by_server) <= 1:  # no thread for one server
            for server in by_server:
                upload(server)
            return names
        for future in _at_once([lambda server=server: upload(server) for server in by_server], failed):
            future.result()
        return names

    def _antenna(self, server: str) -> int:
        """The antenna the plan sends ``server``'s frames on (0 where it names none)."""
        plan = self.plan
        if server in plan.servers and len(plan.antennas) == len(plan.servers):
            return plan.antennas[plan.servers.index(server)]
        return 0

    def _models(self) -> list[tuple[Any, str, bytes]]:
        """(client, name, bytes) of every model this runner's frames need on a server."""
        return list(self.loads)

    def reload_evicted(self) -> bool:
        """Load again every model of this runner that its server no longer holds (a server unloads a model no
        one used for its ``--model-lease``: a device suspended, or frozen, for that long finds them gone). Whether
        every model is on its server now (then a frame that failed with NOT_FOUND is run again, not lost, and
        the server is not taken for down); one line per server that had lost some."""
        with self._reloading:
            by_client: dict[Any, list[tuple[str, bytes]]] = {}
            for client, name, data in self._models():
                by_client.setdefault(client, []).append((name, data))
            try:
                for client, models in by_client.items():
                    loaded = set(client.loaded_models())
                    gone = [(name, data) for name, data in models if name not in loaded]
                    for _, data in gone:
                        self.device.uploads.reload(client, data, self.device.tag)
                    if gone:
                        self.log(f"server {client.address} had lost {len(gone)} model(s) of the plan (its lease ran "
                                 "out?): loaded again, the frame runs again")
            except UserError:  # the server does not answer, or has no room now: a failure, as before
                return False
        return True

    def _prepare(self) -> None:
        raise NotImplementedError

    @classmethod
    def extracted(cls, device: Device, plan: StagedPlan) -> list[tuple[str, bytes]] | None:
        """The (server, model bytes) a runner of ``plan`` uploads, from the models the device extracted so far;
        None where one was never extracted (then it was never uploaded either)."""
        return []

    # ---- one frame ------------------------------------------------------------------------------------
    def run_frame(self, x: np.ndarray) -> tuple[Outputs, FrameTiming]:
        """One frame (1xCxHxW uint8 pixels): (every output of the model by name, its timing). Raises ServerError
        naming the server that failed. A busy server (RESOURCE_EXHAUSTED: back-pressure, e.g. while other frames' jobs
        hold its threads) is waited for with backoff, up to the runner's timeout. A model gone from its server
        (NOT_FOUND: evicted when its lease ran out) is loaded again and the frame run again (`reload_evicted`)."""
        reloads = 0
        while True:
            try:
                return while_busy(lambda: self._run_frame(x), self.timeout, stop=self._inflight.stopped)
            except ServerError as exc:
                if self._inflight.stopped.is_set():
                    raise RunStopped("the run stopped") from None
                # a model gone from a server that answers: load it again rather than take the server for down
                if exc.code != grpc.StatusCode.NOT_FOUND or reloads >= EVICTED_RETRIES or not self.reload_evicted():
                    raise
                reloads += 1

    def _run_frame(self, x: np.ndarray) -> tuple[np.ndarray, FrameTiming]:
        raise NotImplementedError

    # ---- a stream of frames ---------------------------------------------------------------------------
    def run_frames(self, inputs: Iterable[np.ndarray] | Feed, depth: int = 2,
                   replan: Callable[[set[str]], StagedPlan] | None = None,
                   give_up: GiveUp | None = None, adapt: Adaptation | None = None,
                   first: int = 0, in_flight: Callable[[], int] | None = None) -> Iterator[FrameResult]:
        """Every input's result in order (numbered from ``first`` where ``inputs`` are frames; a
        device.feed.Feed numbers its own), ``depth`` frames in flight (device.pipeline; ``in_flight``: fewer
        while it says so). A server that fails, or answers wrongly (a tensor that does not fit the plan), is
        left out of a new plan (``replan(down)``) and the frame is run again on it; a frame that fails
        pipeline.MAX_RETRIES times (or with no server left) yields an explicit error. Nothing is lost. Down
        servers are probed and rejoin; with ``adapt`` the run measures its rates from live frames and switches
        to a plan that measures faster when they change (device.adaptation).

        Raises GaveUp (a UserError) when ``give_up`` (default: GiveUp()) says the run has failed for too long,
        after cancelling the calls in flight; a failure of the device's own code or of the frame source is a
        one-line UserError."""
        inflight = self._inflight

        def make(plan: StagedPlan) -> StagedRunner:
            runner = StagedRunner(self.device, plan, exchange_timeout=self.exchange_timeout, log=self.log)
            runner._inflight = inflight  # one set of calls to cancel, whichever runner started them
            return runner

        dev = self.device
        health = Health(dev, self, make, replan, self._ready, self._server_of, adapt,
                        unreached=dev.measurements.unreached, measure=dev.measure_server)
        return pipeline.run_frames(health, inputs, depth, give_up or GiveUp(), inflight, first, in_flight)

    def _ready(self, server: str) -> bool:
        return self.device.pool.ready(server)

    def _server_of(self, address: str) -> str | None:
        """The server listening at ``address`` (on any antenna)."""
        return self.device.pool.server_at(address)


class LocalRunner(StagedRunner):
    """The whole model on the device."""

    kind = "local"

    def _prepare(self) -> None:
        self.whole = _session(self.device.model.SerializeToString())
        self.whole_input = self.whole.get_inputs()[0].name
        self.output_names = [o.name for o in self.whole.get_outputs()]

    def _run_frame(self, x: np.ndarray) -> tuple[Outputs, FrameTiming]:
        start = time.perf_counter()
        outputs = dict(zip(self.output_names, self.whole.run(None, {self.whole_input: x}), strict=True))
        return outputs, FrameTiming(latency=time.perf_counter() - start, compute=time.perf_counter() - start)


class OffloadRunner(StagedRunner):
    """The whole model on one server: the device sends pixels and gets the output."""

    kind = "offload"

    def _prepare(self) -> None:
        dev = self.device
        g = dev.partitioner.graph
        source = _source(dev, [g.input_name], list(g.outputs), Dims.WHOLE, "whole")
        self.whole_name = self._upload(self.plan.servers[0], _whole_bytes(dev), source)
        self.whole_input = dev.model.graph.input[0].name
        self.output_specs = output_specs(dev.model)  # what the server's answer must be

    @classmethod
    def extracted(cls, device: Device, plan: StagedPlan) -> list[tuple[str, bytes]] | None:
        whole = device.stage_models.get(WHOLE)
        return None if whole is None else [(server, whole["bytes"]) for server in plan.servers]

    def _run_frame(self, x: np.ndarray) -> tuple[Outputs, FrameTiming]:
        start = time.perf_counter()
        server, antenna = self.plan.servers[0], self.plan.antennas[0]
        client = self.device.client(self.index[server], antenna)
        calls: list[Any] = []
        try:
            if self.device.pace:  # EMULATED bandwidth, as a split plan's senders pace: see `paced`
                paced(start, x.nbytes, self.device.measured.antenna_bytes_per_second[antenna])
            handle = client.start_run(self.whole_name, {self.whole_input: x}, timeout=self.timeout,
                                      started=lambda call: (calls.append(call), self._inflight.add(call, server)))
            sent = time.perf_counter() - start
            outputs, wire_times = handle.result()
        finally:
            for call in calls:
                self._inflight.discard(call)
        what = f"the output of {server}"
        checked = check_outputs(outputs, self.output_specs, what, client.address)
        latency, times = time.perf_counter() - start, StepTimes.from_wire(wire_times)
        step = ServerStep(server, antenna, (0, x.shape[2]), (0, 0), received=sent, finish=latency, times=times,
                          origin=max(0.0, latency - times.wall))  # upper bound: the answer's return is not timed
        return checked, FrameTiming(latency=latency, sent=sent, compute=times.compute, queue=times.queue,
                                    server=server, servers=(step,))


class RoundRobinRunner(StagedRunner):
    """Whole frames dealt to the plan's servers in turn, an offload runner each."""

    kind = "round-robin"

    @classmethod
    def least_depth(cls, plan: StagedPlan) -> int:
        return len(plan.servers)

    def _prepare(self) -> None:
        self.turns: list[OffloadRunner] = []
        plans = [offload_plan_on(s, m) for s, m in zip(self.plan.servers, self.plan.antennas, strict=True)]
        for plan in plans:  # opened here, not on the threads: Channels.client is not for threads
            self.device.client(self.index[plan.servers[0]], plan.antennas[0])
        # each turn's whole model goes to its own server over its own antenna, all at once (as `_upload_all`)
        made = _at_once([lambda plan=plan: OffloadRunner(self.device, plan, timeout=self.timeout, log=self.log)
                         for plan in plans])
        self.turns = [turn.result() for turn in made if turn.exception() is None]  # `close` gives them back
        for turn in made:
            turn.result()  # the first failure
        self._next = itertools.count()
        self._turn_lock = threading.Lock()

    extracted = OffloadRunner.extracted

    def _models(self) -> list[tuple[Any, str, bytes]]:
        return [m for turn in self.turns for m in turn._models()]

    def close(self) -> None:
        """Give back every turn's models."""
        for turn in getattr(self, "turns", []):
            turn.close()
        super().close()

    def _run_frame(self, x: np.ndarray) -> tuple[Outputs, FrameTiming]:
        with self._turn_lock:
            turn = self.turns[next(self._next) % len(self.turns)]
        return turn._run_frame(x)


@dataclass
class _Sends:
    """What one split frame's senders left behind: the participants' event streams and times, or a failure."""

    streams: dict[int, SplitJob] = field(default_factory=dict)
    send_start: dict[int, float] = field(default_factory=dict)
    sent_at: dict[int, float] = field(default_factory=dict)
    received_at: dict[int, float] = field(default_factory=dict)  # its `received` event came (before any pacing)
    failure: list[ServerError] = field(default_factory=list)
    crashed: list[BaseException] = field(default_factory=list)  # a sender's own failure (not the server's)
    lock: threading.Lock = field(default_factory=threading.Lock)


class SplitRunner(StagedRunner):
    """A split plan: one SplitRun job per participant (see the module doc)."""

    kind = "split"

    def _prepare(self) -> None:
        dev, plan = self.device, self.plan
        p = dev.partitioner
        levels = tuple(plan.levels)
        parts = _stage_models(dev, levels)
        loads = []
        for i, server in enumerate(plan.servers):
            if server == DEVICE:
                continue
            for j, (a, b, _) in enumerate(parts["sources"], start=1):
                sides = participant_sides(dev, plan, j, i)
                data, name = _segment_bytes(dev, levels, j, sides)
                loads.append((server, data, _source(dev, [a], [b], Dims.ROWS, name, sides)))
        tail = parts["tail"]
        if plan.tail is not None:
            cut = p.cut(plan.levels[-1]).tensor
            loads.append((plan.tail, parts["tail_bytes"],
                          _source(dev, [cut], list(p.graph.outputs), Dims.STATIC, tail.graph.name)))
        names = iter(self._upload_all(loads))
        # content-addressed; each participant's models are those of its windows' open sides (`participant_sides`)
        self.segment_models = [[] if server == DEVICE else [next(names) for _ in parts["sources"]]
                               for server in plan.servers]
        self.tail_name = next(names) if plan.tail is not None else ""
        if DEVICE in plan.servers:  # the device's own band: one stage (the planner allows no exchange with it)
            sides = participant_sides(dev, plan, 1, plan.servers.index(DEVICE))
            own = parts.setdefault("own", {})
            if sides not in own:
                own[sides] = _session(_segment_bytes(dev, levels, 1, sides)[0])
            self.own = own[sides]
            self.own_input = self.own.get_inputs()[0].name
        # What the servers' answers must be: bands of the last level, or the tail's output (as NCHW on the wire)
        last = p.cut(plan.levels[-1])
        self.band_shape = (1, last.channels, None, last.width)
        self.band_dtype = value_dtype(tail.graph.input[0])
        self.output_specs = output_specs(tail)
        if plan.tail is None:
            if "tail_session" not in parts:
                parts["tail_session"] = _session(parts["tail_bytes"])
            self.tail = parts["tail_session"]
            self.tail_input = self.tail.get_inputs()[0].name
            self.tail_outputs = [o.name for o in self.tail.get_outputs()]
        self.peers = [NOT_A_SERVER if s == DEVICE else dev.cluster.address_on(dev.cluster.servers[self.index[s]], 0)
                      for s in plan.servers]
        self.row_bytes = dev.channels * dev.width * p.graph.itemsize

    @property
    def segment_names(self) -> list[str]:
        """Every segment model this runner loaded, once each."""
        return list(dict.fromkeys(name for names in self.segment_models for name in names))

    @classmethod
    def extracted(cls, device: Device, plan: StagedPlan) -> list[tuple[str, bytes]] | None:
        levels = tuple(plan.levels)
        if device.stage_models.get(levels) is None:
            return None
        out = [(server, _segment_bytes(device, levels, j, participant_sides(device, plan, j, i))[0])
               for i, server in enumerate(plan.servers) if server != DEVICE for j in range(1, len(levels) + 1)]
        return out + ([(plan.tail, device.stage_models[levels]["tail_bytes"])] if plan.tail is not None else [])

    @property
    def rests(self) -> list[tuple[int, int] | None]:
        """Per participant, the rows of its window sent after its request (a streamed window), or None."""
        return streamed(self.plan)

    def tables(self, i: int) -> dict[str, Any]:
        """Participant ``i``'s request but its job id and rows (deepco.wire.split_jobs.job_skeleton's arguments)."""
        plan = self.plan
        return dict(segment_models=self.segment_models[i], peers=self.peers, bands=plan.bands, windows=plan.windows,
                    crops=plan.crops, exchange_timeout=self.exchange_timeout, lookahead=plan.lookahead,
                    tail=plan.servers.index(plan.tail) if plan.tail else None, tail_model=self.tail_name,
                    parts=plan.overlap, rest=self.rests[i])

    def request(self, job: str, i: int, x: np.ndarray) -> dpb.SplitRequest:
        """The SplitRequest of participant ``i`` for frame ``x`` under job id ``job`` (deepco.wire.split_jobs)."""
        return job_request(job, i, image=x, **self.tables(i))

    def request_bytes(self, job: str, i: int, x: np.ndarray) -> bytes:
        """`request` serialized, from participant ``i``'s skeleton serialized once per runner: a frame's
        request costs the camera one copy of its window and no message building."""
        skeleton = self._skeletons.get(i)
        if skeleton is None:
            skeleton = self._skeletons[i] = job_skeleton(i, **self.tables(i)).SerializeToString()
        return request_bytes(skeleton, job, x, input_rows(self.plan.windows, i, self.rests[i]))

    def _run_frame(self, x: np.ndarray) -> tuple[Outputs, FrameTiming]:
        start = time.perf_counter()
        with contextlib.ExitStack() as calls:
            remote = [i for i in range(len(self.plan.servers)) if self.plan.servers[i] != DEVICE]
            sends = self._send_all(x, start, remote, calls)
            sent = time.perf_counter() - start
            results: dict[int, tuple[dpb.SplitResult, float]] = {}
            own_band = self._own_band(x, start, results) if DEVICE in self.plan.servers and not sends.failure \
                else None
            self._collect_all(sends, start, remote, results)
            collected = time.perf_counter()
            outputs, began, tail_seconds = self._finish(results, own_band, collected)
            end = time.perf_counter()
            return outputs, FrameTiming(latency=end - start, sent=sent, collected=collected - start,
                                       stitch=began - collected, tail=tail_seconds,
                                       servers=self._steps(sends, results))

    def _send_all(self, x: np.ndarray, start: float, remote: list[int], calls: contextlib.ExitStack) -> _Sends:
        """Start every remote participant's job, one sender thread per antenna sending in the plan's order;
        returns when every input is sent (or a send failed)."""
        plan = self.plan
        sends = _Sends()
        by_antenna: dict[int, list[int]] = {}
        for i in sorted(remote, key=lambda i: plan.order[i]):
            by_antenna.setdefault(plan.antennas[i], []).append(i)
        job = uuid.uuid4().hex
        threads = [threading.Thread(target=self._sender, args=(m, by_antenna[m], job, x, start, sends, calls),
                                    daemon=True) for m in by_antenna]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sends

    def _sender(self, m: int, participants: list[int], job: str, x: np.ndarray, start: float, sends: _Sends,
                calls: contextlib.ExitStack) -> None:
        """Send ``participants`` their inputs over antenna ``m``, one after another: every request first, then
        the rest of each streamed window in the same order (so that every server starts on its first rows
        before any rest holds the antenna). The first failure ends the antenna's sends."""
        dev, plan, rests = self.device, self.plan, self.rests
        try:
            for i in participants:
                client = dev.client(self.index[plan.servers[i]], m)
                began = time.perf_counter()
                sends.send_start[i] = began - start
                if dev.pace:  # hold the antenna for as long as these bytes take at its bandwidth (EMULATED)
                    a, b = plan.windows[0][i]
                    paced(began, ((rests[i] or (b, b))[0] - a) * self.row_bytes,
                          dev.measured.antenna_bytes_per_second[m])
                handle = client.start_split_bytes(self.request_bytes(job, i, x), timeout=self.timeout)
                self._inflight.add(handle.call, plan.servers[i])
                calls.callback(self._inflight.discard, handle.call)
                with sends.lock:
                    sends.streams[i] = handle
                handle.received()
                sends.received_at[i] = time.perf_counter() - start
                sends.sent_at[i] = time.perf_counter() - start
            acknowledged = {}
            for i in participants:
                if (rest := rests[i]) is None:
                    continue
                if dev.pace:
                    paced(time.perf_counter(), (rest[1] - rest[0]) * self.row_bytes,
                          dev.measured.antenna_bytes_per_second[m])
                acknowledged[i] = dev.client(self.index[plan.servers[i]], m).send_rows(
                    rest_bytes(job, i, x, rest), timeout=self.timeout)
            for i, ack in acknowledged.items():
                ack()
                sends.sent_at[i] = time.perf_counter() - start
        except ServerError as exc:
            sends.failure.append(exc)
        except BaseException as exc:  # noqa: BLE001 - the frame's thread raises it
            sends.crashed.append(exc)

    def _own_band(self, x: np.ndarray, start: float, results: dict[int, tuple[dpb.SplitResult, float]]) -> Any:
        """The device's band, computed while the servers compute theirs."""
        plan = self.plan
        i = plan.servers.index(DEVICE)
        (lo, hi), (a, b) = plan.windows[1][i], plan.bands[1][i]
        began = time.perf_counter()
        y = self.own.run(None, {self.own_input: np.ascontiguousarray(x[:, :, lo:hi, :])})[0]
        crop = plan.crops[1][i]
        own = dpb.SplitResult()
        clock = StepClock(own.times, began)  # the device's own step, timed like a server's
        clock.since("compute", began, 1)
        clock.finish()
        results[i] = (own, time.perf_counter() - start)
        return y[:, :, crop:crop + b - a]

    def _collect_all(self, sends: _Sends, start: float, remote: list[int],
                     results: dict[int, tuple[dpb.SplitResult, float]]) -> None:
        """Every remote participant's result (with when it came) into ``results``; the first failure (its root
        cause) is raised, after cancelling every job of the frame."""

        def collect(i: int) -> tuple[dpb.SplitResult, float]:
            return sends.streams[i].result(), time.perf_counter() - start

        try:
            if sends.crashed:
                raise sends.crashed[0]
            if sends.failure:
                raise sends.failure[0]
            with ThreadPoolExecutor(max_workers=len(remote)) as pool:
                futures = {pool.submit(collect, i): i for i in remote}
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                errors = [f.exception() for f in done if f.exception() is not None]
                if errors:
                    raise root_cause(errors)
                for f, i in futures.items():
                    results[i] = f.result()
        except BaseException:
            for events in sends.streams.values():
                events.cancel()
            raise

    def _finish(self, results: dict[int, tuple[dpb.SplitResult, float]], own_band: Any,
                collected: float) -> tuple[Outputs, float, float]:
        """The model's outputs from the participants' results: the tail participant's, or the bands stitched
        and the tail run on the device. (outputs, when the tail began, the tail's seconds)."""
        dev, plan = self.device, self.plan
        if plan.tail is not None:
            c = plan.servers.index(plan.tail)
            address = dev.client(self.index[plan.tail], 0).address
            outputs = check_named_rows(results[c][0].outputs, self.output_specs, f"the output of {plan.tail}", address)
            return outputs, collected, 0.0
        pieces = []
        for i, server in enumerate(plan.servers):
            if server == DEVICE:
                pieces.append(own_band)
                continue
            a, b = plan.bands[-1][i]
            band = (*self.band_shape[:2], b - a, self.band_shape[3])
            pieces.append(check_rows(results[i][0].output, a, band, self.band_dtype, f"the band of {server}",
                                     dev.client(self.index[server], 0).address))
        stitched = np.ascontiguousarray(np.concatenate(pieces, axis=2))
        began = time.perf_counter()
        outputs = dict(zip(self.tail_outputs, self.tail.run(None, {self.tail_input: stitched}), strict=True))
        return outputs, began, time.perf_counter() - began

    def _steps(self, sends: _Sends, results: dict[int, tuple[dpb.SplitResult, float]]) -> tuple[ServerStep, ...]:
        plan = self.plan
        steps = []
        for i in range(len(plan.servers)):
            r, finish = results[i]
            times = StepTimes.from_wire(r.times)
            # Both are upper bounds of the step's start on the device's clock (each event reaches it late): the least
            origin = min(sends.received_at.get(i, finish) - times.input, finish - times.wall)
            steps.append(ServerStep(
                name=plan.servers[i], antenna=plan.antennas[i], rows=tuple(plan.windows[0][i]),
                band=tuple(plan.bands[-1][i]), send_start=sends.send_start.get(i, 0.0),
                received=sends.sent_at.get(i, 0.0), finish=finish, times=times,
                origin=max(origin, sends.send_start.get(i, 0.0)),
                messages_received=r.messages_received, messages_sent=r.messages_sent,
                bytes_received=r.bytes_received, bytes_sent=r.bytes_sent))
        return tuple(steps)


class ScalesRunner(SplitRunner):
    """A plan across scales (deepco.planning.staged.scales_plan): every participant runs the stages from the
    image through levels of several tensors (a U-Net's or a detector's scales, skips included) on bands of
    image rows, the servers exchanging each tensor's halo between stages; then either every participant
    returns its band of every tensor of the last level by name, and the device checks each band against the
    plan, stitches every tensor and runs the rest of the model, or the ``tail`` participant gathers them and
    returns the model's outputs. Sending and collecting are a split's."""

    kind = "scales"

    def _prepare(self) -> None:
        dev, plan = self.device, self.plan
        parts = _level_models(dev, tuple(plan.levels))
        sources = [_source(dev, stage.inputs, stage.outputs, Dims.TENSOR_ROWS, stage.model.graph.name)
                   for stage in parts["stages"]]
        loads = [(server, data, source) for server in plan.servers
                 for data, source in zip(parts["stages_bytes"], sources, strict=True)]
        g = dev.partitioner.graph
        if plan.tail is not None:
            tail = parts["tail"]
            loads.append((plan.tail, parts["tail_bytes"], _source(dev, [i.name for i in tail.graph.input],
                                                                  list(g.outputs), Dims.STATIC, tail.graph.name)))
            self.output_specs = output_specs(tail)
        names = self._upload_all(loads)
        # content-addressed: the same on every server
        self.segment_models = [names[:len(sources)] for _ in plan.servers]
        self.tail_name = names[-1] if plan.tail is not None else ""
        dtypes = {vi.name: value_dtype(vi) for stage in parts["stages"]
                  for vi in [*stage.model.graph.input, *stage.model.graph.output]}
        # what each participant's band of tensor t must be: (channels, width, data type)
        self.bands_of = {t: (g.shapes[t][1], g.hw[t][1], dtypes[t]) for t in plan.tensors[-1]}
        self.tail = parts["tail_session"] if plan.tail is None else None
        self.peers = [dev.cluster.address_on(dev.cluster.servers[self.index[s]], 0) for s in plan.servers]
        self.row_bytes = dev.channels * dev.width * g.itemsize

    @classmethod
    def extracted(cls, device: Device, plan: StagedPlan) -> list[tuple[str, bytes]] | None:
        parts = device.stage_models.get(("scales", *plan.levels))
        if parts is None:
            return None
        out = [(server, data) for server in plan.servers for data in parts["stages_bytes"]]
        return out + ([(plan.tail, parts["tail_bytes"])] if plan.tail is not None else [])

    def tables(self, i: int) -> dict[str, Any]:
        """Participant ``i``'s request but its job id and rows: its window (or band) of the image's place, and
        every level's tensor tables."""
        plan = self.plan
        return dict(segment_models=self.segment_models[i], peers=self.peers, bands=plan.bands, windows=plan.windows,
                    crops=[[0] * len(plan.servers) if j else [] for j in range(len(plan.bands))],
                    exchange_timeout=self.exchange_timeout, lookahead=plan.lookahead,
                    tail=plan.servers.index(plan.tail) if plan.tail else None, tail_model=self.tail_name,
                    tensors=plan.tensors)

    def _finish(self, results: dict[int, tuple[dpb.SplitResult, float]], own_band: Any,
                collected: float) -> tuple[Outputs, float, float]:
        """The tail participant's outputs, or every tensor of the last level stitched from the participants'
        checked bands and the rest of the model run on them (the level holds the model's outputs themselves
        when there is no rest)."""
        dev, plan = self.device, self.plan
        if plan.tail is not None:
            return super()._finish(results, own_band, collected)
        pieces: dict[str, list[np.ndarray]] = {t: [] for t in self.bands_of}
        for i, server in enumerate(plan.servers):
            address = dev.client(self.index[server], 0).address
            bands = {m.name: m.rows for m in results[i][0].outputs}
            if sorted(bands) != sorted(pieces) or len(results[i][0].outputs) != len(pieces):
                raise WrongAnswer(address, f"the bands of {server} are of tensors {sorted(bands)[:8]}, expected "
                                           f"{sorted(pieces)[:8]}")
            for t, (channels, width, dtype) in self.bands_of.items():
                a, b = plan.tensors[-1][t]["owned"][i]
                pieces[t].append(check_rows(bands[t], a, (1, channels, b - a, width), dtype,
                                            f"the band of {t!r} from {server}", address))
        level = {t: np.ascontiguousarray(np.concatenate(p, axis=2)) for t, p in pieces.items()}
        began = time.perf_counter()
        if self.tail is None:
            outputs = {o: level[o] for o in dev.partitioner.graph.outputs}
        else:
            names = [o.name for o in self.tail.get_outputs()]
            feeds = {i.name: level[i.name] for i in self.tail.get_inputs()}
            outputs = dict(zip(names, self.tail.run(None, feeds), strict=True))
        return outputs, began, time.perf_counter() - began


# The one place a plan's kind picks code: its runner.
RUNNERS: dict[str, type[StagedRunner]] = {r.kind: r for r in (LocalRunner, OffloadRunner, RoundRobinRunner,
                                                              SplitRunner, ScalesRunner)}


WHOLE = ("whole",)  # the whole model's entry in a device's extracted models
_EXTRACTING = threading.Lock()  # `_whole_bytes`: the servers' uploads may want it at once


def warm(device: Device, plan: StagedPlan) -> bool:
    """Whether every model ``plan`` needs is loaded on its servers already (by this device): a runner of it
    uploads nothing, so switching to it costs the camera's CPU and antennas nothing."""
    needed = RUNNERS[plan.kind].extracted(device, plan)
    if needed is None:
        return False
    return all(device.uploads.holds(server, data, device.tag) for server, data in needed)


def upload_bytes(device: Device, plan: StagedPlan) -> int:
    """About how many bytes a runner of ``plan`` would send to load its models now: those its servers do not hold
    from this device, at most the whole model's size (a server derives a stage from a whole model it holds or
    fetches from a peer, so a radio carries a whole model about once: `Uploads._derive`); the whole model's
    size where its stage models were never extracted (extracting them to count would cost a weak camera
    seconds of CPU). The whole model's bytes are serialized once per device (`_whole_bytes`; a cold start
    has them already): protobuf's ``ByteSize`` serializes the message to count it, each time."""
    whole = len(_whole_bytes(device))
    needed = RUNNERS[plan.kind].extracted(device, plan)
    if needed is None:
        return whole
    return min(whole, sum(len(data) for server, data in needed if not device.uploads.holds(server, data, device.tag)))


def send_whole_early(device: Device) -> threading.Thread | None:
    """On a cold start, send the whole model to the fastest server up in the background, while the device plans
    and its first frames run (issue 27): a derived stage is made from it there, and the other servers fetch it
    from there over their LAN. So the radio carries it once, in parts over every antenna, rather than once per
    server when calibration asks. The thread (None where no server is up). A failure is one warning line;
    calibration then sends what its plans need, as it would have."""
    rates = device.rates()
    up = [name for name in device.servers() if name not in device.down and name in rates.server_flops_per_second]
    if not up:
        return None
    target = max(up, key=rates.server_flops_per_second.__getitem__)
    antenna = max(range(len(rates.antenna_bytes_per_second)), key=rates.antenna_bytes_per_second.__getitem__)
    client = device.client([s.name for s in device.cluster.servers].index(target), antenna)

    def send() -> None:
        try:
            device.uploads.hold_whole(target, client, _whole_bytes(device), device.tag)
        except NoRoom:
            pass  # calibration plans within the room the servers have
        except (UserError, ValueError) as exc:  # ServerError is a UserError; ValueError: its channel closed
            device.log(f"warning: the whole model was not sent to {target} ahead of planning: {exc}")

    thread = threading.Thread(target=send, name="deepco-whole-ahead", daemon=True)
    thread.start()
    return thread


def _whole_bytes(device: Device) -> bytes:
    """The whole model's bytes as a server runs it, extracted once per device: a weak camera takes seconds to
    copy and serialise a ResNet, which an offload made again (failover, a switch) must not cost."""
    with _EXTRACTING:
        parts = device.stage_models.get(WHOLE)
        if parts is None:
            parts = device.stage_models[WHOLE] = {"bytes": device.partitioner.whole().SerializeToString()}
    return parts["bytes"]


def _source(device: Device, inputs: list[str], outputs: list[str], dims: Dims, name: str,
            sides: Sides = CLOSED) -> StageSource:
    """How a server derives the stage from ``inputs`` to ``outputs`` itself (device.lifecycle.StageSource), on
    open ``sides`` (a segment's: deepco.partition.open_rows)."""
    return StageSource(whole=lambda: _whole_bytes(device), inputs=tuple(inputs), outputs=tuple(outputs),
                       dims=int(dims), name=name, height=device.height, width=device.width,
                       open_rows=sides_bits(sides))


def participant_sides(device: Device, plan: StagedPlan, j: int, i: int) -> Sides:
    """The open sides of participant ``i``'s model of segment ``j`` (1-based): those of its window of the level
    that are not at the level's border (the planner's crops and FLOPs assume the same: `CostModel.sides`), none
    for a plan saved before runs on open rows; a segment with no open form ignores them (`_segment_bytes`)."""
    if not plan.open_rows:
        return CLOSED
    height = device.height if j == 1 else device.partitioner.cut(plan.levels[j - 2]).height
    return sides_for(plan.windows[j][i], height)


def _segment_bytes(device: Device, levels: tuple[str, ...], j: int, sides: Sides) -> tuple[bytes, str]:
    """Segment ``j``'s (1-based) model of the chain ``levels`` on open ``sides``, serialized, and its graph
    name; made once per device. The model's own where both sides are closed or it has no open form."""
    parts = _stage_models(device, levels)
    segment = parts["segs"][j - 1]
    if sides == CLOSED or segment.steps is None:
        return parts["segments"][j - 1], parts["sources"][j - 1][2]
    opened = parts.setdefault("open", {})
    if (j, sides) not in opened:
        model = open_segment(segment.model, sides)
        opened[(j, sides)] = (model.SerializeToString(), model.graph.name)
    return opened[(j, sides)]


def _stage_models(device: Device, levels: tuple[str, ...]) -> dict[str, Any]:
    """The segment models (bytes) and the tail (model, bytes; ORT sessions added by the runners) of a chain of
    levels, extracted once per device: a replan onto the same levels (failover, a switch, rejoin) then costs
    no model extraction."""
    parts = device.stage_models.get(levels)
    if parts is None:
        p = device.partitioner
        segments = p.segments(levels[-1], models=True, through=list(levels[:-1]))
        _, tail = p.split(levels[-1])
        parts = {"segments": [seg.model.SerializeToString() for seg in segments], "segs": segments, "tail": tail,
                 "tail_bytes": tail.SerializeToString(),
                 "sources": [(seg.source, seg.target, seg.model.graph.name) for seg in segments]}
        device.stage_models[levels] = parts
    return parts


def _level_models(device: Device, levels: tuple[str, ...]) -> dict[str, Any]:
    """The stages from the image through ``levels`` (deepco.partition.levels; their models' bytes) and the rest
    of the model from the last level's tensors (model, bytes, and an ORT session; None when the level holds
    every output), once per device."""
    key = ("scales", *levels)
    parts = device.stage_models.get(key)
    if parts is None:
        p = device.partitioner
        stages = p.stages(list(levels))
        tail = p.level_tail(levels[-1])
        parts = {"stages": stages, "stages_bytes": [stage.model.SerializeToString() for stage in stages],
                 "tail": tail, "tail_bytes": None if tail is None else tail.SerializeToString(),
                 "tail_session": None if tail is None else _session(tail.SerializeToString())}
        device.stage_models[key] = parts
    return parts


def _at_once(calls: list[Callable[[], Any]], stop: threading.Event | None = None) -> list[Future]:
    """Run each of ``calls`` on a thread of its own; their futures once every one has ended. An interrupt of the
    wait (Ctrl-C) sets ``stop`` and is raised at once: the device closes meanwhile, and closing its channels
    cancels the calls the threads are in."""
    pool = ThreadPoolExecutor(len(calls), thread_name_prefix="deepco-upload")
    try:
        futures = [pool.submit(call) for call in calls]
        wait(futures)
    except BaseException:
        if stop is not None:
            stop.set()
        raise
    finally:
        pool.shutdown(wait=False)
    return futures


def root_cause(errors: list[BaseException]) -> BaseException:
    """Of several servers' failures, the one that names the cause rather than a consequence (a cancelled
    job, or a peer that stopped waiting because of it)."""
    def rank(exc: BaseException) -> int:
        code = getattr(exc, "code", None)
        return {grpc.StatusCode.CANCELLED: 2, grpc.StatusCode.DEADLINE_EXCEEDED: 1}.get(code, 0)

    return min(errors, key=rank)
