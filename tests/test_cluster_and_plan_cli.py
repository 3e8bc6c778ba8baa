"""The cluster file loader and `deepco plan`, driven as a user would: a real process and real files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepco.cluster import ClusterError, load_cluster
from deepco.planning import Instance, make_plan

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "paper-example1.toml"

VALID = """
[device]
antennas = 2
bandwidth = 60.0
[workload]
data_size = 10.0
work = 10.0
prefetch_ratio = 0.4
layers = 30
exchange_time = 0.05
[[servers]]
name = "s1"
capacity = 10.0
address = "127.0.0.1:50051"
[[servers]]
name = "s2"
capacity = 7.0
"""


def deepco(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepco", *args], capture_output=True, text=True, timeout=timeout)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def test_the_issue_form_loads_and_normalises_capacity(tmp_path):
    cluster = load_cluster(write(tmp_path, VALID.replace("work = 10.0", "work = 20.0")))
    assert [a.bandwidth for a in cluster.device.antennas] == [60.0, 60.0]
    assert cluster.servers[0].address == "127.0.0.1:50051" and cluster.servers[1].address is None
    assert cluster.normalised_capacities() == [10.0 * 10 / 20, 7.0 * 10 / 20]  # c(i) = c^(i) s / w


def test_antenna_tables_with_their_own_bandwidth(tmp_path):
    text = VALID.replace("antennas = 2\nbandwidth = 60.0\n", "") + """
[[device.antenna]]
name = "wifi"
bandwidth = 20.0
[[device.antenna]]
name = "5g"
bandwidth = 90.0
"""
    cluster = load_cluster(write(tmp_path, text))
    assert [(a.name, a.bandwidth) for a in cluster.device.antennas] == [("wifi", 20.0), ("5g", 90.0)]
    plan = make_plan(Instance.from_cluster(cluster), "thread-sa")
    assert {a.antenna for a in plan.servers} == {"5g"}  # one antenna: the faster one


def test_training_resources_sites_and_links_load(tmp_path):
    resources = 'site = "edge1"\ngpus = 2\nworker_slots = 4\nps_slots = 1'
    text = VALID.replace('address = "127.0.0.1:50051"', resources) + """
