"""The device: connect to the servers, measure them, plan, and run frames through the plan.

Setup: export (or read) the model, analyse it with the exact partitioner, time the device itself on the
whole model, upload a reference head to every server and time it there (DeepcoService.Profile), probe
each antenna's bandwidth (DeepcoService.Echo), then plan every candidate cut (THREAD's association and
order + integer rows on the exact cost model) and keep the cut of least predicted frame time. Its head
goes to the servers, its tail stays here.

Running: one sender thread per antenna sends each frame's slices in the plan's order, one after another
(the next send starts when the server reports the previous slice received); antennas run in parallel;
results are collected as they come, cropped, stitched and fed to the tail. Up to ``depth`` frames are in
flight, so frame k+1's transfers overlap frame k's computation.
"""

from __future__ import annotations

import collections
import queue
import re
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
import numpy as np
import onnxruntime as ort
from deepco_device.answers import check_tensor, only_output, value_dtype
from deepco_device.giveup import TICK, GiveUp
from deepco_device.lifecycle import Uploads
from deepco_device.preprocess import Preprocessing, preprocessing_for
from deepco_device.records import FrameResult, InFlightFrame, Measurements, ServerTiming

from deepco.cluster import Cluster
from deepco.errors import UserError
from deepco.modelcard import check_input
from deepco.partition import Cut, Partitioner, load_model
from deepco.partition.pixels import with_pixel_input
from deepco.planning import make_plan
from deepco.planning.rows import Node, RowPlan, SliceBill, abstract_instance, association, equal_rows, size_rows
from deepco.planning.staged import MIN_STAGE_FLOPS
from deepco.planning.thread import association_steps
from deepco.wire.client import InferenceClient, ServerError, WrongAnswer
from deepco.wire.security import ChannelSecurity

T = TypeVar("T")
ALGORITHMS = ("thread", "thread-sa", "single", "equal")
PROBE_BYTES = 1 << 20
PEER_PROBE_BYTES = 4 << 20  # server to server: larger, the links may be a LAN
PROBE_SECONDS = 0.5  # how often a down server is asked whether it is back
MIN_DEADLINE = 2.0  # seconds a slice may always take (start-up hiccups, a slow first run)
DEADLINE_FACTOR = 10.0  # ... or this many times the plan's frame time, if longer
BUSY_BACKOFF = 0.02  # first pause (s) when every server answers RESOURCE_EXHAUSTED; doubles up to 0.5 s
DRIFT_THRESHOLD = 0.5  # replan when a server or link is this much (50%) off the plan ...
DRIFT_SAMPLES = 5  # ... for this many slices in a row, all in the same direction


def _session(model_bytes: bytes, threads: int = 1) -> ort.InferenceSession:
    """An ORT session for the device. One thread, no spinning: a camera has one weak core (under a CPU
    quota, spinning threads burn the quota and throttle the whole process)."""
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def _while_busy(call: Callable[[], T], patience: float = 60.0) -> T:
    """``call()``, retried with backoff while the server answers RESOURCE_EXHAUSTED (back-pressure: other
    devices' setups hold its work slots), for at most ``patience`` seconds."""
    give_up = time.monotonic() + patience
    pause = BUSY_BACKOFF
    while True:
        try:
            return call()
        except ServerError as exc:
            if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() + pause > give_up:
                raise
        time.sleep(pause)
        pause = min(2 * pause, 0.5)


def _marshal_seconds_per_byte(nbytes: int = 1 << 20) -> float:
    """The device's own CPU time to encode and serialise one byte of a request (measured here, so under the
    device's CPU share): a weak camera pays it for every slice it sends."""
    from deepco.wire.tensors import encode_request

    x = np.zeros((1, 1, 1, nbytes), np.uint8)
    return _median_seconds(lambda: encode_request("probe", {"x": x}).SerializeToString(), runs=5) / nbytes


