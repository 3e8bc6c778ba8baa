"""Models with several outputs (a detector's heads) and models exported as PyTorch exports them, on real
in-process servers on loopback.

- Every plan kind (local, offload, round-robin, split with the tail on the device or on a server, and auto's
  calibrated plan) delivers every output of the zoo's YOLOv8n, each within 1e-4 of ONNX Runtime on the whole
  model (each output judged on its own scale); before, offload (and so `auto`, which calibrates it) failed
  with "2 outputs, expected 1" and the others kept only the first.
- `deepco run --save-outputs` writes every output, keyed by its name, and `--output raw` one file per output.
- A U-Net exported by torch.onnx.export with F.interpolate(size=skip.shape[2:]) (Shape -> Slice -> Concat ->
  Resize) loads and runs on the server exactly; before, the request bound refused it ("depends on input
  values"). Sizes that do depend on values are still refused, and the folding evaluates no big constant.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from deepco_device.answers import check_outputs, output_specs, relative_error
from deepco_device.preprocess import normalise
from deepco_device.run_command import file_names
from deepco_device.run_report import saved_outputs
from deepco_device.session import Device
from deepco_device.staged import StagedPlanner, StagedRunner
from onnx import TensorProto, helper
from torch import nn
from torch.nn import functional as F  # noqa: N812 - torch's own spelling

from deepco.cli import main
from deepco.cluster import parse_cluster
from deepco.planning.staged import StagedPlan, scales_plan, split_plan, split_shares
from deepco.wire.client import InferenceClient, ServerError, WrongAnswer

SIZE = (64, 64)  # yolov8n's stride 32 divides it: 2x2 at P5
PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"


@pytest.fixture(scope="module")
def servers(two_servers):
    return two_servers


@pytest.fixture(scope="module")
def yolo(partition_zoo) -> str:
    _, path = partition_zoo("yolov8n", *SIZE)
    return path


def cluster_data(servers) -> dict:
    return {"device": {"antennas": 2, "bandwidth": 100.0},
            "servers": [{"name": f"s{i}", "capacity": 1.0, "address": s.address} for i, s in enumerate(servers)]}


@pytest.fixture(scope="module")
def device(servers, yolo):
    with Device(parse_cluster(cluster_data(servers)), yolo, *SIZE, log=lambda _: None) as dev:
        dev.setup(rows=False)
        yield dev


def pixels(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (1, 3, *SIZE), dtype=np.uint8)


def whole_model(model: onnx.ModelProto, inputs: np.ndarray) -> dict[str, np.ndarray]:
    """ONNX Runtime on the unpartitioned model: every output by name."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {session.get_inputs()[0].name: inputs}), strict=True))


def run_once(dev: Device, plan, px: np.ndarray):
    """One frame of ``plan``: (every output by name, its timing); the plan's models are given back after."""
    runner = StagedRunner(dev, plan)
    try:
        return runner.run_frame(px)
    finally:
        runner.close()


def plans(planner: StagedPlanner) -> dict:
    cuts = [c.name for c in planner.costs.cuts]
    rates = planner.rates()
    return {
        "local": planner.named("local"),
        "offload": planner.named("offload"),
        "round-robin": planner.named("round-robin"),
        "split, tail on the device": split_plan(planner.costs, rates, ["s0", "s1"], [cuts[-1]], True, None),
        "split in stages, tail on a server": split_plan(planner.costs, rates, ["s0", "s1"], [cuts[0], cuts[-1]],
                                                        False, "s1"),
    }


def test_every_plan_kind_delivers_every_output_exactly(device):
    want = whole_model(device.reference_model, normalise(pixels(), device.preprocessing))
    assert list(want) == ["p3", "p4", "p5"]
    planner = StagedPlanner(device)
    chosen = plans(planner) | {"auto": planner.calibrate("latency")}
    for what, plan in chosen.items():
        assert plan is not None, what
        got, _ = run_once(device, plan, pixels())
        assert list(got) == list(want), what
        error = relative_error(got, want)
        assert error <= 1e-4, f"{what} ({plan.describe()}): relative error {error:.2e}"


def test_a_plan_across_scales_runs_exactly_on_the_servers(device):
    # One stage from the image to the neck's last row-local level (P3, P4 and SPPF alive at once: the skips
    # cross the cut), each server on its window of the image, its bands of every tensor back to the device.
    planner = StagedPlanner(device)
    plan = scales_plan(planner.costs, planner.rates(), ["s0", "s1"])
    assert plan is not None and len(plan.tensors) >= 2
    assert StagedPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan  # saved and run as data
    assert split_shares(plan, planner.costs)["plan"] > split_shares(plan, planner.costs)["single_tensor_cuts"]
    want = whole_model(device.reference_model, normalise(pixels(2), device.preprocessing))
    runner = StagedRunner(device, plan)
    try:
        got, timing = runner.run_frame(pixels(2))
        # a request whose image rows do not match its tables (sent the window, but told it owns a band) is refused
        request = runner.request("not-lookahead", 0, pixels(2))
        request.lookahead = False
        with pytest.raises(ServerError, match="input holds rows .* but server 0 owns") as info:
            device.client(0, 0).start_split(request).received()
        assert info.value.code.name == "INVALID_ARGUMENT"
    finally:
        runner.close()
    assert [s.name for s in timing.servers] == ["s0", "s1"]
    assert relative_error(got, want) <= 1e-4, plan.describe()


