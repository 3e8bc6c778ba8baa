"""The weak camera of `deepco demo` and `deepco bench --preset demo`, in absolute terms.

A cgroup CPU quota is a share of *this* machine's core, so a camera given a fixed share is as weak as the
host is slow: on a 2-core AMD EPYC host the demo's 0.2 core ran EfficientNet-Lite0 at 288x288 in 130-170 ms
and a split won all of ten runs; on a 2-core Intel Xeon host the same 0.2 core ran it in 70-90 ms and the
camera alone won six of ten (the radio's 20 Mbit/s do not get faster with the host). The camera is therefore
a device of ``CAMERA_GFLOPS`` on the model it runs: the share of one core that gives that is measured on the
host (ONNX Runtime on one thread, at full speed, before any quota) and used as the quota, up to ``cap``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import onnx

CAMERA = "camera"  # `deepco bench --preset demo`'s device share: the demo's camera, measured as the demo does
# a weak camera's CPU on a CNN: EfficientNet-Lite0 at 288x288 (1.29 GFLOPs) in ~90 ms of compute, ~140 ms a frame
# with the rest of the device's work; what the AMD EPYC host's 0.2 core was (local p50 130-170 ms)
CAMERA_GFLOPS = 14.0
CAMERA_CAP = 0.2  # the camera's share at most: what the demo's three 0.6-core edge boxes leave of two cores
SMALLEST_SHARE = 0.05  # below this the 10 ms cgroup period leaves the camera slices under half a millisecond
RUNS = 5  # timed runs at least after one warm-up, ...
TIMED_SECONDS = 0.5  # ... and for this long: the fastest is the host's speed (the others carry interruptions;
# with 5 runs of 13 ms the host read anywhere from 59 to 100 GFLOP/s right after the servers started)


def host_gflops(model: onnx.ModelProto, height: int, width: int) -> float:
    """GFLOP/s of one of this machine's cores on ``model`` at ``height`` x ``width`` (ONNX Runtime, one thread,
    the fastest of the runs in ``TIMED_SECONDS``, ``RUNS`` at least, on a zero frame of the model's input
    shape)."""
    import onnxruntime as ort

    from deepco.partition.source import model_flops

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    first = session.get_inputs()[0]
    channels = first.shape[1] if isinstance(first.shape[1], int) else 3
    frame = np.zeros((1, channels, height, width), np.float32)
    session.run(None, {first.name: frame})  # the first run allocates
    seconds: list[float] = []
    until = time.perf_counter() + TIMED_SECONDS
    while len(seconds) < RUNS or time.perf_counter() < until:
        start = time.perf_counter()
        session.run(None, {first.name: frame})
        seconds.append(time.perf_counter() - start)
    return model_flops(model, height, width) / min(seconds) / 1e9


def camera_share(model: onnx.ModelProto, height: int, width: int, cap: float) -> tuple[float, float]:
    """(the share of one core at which this machine runs ``model`` at ``CAMERA_GFLOPS``, at most ``cap`` and at
    least ``SMALLEST_SHARE``; this machine's GFLOP/s on one core)."""
    host = host_gflops(model, height, width)
    return min(cap, max(SMALLEST_SHARE, CAMERA_GFLOPS / host)), host
