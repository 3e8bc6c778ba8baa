"""What the device records: the measurements setup made, and each frame's result and timeline."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from deepco.planning.staged import Rates
from deepco.wire.step_times import phases_of


@dataclass
class Measurements:
    """What setup measured: server and device speeds, antenna bandwidths, per-request overhead."""

    server_flops_per_second: dict[str, float]
    antenna_bytes_per_second: list[float]
    request_overhead: float
    device_flops_per_second: float
    paced: bool
    peer_bytes_per_second: float = 0.0  # server to server (ProbePeer); 0: not measured (one server)
    peer_overhead: float = 0.0
    device_seconds_per_byte: float = 0.0  # the device's own CPU time to marshal a byte it sends

    def to_dict(self) -> dict:
        """JSON form."""
        return {"server_flops_per_second": self.server_flops_per_second,
                "antenna_bytes_per_second": self.antenna_bytes_per_second,
                "request_overhead": self.request_overhead,
                "device_flops_per_second": self.device_flops_per_second, "paced": self.paced,
                "peer_bytes_per_second": self.peer_bytes_per_second, "peer_overhead": self.peer_overhead,
                "device_seconds_per_byte": self.device_seconds_per_byte}

    def rates(self) -> Rates:
        """The staged planner's view of these measurements."""
        peer = self.peer_bytes_per_second or max(self.antenna_bytes_per_second)
        return Rates(dict(self.server_flops_per_second), list(self.antenna_bytes_per_second), self.request_overhead,
                     self.device_flops_per_second, peer, self.peer_overhead or self.request_overhead,
                     self.device_seconds_per_byte, self.paced)


@dataclass(frozen=True)
class StepTimes:
    """Where one server step's time went, as the server reported it with its answer (the wire's
    ``deepco.StepTimes``, seconds): decoding its input, waiting for peers' rows, for a compute slot, computing,
    encoding and sending rows on."""

    input: float = 0.0
    halo: float = 0.0
    queue: float = 0.0
    compute: float = 0.0
    encode: float = 0.0
    send: float = 0.0
    wall: float = 0.0  # the step's start to its answer ready, on the server (0: not reported)
    assemble: float = 0.0  # copying rows into a run's window or a band (0 from a server that does not report it)
    # the timeline: (phase, level, start, end), seconds since the step's start on the server, in order
    phases: tuple[tuple[str, int, float, float], ...] = ()

    @classmethod
    def from_wire(cls, times) -> StepTimes:
        """From a ``deepco_service_pb2.StepTimes``."""
        return cls(times.input_seconds, times.halo_seconds, times.queue_seconds, times.compute_seconds,
                   times.encode_seconds, times.send_seconds, times.wall_seconds, times.assemble_seconds,
                   phases_of(times))

    def to_dict(self) -> dict:
        """JSON form."""
        return {"input": self.input, "halo": self.halo, "queue": self.queue, "compute": self.compute,
                "encode": self.encode, "send": self.send, "assemble": self.assemble, "wall": self.wall,
                "phases": [{"phase": p, "level": level, "start": a, "end": b} for p, level, a, b in self.phases]}


@dataclass(frozen=True)
class ServerStep:
    """One participant's part of one frame as the runner saw it (seconds from the frame's start) and as the
    server reported it (its own `StepTimes`, messages and bytes). Split frames have one per participant, an
    offloaded frame one for its server."""

    name: str
    antenna: int
    rows: tuple[int, int]  # the image rows it was sent
    band: tuple[int, int]  # its band of the plan's last level
    send_start: float = 0.0
    received: float = 0.0  # the server reported its input received
    finish: float = 0.0  # its result was in
    times: StepTimes = StepTimes()
    # the server step's start on the frame's clock, where its timeline begins: estimated as the least of when
    # the device heard its input was received less the server's input time, and its finish less its wall time
    origin: float = 0.0
    messages_received: int = 0
    messages_sent: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0

    compute = property(lambda self: self.times.compute, doc="The server's ONNX Runtime seconds.")
    queue = property(lambda self: self.times.queue, doc="Seconds it waited for a compute slot.")
    exchange_wait = property(lambda self: self.times.halo, doc="Seconds it waited for peers' rows.")

    def to_dict(self) -> dict:
        """JSON form (the --json-log's ``staged.servers`` entries)."""
        return {"name": self.name, "antenna": self.antenna, "rows": list(self.rows), "band": list(self.band),
                "send_start": self.send_start, "received": self.received, "finish": self.finish,
                "origin": self.origin,
                "compute": self.compute, "exchange_wait": self.exchange_wait, "queue": self.queue,
                "times": self.times.to_dict(),
                "messages_received": self.messages_received, "messages_sent": self.messages_sent,
                "bytes_received": self.bytes_received, "bytes_sent": self.bytes_sent}