def test_the_zoo_unet_runs_across_scales_on_the_servers(servers, partition_zoo):
    _, path = partition_zoo("unet", *SIZE)
    with Device(parse_cluster(cluster_data(servers)), path, *SIZE, log=lambda _: None) as dev:
        dev.setup(rows=False)
        planner = StagedPlanner(dev)
        plan = scales_plan(planner.costs, planner.rates(), ["s0", "s1"])
        assert plan is not None
        want = whole_model(dev.reference_model, normalise(pixels(3), dev.preprocessing))
        got, _ = run_once(dev, plan, pixels(3))
        assert relative_error(got, want) <= 1e-4, plan.describe()


def test_an_answer_missing_an_output_is_a_wrong_answer(device):
    specs = output_specs(device.model)
    outputs = whole_model(device.reference_model, normalise(pixels(), device.preprocessing))
    assert check_outputs(outputs, specs, "the output of s0", "here") == outputs
    del outputs["p4"]
    with pytest.raises(WrongAnswer, match="'p4'"):
        check_outputs(outputs, specs, "the output of s0", "here")


def test_run_saves_and_writes_every_output(servers, yolo, tmp_path):
    cluster = tmp_path / "cluster.toml"
    cluster.write_text("".join(f'[[servers]]\nname = "s{i}"\naddress = "{s.address}"\n'
                               for i, s in enumerate(servers)))
    saved, raw = tmp_path / "out.npz", tmp_path / "raw"
    code = main(["run", "--cluster", str(cluster), "--model", yolo, "--input-size", "x".join(map(str, SIZE)),
                 "--source", str(PHOTO), "--frames", "1", "--algorithm", "offload", "--quiet",
                 "--save-outputs", str(saved), "--output", "raw", "--output-dir", str(raw)])
    assert code == 0
    data = np.load(saved)
    assert sorted(data.files) == ["inputs", "outputs/p3", "outputs/p4", "outputs/p5"]
    want = whole_model(onnx.load(yolo), data["inputs"].astype(np.float32))
    assert relative_error({n: data[f"outputs/{n}"] for n in want}, want) <= 1e-4
    assert sorted(p.name for p in raw.iterdir()) == [f"frame-000000-{n}.npy" for n in ("p3", "p4", "p5")]
    for name in want:
        np.testing.assert_array_equal(np.load(raw / f"frame-000000-{name}.npy"), data[f"outputs/{name}"])


def test_a_failed_frame_is_nan_in_every_saved_output_and_names_become_file_names():
    ok = {"boxes/p3": np.ones((1, 2, 3, 3), np.float32), "scores": np.zeros((1, 4), np.float32)}
    saved = saved_outputs([ok, None, ok])
    assert sorted(saved) == ["outputs/boxes/p3", "outputs/scores"]
    assert saved["outputs/scores"].shape == (3, 4) and np.isnan(saved["outputs/scores"][1]).all()
    assert not np.isnan(saved["outputs/boxes/p3"][[0, 2]]).any() and np.isnan(saved["outputs/boxes/p3"][1]).all()
    assert list(saved_outputs([None, {"y": np.ones((1, 3))}])) == ["outputs"]
    assert file_names(["boxes/p3", "scores", "a:b", "a_b"]) == {"boxes/p3": "boxes_p3", "scores": "scores",
                                                                "a:b": "a_b-2", "a_b": "a_b-3"}


