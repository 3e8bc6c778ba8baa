"""Measuring what the planners need, at setup: the device's own speed on the whole model, every server's speed
on a small compute probe (DeepcoService.Profile: kilobytes over the radio, not the model), each antenna's
bandwidth and the per-request overhead (DeepcoService.Echo: kilobytes on a slow radio, `next_link_probe`), the
server-to-server link (two servers probe each other, DeepcoService.ProbePeer) and the device's own CPU time per
byte it marshals. With pacing the antennas' configured bandwidths are what pacing enforces, so they are taken as
given.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
import uuid
from collections.abc import Callable, Collection

import numpy as np
import onnx
import onnxruntime as ort
from deepco_device.backpressure import while_busy
from deepco_device.channels import Channels
from deepco_device.lifecycle import load_with_room
from deepco_device.records import Measurements
from onnx import helper, numpy_helper

from deepco.partition import Cut, Partitioner
from deepco.wire.client import InferenceClient, ServerError

PROBE_BYTES = 1 << 20  # the link probe's largest payload (a fast link: its transfer is long beside the jitter)
LINK_PROBE_START = 32 << 10  # its first: on a slow radio (8 Mbit/s: 33 ms) it is the only one
LINK_PROBE_SECONDS = 0.025  # a payload that takes this long to cross times the link well (jitter: ~1 ms)
PEER_PROBE_BYTES = 4 << 20  # server to server: larger, the links may be a LAN


def device_session(model_bytes: bytes, threads: int = 1) -> ort.InferenceSession:
    """An ORT session for the device. One thread, no spinning: a camera has one weak core (under a CPU
    quota, spinning threads burn the quota and throttle the whole process)."""
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def wall_times(fn: Callable[[], object], runs: int = 3) -> list[float]:
    """The wall time of each of ``runs`` calls of ``fn``. A call a busy server refuses is retried
    (`while_busy`), and only the call that succeeded is timed."""

    def timed() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return [while_busy(timed) for _ in range(runs)]


def median_seconds(fn: Callable[[], object], runs: int = 3) -> float:
    """Median wall time of ``runs`` calls of ``fn`` (`wall_times`)."""
    return statistics.median(wall_times(fn, runs))


SUSTAINED_SECONDS = 0.3  # a timed probe's calls, back to back: many periods of any CPU quota (10-100 ms)
SUSTAINED_MAX_RUNS = 200


def runs_for(seconds_per_run: float) -> int:
    """Calls of ``seconds_per_run`` each that together last ``SUSTAINED_SECONDS`` (3 to ``SUSTAINED_MAX_RUNS``)."""
    return max(3, min(SUSTAINED_MAX_RUNS, math.ceil(SUSTAINED_SECONDS / max(seconds_per_run, 1e-6))))


def sustained_seconds(fn: Callable[[], object]) -> float:
    """Seconds per call of ``fn``, called back to back for about ``SUSTAINED_SECONDS`` in all. Under a CPU
    quota a call shorter than the quota's period can run unthrottled, so the median of a few short calls is the
    core's burst speed, not the share the process gets: on the camera preset a 5 ms probe on a 0.45-core
    server measured it 2.75x too fast. The mean over many periods is the sustained speed."""
    start = time.perf_counter()
    fn()
    runs = runs_for(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(runs):
        fn()
    return (time.perf_counter() - start) / runs


def marshal_seconds_per_byte(nbytes: int = 1 << 20) -> float:
    """The device's own CPU time to encode and serialise one byte of a request (measured here, so under the
    device's CPU share): a weak camera pays it for every slice it sends."""
    from deepco.wire.tensors import encode_request

    x = np.zeros((1, 1, 1, nbytes), np.uint8)
    return sustained_seconds(lambda: encode_request("probe", {"x": x}).SerializeToString()) / nbytes


PROBE_CHANNELS = 64  # a ResNet's first stage: the probe's convolutions run at a real CNN's FLOP rate
PROBE_CONVS = 4  # convolutions of the probe, all sharing one weight tensor (uploaded once: 147 KB)
PROBE_FLOPS = 2e8  # work per timed run, at most: milliseconds on a server, under a second on a camera


