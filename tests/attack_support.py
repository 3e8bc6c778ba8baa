"""The nine attacks of the server's second hostile review, as functions a test holds for seconds and
bench/attacks.py for half a minute, with a readiness prober and peak-RSS readings of the server process.

It holds no tests itself. Every attack talks to a loopback address, is bounded in count and time, and ends
by itself.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import multiprocessing
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnx import TensorProto, helper

from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire import inference_pb2 as pb
from deepco.wire.rows import encode_rows
from deepco.wire.tensors import encode_request

READY = "/inference.GRPCInferenceService/ServerReady"
# A channel of its own connection: gRPC Python otherwise shares one connection between channels to one address.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def _model(nodes, inputs, outputs, initializers=(), opset: int = 17) -> bytes:
    graph = helper.make_graph(nodes, "attack", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model.SerializeToString()


# --- reading the server -------------------------------------------------------------------------------------

def _status_kb(pid: int, field: str) -> int:
    return next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith(field + ":"))


def rss_mb(pid: int) -> float:
    """The process's resident memory now, in MB."""
    return _status_kb(pid, "VmRSS") / 1024


def peak_mb(pid: int) -> float:
    """The process's peak resident memory since the last :func:`reset_peak`, in MB."""
    return _status_kb(pid, "VmHWM") / 1024


def reset_peak(pid: int) -> None:
    """Restart the process's peak-RSS count (Linux: clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def _probe(address: str, every: float, deadline: float, stop, results: list[tuple[str, float]]) -> None:
    with grpc.insecure_channel(address) as channel:
        ready = channel.unary_unary(READY, request_serializer=pb.ServerReadyRequest.SerializeToString,
                                    response_deserializer=pb.ServerReadyResponse.FromString)
        while not stop.is_set():
            start = time.perf_counter()
            try:
                ok = ready(pb.ServerReadyRequest(), timeout=deadline).ready
                outcome = "OK" if ok else "not ready"
            except grpc.RpcError as exc:
                outcome = exc.code().name
            results.append((outcome, time.perf_counter() - start))
            stop.wait(every)


def _probe_process(address: str, every: float, deadline: float, stop, pipe) -> None:
    results: list[tuple[str, float]] = []
    _probe(address, every, deadline, stop, results)
    pipe.send(results)


class Prober:
    """ServerReady every ``every`` seconds with a ``deadline``, on a channel of its own, in a thread, or with
    ``own_process`` in a process of its own, so that an attacker's threads cannot hold its interpreter lock (the
    benchmark's way: there a slow probe must be the server's fault)."""

    def __init__(self, address: str, every: float = 0.1, deadline: float = 1.0, own_process: bool = False):
        self.address, self.every, self.deadline = address, every, deadline
        self.results: list[tuple[str, float]] = []
        if own_process:
            context = multiprocessing.get_context("spawn")  # gRPC does not survive a fork
            self._stop = context.Event()
            self._receive, send = context.Pipe(duplex=False)
            self._worker = context.Process(target=_probe_process, daemon=True,
                                           args=(address, every, deadline, self._stop, send))
        else:
            self._stop, self._receive = threading.Event(), None
            self._worker = threading.Thread(target=_probe, daemon=True,
                                            args=(address, every, deadline, self._stop, self.results))

    def __enter__(self) -> Prober:
        self._worker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._receive is not None and self._receive.poll(10 + self.deadline):
            self.results = self._receive.recv()
        self._worker.join(timeout=10)

    @property
    def failed(self) -> list[tuple[str, float]]:
        """Probes that failed or took the deadline or more."""
        return [(o, round(s, 3)) for o, s in self.results if o != "OK" or s >= self.deadline]

    @property
    def slowest(self) -> float:
        return max((s for _, s in self.results), default=0.0)


# --- 1. variable-size elements --------------------------------------------------------------------------------

def string_doubling_model(doublings: int = 27) -> bytes:
    """Cast the input to STRING, then double the string ``doublings`` times with StringConcat (opset 20)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.STRING, [1])
    nodes = [helper.make_node("Cast", ["x"], ["s0"], to=TensorProto.STRING, name="to_string")]
    for i in range(doublings):
        out = "y" if i == doublings - 1 else f"s{i + 1}"
        nodes.append(helper.make_node("StringConcat", [f"s{i}", f"s{i}"], [out], name=f"double{i}"))
    return _model(nodes, [x], [y], opset=20)


# --- 2. repeated output names ---------------------------------------------------------------------------------

