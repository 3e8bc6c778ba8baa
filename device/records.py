"""What the device records: the measurements setup made, and each frame's result and timeline."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from deepco.planning.staged import Rates


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
    """One frame's output (or error) and its timeline."""

    index: int
    output: np.ndarray | None = None
    error: str | None = None
    latency: float = 0.0
    dispatch: float = 0.0  # from the last slice's return to the start of stitching (thread hand-over)
    stitch: float = 0.0
    tail: float = 0.0
    servers: list[ServerTiming] = field(default_factory=list)
    staged: dict | None = None  # a staged plan's timeline (device.staged: sent, collected, tail, per server)

    def log_record(self, predicted: float) -> dict:
        """The --json-log line of this frame."""
        record = {"frame": self.index, "latency": self.latency, "predicted": predicted, "error": self.error,
                  "dispatch": self.dispatch, "stitch": self.stitch, "tail": self.tail,
                  "servers": [{"name": s.name, "antenna": s.antenna, "rows": list(s.rows), "send_start": s.send_start,
                               "transfer": s.transfer, "queue": s.queue, "compute": s.compute, "return": s.back,
                               "finish": s.finish, "recovered_from": s.recovered_from} for s in self.servers]}
        if self.staged is not None:
            record["staged"] = self.staged
        return record
