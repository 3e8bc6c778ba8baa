"""Split plans across scales in several stages (issue 29: cuts across scales), on real servers on loopback.

A plan of kind ``scales`` runs stages between levels of several tensors (the zoo's YOLOv8n neck, its U-Net's
skips) on bands of image rows; between stages the servers exchange each tensor's halo rows directly, skips
stay on the band until read, and the last level's bands go back to the device or to the server that runs
the tail. Every output must equal ONNX Runtime on the whole model within 1e-4 of its own scale, with 2 and
3 servers, bands of unequal heights, with and without lookahead, the tail on the device and on a server.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import plan_support
import pytest
from deepco_device.answers import relative_error
from deepco_device.preprocess import normalise
from deepco_device.session import Device
from deepco_device.staged import StagedPlanner, StagedRunner

from deepco.cli import main
from deepco.cluster import parse_cluster
from deepco.planning.staged import StagedPlan, scales_chain, scales_plan, search, split_shares
from deepco.wire.client import ServerError

SIZE = (128, 128)  # four rows at stride 32: room for three bands at every stage
PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"


@pytest.fixture(scope="module")
def three_servers():
    """Three in-process servers on loopback with room for a model per stage."""
    from deepco_server.app import ServeConfig, Server

    with contextlib.ExitStack() as stack:
        srvs = [Server(ServeConfig(port=0, device="cpu", threads=1, max_models=256, max_inflight=8)) for _ in range(3)]
        for srv in srvs:
            stack.callback(srv.stop, 0)
        yield srvs


def cluster_data(servers) -> dict:
    return {"servers": [{"name": f"s{i}", "address": s.address} for i, s in enumerate(servers)]}


def every(part, step: int, last: int | None = None) -> list[str]:
    """Level names of every ``step``-th level up to ``last`` (default: the deepest), the last included."""
    names = [lv.name for lv in part.levels[1:]]
    names = names[: (last or len(names))]
    return sorted(set(names[step - 1::step]) | {names[-1]}, key=names.index)


def pixels(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (1, 3, *SIZE), dtype=np.uint8)


def whole_model(device: Device, x: np.ndarray) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(device.reference_model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    feeds = {session.get_inputs()[0].name: normalise(x, device.preprocessing)}
    return dict(zip(names, session.run(None, feeds), strict=True))


def check_plan_runs_exactly(device: Device, plan: StagedPlan, frames: int = 2) -> None:
    """``plan`` run on the servers, frame after frame: every output within 1e-4 of the whole model's."""
    assert plan is not None
    assert StagedPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan  # saved and run as data
    runner = StagedRunner(device, plan)
    try:
        for k in range(frames):
            got, timing = runner.run_frame(pixels(k))
            want = whole_model(device, pixels(k))
            assert list(got) == list(want)
            for name in want:
                error = relative_error({name: got[name]}, {name: want[name]})
                assert error <= 1e-4, f"{plan.describe()}: frame {k}, {name!r}: relative error {error:.2e}"
            assert [s.name for s in timing.servers] == plan.servers
            if len(plan.levels) > 1:  # the halo of every later stage came from the peers
                assert sum(s.messages_received for s in timing.servers) > 0
    finally:
        runner.close()


@pytest.fixture(scope="module", params=["yolov8n", "unet"])
def device(request, three_servers, partition_zoo):
    _, path = partition_zoo(request.param, *SIZE)
    with Device(parse_cluster(cluster_data(three_servers)), path, *SIZE, log=lambda _: None) as dev:
        dev.setup(rows=False)
        yield dev


