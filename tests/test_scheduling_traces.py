"""Trace loaders on the real files, malformed rows, and the synthetic generator's ranges."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

import pytest

from deepco.scheduling.synthetic import synthetic_jobs
from deepco.scheduling.traces import TraceError, alibaba_cluster, load_trace

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
if not TRACES.exists():  # the shared folder sits beside the checkout
    TRACES = Path("/work/shared/traces")
needs_traces = pytest.mark.skipif(not TRACES.exists(), reason="shared traces not present")


@needs_traces
def test_gavel_maps_arrival_demand_and_relative_size():
    path = TRACES / "gavel-philly" / "2869ce.trace"
    rows = [line.split("\t") for line in path.read_text().splitlines() if line.strip()]
    jobs = load_trace(path, "gavel", seed=3)
    assert len(jobs) == len(rows) == 533
    # rows are already in arrival order; the 7-field layout has arrival in field 6 and GPUs in field 7
    assert [j.demand for j in jobs] == [int(r[6]) for r in rows]
    first = float(rows[0][5])
    assert [j.arrival for j in jobs] == [int((float(r[5]) - first) // 3600) for r in rows]
    # epochs keep sizes relative to the median job, which gets the middle of She's range (75)
    sizes = [int(r[4]) * int(r[6]) for r in rows]
    med = statistics.median(sizes)
    k = sizes.index(max(s for s in sizes if s <= med))
    assert jobs[k].epochs == min(1000, max(1, round(75 * sizes[k] / med)))
    assert all(j.chunks >= j.demand and 10 <= j.minibatches <= 50 for j in jobs)


@needs_traces
def test_alibaba_keeps_gpu_pods_that_ran_and_builds_a_cluster():
    path = TRACES / "alibaba-gpu-2023" / "openb_pod_list_default.csv"
    with path.open() as f:
        ran = [r for r in csv.DictReader(f) if int(r["num_gpu"]) > 0 and r["pod_phase"] != "Pending"
               and r["scheduled_time"]]
    jobs = load_trace(path, "alibaba", jobs=None)
    assert len(jobs) == len(ran)
    assert load_trace(path, "alibaba", jobs=50)[-1].id == 49
    cl = alibaba_cluster(TRACES / "alibaba-gpu-2023" / "openb_node_list_gpu_node.csv", servers=10)
    assert len(cl.servers) == 11 and cl.servers[0].resources.worker_slots == 2
    assert cl.servers[0].worker_type == "P100" and cl.servers[-1].site == "cloud"


@needs_traces
def test_tiresias_csv():
    jobs = load_trace(TRACES / "tiresias" / "60_job.csv", "tiresias")
    assert len(jobs) == 60 and jobs[1].demand == 8


@pytest.mark.parametrize("fmt, text, message", [
    ("gavel", "A\tcmd\t-n\t1\t100\t0.0\t1\nB\tcmd\t-n\t1\tmany\t5.0\t1\n",
     r"bad.txt:2: field 'total_steps': must be an integer, got 'many'"),
    ("gavel", "A\tcmd\t1\t0.0\t1\n", r"bad.txt:1: has 5 tab-separated fields, expected 10"),
    ("gavel", "A\tcmd\t-n\t1\t100\t-3\t1\n", r"bad.txt:1: field 'arrival_time': must be >= 0"),
    ("tiresias", "job_id,num_gpu,submit_time,duration\n0,0,0,10\n",
     r"bad.txt:2: field 'num_gpu': must be >= 1"),
    ("tiresias", "job_id,num_gpu,submit_time\n", r"bad.txt:1: header lacks field\(s\) duration"),
    ("alibaba", "name,num_gpu,pod_phase,creation_time,deletion_time,scheduled_time\np,1,Running,5,3,4\n",
     r"bad.txt:2: field 'deletion_time': 3 is before scheduled_time 4"),
])
def test_malformed_rows_name_file_line_and_field(tmp_path, fmt, text, message):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(TraceError, match=message):
        load_trace(path, fmt)


def test_ten_field_gavel_layout(tmp_path):
    path = tmp_path / "t.trace"
    path.write_text("LM\tcmd\tdir\t-n\t1\t500\t4\t1\t-1\t7200.0\n")
    (j,) = load_trace(path, "gavel")
    assert j.demand == 4 and j.arrival == 0 and j.epochs == 75  # alone, it is the median job


def test_synthetic_ranges_of_both_seeds():
    she = synthetic_jobs(300, seed=1, preset="she", horizon=150)
    assert all(50 <= j.epochs <= 100 and 20 <= j.chunks <= 50 and 10 <= j.minibatches <= 50 for j in she)
    assert all(1 <= j.arrival <= 100 for j in she)  # x_j in [1, T/1.5]
    assert all(0.001 <= j.worker_time <= 0.05 for j in she)  # n_j in hours = slots
    assert all(10 / 3.6e6 <= j.ps_time <= 100 / 3.6e6 for j in she)  # H_j in [10, 100] ms
    wang = synthetic_jobs(300, seed=1, preset="wang")
    assert {(j.chunks, j.minibatches) for j in wang} == {(27, 58), (115, 58), (60, 58)}
    assert all(20 <= j.epochs <= 60 for j in wang)
    assert synthetic_jobs(5, seed=2)[0].__dict__ == synthetic_jobs(5, seed=2)[0].__dict__
