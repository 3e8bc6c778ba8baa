"""Models cross the radio once (issue 27): a server holds the whole model and derives each stage model itself from a
small description (deepco.partition.derive, server/derived.py); real `deepco serve` servers on loopback sockets,
real ONNX Runtime."""

from __future__ import annotations

import contextlib

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from deepco_device.preprocess import normalise
from deepco_device.runners import SplitRunner
from deepco_device.session import Device
from deepco_device.staged import StagedPlanner, StagedRunner
from deepco_server.app import ServeConfig, Server

from deepco.cluster import parse_cluster
from deepco.partition import Partitioner
from deepco.partition.derive import Dims, WholeModel, open_segment
from deepco.partition.open_rows import sides_bits
from deepco.planning.staged import offload_plan_on, split_plan
from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire.client import InferenceClient, ServerError, content_name_of

H, W = 97, 131  # odd sizes: halos clipped unevenly
DERIVES = "deepco_derive_stages"


@contextlib.contextmanager
def servers(count: int, derive: bool = True):
    with contextlib.ExitStack() as stack:
        srvs = [Server(ServeConfig(port=0, device="cpu", threads=1, max_models=64, max_inflight=4,
                                   derive_stages=derive)) for _ in range(count)]
        for srv in srvs:
            stack.callback(srv.stop, 0)
        yield srvs


def device(srvs) -> Device:
    data = {"device": {"antennas": 2, "bandwidth": 100.0},
            "servers": [{"name": f"s{i}", "capacity": 1.0, "address": f"127.0.0.1:{s.port}"}
                        for i, s in enumerate(srvs)]}
    dev = Device(parse_cluster(data), "resnet18", H, W, log=lambda _: None)
    dev.setup()
    return dev


def pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (1, 3, H, W), dtype=np.uint8)


def reference(dev: Device, px: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(dev.reference_model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: normalise(px, dev.preprocessing)})[0]


def plan_of(dev: Device, chosen: list[str], levels: list[str], tail: bool):
    planner = StagedPlanner(dev)
    plan = split_plan(planner.costs, planner.rates(), chosen, levels, True, chosen[0] if tail else None)
    assert plan is not None
    return plan


def run_once(dev: Device, plan, seed: int = 0) -> np.ndarray:
    runner = StagedRunner(dev, plan)
    try:
        outputs, _ = runner.run_frame(pixels(seed))
        (got,) = outputs.values()
        return got
    finally:
        runner.close()


@pytest.fixture(scope="module")
def resnet_partitioner(partition_zoo):
    from deepco.partition.pixels import with_pixel_input

    model, _ = partition_zoo("resnet18", 0, 0)
    return Partitioner(with_pixel_input(model, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 1 / 255), H, W)


def test_a_derived_stage_is_the_device_s_stage_byte_for_byte(resnet_partitioner):
    """From the whole model's bytes alone (as a server has them), every stage the device extracts comes out
    the same bytes: the segments of a multi-stage split, its tail, and the whole model itself."""
    p = resnet_partitioner
    whole = WholeModel(__import__("onnx").load_from_string(p.whole().SerializeToString()))
    levels = ["layer1", "layer2.0", "layer3"]
    segments = p.segments(levels[-1], models=True, through=levels[:-1])
    for seg in segments:
        derived = whole.stage([seg.source], [seg.target], Dims.ROWS, seg.model.graph.name)
        assert derived.SerializeToString() == seg.model.SerializeToString(), seg.name
        for sides in [(True, False), (False, True), (True, True)]:  # the segment on open rows, each pair of sides
            opened = open_segment(seg.model, sides)
            derived = whole.stage([seg.source], [seg.target], Dims.ROWS, opened.graph.name, sides_bits(sides))
            assert derived.SerializeToString() == opened.SerializeToString(), (seg.name, sides)
            assert opened.SerializeToString() != seg.model.SerializeToString()
    _, tail = p.split(levels[-1])
    derived = whole.stage([p.cut(levels[-1]).tensor], list(p.graph.outputs), Dims.STATIC, tail.graph.name)
    assert derived.SerializeToString() == tail.SerializeToString()
    same = whole.stage([p.graph.input_name], list(p.graph.outputs), Dims.WHOLE, "whole")
    assert same.SerializeToString() == p.whole().SerializeToString()