def _median_seconds(fn: Callable[[], object], runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Device:
    """A device running one model over the servers of a cluster file."""

    def __init__(self, cluster: Cluster, model: str, height: int, width: int, *, algorithm: str = "thread",
                 cut: str = "auto", weights: str | None = None, pace: bool = False, depth: int = 2,
                 log: Callable[[str], None] = print, security: ChannelSecurity | None = None,
                 preprocessing: Preprocessing | None = None):
        if algorithm not in ALGORITHMS:
            raise UserError(f"unknown algorithm {algorithm!r} (choose from {', '.join(ALGORITHMS)})")
        if depth < 1:
            raise UserError(f"pipeline depth must be >= 1, got {depth}")
        self.cluster, self.model_spec, self.height, self.width = cluster, model, height, width
        self.algorithm, self.cut_spec, self.weights, self.pace, self.depth = algorithm, cut, weights, pace, depth
        self.log = log
        self.security = security
        self.clients: dict[tuple[str, int], InferenceClient] = {}
        self.uploads = Uploads()  # unloaded on close()
        self.down: set[str] = set()  # servers marked failed, probed until they answer again
        self.suspect: set[str] = set()  # servers that answered wrongly: down for good, never probed back
        self.events: list[dict] = []  # down / up, with times (perf_counter)
        self._health = threading.RLock()
        self.drift_threshold = DRIFT_THRESHOLD
        self._drift: dict[str, collections.deque] = {}
        self.plan: RowPlan | None = None
        self.cut: Cut | None = None
        self.measured: Measurements | None = None
        self.preprocessing = preprocessing or preprocessing_for(model)  # checked against the model in setup()
        self.channels = self.preprocessing.channels
        self.tag = re.sub(r"[^A-Za-z0-9_.-]", "_", model.rsplit("/", 1)[-1])

    # ---- setup ----------------------------------------------------------------------------------------
    def client(self, server: int, antenna: int) -> InferenceClient:
        """The channel to ``server`` over ``antenna`` (opened once)."""
        key = (self.cluster.servers[server].name, antenna)
        if key not in self.clients:
            address = self.cluster.address_on(self.cluster.servers[server], antenna)
            self.clients[key] = InferenceClient(address, timeout=120.0, security=self.security)
        return self.clients[key]

    def close(self) -> None:
        """Unload what this device uploaded (not from servers marked down), then close every channel."""
        index = {s.name: k for k, s in enumerate(self.cluster.servers)}
        down = {self.client(index[name], 0).address for name in self.down if name in index}
        for problem in self.uploads.release(skip=down):
            self.log(f"warning: {problem}")
        for c in self.clients.values():
            c.close()
        self.clients.clear()

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def setup(self, rows: bool = True) -> RowPlan | None:
        """Load, measure, plan and upload; returns the plan (also printed through ``log``). ``rows=False``
        stops after measuring: the staged planner (device/staged.py) plans and uploads for itself, and the
        paper's row plans over every cut would only cost time (seconds per cut on a weak device)."""
        self.reference_model = load_model(self.model_spec, self.height, self.width, self.weights)
        how = self.preprocessing
        check_input(self.reference_model, how)  # a clear error before ORT sees the wrong pixels
        # the device sends uint8 pixels; the normalisation runs in the first stage's graph
        self.model = with_pixel_input(self.reference_model, how.mean, how.std, how.scale)
        self.partitioner = p = Partitioner(self.model, self.height, self.width)
        cuts = p.cuts if self.cut_spec == "auto" else [p.cut(self.cut_spec)]
        if self.cut_spec == "auto":  # a cut with next to no work before it only sends float32 instead of pixels
            cuts = [c for c in cuts if c.head_flops >= MIN_STAGE_FLOPS * p.total_flops] or cuts
        for k in range(len(self.cluster.servers)):
            self.client(k, 0).wait_ready(timeout=10.0)
        x = np.zeros((1, self.channels, self.height, self.width), np.uint8)
        whole = _session(self.model.SerializeToString())
        self.input_name = whole.get_inputs()[0].name
        device_rate = p.total_flops / _median_seconds(lambda: whole.run(None, {self.input_name: x}))
        reference = max(cuts, key=lambda c: c.head_flops)  # most work: the steadiest FLOP/s measurement
        ref_head, _ = p.split(reference)
        ref_name = f"{self.tag}-probe-{uuid.uuid4().hex[:8]}"  # other devices may probe the same servers
        rates = {}
        for k, srv in enumerate(self.cluster.servers):
            c = self.client(k, 0)
            _while_busy(lambda c=c: c.load_model(ref_head.SerializeToString(), ref_name))
            seconds = _while_busy(lambda c=c: c.profile(ref_name, x.shape, runs=3, warmup=1).seconds)
            rates[srv.name] = reference.head_flops / seconds
            c.unload_model(ref_name)
        bandwidths, overhead = self._probe_links()
        peer, peer_overhead = self._probe_peers()
        self.measured = Measurements(rates, bandwidths, overhead, device_rate, self.pace, peer, peer_overhead,
                                     _marshal_seconds_per_byte())
        if not rows:
            return None
        plans = {c.name: self._plan_at(c, self.algorithm) for c in cuts}
        self.cut = min(cuts, key=lambda c: (plans[c.name].frame_time, -cuts.index(c)))
        self.plan = plans[self.cut.name]
        if len(cuts) > 1:
            others = ", ".join(f"{n} {pl.frame_time * 1e3:.1f}" for n, pl in plans.items())
            self.log(f"cut: {self.cut.name} (least predicted frame time, ms: {others})")
        self._upload()
        return self.plan

    def plan_for(self, algorithm: str) -> RowPlan:
        """Another algorithm's plan at the chosen cut, on the same measurements (for side-by-side runs)."""
        if algorithm not in ALGORITHMS:
            raise UserError(f"unknown algorithm {algorithm!r} (choose from {', '.join(ALGORITHMS)})")
        assert self.cut is not None, "setup() first"
        return self._plan_at(self.cut, algorithm)

    def _probe_links(self) -> tuple[list[float], float]:
        antennas = self.cluster.device.antennas
        if self.pace:  # the configured bandwidth is what pacing will enforce
            overhead = _median_seconds(lambda: self.client(0, 0).echo(1), runs=5)
            return [a.bandwidth * 1e6 / 8 for a in antennas], overhead
        bandwidths, overheads = [], []
        for m in range(len(antennas)):
            c = self.client(0, m)
            small = _median_seconds(lambda c=c: c.echo(1), runs=5)
            big = _median_seconds(lambda c=c: c.echo(PROBE_BYTES), runs=3)
            bandwidths.append(PROBE_BYTES / max(big - small, 1e-6))
            overheads.append(small)
        return bandwidths, statistics.median(overheads)

    def _probe_peers(self) -> tuple[float, float]:
        """Server-to-server bandwidth and per-message overhead: the two strongest-listed servers probe each
        other both ways (ProbePeer); (0, 0) with one server."""
        servers = self.cluster.servers
        if len(servers) < 2:
            return 0.0, 0.0
        samples = []
        for a, b in ((0, 1), (1, 0)):
            try:
                small, large = self.client(a, 0).probe_peer(self.cluster.address_on(servers[b], 0), PEER_PROBE_BYTES)
            except ServerError as exc:
                self.log(f"peer probe {servers[a].name} -> {servers[b].name} failed ({exc}); "
                         "assuming the antennas' bandwidth between servers")
                return 0.0, 0.0
            # On a fast LAN a megabyte crosses in about the jitter of the small round trip: attribute at least
            # half of the large round trip to the transfer, or the difference can be ~0 and the rate absurd
            samples.append((PEER_PROBE_BYTES / max(large - small, 0.5 * large), small))
        return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)

    def _plan_at(self, cut: Cut, algorithm: str, exclude: set[str] | frozenset = frozenset()) -> RowPlan:
        m = self.measured
        assert m is not None
        p = self.partitioner
        nodes = [Node(s.name, m.server_flops_per_second[s.name]) for s in self.cluster.servers
                 if s.name not in exclude]
        image_bytes = self.channels * self.height * self.width * p.graph.itemsize
        tail_time = cut.tail_flops / m.device_flops_per_second

        def bill(a: int, b: int) -> SliceBill:
            s = p.cost(cut, a, b)
            return SliceBill(s.input_bytes, s.flops, s.output_bytes)

        if algorithm == "equal":
            return equal_rows(nodes, m.antenna_bytes_per_second, cut.height, bill, overhead=m.request_overhead,
                              tail_time=tail_time)
        inst = abstract_instance(nodes, m.antenna_bytes_per_second, image_bytes, cut.head_flops,
                                 cut.halo / self.height)
        candidates = [association(make_plan(inst, algorithm), inst)]
        if algorithm in ("thread", "thread-sa"):
            # SSP's loop over the number of servers, judged by the exact cost model instead of eq. (11)/(14)
            candidates += association_steps(inst, algorithm)
        plans = [size_rows(groups, nodes, m.antenna_bytes_per_second, cut.height, bill,
                           overhead=m.request_overhead, tail_time=tail_time, algorithm=algorithm)
                 for groups in candidates]
        return min(plans, key=lambda pl: pl.completion_time)

    def _upload(self) -> None:
        """The chosen cut's head to every server (any plan may use any of them), its tail here."""
        assert self.cut is not None
        head, tail = self.partitioner.split(self.cut)
        self.head_input = head.graph.input[0].name
        self.piece_dtype = value_dtype(head.graph.output[0])  # what every slice's answer must be
        data = self._head_bytes = head.SerializeToString()
        # Content-addressed: a server runs this name only with these bytes (see device.lifecycle).
        self._head_base = f"{self.tag}-{self.cut.name}-head"
        for k in range(len(self.cluster.servers)):
            self.head_name = self.uploads.upload(self.client(k, 0), data, self._head_base)
        self.tail = _session(tail.SerializeToString())
        self.tail_input = self.tail.get_inputs()[0].name
        self._costs: dict[tuple[int, int], object] = {}
        self._shapes: dict[tuple[int, int], tuple[int, int, int, int]] = {}

    def slice_cost(self, start: int, stop: int):
        """The partitioner's SliceCost of cut rows [start, stop) (cached)."""
        key = (start, stop)
        if key not in self._costs:
            self._costs[key] = self.partitioner.cost(self.cut, start, stop)
        return self._costs[key]

    def piece_shape(self, start: int, stop: int) -> tuple[int, int, int, int]:
        """The shape of a server's answer for cut rows [start, stop) (the halo rows around them included)."""
        key = (start, stop)
        if key not in self._shapes:
            self._shapes[key] = (1, self.cut.channels, self.partitioner.computed_rows(self.cut, start, stop),
                                 self.cut.width)
        return self._shapes[key]

    def check_piece(self, outputs: dict[str, np.ndarray], s, address: str) -> np.ndarray:
        """The answer for slice ``s`` if it fits the plan (one output, its shape and data type), else WrongAnswer."""
        what = f"the answer for rows {s.start}-{s.stop} at {self.cut.name}"
        return check_tensor(only_output(outputs, what, address), self.piece_shape(s.start, s.stop),
                            self.piece_dtype, what, address)

    def describe_measurements(self) -> str:
        """One line: what setup measured."""
        m = self.measured
        assert m is not None, "setup() first"
        peer = (f"; server to server {m.peer_bytes_per_second * 8 / 1e6:.1f} Mbit/s" if m.peer_bytes_per_second
                else "")
        return ("measured: " + ", ".join(f"{n} {r / 1e9:.2f} GFLOP/s" for n, r in m.server_flops_per_second.items())
                + "; antennas " + ", ".join(f"{b * 8 / 1e6:.1f} Mbit/s" for b in m.antenna_bytes_per_second)
                + (" (paced: EMULATED by app-level pacing)" if m.paced else "")
                + f"; request overhead {m.request_overhead * 1e3:.2f} ms{peer}; device "
                f"{m.device_flops_per_second / 1e9:.2f} GFLOP/s, {m.device_seconds_per_byte * 1e9:.2f} ns of its CPU "
                "per byte sent")

    def describe_plan(self, plan: RowPlan | None = None) -> str:
        """A plan (default: setup's) as a table, with what was measured."""
        plan, m, cut = plan or self.plan, self.measured, self.cut
        assert plan is not None and m is not None and cut is not None
        lines = [f"plan: {plan.algorithm} at cut {cut.name} ({cut.height} rows, halo {cut.halo_top}+"
                 f"{cut.halo_bottom}, stride {cut.stride}); predicted frame {plan.frame_time * 1e3:.1f} ms "
                 f"(slices {plan.completion_time * 1e3:.1f} + tail {plan.tail_time * 1e3:.1f})",
                 self.describe_measurements(),
                 f"{'server':<10} {'antenna':>7} {'order':>5} {'rows':>9} {'tx start':>9} {'tx':>8} {'compute':>8} "
                 f"{'return':>8} {'finish':>8}  (ms)"]
        for s in sorted(plan.slices, key=lambda s: (s.antenna, s.order)):
            lines.append(f"{s.name:<10} {s.antenna:>7} {s.order:>5} {f'{s.start}-{s.stop}':>9} "
                         f"{s.transfer_start * 1e3:>9.1f} {s.transfer_time * 1e3:>8.1f} {s.compute_time * 1e3:>8.1f} "
                         f"{s.return_time * 1e3:>8.1f} {s.finish_time * 1e3:>8.1f}")
        return "\n".join(lines)

    # ---- running --------------------------------------------------------------------------------------
    # ---- failures -------------------------------------------------------------------------------------
    def _live_plan(self, algorithm: str) -> RowPlan:
        """A plan on the servers not marked down (raises UserError if none is left)."""
        live = [s.name for s in self.cluster.servers if s.name not in self.down]
        if not live:
            raise UserError("no server is left: every server of the cluster is down")
        return self._plan_at(self.cut, algorithm, exclude=self.down)

    def _mark_down(self, name: str, why: str, algorithm: str, wrong: bool = False) -> None:
        """Leave ``name`` out of the plan; ``wrong``: it answered wrongly, so it is never probed back."""
        with self._health:
            if wrong:
                self.suspect.add(name)
            if name in self.down:
                return
            self.down.add(name)
            detected = time.perf_counter()
            try:
                self.active_plan = self._live_plan(algorithm)
                on = ", ".join(sorted({s.name for s in self.active_plan.slices}))
            except UserError:
                on = "nothing"
            self.events.append({"event": "down", "server": name, "at": detected, "why": why,
                                "replanned_in": time.perf_counter() - detected})
        self.log(f"server {name} down ({why}){' for good: it answered wrongly' if wrong else ''}; replanned on "
                 f"{on} in {self.events[-1]['replanned_in'] * 1e3:.1f} ms; its rows of frames in flight are "
                 "recomputed there")

    def _probe_down(self, algorithm: str, stop: threading.Event) -> None:
        """Every PROBE_SECONDS, ask each down server if it is ready; bring it back (re-uploading the head)."""
        index = {s.name: k for k, s in enumerate(self.cluster.servers)}
        while not stop.wait(PROBE_SECONDS):
            for name in sorted(self.down - self.suspect):
                client = self.client(index[name], 0)
                try:
                    if not client.server_ready(timeout=1.0):
                        continue
                    self.uploads.upload(client, self._head_bytes, self._head_base)  # a restarted server lost it
                except ServerError:
                    continue
                with self._health:
                    self.down.discard(name)
                    self.active_plan = self._live_plan(algorithm)
                    self.events.append({"event": "up", "server": name, "at": time.perf_counter()})
                self.log(f"server {name} is back; replanned on "
                         f"{', '.join(sorted({s.name for s in self.active_plan.slices}))}")

    def _recover(self, frame: InFlightFrame, s, failed: str,
                 stop: threading.Event | None = None) -> tuple[np.ndarray, ServerTiming]:
        """Compute rows [s.start, s.stop) again on the fastest live server (the frame must not be lost).

        A busy server (RESOURCE_EXHAUSTED: back-pressure, not a failure) is skipped, and when every live
        server is busy the device backs off and tries again, until the frame's deadline has passed twice."""
        index = {srv.name: k for k, srv in enumerate(self.cluster.servers)}
        cost = self.slice_cost(s.start, s.stop)
        a, b = cost.input_rows
        rates = self.measured.server_flops_per_second
        give_up = time.perf_counter() + 2 * self._deadline(frame.plan)
        pause = BUSY_BACKOFF
        busy = False
        while stop is None or not stop.is_set():
            busy = False
            for name in sorted((n for n in rates if n not in self.down), key=lambda n: -rates[n]):
                timing = ServerTiming(name, 0, (s.start, s.stop), recovered_from=failed)
                sent = time.perf_counter()
                timing.send_start = sent - frame.start
                try:
                    handle = self.client(index[name], 0).start_run(
                        self.head_name, {self.head_input: np.ascontiguousarray(frame.x[:, :, a:b, :])},
                        timeout=self._deadline(frame.plan) * 2)
                    timing.transfer = time.perf_counter() - sent
                    outputs, compute, queued = handle.result()
                    piece = self.check_piece(outputs, s, handle.client.address)
                except ServerError as exc:
                    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not isinstance(exc, WrongAnswer):
                        busy = True
                    else:
                        self._mark_down(name, f"{exc.code.name}: {exc.details}", frame.plan.algorithm,
                                        wrong=isinstance(exc, WrongAnswer))
                    continue
                self._close_timing(frame, timing, compute, queued)
                return piece, timing
            if not busy or time.perf_counter() + pause > give_up:
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
        why = ("the run stopped" if stop is not None and stop.is_set() else
               "every live server stayed busy" if busy else "no live server left")
        raise UserError(f"rows {s.start}-{s.stop} could not be computed: {why}")

    def _watch_drift(self, s, timing: ServerTiming, algorithm: str) -> None:
        """Online re-profiling: a server computing, or an antenna sending, persistently off the plan by more
        than ``drift_threshold`` gets its measured speed rescaled by what was seen, and the device replans."""
        if self.drift_threshold <= 0 or s.compute_time <= 0:
            return
        plan_tx = s.transfer_time + self.measured.request_overhead
        samples = {f"server {s.name}": timing.compute / s.compute_time}
        if not self.pace and plan_tx > 1e-3:  # paced links are exact by construction
            samples[f"antenna {s.antenna}"] = timing.transfer / plan_tx
        changed = []
        with self._health:
            for key, ratio in samples.items():
                window = self._drift.setdefault(key, collections.deque(maxlen=DRIFT_SAMPLES))
                window.append(ratio)
                if len(window) < DRIFT_SAMPLES:
                    continue
                high = all(r > 1 + self.drift_threshold for r in window)
                low = all(r < 1 / (1 + self.drift_threshold) for r in window)
                if not (high or low):
                    continue
                factor = statistics.median(window)
                if key.startswith("server"):
                    self.measured.server_flops_per_second[s.name] /= factor
                else:
                    self.measured.antenna_bytes_per_second[s.antenna] /= factor
                window.clear()
                changed.append(f"{key} at {factor:.2f}x the planned time")
            if changed:
                self.active_plan = self._live_plan(algorithm)
                self.events.append({"event": "drift", "what": changed, "at": time.perf_counter()})
        if changed:
            self.log(f"drift: {'; '.join(changed)}: re-profiled and replanned on "
                     f"{', '.join(sorted({x.name for x in self.active_plan.slices}))}")

    def _deadline(self, plan: RowPlan) -> float:
        """How long a slice may take before its server counts as failed."""
        return max(MIN_DEADLINE, DEADLINE_FACTOR * plan.frame_time)

    @staticmethod
    def _close_timing(frame: InFlightFrame, timing: ServerTiming, compute: float, queued: float) -> None:
        timing.finish = time.perf_counter() - frame.start
        timing.compute, timing.queue = compute, queued
        # The "received" event reaches us a little after the server started computing (it shares the
        # wire and the CPU with the compute), so the transfer is at most what the server's own times leave.
        total = timing.finish - timing.send_start
        timing.transfer = min(timing.transfer, total - compute - queued)
        timing.back = total - timing.transfer - compute - queued

    # ---- running --------------------------------------------------------------------------------------
    def run(self, inputs: Iterable[np.ndarray], plan: RowPlan | None = None,
            depth: int | None = None, give_up: GiveUp | None = None) -> Iterator[FrameResult]:
        """Results of every input (1x3xHxW float32), in order; each either an output or an error.

        ``plan`` defaults to the one setup() made; ``depth`` (frames in flight) to the device's. A server
        that errs or misses its deadline is marked down, the frame's rows it had are computed again on a
        live server, and later frames use a plan without it; a down server is probed and rejoins. A server
        whose answer does not fit the plan (shape, data type, rows) is marked down for good.

        Raises GaveUp (a UserError) when ``give_up`` (default: GiveUp()) says the run has failed for too
        long, and UserError naming the thread when one of the device's own threads fails."""
        assert self.plan is not None, "setup() first"
        self.active_plan = plan or self.plan
        algorithm = self.active_plan.algorithm
        depth = depth or self.depth
        give_up = give_up or GiveUp()
        index = {s.name: k for k, s in enumerate(self.cluster.servers)}
        antennas = range(len(self.cluster.device.antennas))
        done: queue.Queue[InFlightFrame] = queue.Queue()
        slots = threading.Semaphore(depth)
        senders: dict[int, queue.Queue] = {m: queue.Queue() for m in antennas}
        pool = ThreadPoolExecutor(max_workers=4 + 2 * len(self.cluster.servers))
        stop = threading.Event()
        crashed: list[str] = []  # one line per device thread that failed: the run ends with the first
        finished: queue.Queue[FrameResult | None] = queue.Queue()

        def guarded(name: str, fn: Callable[..., None]) -> Callable[..., None]:
            """``fn``, but an exception ends the run with one line instead of killing a thread silently."""
            def target(*args: object) -> None:
                try:
                    fn(*args)
                except BaseException as exc:  # noqa: BLE001 - reported to the consumer, which raises it
                    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    crashed.append(f"the device's {name} thread failed: {type(exc).__name__}"
                                   + (f": {text}" if text else ""))
                    stop.set()
                    finished.put(None)  # wake the consumer
            return target

        def settle(frame: InFlightFrame, s, piece: np.ndarray | None, timing: ServerTiming | None, error: str | None):
            with frame.lock:
                if error is not None:
                    frame.error = frame.error or error
                else:
                    frame.pieces[s.start] = piece
                    frame.timings[s.start] = timing
                frame.remaining -= 1
                last = frame.remaining == 0
            if last:
                done.put(frame)

        def failed(frame: InFlightFrame, s, exc: ServerError) -> None:
            wrong = isinstance(exc, WrongAnswer)
            if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED or wrong:  # busy is back-pressure, not a failure
                self._mark_down(s.name, f"{exc.code.name}: {exc.details}", algorithm, wrong=wrong)
            try:
                piece, timing = self._recover(frame, s, s.name, stop)
            except UserError as err:
                settle(frame, s, None, None, f"{exc}; {err}")
                return
            settle(frame, s, piece, timing, None)

        def collect(frame: InFlightFrame, s, handle, timing: ServerTiming) -> None:
            try:
                outputs, compute, queued = handle.result()
                piece = self.check_piece(outputs, s, handle.client.address)
            except ServerError as exc:
                failed(frame, s, exc)
                return
            self._close_timing(frame, timing, compute, queued)
            settle(frame, s, piece, timing, None)
            self._watch_drift(s, timing, algorithm)

        def sender(m: int) -> None:
            while True:
                frame = senders[m].get()
                if frame is None:
                    return
                for s in sorted((s for s in frame.plan.slices if s.antenna == m), key=lambda s: s.order):
                    cost = self.slice_cost(s.start, s.stop)
                    a, b = cost.input_rows
                    timing = ServerTiming(s.name, m, (s.start, s.stop))
                    sent = time.perf_counter()
                    timing.send_start = sent - frame.start
                    try:
                        handle = self.client(index[s.name], m).start_run(
                            self.head_name, {self.head_input: np.ascontiguousarray(frame.x[:, :, a:b, :])},
                            timeout=self._deadline(frame.plan))
                    except ServerError as exc:
                        pool.submit(guarded("recovery", failed), frame, s, exc)
                        continue
                    if self.pace:  # hold the antenna for as long as these bytes take at its bandwidth
                        bandwidth = self.measured.antenna_bytes_per_second[m]
                        pause = sent + cost.input_bytes / bandwidth - time.perf_counter()
                        if pause > 0:
                            time.sleep(pause)
                    timing.transfer = time.perf_counter() - sent
                    pool.submit(guarded("collector", collect), frame, s, handle, timing)

        for m in antennas:
            threading.Thread(target=guarded(f"sender (antenna {m})", sender), args=(m,), daemon=True).start()
        threading.Thread(target=guarded("prober", self._probe_down), args=(algorithm, stop), daemon=True).start()
        feeder_error: list[BaseException] = []
        fed: list[int] = []
        sent_frames = [0]  # frames handed to the senders so far

        def feed() -> None:
            count = 0
            try:
                for x in inputs:
                    while not slots.acquire(timeout=TICK):
                        if stop.is_set():
                            return
                    with self._health:
                        current = self.active_plan
                    frame = InFlightFrame(count, x, time.perf_counter(), len(current.slices), current)
                    count += 1
                    for m in antennas:
                        senders[m].put(frame)
                    sent_frames[0] = count
            except BaseException as exc:  # a source error ends the run after the frames already in
                feeder_error.append(exc)
            finally:
                fed.append(count)
                finished.put(None)  # wake the consumer: it now knows how many frames to expect

        def finisher() -> None:  # stitch + tail off the consumer's thread, so a slow consumer stalls nothing
            while True:
                frame = done.get()
                if frame is None:
                    return
                result = self._finish(frame, sorted(frame.plan.slices, key=lambda s: s.start))
                slots.release()
                finished.put(result)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        threading.Thread(target=guarded("finisher", finisher), daemon=True).start()
        pending: dict[int, FrameResult] = {}
        next_index = 0
        try:
            while not fed or next_index < fed[0]:
                try:
                    result = finished.get(timeout=TICK)
                except queue.Empty:
                    result = None
                if crashed:
                    raise UserError(crashed[0])
                if result is not None:
                    pending[result.index] = result
                while next_index in pending:
                    result = pending.pop(next_index)
                    next_index += 1
                    yield result
                    give_up.seen(result)
                with self._health:
                    waiting = ", ".join(sorted({s.name for s in self.active_plan.slices}))
                give_up.check(sent_frames[0] > next_index, f"servers {waiting}" + (
                    f" ({', '.join(sorted(self.down))} down)" if self.down else ""))
        finally:
            stop.set()
            for m in antennas:
                senders[m].put(None)
            done.put(None)  # type: ignore[arg-type]
            pool.shutdown(wait=True, cancel_futures=True)
            feeder.join(timeout=5)
        if feeder_error:
            exc = feeder_error[0]
            if isinstance(exc, UserError):
                raise exc
            raise UserError(f"the frame source failed: {type(exc).__name__}: {exc}") from exc

    def _finish(self, frame: InFlightFrame, order) -> FrameResult:
        result = FrameResult(frame.index)
        result.servers = [frame.timings[k] for k in sorted(frame.timings)]
        if frame.error is not None:
            result.error = frame.error
            result.latency = time.perf_counter() - frame.start
            return result
        start = time.perf_counter()
        result.dispatch = start - frame.start - max(t.finish for t in result.servers)
        crops = []
        for s in order:
            c0, c1 = self.slice_cost(s.start, s.stop).crop
            crops.append(frame.pieces[s.start][:, :, c0:c1, :])
        stitched = np.ascontiguousarray(np.concatenate(crops, axis=2))
        mid = time.perf_counter()
        result.output = self.tail.run(None, {self.tail_input: stitched})[0]
        end = time.perf_counter()
        result.stitch, result.tail = mid - start, end - mid
        result.latency = end - frame.start
        return result
