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


def deepco(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepco", *args], capture_output=True, text=True, timeout=60)


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
    (lambda t: t.replace('bandwidth = 60.0', ''), "key 'device.bandwidth': missing"),
    (lambda t: t.replace('name = "s2"\n', ''), "key 'servers[1].name': missing"),
    (lambda t: t.replace('data_size = 10.0', 'data_size = "big"'), "key 'workload.data_size': must be a number"),
    (lambda t: t.replace('name = "s2"', 'name = "s1"'), "server names must be unique"),
    (lambda t: t.replace('50051"', '99999"'), "key 'servers[0].address'"),
    (lambda t: t.replace('prefetch_ratio = 0.4', 'prefetch_ratio = 1.5'), "key 'workload.prefetch_ratio'"),
    (lambda t: t.replace('work = 10.0', 'work = 10.0\nwrok = 3'), "key 'workload.wrok': unknown key"),
    (lambda t: t + '\n[[servers]]\nname = "s3"\n', "key 'servers[2].capacity': missing"),
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


def test_a_cluster_without_workload_cannot_be_planned_abstractly(tmp_path):
    text = VALID.split("[workload]")[0] + VALID.split("exchange_time = 0.05")[1]
    result = deepco("plan", "--cluster", str(write(tmp_path, text)))
    assert result.returncode != 0 and "key 'workload': missing" in result.stderr