@pytest.fixture(scope="module")
def deriving():
    """A device on three servers that derive stage models."""
    with servers(3) as srvs, device(srvs) as dev:
        yield dev


def offload(dev: Device, server: str) -> None:
    """Run one frame offloaded to ``server``: the whole model goes there (held to derive from, and derived as the
    model to run)."""
    run_once(dev, offload_plan_on(server, 0))


def test_stages_cross_the_radio_as_descriptions_once_the_whole_model_is_there(deriving):
    """Multi-stage splits: while a server's stage models weigh less than the whole
    model they are uploaded (a cold setup that needs a prefix of the weights sends no more than before); an
    offload sends the whole model, once: the next servers fetch it from the first (server/whole_fetch.py); from
    then on a new plan sends descriptions only, a few hundred bytes a stage, and its output equals the whole
    model within 1e-4."""
    dev = deriving
    assert DERIVES in dev.client(0, 0).server_metadata()["extensions"]
    before = dev.uploads.sent_bytes
    first = plan_of(dev, ["s0", "s1", "s2"], ["layer1", "layer3"], tail=False)
    run_once(dev, first)
    segments = sum(len(d) for _, d in SplitRunner.extracted(dev, first))  # each server's models of its sides
    assert dev.uploads.sent_bytes - before == segments

    whole = len(dev.stage_models[("whole",)]["bytes"])
    before = dev.uploads.sent_bytes
    for server in ("s0", "s1", "s2"):
        offload(dev, server)
    assert whole < dev.uploads.sent_bytes - before < whole + 3 * 1000  # the whole model once, descriptions, fetches

    second = plan_of(dev, ["s1", "s2"], ["layer2", "layer3.0"], tail=True)  # other stages, other tail
    before = dev.uploads.sent_bytes
    got = run_once(dev, second, seed=1)
    assert 0 < dev.uploads.sent_bytes - before < 2 * 3 * 1000  # no model: descriptions
    want = reference(dev, pixels(1))
    assert float(np.abs(got - want).max()) / float(np.abs(want).max()) < 1e-4


def test_a_server_that_lost_the_whole_model_gets_it_again(deriving):
    """The whole model dropped on the server (its lease, or by hand): the next derivation is NOT_FOUND and the
    server fetches the whole model again from a peer that holds it; once no server holds it, the device sends
    it again. Either way it derives and the run goes on."""
    dev = deriving
    offload(dev, "s0")
    offload(dev, "s1")
    whole = dev.stage_models[("whole",)]["bytes"]
    name = content_name_of(f"{dev.tag}-whole", dev.uploads.digest(whole))
    dev.client(0, 0).unload_model(name, force=True)
    plan = plan_of(dev, ["s0"], ["layer1.0"], tail=True)
    before = dev.uploads.sent_bytes
    run_once(dev, plan, seed=2)
    assert 0 < dev.uploads.sent_bytes - before < 3 * 1000  # fetched from s1: a request crossed the radio
    for k in range(3):
        with contextlib.suppress(ServerError):
            dev.client(k, 0).unload_model(name, force=True)
    before = dev.uploads.sent_bytes
    got = run_once(dev, plan, seed=2)
    assert len(whole) < dev.uploads.sent_bytes - before < len(whole) + 3 * 1000
    want = reference(dev, pixels(2))
    assert float(np.abs(got - want).max()) / float(np.abs(want).max()) < 1e-4