class TinyUNet(nn.Module):
    """Two levels and the decoder brought to the skip's size as ordinary PyTorch U-Nets write it: interpolated
    to ``skip.shape[2:]``, and (milesial/Pytorch-UNet's ``Up``) upsampled then padded by the size difference.
    Both sizes are computed in the exported graph from shapes: Shape -> Slice -> Concat -> Resize, and
    Shape -> Gather -> Sub -> Div -> ... -> Pad."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(3, 8, 3, padding=1)
        self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.out = nn.Conv2d(32, 2, 3, padding=1)

    def forward(self, x):
        skip = torch.relu(self.enc(x))
        deep = torch.relu(self.down(skip))
        resized = F.interpolate(deep, size=skip.shape[2:], mode="bilinear", align_corners=False)
        up = self.up(deep)
        dy, dx = skip.shape[2] - up.shape[2], skip.shape[3] - up.shape[3]
        up = F.pad(up, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
        return self.out(torch.cat([resized, up, skip], dim=1))


def export_tiny_unet(path: Path, dynamic: bool) -> Path:
    torch.manual_seed(0)
    axes = {"image": {2: "height", 3: "width"}, "mask": {2: "height", 3: "width"}} if dynamic else None
    torch.onnx.export(TinyUNet().eval(), (torch.zeros(1, 3, *SIZE),), str(path), dynamo=False, opset_version=17,
                      input_names=["image"], output_names=["mask"], dynamic_axes=axes)
    return path


@pytest.fixture(scope="module")
def tiny_unet(tmp_path_factory) -> Path:
    return export_tiny_unet(tmp_path_factory.mktemp("unet") / "tiny-unet.onnx", dynamic=True)


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic-export", "static-export"])
def test_a_pytorch_unet_loads_and_runs_exactly_on_the_server(servers, tmp_path, dynamic):
    path = export_tiny_unet(tmp_path / "tiny-unet.onnx", dynamic)
    model = onnx.load(str(path))
    assert {"Shape", "Resize", "Pad"} <= {n.op_type for n in model.graph.node}  # sizes computed in the graph
    with InferenceClient(servers[0].address) as client:
        client.load_model(path.read_bytes(), "tiny-unet")
        try:
            for h, w in (SIZE, (48, 80)) if dynamic else (SIZE,):
                x = np.random.default_rng(h).standard_normal((1, 3, h, w)).astype(np.float32)
                got = client.infer_many("tiny-unet", {"image": x})
                want = whole_model(model, x)
                assert got["mask"].shape == (1, 2, h, w)
                assert relative_error(got, want) <= 1e-5
        finally:
            client.unload_model("tiny-unet")


def test_a_pytorch_unet_runs_split_on_the_servers(servers, tiny_unet):
    with Device(parse_cluster(cluster_data(servers)), str(tiny_unet), *SIZE, log=lambda _: None) as dev:
        dev.setup(rows=False)
        planner = StagedPlanner(dev)
        want = whole_model(dev.reference_model, normalise(pixels(1), dev.preprocessing))
        cut = planner.costs.cuts[-1].name
        for plan in (planner.named("offload"),
                     split_plan(planner.costs, planner.rates(), ["s0", "s1"], [cut], True, "s0")):
            got, _ = run_once(dev, plan, pixels(1))
            assert relative_error(got, want) <= 1e-4, plan.describe()


def test_sizes_that_depend_on_values_are_still_refused_and_nothing_big_is_folded(servers):
    # Shape(x) makes the bound fold; ConstantOfShape of a constant 2^34 elements must be neither evaluated
    # while folding (64 GiB) nor run: the request is refused for its size, at once.
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Constant", [], ["n"], value=helper.make_tensor("n", TensorProto.INT64, [1], [1 << 34])),
             helper.make_node("ConstantOfShape", ["n"], ["big"]),
             helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0),
             helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
             helper.make_node("ReduceSum", ["sf"], ["size"], keepdims=0),
             helper.make_node("Add", ["total", "size"], ["y"])]
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "h", "w"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    # and a Resize whose size is an input's values: no shape bounds it
    resize = helper.make_graph(
        [helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="nearest")], "by-value",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "h", "w"]),
         helper.make_tensor_value_info("sizes", TensorProto.INT64, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    by_value = helper.make_model(resize, opset_imports=[helper.make_opsetid("", 17)])
    x = np.zeros((1, 3, 8, 8), np.float32)
    with InferenceClient(servers[1].address) as client:
        client.load_model(model.SerializeToString(), "big")
        client.load_model(by_value.SerializeToString(), "by-value")
        try:
            with pytest.raises(ServerError, match="per-request limit") as info:
                client.infer_many("big", {"x": x})
            assert info.value.code.name == "RESOURCE_EXHAUSTED"
            with pytest.raises(ServerError, match="depends on input values") as info:
                client.infer_many("by-value", {"x": x, "sizes": np.array([1, 3, 16, 16], np.int64)})
            assert info.value.code.name == "RESOURCE_EXHAUSTED"
        finally:
            client.unload_model("big")
            client.unload_model("by-value")


@pytest.mark.parametrize("name", ["yolov8n", "unet"])
def test_the_cost_model_counts_every_output_byte_of_a_dynamic_export(partition_zoo, name):
    """The zoo exports with dynamic rows and columns: the outputs coming back are as large as ONNX Runtime
    makes them at the size (yolov8n's raw heads at 96x160: 144 channels at three strides), not one row and
    column each (before: 1,152 bytes for yolov8n, so an offload's return over the antenna cost nothing)."""
    from deepco_device.parts import ModelArtefacts
    from deepco_device.preprocess import preprocessing_for

    height, width = 96, 160
    _, path = partition_zoo(name, height, width)
    artefacts = ModelArtefacts(path, height, width, None, preprocessing_for(name))
    artefacts.load()
    session = ort.InferenceSession(artefacts.reference_model.SerializeToString(), providers=["CPUExecutionProvider"])
    spec = session.get_inputs()[0]
    outputs = session.run(None, {spec.name: np.zeros((1, 3, height, width), np.float32)})
    assert artefacts.costs.output_bytes == sum(o.nbytes for o in outputs) > 10_000
