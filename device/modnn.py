"""MoDNN (Mao et al., DATE'17) as a real distributed runtime: the rival DeepCo's benchmark runs against.

The device cuts the image into disjoint bands proportional to the servers' measured speeds and sends each
server only its own band (no halo); MoDNN-SA sends them all over the fastest antenna, MoDNN-MA spreads the
servers over the antennas as deepco.planning.baselines.modnn_ma does (the paper's footnote vii). The
servers then run the head segment by segment (deepco.partition.segments: one segment per cut, i.e. per
residual block for a ResNet) and, before each segment, exchange the boundary rows their neighbours need
directly with each other over gRPC streams (server/modnn.py); the device relays nothing. Each returns its
band of the cut tensor; the device concatenates the bands (disjoint: no crop) and runs the tail.

    dev = Device(cluster, "resnet18", 224, 224, cut="layer2"); dev.setup()   # measure, upload THREAD's head
    runner = ModnnRunner(dev, "modnn-ma")           # association, tables, segment models uploaded
    runner.predicted                                # predicted frame time (s), runner.prediction: breakdown
    output, timing = runner.run_frame(x)            # x: 1x3xHxW float32; output: the model's output

Frames run one at a time (MoDNN's servers synchronise every level, so there is nothing to pipeline). With
a Device made with ``pace=True`` the sends are paced per antenna exactly as Device.run paces THREAD's;
server-to-server exchanges are not paced (the servers' LAN).
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from deepco.errors import UserError
from deepco.partition import Segment
from deepco.planning.baselines import modnn_ma, modnn_sa
from deepco.planning.modnn import ownership as ownership_tables
from deepco.planning.modnn import receives, sends
from deepco.planning.rows import Node, abstract_instance, association
from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire.client import ServerError, content_name
from deepco.wire.rows import decode_rows, encode_rows
from device.session import Device

ALGORITHMS = ("modnn-sa", "modnn-ma")


@dataclass
class _Call:
    server: int
    antenna: int
    events: Any = None
    send_start: float = 0.0
    received: float = 0.0


class ModnnRunner:
    """MoDNN-SA / MoDNN-MA frames over the servers of a set-up Device, at the Device's cut.

    ``exchange_timeout``: the longest a server waits for a peer's rows (the job then fails naming the
    peer); ``timeout``: the device's deadline for a whole frame on one server; ``exchange_overhead``: the
    fixed cost of one level's exchange in the prediction (default: the measured request overhead, an Echo
    round trip; a real exchange also pays a stream message, a thread hand-over and the barrier, so the bench
    may calibrate it from `run_frame`'s ``exchange_wait``); ``peer_bytes_per_second``: the server-to-server
    bandwidth in the prediction (default: the device's best antenna; the testbed's ``peer_mbps`` x 1e6 / 8
    where it shapes the peer links).
    """

    def __init__(self, device: Device, algorithm: str = "modnn-ma", *, exchange_timeout: float = 30.0,
                 timeout: float = 120.0, exchange_overhead: float | None = None,
                 peer_bytes_per_second: float | None = None):
        if algorithm not in ALGORITHMS:
            raise UserError(f"unknown MoDNN algorithm {algorithm!r} (choose from {', '.join(ALGORITHMS)})")
        if device.cut is None or device.measured is None:
            raise UserError("ModnnRunner needs a Device that is set up (Device.setup())")
        self.device, self.algorithm = device, algorithm
        self.exchange_timeout, self.timeout = exchange_timeout, timeout
        self.exchange_overhead = device.measured.request_overhead if exchange_overhead is None else exchange_overhead
        self.peer_bytes_per_second = peer_bytes_per_second or max(device.measured.antenna_bytes_per_second)
        self.cut = device.cut
        m = device.measured
        servers = device.cluster.servers
        self.rates = [m.server_flops_per_second[s.name] for s in servers]
        nodes = [Node(s.name, r) for s, r in zip(servers, self.rates, strict=True)]
        image_bytes = device.channels * device.height * device.width * device.partitioner.graph.itemsize
        # MoDNN sends no halo: the abstract instance only decides the association (and transfer order).
        inst = abstract_instance(nodes, m.antenna_bytes_per_second, image_bytes, self.cut.head_flops, 0.0)
        plan = (modnn_sa if algorithm == "modnn-sa" else modnn_ma)(inst)
        self.groups: list[list[int]] = association(plan, inst)
        self.segments: list[Segment] = device.partitioner.segments(self.cut)
        heights = [device.height] + [s.height for s in self.segments]
        self.bands = ownership_tables(self.rates, heights)
        self.windows = [[]] + [[seg.window(*self.bands[j][i]) for i in range(len(servers))]
                               for j, seg in enumerate(self.segments, start=1)]
        self.peers = [device.cluster.address_on(s, 0) for s in servers]
        self.model_names = [f"{device.tag}-{self.cut.name}-modnn{j}-{len(self.segments)}"
                            for j in range(1, len(self.segments) + 1)]
        self._upload()
        self.prediction = self._predict()
        self.predicted: float = self.prediction["frame"]

    # ---- setup ----------------------------------------------------------------------------------------
    def _upload(self) -> None:
        """Every segment model to every server (RepositoryModelLoad) under content-addressed names."""
        data = [seg.model.SerializeToString() for seg in self.segments]
        bases, names = self.model_names, []
        for k in range(len(self.device.cluster.servers)):
            client = self.device.client(k, 0)
            loaded = set(client.loaded_models())
            # one model per segment: a server needs that many free model slots (`deepco serve --max-models`)
            missing = [b for b, d in zip(bases, data, strict=True) if content_name(b, d) not in loaded]
            limit = client.server_metadata().get("deepco_max_models")
            if limit is not None and len(loaded) + len(missing) > int(limit):
                raise UserError(f"MoDNN at cut {self.cut.name!r} needs {len(self.segments)} segment models on "
                                f"each server, but server {client.address} has {len(loaded)} of its {limit} model "
                                "slots taken; start it with a larger --max-models")
            names = [self.device.uploads.upload(client, model, base)
                     for base, model in zip(bases, data, strict=True)]
        self.model_names = names

    def _predict(self) -> dict[str, Any]:
        """The cost model: transfers per antenna in order (everyone waits for the last band), then per level
        the slowest server's exchange (received halo bytes / bandwidth + a request overhead) plus its
        compute (segment FLOPs on its window / measured FLOP/s), then the bands' return and the tail.

        Server-to-server links are not measured: ``peer_bytes_per_second`` (see the class doc)."""
        m = self.device.measured
        bw = m.antenna_bytes_per_second
        link = self.peer_bytes_per_second
        over = m.request_overhead
        arrived = 0.0
        for antenna, group in enumerate(self.groups):
            clock = 0.0
            for i in group:
                a, b = self.bands[0][i]
                clock += over + (b - a) * self.segments[0].in_row_bytes / bw[antenna]
            arrived = max(arrived, clock)
        levels = []
        rows = self._windows_rows()
        for j, seg in enumerate(self.segments, start=1):
            worst = 0.0
            for i in range(len(self.rates)):
                halo = sum(b - a for a, b in receives(self.bands, rows, j - 1, i).values())
                exchange = (self.exchange_overhead + halo * seg.in_row_bytes / link) if halo else 0.0
                worst = max(worst, exchange + self.windows[j][i].flops / self.rates[i])
            levels.append(worst)
        antenna_of = {i: a for a, g in enumerate(self.groups) for i in g}
        back = max(over + (b - a) * self.segments[-1].row_bytes / bw[antenna_of[i]]
                   for i, (a, b) in enumerate(self.bands[-1]))
        tail = self.cut.tail_flops / m.device_flops_per_second
        return {"transfer": arrived, "levels": levels, "return": back, "tail": tail,
                "frame": arrived + sum(levels) + back + tail}

    def _windows_rows(self) -> list[list[tuple[int, int]]]:
        return [[]] + [[w.input_rows for w in level] for level in self.windows[1:]]

    def exchanges(self) -> list[dict[tuple[int, int], tuple[int, int]]]:
        """Per level j-1 -> j, the rows (sender, receiver) -> [a, b) the servers send each other."""
        rows = self._windows_rows()
        return [{(s, r): iv for s in range(len(self.rates)) for r, iv in sends(self.bands, rows, j, s).items()}
                for j in range(len(self.segments))]

    def request(self, job: str, server: int, x: np.ndarray) -> dpb.ModnnRequest:
        """The ModnnRequest for ``server``: its own band of the image and every level's tables."""
        levels = []
        for j in range(len(self.segments) + 1):
            level = dpb.ModnnLevel(owned=[dpb.RowRange(start=a, stop=b) for a, b in self.bands[j]])
            if j:
                level.window.extend(dpb.RowRange(start=w.input_rows[0], stop=w.input_rows[1])
                                    for w in self.windows[j])
                level.crop.extend(w.crop[0] for w in self.windows[j])
            levels.append(level)
        a, b = self.bands[0][server]
        return dpb.ModnnRequest(job_id=job, segment_models=self.model_names, server_index=server, peers=self.peers,
                                levels=levels, input=encode_rows(np.ascontiguousarray(x[:, :, a:b, :]), a),
                                exchange_timeout_seconds=self.exchange_timeout)

    # ---- running --------------------------------------------------------------------------------------
    def run_frame(self, x: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        """One frame (1x3xHxW float32) through MoDNN: (the model's output, timing dict in seconds).

        Raises ServerError naming the server (or, from a server, the peer) that failed; the other servers'
        jobs are cancelled so they clean up at once."""
        dev = self.device
        job = uuid.uuid4().hex
        start = time.perf_counter()
        calls = {i: _Call(i, m) for m, group in enumerate(self.groups) for i in group}
        lock = threading.Lock()
        failure: list[ServerError] = []

        def sender(m: int) -> None:
            for i in self.groups[m]:
                call = calls[i]
                client = dev.client(i, m)
                sent = time.perf_counter()
                call.send_start = sent - start
                try:
                    events = client.deepco.ModnnRun(self.request(job, i, x), timeout=self.timeout)
                    with lock:
                        call.events = events
                    first = next(events)
                    if first.WhichOneof("event") != "received":
                        raise ServerError(client.address, grpc.StatusCode.INTERNAL, "ModnnRun answered out of order")
                except grpc.RpcError as exc:
                    failure.append(ServerError(client.address, exc.code(), exc.details() or ""))
                    return
                except ServerError as exc:
                    failure.append(exc)
                    return
                if dev.pace:  # as Device.run: hold the antenna for as long as these bytes take at its bandwidth
                    a, b = self.bands[0][i]
                    nbytes = (b - a) * self.segments[0].in_row_bytes
                    pause = sent + nbytes / dev.measured.antenna_bytes_per_second[m] - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)
                call.received = time.perf_counter() - start

        def collect(i: int) -> tuple[dpb.ModnnResult, float]:
            call = calls[i]
            client = dev.client(i, call.antenna)
            try:
                event = next(call.events)
            except grpc.RpcError as exc:
                raise ServerError(client.address, exc.code(), exc.details() or "") from None
            except StopIteration:
                raise ServerError(client.address, grpc.StatusCode.INTERNAL, "ModnnRun ended without a result") \
                    from None
            return event.modnn_result, time.perf_counter() - start

        senders = [threading.Thread(target=sender, args=(m,), daemon=True) for m, g in enumerate(self.groups) if g]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        sent = time.perf_counter() - start
        results: dict[int, tuple[dpb.ModnnResult, float]] = {}
        try:
            if failure:
                raise failure[0]
            with ThreadPoolExecutor(max_workers=len(calls)) as pool:
                futures = {pool.submit(collect, i): i for i in calls}
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                errors = [f.exception() for f in done if f.exception() is not None]
                if errors:
                    self._cancel(calls)
                    raise _root_cause(errors)
                for f, i in futures.items():
                    results[i] = f.result()
        except BaseException:
            self._cancel(calls)
            raise
        collected = time.perf_counter()
        pieces = []
        for i in range(len(self.rates)):
            array, row = decode_rows(results[i][0].output, f"band of server {i}")
            a, b = self.bands[-1][i]
            if row != a or array.shape[2] != b - a:
                raise ServerError(dev.client(i, calls[i].antenna).address, grpc.StatusCode.INTERNAL,
                                  f"returned rows [{row}, {row + array.shape[2]}), expected [{a}, {b})")
            pieces.append(array)
        stitched = np.ascontiguousarray(np.concatenate(pieces, axis=2))
        mid = time.perf_counter()
        output = dev.tail.run(None, {dev.tail_input: stitched})[0]
        end = time.perf_counter()
        timing: dict[str, Any] = {
            "latency": end - start, "sent": sent, "collected": collected - start, "stitch": mid - collected,
            "tail": end - mid, "predicted": self.predicted, "servers": []}
        for i in range(len(self.rates)):
            r, finish = results[i]
            timing["servers"].append({
                "name": dev.cluster.servers[i].name, "antenna": calls[i].antenna, "rows": list(self.bands[0][i]),
                "send_start": calls[i].send_start, "received": calls[i].received, "finish": finish,
                "compute": r.compute_seconds, "exchange_wait": r.exchange_wait_seconds, "queue": r.queue_seconds,
                "messages_received": r.messages_received, "messages_sent": r.messages_sent,
                "bytes_received": r.bytes_received, "bytes_sent": r.bytes_sent})
        return output, timing

    @staticmethod
    def _cancel(calls: dict[int, _Call]) -> None:
        for call in calls.values():
            if call.events is not None:
                call.events.cancel()

    def unload(self) -> None:
        """Unload the segment models from every server."""
        self.device.uploads.release(set(self.model_names))


def _root_cause(errors: list[BaseException]) -> BaseException:
    """Of several servers' failures, the one that names the cause rather than a consequence (a cancelled
    job, or a peer that stopped waiting because of it)."""
    def rank(exc: BaseException) -> int:
        code = getattr(exc, "code", None)
        return {grpc.StatusCode.CANCELLED: 2, grpc.StatusCode.DEADLINE_EXCEEDED: 1}.get(code, 0)

    return min(errors, key=rank)