def probe_model() -> onnx.ModelProto:
    """The compute probe: ``PROBE_CONVS`` 3x3 convolutions (each followed by a ReLU) of ``PROBE_CHANNELS``
    channels that share one weight tensor, on an input of any height and width. It crosses the radio as
    about 150 KB whatever the model; its work is set by the input's size, which the server makes itself
    (DeepcoService.Profile), so timing a server costs no bytes beyond the model. The servers' FLOP rate on
    the real model differs by a factor calibration fits (`deepco.planning.calibration`: the compute scale)."""
    c = PROBE_CHANNELS
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((c, c, 3, 3)) * np.sqrt(2.0 / (9 * c))).astype(np.float32)  # keeps the scale
    nodes, last = [], "x"
    for k in range(PROBE_CONVS):
        nodes += [helper.make_node("Conv", [last, "w"], [f"c{k}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{k}"], [f"r{k}"])]
        last = f"r{k}"
    graph = helper.make_graph(nodes, "deepco-probe",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, c, "h", "w"])],
                              [helper.make_tensor_value_info(last, onnx.TensorProto.FLOAT, [1, c, "h", "w"])],
                              [numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@functools.cache
def probe_bytes() -> bytes:
    """`probe_model` serialised, made once: a server that joins mid-run is probed beside the live frames, and
    on a tenth of a core making it again takes tens of milliseconds of the camera's CPU from them."""
    return probe_model().SerializeToString()


def probe_shape(flops: float) -> tuple[list[int], float]:
    """The probe's input shape for about ``flops`` of work (at most ``PROBE_FLOPS``), and its exact FLOPs."""
    per_pixel = 2 * PROBE_CHANNELS * PROBE_CHANNELS * 9 * PROBE_CONVS
    side = max(8, math.isqrt(int(min(flops, PROBE_FLOPS) // per_pixel)))
    return [1, PROBE_CHANNELS, side, side], float(per_pixel * side * side)


def server_rates(channels: Channels, reference: Cut, tag: str, skip: Collection[str] = ()) -> dict[str, float]:
    """FLOP/s of every server (but those in ``skip``) on the compute probe (`probe_model`), sized like the head
    up to ``reference`` (at most ``PROBE_FLOPS``); uploaded under a name of its own, since other devices may
    probe the same servers, and unloaded again."""
    data = probe_bytes()
    shape, flops = probe_shape(reference.head_flops)
    name = f"{tag}-probe-{uuid.uuid4().hex[:8]}"
    rates = {}
    for k, srv in enumerate(channels.cluster.servers):
        if srv.name in skip:
            continue
        c = channels.client(k, 0)
        load_with_room(c, data, name)  # a full server is one line at once, not a minute's wait
        first = while_busy(lambda c=c: c.profile(name, shape, runs=3, warmup=1).seconds)
        runs = runs_for(first)
        timed = while_busy(lambda c=c, runs=runs: c.profile(name, shape, runs=runs, warmup=0).run_seconds)
        rates[srv.name] = flops * len(timed) / sum(timed)  # the mean: see sustained_seconds
        while_busy(lambda c=c: c.unload_model(name))
    return rates


def probe_links(channels: Channels, pace: bool, marshal: float = 0.0, server: int = 0) -> tuple[list[float], float]:
    """Each antenna's bandwidth (bytes/s) and the per-request overhead (s), over ``server`` (the first one up).
    ``marshal``: the device's own CPU seconds per byte sent, which the cost model counts on its own: it is
    taken out of the probe's time (on a 0.1-core camera it is half of it, and counting it twice made the
    links look 3-10x slower than their shaping)."""
    antennas = channels.cluster.device.antennas
    if pace:  # the configured bandwidth is what pacing will enforce
        overhead = median_seconds(lambda: channels.client(server, 0).echo(1), runs=5)
        return [a.bandwidth * 1e6 / 8 for a in antennas], overhead
    bandwidths, overheads = [], []
    for m in range(len(antennas)):
        bandwidth, small = probe_link(channels.client(server, m), marshal)
        bandwidths.append(bandwidth)
        overheads.append(small)
    return bandwidths, statistics.median(overheads)


def probe_link(client: InferenceClient, marshal: float = 0.0) -> tuple[float, float]:
    """The bandwidth (bytes/s) of the antenna ``client`` talks over, and its 1-byte round trip (s): Echo payloads
    grown until one takes LINK_PROBE_SECONDS (`next_link_probe`), less the device's marshalling (``marshal``)."""
    smalls = wall_times(lambda: client.echo(1), runs=5)
    # The transfer is the large echo's time less the least small one: a loaded machine that slowed the small
    # echoes more than the large ones made a median difference credit the link with its time (1.22x the radio)
    small, floor = statistics.median(smalls), min(smalls)
    nbytes: int | None = LINK_PROBE_START
    while nbytes is not None:
        size, took = nbytes, median_seconds(lambda n=nbytes: client.echo(n), runs=3)
        # ... and a burst of load over all five small echoes still raised that floor (a CI run read 1.2x the
        # radio, another grew a slow radio's payload fourfold): the floor is the least of those and of as many
        # more taken after each large one
        floor = min(floor, *wall_times(lambda: client.echo(1), runs=5))
        nbytes = next_link_probe(size, took - floor)
    transfer = took - floor
    return size / max(transfer - marshal * size, 0.5 * transfer, 1e-6), small


def next_link_probe(nbytes: int, transfer: float) -> int | None:
    """The link probe's next payload after ``nbytes`` crossed in ``transfer`` seconds (beyond a 1-byte echo), or
    None where that one timed the link well enough (it took ``LINK_PROBE_SECONDS``) or was the largest. A slow
    radio is timed on kilobytes (a megabyte is seconds at 8 Mbit/s, and 3 of them were sent per antenna); a
    fast link on a payload sized from the first one's rate to take twice ``LINK_PROBE_SECONDS``."""
    if transfer >= LINK_PROBE_SECONDS or nbytes >= PROBE_BYTES:
        return None
    wanted = nbytes * 2 * LINK_PROBE_SECONDS / transfer if transfer > 0 else PROBE_BYTES
    return int(min(PROBE_BYTES, max(wanted, 4 * nbytes)))


def probe_peers(channels: Channels, log: Callable[[str], None], up: list[int] | None = None) -> tuple[float, float]:
    """Server-to-server bandwidth and per-message overhead: the two first-listed servers of ``up`` (indices;
    default all) probe each other both ways (ProbePeer); (0, 0) with one server, or when a probe fails (the
    antennas' bandwidth is then assumed between servers)."""
    cluster = channels.cluster
    servers = cluster.servers
    up = list(range(len(servers))) if up is None else up
    if len(up) < 2:
        return 0.0, 0.0
    samples = []
    for a, b in ((up[0], up[1]), (up[1], up[0])):
        try:
            small, large = while_busy(lambda a=a, b=b: channels.client(a, 0).probe_peer(
                cluster.address_on(servers[b], 0), PEER_PROBE_BYTES))
        except ServerError as exc:
            log(f"peer probe {servers[a].name} -> {servers[b].name} failed ({exc}); "
                "assuming the antennas' bandwidth between servers")
            return 0.0, 0.0
        # On a fast LAN a megabyte crosses in about the jitter of the small round trip: attribute at least
        # half of the large round trip to the transfer, or the difference can be ~0 and the rate absurd
        samples.append((PEER_PROBE_BYTES / max(large - small, 0.5 * large), small))
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def measure(channels: Channels, partitioner: Partitioner, whole: ort.InferenceSession, x: np.ndarray,
            reference: Cut, *, pace: bool, tag: str, log: Callable[[str], None],
            skip: Collection[str] = (), step: Callable[[str], None] = lambda what: None) -> tuple[Measurements, float]:
    """Everything setup measures (see the module doc), on the servers not in ``skip`` (down at the start); and
    the ratio of the device's speed on the model to its speed on the probe, by which a server's probe rate
    becomes its rate on the model (`server_rates` times it: a server that joins later is measured so too).
    ``whole``: the device's session of the whole model; ``x``: a blank frame of pixels; ``reference``: the cut
    whose head's work the servers' probe is sized by."""
    name = whole.get_inputs()[0].name
    step("measuring the device")
    device_rate = partitioner.total_flops / median_seconds(lambda: whole.run(None, {name: x}))
    # The probe's FLOPs run at another rate than the model's (a ResNet at 64x64 ran 5x slower per FLOP on
    # these servers than the probe): the device times the probe too, and takes the servers' rates on the model
    # to be theirs on the probe at its own ratio (calibration fits what remains: the compute scale).
    shape, flops = probe_shape(reference.head_flops)
    probe, probe_x = device_session(probe_bytes()), np.zeros(shape, np.float32)
    ratio = device_rate / (flops / sustained_seconds(lambda: probe.run(None, {"x": probe_x})))
    step("measuring the servers")
    rates = {k: v * ratio for k, v in server_rates(channels, reference, tag, skip).items()}
    marshal = marshal_seconds_per_byte()
    up = [k for k, srv in enumerate(channels.cluster.servers) if srv.name not in skip]
    step("measuring the antennas")
    bandwidths, overhead = probe_links(channels, pace, marshal, up[0])
    step("measuring server to server")
    peer, peer_overhead = probe_peers(channels, log, up)
    return Measurements(rates, bandwidths, overhead, device_rate, pace, peer, peer_overhead, marshal), ratio