[[sites]]
name = "edge1"
[[sites]]
name = "cloud"
kind = "cloud"
upload_delay = 30.0
[[links]]
from = "edge1"
to = "cloud"
bandwidth = 100.0
cost = 0.02
"""
    cluster = load_cluster(write(tmp_path, text))
    assert cluster.servers[0].resources.gpus == 2 and cluster.servers[0].resources.worker_slots == 4
    assert cluster.site("cloud").upload_delay == 30.0
    assert cluster.links[0].cost == 0.02


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.replace('capacity = 7.0', 'capacity = -7.0'), "key 'servers[1].capacity': must be positive"),
    (lambda t: t.replace('antennas = 2', 'antennas = 0'), "key 'device.antennas': must be >= 1"),
    (lambda t: t.replace('name = "s2"\n', ''), "missing key 'servers[1].name'"),
    (lambda t: t.replace('data_size = 10.0', 'data_size = "big"'), "key 'workload.data_size': must be a number"),
    (lambda t: t.replace('name = "s2"', 'name = "s1"'), "server names must be unique"),
    (lambda t: t.replace('50051"', '99999"'), "key 'servers[0].address'"),
    (lambda t: t.replace('prefetch_ratio = 0.4', 'prefetch_ratio = 1.5'), "key 'workload.prefetch_ratio'"),
    (lambda t: t.replace('work = 10.0', 'work = 10.0\nwrok = 3'), "key 'workload.wrok': unknown key"),
    (lambda t: t.replace('[device]', '[device'), "invalid TOML"),
])
def test_bad_cluster_files_name_file_key_and_problem(tmp_path, edit, message):
    path = write(tmp_path, edit(VALID))
    with pytest.raises(ClusterError, match=None) as err:
        load_cluster(path)
    assert str(path) in str(err.value) and message in str(err.value)
    result = deepco("plan", "--cluster", str(path))
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr


def test_missing_file_and_unknown_algorithm_exit_non_zero_with_one_line(tmp_path):
    result = deepco("plan", "--cluster", str(tmp_path / "absent.toml"))
    assert result.returncode != 0 and "no such file" in result.stderr and len(result.stderr.splitlines()) == 1
    result = deepco("plan", "--cluster", str(EXAMPLE), "--algorithm", "fastest")
    assert result.returncode != 0 and "invalid choice: 'fastest'" in result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_plan_json_is_exactly_one_object_with_the_documented_fields():
    result = deepco("plan", "--cluster", str(EXAMPLE), "--algorithm", "thread", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)  # fails if there is anything but one JSON document
    assert plan["algorithm"] == "thread"
    assert plan["completion_time"] == pytest.approx(0.977, abs=1e-3)
    assert len(plan["servers"]) == 3  # only the selected servers
    for server in plan["servers"]:
        assert {"name", "antenna", "order", "ratio", "transfer_start", "transfer_time", "compute_time",
                "finish_time"} <= set(server)
    orders = sorted((s["antenna"], s["order"]) for s in plan["servers"])
    assert orders == [("a0", 0), ("a0", 1), ("a1", 0)]


def test_plan_table_lists_every_selected_server():
    result = deepco("plan", "--cluster", str(EXAMPLE), "--algorithm", "modnn-sa")
    assert result.returncode == 0
    assert "completion time: 2" in result.stdout
    assert all(name in result.stdout for name in ("s1", "s2", "s3", "s4"))


def test_plan_table_columns_line_up_with_host_port_names(tmp_path):
    cluster = tmp_path / "long.toml"
    cluster.write_text(EXAMPLE.read_text().replace('name = "s1"', 'name = "edge-server-one.example:50051"'))
    result = deepco("plan", "--cluster", str(cluster))
    assert result.returncode == 0, result.stderr
    table = result.stdout.splitlines()[1:]
    assert "edge-server-one.example:50051" in result.stdout
    assert len({len(line) for line in table}) == 1, table  # fixed-width fields: every row as long as the header
    assert all(line.index(" a") == table[0].index(" antenna") for line in table[2:]), table


def test_a_cluster_without_workload_cannot_be_planned_abstractly(tmp_path):
    text = VALID.split("[workload]")[0] + VALID.split("exchange_time = 0.05")[1]
    result = deepco("plan", "--cluster", str(write(tmp_path, text)))
    assert result.returncode != 0 and "missing key 'workload'" in result.stderr


def test_an_address_only_file_loads_with_what_the_device_measures_left_open(tmp_path):
    cluster = load_cluster(write(tmp_path, '[[servers]]\naddress = "127.0.0.1:5001"\n'
                                           '[[servers]]\naddress = "127.0.0.1:5002"\n'))
    assert [(s.name, s.address, s.capacity) for s in cluster.servers] == [
        ("127.0.0.1:5001", "127.0.0.1:5001", None), ("127.0.0.1:5002", "127.0.0.1:5002", None)]
    assert [(a.name, a.bandwidth) for a in cluster.device.antennas] == [("a0", None)]
    assert not cluster.device.declared and cluster.workload is None
    cluster.require_addresses()  # nothing missing for `deepco run`


def test_every_missing_key_of_a_file_is_reported_in_one_error(tmp_path):
    text = """
