"""MoDNN (Mao et al., DATE'17) as a real distributed runtime: the rival DeepCo's benchmark runs against.

The device cuts the image into disjoint bands proportional to the servers' measured speeds and sends each
server only its own band (no halo); MoDNN-SA sends them all over the fastest antenna, MoDNN-MA spreads the
servers over the antennas as deepco.planning.baselines.modnn_ma does (the paper's footnote vii). The
servers then run the head segment by segment (deepco.partition.segments: one segment per cut, i.e. per
residual block for a ResNet) and, before each segment, exchange the boundary rows their neighbours need
directly with each other over gRPC streams (server/split_jobs.py); the device relays nothing. Each returns its
band of the cut tensor; the device concatenates the bands (disjoint: no crop) and runs the tail.

    dev = Device(cluster, "resnet18", 224, 224, cut="layer2"); dev.setup()   # measure, upload THREAD's head
    runner = ModnnRunner(dev, "modnn-ma")           # association, tables, segment models uploaded
    runner.predicted                                # predicted frame time (s), runner.prediction: breakdown
    outputs, timing = runner.run_frame(x)           # x: 1x3xHxW uint8 pixels; outputs: every output by name

MoDNN is one shape of staged plan (deepco.planning.staged: a stage per cut, no lookahead, the tail on the
device): this module builds MoDNN's association and band tables and keeps MoDNN's own cost model; the
staged runtime (device/staged.py) runs the frames. With a Device made with ``pace=True`` the sends are
paced per antenna exactly as every staged plan's; server-to-server exchanges are not paced.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from deepco_device.backpressure import while_busy
from deepco_device.records import FrameTiming
from deepco_device.runners import StagedRunner
from deepco_device.session import Device

from deepco.errors import UserError
from deepco.partition import Segment
from deepco.planning.bands import ownership as ownership_tables
from deepco.planning.bands import receives, sends
from deepco.planning.baselines import modnn_ma, modnn_sa
from deepco.planning.rows import Node, abstract_instance, association
from deepco.planning.staged import StagedPlan
from deepco.wire import deepco_service_pb2 as dpb

ALGORITHMS = ("modnn-sa", "modnn-ma")


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
        self.windows = [[]] + [[seg.open_window(*self.bands[j][i]) for i in range(len(servers))]
                               for j, seg in enumerate(self.segments, start=1)]
        self.peers = [device.cluster.address_on(s, 0) for s in servers]
        self._check_room()
        # MoDNN is one shape of staged plan: a stage per cut, bands from the image on (no lookahead), the tail
        # on the device; the staged runtime runs it (and uploads its segment models)
        position = {i: (m, k) for m, group in enumerate(self.groups) for k, i in enumerate(group)}
        self.prediction = self._predict()
        self.predicted: float = self.prediction["frame"]
        self.plan = StagedPlan(algorithm, "split", servers=[s.name for s in servers],
                               antennas=[position[i][0] for i in range(len(servers))],
                               order=[position[i][1] for i in range(len(servers))],
                               levels=[seg.name for seg in self.segments], bands=self.bands,
                               windows=[list(self.bands[0])] + [[w.input_rows for w in level]
                                                               for level in self.windows[1:]],
                               crops=[[]] + [[w.crop[0] for w in level] for level in self.windows[1:]],
                               lookahead=False, tail=None, predicted=self.predicted, breakdown=self.prediction)
        self.staged = StagedRunner(device, self.plan, exchange_timeout=exchange_timeout, timeout=timeout)
        self.model_names = self.staged.segment_names

    # ---- setup ----------------------------------------------------------------------------------------
    def _check_room(self) -> None:
        """Every server needs a free model slot per segment (`deepco serve --max-models`): say so before
        uploading anything."""
        for k in range(len(self.device.cluster.servers)):
            client = self.device.client(k, 0)
            loaded = len(while_busy(client.loaded_models))
            limit = while_busy(client.server_metadata).get("deepco_max_models")
            if limit is not None and loaded + len(self.segments) > int(limit):
                raise UserError(f"MoDNN at cut {self.cut.name!r} needs {len(self.segments)} segment models on "
                                f"each server, but server {client.address} has {loaded} of its {limit} model "
                                "slots taken; start it with a larger --max-models")

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

    def request(self, job: str, server: int, x: np.ndarray) -> dpb.SplitRequest:
        """The SplitRequest for ``server``: its own band of the image and every level's tables."""
        return self.staged.request(job, server, x)

    # ---- running --------------------------------------------------------------------------------------
    def run_frame(self, x: np.ndarray) -> tuple[dict[str, np.ndarray], FrameTiming]:
        """One frame (1x3xHxW uint8 pixels) through MoDNN: (every output by name, its timing; the prediction
        is ``predicted``).

        Raises ServerError naming the server (or, from a server, the peer) that failed; the other servers'
        jobs are cancelled so they clean up at once."""
        return self.staged.run_frame(x)

    def unload(self) -> None:
        """Unload the segment models from every server."""
        self.device.uploads.release(set(self.model_names))

