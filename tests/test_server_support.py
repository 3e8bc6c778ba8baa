"""Shared helpers for the wire/server tests: small ONNX conv nets and a `deepco serve` subprocess.

It holds no tests itself (pytest imports it like any test module and finds none).
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent


def conv_model(channels: tuple[int, ...] = (3, 8, 8, 4), seed: int = 0, strides: tuple[int, ...] = (),
               pad: int = 1) -> bytes:
    """A small conv net (3x3 convs, ReLU between) with dynamic batch, height and width."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    prev = "input"
    for i, (cin, cout) in enumerate(zip(channels, channels[1:], strict=False)):
        w = numpy_helper.from_array((rng.standard_normal((cout, cin, 3, 3)) * 0.3).astype(np.float32), f"w{i}")
        b = numpy_helper.from_array(rng.standard_normal(cout).astype(np.float32) * 0.1, f"b{i}")
        inits += [w, b]
        stride = strides[i] if i < len(strides) else 1
        nodes.append(helper.make_node("Conv", [prev, f"w{i}", f"b{i}"], [f"c{i}"], kernel_shape=[3, 3],
                                      pads=[pad] * 4, strides=[stride, stride]))
        last = i == len(channels) - 2
        out = "output" if last else f"r{i}"
        if not last:
            nodes.append(helper.make_node("Relu", [f"c{i}"], [out]))
        else:
            nodes[-1].output[0] = "output"
        prev = out
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", channels[0], "H", "W"])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", channels[-1], "OH", "OW"])
    graph = helper.make_graph(nodes, "convnet", [x], [y], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


# A model and input that keep one ORT thread busy for about a second (0.8-1.5 s on the CI machine): long
# enough for a test to act while the request is surely in flight.
HEAVY_CHANNELS = (3, 64, 64, 64, 64, 64, 4)
HEAVY_SHAPE = (1, 3, 768, 768)


def whole_bytes(seed: int = 0, channels: tuple[int, ...] = (3, 8, 4)) -> bytes:
    """A small conv net of fixed image size (8x8): a model a server holds whole and derives stages from."""
    model = onnx.load_from_string(conv_model(channels, seed=seed))
    for value in (model.graph.input[0], model.graph.output[0]):
        for d, size in zip(value.type.tensor_type.shape.dim[2:], (8, 8), strict=True):
            d.Clear()
            d.dim_value = size
    return model.SerializeToString()


def heavy_model() -> bytes:
    """The slow model of HEAVY_CHANNELS."""
    return conv_model(channels=HEAVY_CHANNELS)


def reference(model_bytes: bytes, array: np.ndarray) -> np.ndarray:
    """The model's output computed locally with ONNX Runtime (CPU)."""
    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: array})[0]


@dataclass
class ServeProcess:
    """A running `python -m deepco serve` subprocess and what it printed."""

    proc: subprocess.Popen
    address: str
    stderr_lines: list[str] = field(default_factory=list)

    def sigterm(self, timeout: float = 30.0) -> int:
        """Send SIGTERM and wait for the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


def _pump(stream, sink: queue.Queue | list) -> None:
    for line in stream:
        if isinstance(sink, list):
            sink.append(line)
        else:
            sink.put(line)


def stalled_upload(channel: grpc.Channel, until: threading.Event, timeout: float) -> grpc.StatusCode:
    """One ModelInfer upload whose body does not come until ``until`` is set: it holds one of the server's
    work slots meanwhile. Returns how the call ended (OK, or the server's or the deadline's code)."""
    def never_sends() -> Iterator[bytes]:
        until.wait(timeout)
        return
        yield b""

    try:
        channel.stream_unary("/inference.GRPCInferenceService/ModelInfer")(never_sends(), timeout=timeout)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Return once ``condition()`` holds; fail the test naming ``what`` if it does not within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        time.sleep(0.01)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of http://127.0.0.1:port/metrics, by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def metric_sum(samples: dict, name: str, **labels: str) -> float:
    """The sum of the samples of metric ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def child_env() -> dict[str, str]:
    """The environment of a `python -m deepco` subprocess: this checkout first on PYTHONPATH, the caller's
    PYTHONPATH kept after it (where a worktree maps deepco_server and deepco_device to its own folders; an
    editable install elsewhere would otherwise give the subprocess another checkout's server)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


@contextlib.contextmanager
def serve_process(*args: str, startup_timeout: float = 30.0, cwd: Path = ROOT) -> Iterator[ServeProcess]:
    """Start `python -m deepco serve --port 0 ARGS` (in ``cwd``) and yield it once it prints its address."""
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-m", "deepco", "serve", "--port", "0", *args], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    stderr_lines: list[str] = []
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    threading.Thread(target=_pump, args=(proc.stderr, stderr_lines), daemon=True).start()
    try:
        try:
            line = lines.get(timeout=startup_timeout)
        except queue.Empty:
            raise AssertionError(f"deepco serve did not start; stderr: {''.join(stderr_lines)}") from None
        match = re.fullmatch(r"deepco serve: listening on (\S+)\n", line)
        assert match, f"unexpected first line {line!r}; stderr: {''.join(stderr_lines)}"
        yield ServeProcess(proc, match.group(1), stderr_lines)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