[workload]
prefetch_ratio = 0.4
[[servers]]
capacity = 1.0
[[servers]]
site = "edge"
[[sites]]
kind = "edge"
"""
    path = write(tmp_path, text)
    with pytest.raises(ClusterError) as err:
        load_cluster(path)
    message = str(err.value)
    assert message.startswith(f"{path}: missing keys ")
    for key in ("servers[0].name", "servers[1].name", "workload.data_size", "workload.work", "sites[0].name"):
        assert f"'{key}'" in message
    assert "'workload.data_size' (s: the size of one image, in data units)" in message
    assert "unknown site" not in message  # the missing site name is the problem, not the reference to it


def test_the_abstract_planner_names_every_key_it_lacks_with_units(tmp_path):
    text = VALID.replace("bandwidth = 60.0", "") + '\n[[servers]]\nname = "s3"\n'
    result = deepco("plan", "--cluster", str(write(tmp_path, text)))
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "'device.bandwidth' (per antenna: units of workload.data_size per unit of time" in lines[0]
    assert "'servers[2].capacity' (raw compute capacity c^(i): units of workload.work per unit of time)" in lines[0]
    assert "deepco plan --model" in lines[0]


def test_pace_needs_the_bandwidth_in_mbits(tmp_path):
    path = write(tmp_path, '[[servers]]\naddress = "127.0.0.1:5001"\n')
    result = deepco("run", "--cluster", str(path), "--model", "resnet18", "--source", "nothing", "--pace")
    assert result.returncode == 2 and "missing key 'device'" in result.stderr and "Mbit/s" in result.stderr
    result = deepco("run", "--cluster", str(write(tmp_path, '[[servers]]\nname = "a"\n')), "--model", "resnet18",
                    "--source", "nothing")
    assert result.returncode == 2 and "missing key 'servers[0].address'" in result.stderr


# ---- real servers: `deepco run` and `deepco plan --model` on a file holding nothing but addresses ----------
PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"


@pytest.fixture(scope="module")
def address_only(tmp_path_factory):
    """(cluster file holding only the addresses of two `deepco serve` processes, resnet18 64x64 ONNX file)."""
    from test_server_support import serve_process

    folder = tmp_path_factory.mktemp("address-only")
    model = folder / "resnet18.onnx"
    result = deepco("export", "--model", "resnet18", "--input-size", "64x64", "--output", str(model))
    assert result.returncode == 0, result.stderr
    with serve_process("--threads", "1") as a, serve_process("--threads", "1") as b:
        path = folder / "cluster.toml"
        path.write_text(f'[[servers]]\naddress = "{a.address}"\n\n[[servers]]\naddress = "{b.address}"\n')
        yield path, model, (a.address, b.address)


def test_deepco_run_needs_nothing_but_server_addresses(address_only, tmp_path):
    import numpy as np
    import onnxruntime as ort

    cluster, model, _ = address_only
    saved = tmp_path / "out.npz"
    result = deepco("run", "--cluster", str(cluster), "--model", str(model), "--input-size", "64x64",
                    "--source", str(PHOTO), "--frames", "2", "--cut", "layer2", "--save-outputs", str(saved),
                    timeout=300)
    assert result.returncode == 0, result.stderr
    assert "measured:" in result.stdout and "0 failed" in result.stdout
    data = np.load(saved)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    want = np.concatenate([session.run(None, {session.get_inputs()[0].name: x[None]})[0] for x in data["inputs"]])
    np.testing.assert_allclose(data["outputs"], want, rtol=0, atol=1e-3)


def test_plan_with_a_model_is_a_dry_run_on_the_real_servers(address_only):
    from deepco.wire.client import InferenceClient

    cluster, model, addresses = address_only
    before = [InferenceClient(a).loaded_models() for a in addresses]
    result = deepco("plan", "--cluster", str(cluster), "--model", str(model), "--input-size", "64x64", "--json",
                    timeout=300)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)  # exactly one JSON object; progress went to stderr
    assert out["model"] == str(model) and out["input_size"] == [64, 64]
    assert sorted(out["measured"]["server_flops_per_second"]) == sorted(addresses)
    assert all(v > 0 for v in out["measured"]["server_flops_per_second"].values())
    assert len(out["measured"]["antenna_bytes_per_second"]) == 1
    slices = sorted((s["start"], s["stop"]) for s in out["plan"]["slices"])
    assert slices[0][0] == 0 and slices[-1][1] == out["cut"]["height"] == out["plan"]["rows"]
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:], strict=False))  # the rows are covered once
    assert out["plan"]["frame_time"] == pytest.approx(out["plan"]["completion_time"] + out["plan"]["tail_time"])
    # A dry run leaves nothing loaded on the servers that was not there before.
    assert [InferenceClient(a).loaded_models() for a in addresses] == before
    result = deepco("plan", "--cluster", str(cluster), "--model", str(model), "--algorithm", "modnn-sa")
    assert result.returncode == 2 and "with --model choose one of thread, thread-sa, single, equal" in result.stderr
    # equal exists for real models only: the dry run plans it, the abstract workload model says to give --model
    result = deepco("plan", "--cluster", str(cluster), "--model", str(model), "--input-size", "64x64", "--json",
                    "--algorithm", "equal", timeout=300)
    assert result.returncode == 0, result.stderr
    sizes = [s["stop"] - s["start"] for s in json.loads(result.stdout)["plan"]["slices"]]
    assert len(sizes) == len(addresses) and max(sizes) - min(sizes) <= 1, sizes
    result = deepco("plan", "--cluster", str(EXAMPLE), "--algorithm", "equal")
    assert result.returncode == 2 and "give --model" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("algorithm", ["auto", "local", "offload", "round-robin", "thread"])
def test_a_saved_plan_runs_exactly_as_saved(address_only, tmp_path, algorithm):
    """`deepco plan --model ... --save F.json` writes the plan and `deepco run --plan F.json` runs it: the same
    kind, servers and stages (auto's choice, and every plan kind forced: local, offload, round-robin, a split).
    `plan` once refused auto, `run`'s default (issue 31)."""
    from deepco.planning.staged import StagedPlan

    cluster, model, addresses = address_only
    saved = tmp_path / "plan.json"
    result = deepco("plan", "--cluster", str(cluster), "--model", str(model), "--input-size", "64x64",
                    "--algorithm", algorithm, "--save", str(saved), timeout=300)
    assert result.returncode == 0, result.stderr
    plan = StagedPlan.from_dict(json.loads(saved.read_text())["plan"])
    kind = {"thread": "split", "auto": plan.kind}.get(algorithm, algorithm)  # auto: whichever it chose
    assert plan.kind == kind and set(plan.servers) <= {*addresses, "@device"}
    result = deepco("run", "--cluster", str(cluster), "--model", str(model), "--input-size", "64x64",
                    "--source", str(PHOTO), "--frames", "2", "--plan", str(saved), timeout=300)
    assert result.returncode == 0, result.stderr
    assert "0 failed" in result.stdout
    shown = [line for line in result.stdout.splitlines() if line.startswith("plan: ")]
    assert shown and shown[0].startswith(f"plan: {plan.describe()};"), result.stdout  # kind, servers, stages
    if algorithm == "thread":  # refused for another input size (one kind shows it: the check is the same for all)
        result = deepco("run", "--cluster", str(cluster), "--model", str(model), "--input-size", "32x32",
                        "--source", str(PHOTO), "--frames", "1", "--plan", str(saved), timeout=300)
        assert result.returncode == 2 and "was made for" in result.stderr


def test_a_saved_plan_on_a_server_that_is_down_is_one_line_naming_it(address_only, tmp_path):
    """A saved plan runs as saved or not at all: when a server it runs on is down, `deepco run --plan` says which
    and why in one line (to start on the servers that are up, run without --plan: the planner plans for them)."""
    import socket

    from deepco.planning.staged import StagedPlan

    _, model, (a, b) = address_only
    with socket.socket() as s:  # a port nothing listens on: connections to it are refused
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    up, half = tmp_path / "up.toml", tmp_path / "half.toml"
    up.write_text(f'[[servers]]\nname = "s0"\naddress = "{a}"\n\n[[servers]]\nname = "s1"\naddress = "{b}"\n')
    half.write_text(f'[[servers]]\nname = "s0"\naddress = "{a}"\n\n[[servers]]\nname = "s1"\n'
                    f'address = "127.0.0.1:{dead}"\n')
    saved = tmp_path / "plan.json"
    result = deepco("plan", "--cluster", str(up), "--model", str(model), "--input-size", "64x64",
                    "--algorithm", "equal", "--save", str(saved), timeout=300)  # equal: every server, s1 too
    assert result.returncode == 0, result.stderr
    assert "s1" in StagedPlan.from_dict(json.loads(saved.read_text())["plan"]).servers
    result = deepco("run", "--cluster", str(half), "--model", str(model), "--input-size", "64x64",
                    "--source", str(PHOTO), "--frames", "1", "--plan", str(saved), timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"deepco run: error: --plan {saved} runs on s1 (127.0.0.1:{dead}: connection refused), which is down; "
        "start it, or run without --plan to plan on the servers that are up"]