def repeated_outputs_request(model: str, array: np.ndarray, output: str, count: int) -> pb.ModelInferRequest:
    """A request for ``output`` ``count`` times."""
    request = encode_request(model, {"input": array})
    for _ in range(count):
        request.outputs.add(name=output)
    return request


# --- 3 and 8. headers-only calls --------------------------------------------------------------------------------

@contextlib.contextmanager
def headers_only(address: str, method: str, count: int, metadata: tuple = (),
                 seconds: float = 60.0) -> Iterator[list[grpc.Future]]:
    """``count`` calls of unary ``method`` that send their headers and never their body, each on its own
    connection, held until the block ends (or ``seconds``)."""
    release = threading.Event()

    def never() -> Iterator[bytes]:
        release.wait(seconds)
        return
        yield b""

    channels = [grpc.insecure_channel(address, options=OWN_CONNECTION) for _ in range(count)]
    calls = [ch.stream_unary(method).future(never(), timeout=seconds, metadata=metadata) for ch in channels]
    try:
        yield calls
    finally:
        release.set()
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()


def answer_within(address: str, deadline: float = 1.0, metadata: tuple = ()) -> dict[str, str]:
    """ServerLive, ServerReady, Health/Check and the control calls ServerMetadata, RepositoryIndex,
    ModelReady and RepositoryModelUnload (of no model), each with ``deadline``: how each ended."""
    outcomes = {}
    with grpc.insecure_channel(address) as channel:
        calls = {
            "ServerLive": (channel.unary_unary("/inference.GRPCInferenceService/ServerLive"), b""),
            "ServerReady": (channel.unary_unary(READY), b""),
            "Check": (health_pb2_grpc.HealthStub(channel).Check, health_pb2.HealthCheckRequest()),
            "ServerMetadata": (channel.unary_unary("/inference.GRPCInferenceService/ServerMetadata"), b""),
            "RepositoryIndex": (channel.unary_unary("/inference.GRPCInferenceService/RepositoryIndex"), b""),
            "ModelReady": (channel.unary_unary("/inference.GRPCInferenceService/ModelReady"),
                           pb.ModelReadyRequest(name="none").SerializeToString()),
            "RepositoryModelUnload": (channel.unary_unary("/inference.GRPCInferenceService/RepositoryModelUnload"),
                                      pb.RepositoryModelUnloadRequest(model_name="none").SerializeToString()),
        }
        for name, (call, request) in calls.items():
            start = time.perf_counter()
            try:
                call(request, timeout=deadline, metadata=metadata)
                outcome = "OK"
            except grpc.RpcError as exc:
                outcome = exc.code().name
            outcomes[name] = f"{outcome} {time.perf_counter() - start:.2f}s"
    return outcomes


# --- 4. replies nobody reads --------------------------------------------------------------------------------

def unread_replies(address: str, streams: int, reply_bytes: int, seconds: float) -> dict[int, object]:
    """Echo asking for ``reply_bytes`` on ``streams`` streams of one HTTP/2 connection whose client grants no
    flow-control window (SETTINGS_INITIAL_WINDOW_SIZE 0): the server cannot send a byte of any reply. Waits up
    to ``seconds`` for every stream to end; returns stream id -> its grpc-status (int) or "reset"."""
    host, port = address.rsplit(":", 1)
    body = dpb.EchoRequest(reply_bytes=reply_bytes).SerializeToString()
    frame = b"\0" + len(body).to_bytes(4, "big") + body
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    ended: dict[int, object] = {}
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        conn.initiate_connection()
        conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        sock.sendall(conn.data_to_send())
        ids = []
        for _ in range(streams):
            sid = conn.get_next_available_stream_id()
            ids.append(sid)
            conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", "/deepco.DeepcoService/Echo"),
                                    (":authority", address), ("content-type", "application/grpc"), ("te", "trailers")])
            conn.send_data(sid, frame, end_stream=True)
        sock.sendall(conn.data_to_send())
        sock.settimeout(0.1)
        end = time.monotonic() + seconds
        while time.monotonic() < end and len(ended) < streams:
            try:
                data = sock.recv(1 << 16)
            except TimeoutError:
                continue
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    status = dict(event.headers).get("grpc-status")
                    if status is not None:
                        ended[event.stream_id] = int(status)
                elif isinstance(event, h2.events.StreamReset):
                    ended.setdefault(event.stream_id, "reset")
            if out := conn.data_to_send():
                sock.sendall(out)
    return ended


# --- 5. kernel workspaces ----------------------------------------------------------------------------------------