@pytest.mark.parametrize(("servers", "weights", "lookahead", "tail"), [
    (["s0", "s1"], [1.0, 2.5], True, None),
    (["s0", "s1", "s2"], [1.0, 1.0, 2.0], False, None),
    (["s0", "s1", "s2"], [3.0, 1.0, 1.0], True, "s1"),
    (["s1", "s0"], [1.0, 1.0], False, "s0"),
])
def test_stages_across_scales_equal_the_whole_model(device, servers, weights, lookahead, tail):
    planner = StagedPlanner(device)
    costs, rates = planner.costs, planner.rates()
    part = costs.p
    # tail on a server: stop two thirds of the way (the rest of the model runs there); else the deepest level
    levels = every(part, max(2, len(part.levels) // 6), None if tail is None else 2 * len(part.levels) // 3)
    plan = scales_plan(costs, rates, servers, weights, levels=levels, lookahead=lookahead, tail=tail)
    assert plan is not None, levels
    assert len(plan.levels) >= 3 and plan.tail == tail and plan.lookahead == lookahead
    heights = {b - a for a, b in plan.bands[1]}
    assert len(heights) > 1 or len(servers) == 2 and weights[0] == weights[1], plan.bands[1]  # unequal bands
    carried = [t for level in plan.tensors[1:-1] for t, table in level.items() if not table["crop"]]
    assert carried, "no skip kept on the band: the plan exercises nothing across scales"
    check_plan_runs_exactly(device, plan)


def test_the_planners_chain_runs_and_splits_most_of_the_flops(device):
    planner = StagedPlanner(device)
    costs, rates = planner.costs, planner.rates()
    chain = scales_chain(costs, rates, ["s0", "s1", "s2"], True)
    assert chain, "no chain of levels fits three servers"
    plan = scales_plan(costs, rates, ["s0", "s1", "s2"], levels=chain)
    assert split_shares(plan, costs)["plan"] >= 0.85
    check_plan_runs_exactly(device, plan, frames=1)


@pytest.mark.parametrize("name", ["yolov8n", "unet"])
def test_at_736x1280_the_search_splits_most_of_the_flops_in_several_stages(partition_zoo, name):
    """On a camera with a weak CPU and three servers on fast links, the best plan the search finds for the
    zoo's detector and U-Net at 736x1280 is a split across scales in several stages holding >= 85% of the
    FLOPs (before: one stage to the deepest level, whose windows grow to the whole image, or single-tensor
    cuts ending at the first skip: 18% of the detector's FLOPs)."""
    from deepco.partition import Partitioner
    from deepco.planning.staged import CostModel, Rates

    model, _ = partition_zoo(name, 736, 1280)
    costs = CostModel(Partitioner(model, 736, 1280), 3 * 736 * 1280, 1000)
    rates = Rates({"s0": 5e9, "s1": 5e9, "s2": 4e9}, [12.5e6], 0.002, 1e9, 125e6, 0.0005)
    best = search(costs, rates, ["s0", "s1", "s2"])[0]
    assert best.kind == "scales" and len(best.levels) > 1, best.describe()
    assert split_shares(best, costs)["plan"] >= 0.85


def test_a_server_refuses_tables_that_do_not_add_up(device):
    """A carried skip whose bands differ from the level before, or a job across scales in parts: one clear
    INVALID_ARGUMENT, nothing run."""
    planner = StagedPlanner(device)
    part = planner.costs.p
    plan = scales_plan(planner.costs, planner.rates(), ["s0", "s1"], levels=every(part, max(2, len(part.levels) // 6)))
    runner = StagedRunner(device, plan)
    try:
        request = runner.request("bad-carry", 0, pixels())
        level = next(lv for lv in request.levels[2:] if any(not t.crop for t in lv.tensors))
        skip = next(t for t in level.tensors if not t.crop)
        skip.owned[0].stop, skip.owned[1].start = skip.owned[0].stop + 1, skip.owned[1].start + 1
        with pytest.raises(ServerError, match="carried from level") as info:
            device.client(0, 0).start_split(request).received()
        assert info.value.code.name == "INVALID_ARGUMENT"
        request = runner.request("bad-parts", 0, pixels())
        request.levels[1].parts.add()
        with pytest.raises(ServerError, match="without parts") as info:
            device.client(0, 0).start_split(request).received()
        assert info.value.code.name == "INVALID_ARGUMENT"
    finally:
        runner.close()


def test_a_saved_plan_across_scales_runs_with_deepco_run(three_servers, partition_zoo, tmp_path, capsys):
    """`deepco run --plan` on a saved three-stage plan of the detector, tail on a server: every output exact."""
    model, path = partition_zoo("yolov8n", *SIZE)

    def make(planner, names):
        part = planner.costs.p
        return {"scales": scales_plan(planner.costs, planner.rates(), names, [1.0, 2.0, 1.0],
                                      levels=every(part, len(part.levels) // 3, 3 * len(part.levels) // 4),
                                      lookahead=False, tail="s2")}

    saved = plan_support.saved_plans(three_servers, path, *SIZE, tmp_path, make)
    cluster = tmp_path / "cluster.toml"
    cluster.write_text("".join(f'[[servers]]\nname = "s{i}"\naddress = "{s.address}"\n'
                               for i, s in enumerate(three_servers)))
    out_file = tmp_path / "out.npz"
    code = main(["run", "--cluster", str(cluster), "--model", path, "--input-size", f"{SIZE[0]}x{SIZE[1]}",
                 "--source", str(PHOTO), "--frames", "2", "--plan", str(saved["scales"]), "--quiet",
                 "--save-outputs", str(out_file)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "0 failed" in out, out
    data = np.load(out_file)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    inputs = data["inputs"].astype(np.float32)
    for i in range(len(inputs)):
        want = dict(zip(names, session.run(None, {session.get_inputs()[0].name: inputs[i:i + 1]}), strict=True))
        for name, ref in want.items():
            error = relative_error({name: data[f"outputs/{name}"][i:i + 1]}, {name: ref})
            assert error <= 1e-4, f"frame {i}, {name!r}: relative error {error:.2e}"


def test_a_plan_across_scales_saved_in_the_one_stage_format_is_refused_in_one_line(tmp_path):
    """Before stages across scales a plan's ``tensors`` held its last level only, without the image's table a
    first stage needs: such a saved plan is refused when read, naming the fix, not sent to the servers."""
    from deepco_device.plan_command import load_plan

    from deepco.errors import UserError

    old = StagedPlan("auto", "scales", servers=["s0", "s1"], antennas=[0, 0], order=[0, 1], levels=["n21"],
                     tensors=[]).to_dict() | {"tensors": {"p3": {"owned": [[0, 4], [4, 8]], "crop": [0, 1]}}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"model": "m.onnx", "input_size": [64, 64], "plan": old}))
    with pytest.raises(UserError, match="per-level tables; plan again"):
        load_plan(str(path), "m.onnx", 64, 64, ["s0", "s1"])