@dataclass(frozen=True)
class FrameTiming:
    """One frame's timing as a runner measured it (seconds from the frame's start), read by the pipeline's
    timeline, live adaptation and the JSON log alike. A local frame has ``latency`` and ``compute``; an
    offloaded one also ``sent``, ``queue``, ``server`` and its server's step (``servers``); a split one
    ``sent``, ``collected``, ``stitch``, ``tail`` and a step per participant (``servers``)."""

    latency: float
    sent: float = 0.0
    compute: float = 0.0  # local: the device's; offload: the server's own ONNX Runtime time
    queue: float = 0.0
    server: str | None = None  # offload: the server that ran the whole model
    collected: float = 0.0
    stitch: float = 0.0
    tail: float = 0.0
    servers: tuple[ServerStep, ...] = ()

    def to_dict(self) -> dict:
        """JSON form (the --json-log's ``staged`` field): the fields of the frame's kind, as they were named."""
        if self.server is not None:
            out = {"latency": self.latency, "sent": self.sent, "compute": self.compute, "queue": self.queue,
                   "server": self.server, "times": self.servers[0].times.to_dict() if self.servers else None}
        elif self.servers:
            out = {"latency": self.latency, "sent": self.sent, "collected": self.collected, "stitch": self.stitch,
                   "tail": self.tail, "servers": [s.to_dict() for s in self.servers]}
        else:
            out = {"latency": self.latency, "compute": self.compute}
        return out


@dataclass
class ServerTiming:
    """One participant of one frame, measured on the device (seconds from the frame's start; see
    device.pipeline.timeline). ``rows``: its band of the plan's last level (a paper plan: rows of the cut)."""

    name: str
    antenna: int
    rows: tuple[int, int]
    send_start: float = 0.0
    transfer: float = 0.0  # until the server reported its input received
    queue: float = 0.0  # server side, waiting for a compute slot
    compute: float = 0.0  # server side, ONNX Runtime
    back: float = 0.0  # the rest: exchanges, result serialisation and return transfer
    finish: float = 0.0
    recovered_from: str | None = None  # the frame was first sent to that server, which failed


@dataclass
class FrameResult:
    """One frame's outputs (or error) and its timeline: ``latency`` is the frame's compute latency (from entering
the pipeline to its result), ``capture_to_result`` the age of its result when delivered (from its capture)."""

    index: int  # the frame's index in the source (a live source's dropped frames leave gaps)
    outputs: dict[str, np.ndarray] | None = None  # every output of the model by name, in its order
    error: str | None = None
    latency: float = 0.0
    dispatch: float = 0.0  # from the last slice's return to the start of stitching (thread hand-over)
    stitch: float = 0.0
    tail: float = 0.0
    servers: list[ServerTiming] = field(default_factory=list)
    staged: FrameTiming | None = None  # the runner's own timing of the try that succeeded
    captured: float | None = None  # when the frame was captured (perf_counter; device.feed)
    delivered: float | None = None  # when its result left the pipeline, in order (perf_counter)

    @property
    def output(self) -> np.ndarray | None:
        """The output of a one-output model (None after an error); ValueError naming them if there are several."""
        if self.outputs is None:
            return None
        if len(self.outputs) != 1:
            raise ValueError(f"the model has {len(self.outputs)} outputs ({', '.join(self.outputs)}): read outputs")
        return next(iter(self.outputs.values()))

    @property
    def capture_to_result(self) -> float | None:
        """Seconds from the frame's capture to its result's delivery (None: not both known)."""
        if self.captured is None or self.delivered is None:
            return None
        return self.delivered - self.captured

    def log_record(self, predicted: float, start: float = 0.0) -> dict:
        """The --json-log line of this frame (``captured``: seconds from ``start``, the run's start)."""
        record = {"frame": self.index, "latency": self.latency, "predicted": predicted, "error": self.error,
                  "captured": None if self.captured is None else self.captured - start,
                  "capture_to_result": self.capture_to_result,
                  "dispatch": self.dispatch, "stitch": self.stitch, "tail": self.tail,
                  "servers": [{"name": s.name, "antenna": s.antenna, "rows": list(s.rows), "send_start": s.send_start,
                               "transfer": s.transfer, "queue": s.queue, "compute": s.compute, "return": s.back,
                               "finish": s.finish, "recovered_from": s.recovered_from} for s in self.servers]}
        if self.staged is not None:
            record["staged"] = self.staged.to_dict()
        return record