def wide_conv_transpose_model(kernel: int = 32) -> bytes:
    """A ConvTranspose of stride 1 and kernel ``kernel`` with pads kernel - 1 split to keep H and W: its
    input and output are the same size, its column buffer kernel² times more."""
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 1, "H", "W"])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 1, "H", "W"])
    w = helper.make_tensor("w", TensorProto.FLOAT, [1, 1, kernel, kernel], np.full(kernel * kernel, 1e-3, np.float32))
    low, high = (kernel - 1) // 2, kernel - 1 - (kernel - 1) // 2
    node = helper.make_node("ConvTranspose", ["input", "w"], ["output"], kernel_shape=[kernel, kernel],
                            strides=[1, 1], pads=[low, low, high, high], name="wide")
    return _model([node], [x], [y], [w])


# --- 6. compressed requests ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def _gzipped_echo(inflated: int) -> bytes:
    return gzip.compress(dpb.EchoRequest(payload=bytes(inflated)).SerializeToString(), compresslevel=9)


def _h2_call(address: str, path: str, message: bytes, headers: tuple = (), timeout: float = 10.0,
             compressed: bool = False) -> int | str:
    """One gRPC call over a raw HTTP/2 connection: its grpc-status, or "reset" / "timeout"."""
    host, port = address.rsplit(":", 1)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        conn.initiate_connection()
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", address),
                                ("content-type", "application/grpc"), ("te", "trailers"), *headers])
        body = (b"\1" if compressed else b"\0") + len(message).to_bytes(4, "big") + message
        sock.sendall(conn.data_to_send())
        sock.settimeout(0.1)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            while body:  # as much as the server's flow-control window and frame size allow
                n = min(len(body), conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                if n <= 0:
                    break
                conn.send_data(sid, body[:n], end_stream=n == len(body))
                body = body[n:]
            if out := conn.data_to_send():
                sock.sendall(out)
            try:
                data = sock.recv(1 << 16)
            except TimeoutError:
                continue
            if not data:
                return "reset"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    status = dict(event.headers).get("grpc-status")
                    if status is not None:
                        return int(status)
                elif isinstance(event, h2.events.StreamReset):
                    return "reset"
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if out := conn.data_to_send():
                sock.sendall(out)
    return "timeout"


def compressed_echo(address: str, inflated: int, timeout: float = 10.0) -> str:
    """An Echo whose ``inflated``-byte payload (zeros) travels gzip-compressed (250 MiB: 249 KiB), sent as
    compressed bytes made once: how it ended (the status name)."""
    status = _h2_call(address, "/deepco.DeepcoService/Echo", _gzipped_echo(inflated), (("grpc-encoding", "gzip"),),
                      timeout=timeout, compressed=True)
    return grpc.StatusCode.OK.name if status == 0 else next(
        (c.name for c in grpc.StatusCode if c.value[0] == status), str(status))


# --- 7. made-up exchange jobs --------------------------------------------------------------------------------------

def made_up_exchanges(address: str, count: int, prefix: str = "made-up") -> dict[str, int]:
    """``count`` SplitExchange calls on one connection, each with one 16-byte message for a job nobody runs:
    how they ended, by status name."""
    rows = encode_rows(np.zeros((1, 1, 1, 4), np.float32), 0)
    ended: dict[str, int] = {}
    with grpc.insecure_channel(address, options=OWN_CONNECTION) as channel:
        exchange = channel.stream_unary("/deepco.DeepcoService/SplitExchange",
                                        request_serializer=dpb.RowsMessage.SerializeToString,
                                        response_deserializer=dpb.ExchangeAck.FromString)
        for i in range(count):
            message = dpb.RowsMessage(job_id=f"{prefix}-{i}", level=1, sender=1, rows=rows)
            try:
                exchange(iter([message]), timeout=10)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            ended[code] = ended.get(code, 0) + 1
    return ended


# --- 9. out-of-range typed contents -----------------------------------------------------------------------------

TYPED_CASES = {"INT8": ("int_contents", 1000), "UINT8": ("uint_contents", 300), "UINT16": ("uint_contents", 70000),
               "INT16": ("int_contents", -40000)}


def identity_model(elem: int) -> bytes:
    """x -> y of one element type, any shape."""
    x = helper.make_tensor_value_info("x", elem, [None])
    y = helper.make_tensor_value_info("y", elem, [None])
    return _model([helper.make_node("Identity", ["x"], ["y"])], [x], [y])


def typed_request(model: str, datatype: str, field: str, value: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="x", datatype=datatype, shape=[1])
    getattr(tensor.contents, field).append(value)
    return request