def test_servers_that_do_not_derive_get_the_stage_models_and_the_outputs_are_the_same(deriving):
    """The fallback: a server without the capability (`deepco serve --no-derive-stages`) is sent every stage
    model, and no whole model even for an offload; the same plan's output is bit-identical to the derived
    stages' output."""
    levels = ["layer1", "layer3"]
    offload(deriving, "s0")
    before = deriving.uploads.sent_bytes
    derived = run_once(deriving, plan_of(deriving, ["s0"], levels, tail=True), seed=3)
    assert deriving.uploads.sent_bytes - before < 3 * 1000  # derived
    with servers(1, derive=False) as srvs, device(srvs) as dev:
        assert DERIVES not in dev.client(0, 0).server_metadata()["extensions"]
        before = dev.uploads.sent_bytes
        offload(dev, "s0")
        uploaded = run_once(dev, plan_of(dev, ["s0"], levels, tail=True), seed=3)
        stages = dev.stage_models[tuple(levels)]
        segments = sum(len(d) for d in stages["segments"])
        whole = len(dev.stage_models[("whole",)]["bytes"])
        assert dev.uploads.sent_bytes - before == whole + segments + len(stages["tail_bytes"])
    assert np.array_equal(derived, uploaded)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(ServerError) as info:
        call()
    return info.value.code


def test_bad_descriptions_get_their_status_and_the_server_stays_up(resnet_partitioner):
    """A description is any bytes: each bad one is refused with the status that names its problem, before
    anything is loaded, and the server still answers ServerReady and loads a good one."""
    import hashlib

    p = resnet_partitioner
    whole = p.whole().SerializeToString()
    digest = hashlib.sha256(whole).hexdigest()
    seg = p.segments("layer1", models=True)[-1]

    def describe(**changes) -> bytes:
        fields = dict(whole_sha256=digest, inputs=[seg.source], outputs=[seg.target], dims=Dims.ROWS,
                      name=seg.model.graph.name, height=H, width=W) | changes
        return dpb.StageDescription(**fields).SerializeToString()

    with servers(1) as (srv,):
        client = InferenceClient(f"127.0.0.1:{srv.port}")
        good = describe()
        assert _code(lambda: client.derive_model(good, "s")) == grpc.StatusCode.NOT_FOUND  # no whole model yet
        client.load_model(whole, "w", sha256=digest, whole=True)
        assert client.model_index() == []  # held, not loaded: no model slot
        bad = {
            "garbage": b"\xff\x00\x13not a description",
            "unknown tensor": describe(outputs=["no such tensor"]),
            "absurd dims": describe(height=1 << 30, width=7),
            "unknown dims": describe(dims=99),
            "two outputs on rows": describe(outputs=[seg.target, seg.source]),
            "a name with control characters": describe(name="a\nb"),
            "no stage between them": describe(inputs=[seg.target], outputs=[seg.source]),
            "open rows past both sides": describe(open_rows=4),
            "open rows of a stage not on rows": describe(dims=Dims.STATIC, open_rows=3),
        }
        for why, description in bad.items():
            assert _code(lambda d=description: client.derive_model(d, "s")) == grpc.StatusCode.INVALID_ARGUMENT, why
        assert _code(lambda: client.derive_model(good, "s", sha256="0" * 64)) == grpc.StatusCode.FAILED_PRECONDITION
        assert client.model_index() == [] and client.server_ready()
        client.derive_model(good, "s", sha256=hashlib.sha256(seg.model.SerializeToString()).hexdigest())
        assert [m.name for m in client.model_index()] == ["s"]
        client.unload_model("s")  # a derived model goes as an uploaded one does
        assert client.model_index() == []
        client.close()

    # the whole model's bytes count against --max-model-bytes
    srv = Server(ServeConfig(port=0, device="cpu", threads=1, max_model_bytes=len(whole) - 1))
    try:
        client = InferenceClient(f"127.0.0.1:{srv.port}")
        assert _code(lambda: client.load_model(whole, "w", whole=True)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.server_ready()
        client.close()
    finally:
        srv.stop(0)

    with servers(1, derive=False) as (srv,):
        client = InferenceClient(f"127.0.0.1:{srv.port}")
        assert _code(lambda: client.load_model(whole, "w", whole=True)) == grpc.StatusCode.FAILED_PRECONDITION
        client.close()
