"""Job model (eq. (1)), the cluster model's scheduling fields, and the simulator's constraint checks."""

from __future__ import annotations

import pytest

from deepco.cluster import ClusterError, parse_cluster
from deepco.errors import UserError
from deepco.scheduling import Allocation, Job, SimCluster, SimulationError, bind_delays, simulate
from deepco.scheduling.policies.base import Policy


def make_cluster(edge: list[tuple[int, int]], *, edge_delay: float = 0, cloud_delay: float | None = None,
                 worker_types: list[str | None] | None = None) -> SimCluster:
    servers = []
    for i, (w, p) in enumerate(edge):
        srv = {"name": f"e{i}", "capacity": 1.0, "site": "edge", "worker_slots": w, "ps_slots": p}
        if worker_types and worker_types[i]:
            srv["worker_type"] = worker_types[i]
        servers.append(srv)
    sites = [{"name": "edge", "kind": "edge", "upload_delay": edge_delay}]
    if cloud_delay is not None:
        sites.append({"name": "cloud", "kind": "cloud", "upload_delay": cloud_delay})
        servers.append({"name": "cloud", "capacity": 1.0, "site": "cloud"})
    return SimCluster.from_cluster(parse_cluster({"device": {"antennas": 1, "bandwidth": 1.0},
                                                  "sites": sites, "servers": servers}))


def job(i: int, arrival: int = 0, *, chunks: int = 1, minibatches: int = 1, epochs: int = 1,
        worker_time: float = 1.0, grad: float = 0.0, bandwidth: float = 1.0, demand: int = 1) -> Job:
    return Job(id=i, arrival=arrival, chunks=chunks, minibatches=minibatches, epochs=epochs,
               worker_time=worker_time, ps_time=0.0, grad_size=grad, bandwidth=bandwidth, demand=demand)


def test_rate_is_eq_1_with_and_without_the_communication_term():
    j = Job(id=0, arrival=0, chunks=3, minibatches=5, epochs=2, worker_time=0.02, ps_time=0.005,
            grad_size=100.0, bandwidth=20_000.0)
    n, h, k, b = 0.02, 0.005, 100.0, 20_000.0
    assert j.rate(False) == pytest.approx(1 / (n + h + 2 * k / b))
    assert j.rate(True) == pytest.approx(1 / (n + h))
    assert j.total_work == 2 * 3 * 5 and j.chunk_work == 2 * 5


def test_cluster_reads_slot_types_and_delay_ranges_and_rejects_bad_ones():
    data = {"device": {"antennas": 1, "bandwidth": 1.0},
            "sites": [{"name": "edge", "upload_delay": 1, "upload_delay_max": 4},
                      {"name": "cloud", "kind": "cloud", "upload_delay": 10}],
            "servers": [{"name": "a", "capacity": 1.0, "site": "edge", "worker_slots": 2, "ps_slots": 1,
                         "worker_type": "V100", "ps_type": "cpu"},
                        {"name": "c", "capacity": 1.0, "site": "cloud"}]}
    cl = parse_cluster(data, "x.toml")
    assert cl.servers[0].worker_type == "V100" and cl.servers[0].ps_type == "cpu"
    assert cl.sites[0].upload_delay_max == 4
    sim = SimCluster.from_cluster(cl)
    assert sim.cloud is not None and sim.cloud.worker_slots > 10**9  # the cloud is unbounded
    jobs = [job(i) for i in range(200)]
    bind_delays(jobs, sim, seed=1)
    edge_delays = {j.upload[0] for j in jobs}
    assert edge_delays <= {1, 2, 3, 4} and len(edge_delays) == 4 and {j.upload[1] for j in jobs} == {10}
    bad = {**data, "sites": [{"name": "edge", "upload_delay": 3, "upload_delay_max": 2}]}
    with pytest.raises(ClusterError, match=r"x.toml: key 'sites\[0\].upload_delay_max': must be >= 3"):
        parse_cluster(bad, "x.toml")
    bad = {**data, "servers": [{**data["servers"][0], "worker_type": 7}]}
    with pytest.raises(ClusterError, match=r"key 'servers\[0\].worker_type': must be a non-empty string"):
        parse_cluster(bad, "x.toml")


class Scripted(Policy):
    """Returns the same allocations every slot (to provoke the simulator's checks)."""

    name = "scripted"

    def __init__(self, allocs, **flags):
        self.allocs = allocs
        for k, v in flags.items():
            setattr(self, k, v)

    def schedule(self, t, state):
        out = self.allocs(t) if callable(self.allocs) else self.allocs
        return {j: a for j, a in out.items() if j in state.active}


def run(cluster, jobs, policy):
    bind_delays(jobs, cluster)
    return simulate(cluster, jobs, policy)


def test_completion_time_is_the_end_of_the_last_slot():
    # one worker at p = 1/(n + H) = 1/0.5 = 2 mini-batches per slot; 5 mini-batches -> 3 slots (2 + 2 + 1)
    cl = make_cluster([(2, 1)])
    j = job(0, arrival=4, minibatches=5, worker_time=0.5)
    r = run(cl, [j], Scripted({0: Allocation({0: 1}, ps=0)}))
    assert r.jobs[0].completion == 4 + 3 and r.avg_jct == 3 and r.makespan == 3
    assert r.utilization == pytest.approx(3 / (2 * 3))


@pytest.mark.parametrize("alloc, flags, message", [
    ({0: Allocation({0: 3}, ps=0)}, {}, r"runs 3 workers > D_j = 2 \(2a\)"),
    ({0: Allocation({0: 2}, ps=0), 1: Allocation({0: 1}, ps=0)}, {}, r"runs 3 workers > W_s = 2 \(2g\)"),
    ({0: Allocation({0: 1}, ps=0), 1: Allocation({0: 1}, ps=0)}, {}, r"hosts 2 PSs > P_s = 1 \(2h\)"),
    ({0: Allocation({0: 1}, ps=5)}, {}, r"no valid PS server"),
])
def test_simulator_rejects_broken_constraints(alloc, flags, message):
    cl = make_cluster([(2, 1)])
    jobs = [job(0, chunks=2, minibatches=4), job(1, chunks=2, minibatches=4)]
    with pytest.raises(SimulationError, match=message):
        run(cl, jobs, Scripted(alloc, **flags))


def test_simulator_rejects_work_before_the_data_arrives():
    cl = make_cluster([(2, 1)], edge_delay=2)
    with pytest.raises(SimulationError, match=r"before a_j \+ Delta_js"):
        run(cl, [job(0, arrival=3)], Scripted({0: Allocation({0: 1}, ps=0)}))


def test_simulator_rejects_a_worker_type_mismatch():
    cl = make_cluster([(2, 1)], worker_types=["T4"])
    j = job(0)
    j.worker_type = "V100"
    with pytest.raises(SimulationError, match="worker type mismatch"):
        run(cl, [j], Scripted({0: Allocation({0: 1}, ps=0)}))


def test_simulator_enforces_fixed_allocations_and_no_migration():
    cl = make_cluster([(2, 1), (2, 1)])
    moving = Scripted(lambda t: {0: Allocation({t % 2: 1}, ps=t % 2)}, fixed_allocation=True)
    with pytest.raises(SimulationError, match=r"changed or paused .* \(2c\)-\(2d\)"):
        run(cl, [job(0, minibatches=4)], moving)
    pinned = Scripted(lambda t: {0: Allocation({1: 1}, ps=1)}, no_migration=True)
    pinned.dispatched_servers = lambda jid: {0}
    with pytest.raises(SimulationError, match="never sent to"):
        run(cl, [job(0, minibatches=4)], pinned)


def test_preemptions_count_lost_workers_of_unfinished_jobs():
    cl = make_cluster([(2, 1)])
    # two workers in slot 0, one in slot 1 (preempted once), none in slot 2 (again), then two to the end
    plan = {0: 2, 1: 1, 2: 0}
    policy = Scripted(lambda t: {0: Allocation({0: plan.get(t, 2)}, ps=0)})
    r = run(cl, [job(0, chunks=2, minibatches=6)], policy)  # E D M = 1 * 2 * 6 = 12 mini-batches
    assert r.preemptions == 2
    # rate 1 per worker: done after slots 0..7 = 2, 3, 3, 5, 7, 9, 11, 12 mini-batches -> c = 8
    assert r.jobs[0].completion == 8


def test_device_is_optional_only_for_scheduling_and_a_finite_cloud_needs_ps_slots():
    data = {"sites": [{"name": "cloud", "kind": "cloud", "upload_delay": 1}],
            "servers": [{"name": "c", "capacity": 1.0, "site": "cloud", "worker_slots": 4}]}
    assert not parse_cluster(data, "x.toml").device.declared  # optional everywhere: `deepco run` measures it
    cl = parse_cluster(data, "x.toml", require_device=False)
    with pytest.raises(UserError, match=r"x.toml: key 'servers.c.ps_slots': a cloud with finite worker_slots"):
        SimCluster.from_cluster(cl)
    data["servers"][0]["ps_slots"] = 2
    sim = SimCluster.from_cluster(parse_cluster(data, "x.toml", require_device=False))
    assert sim.finite_cloud and (sim.cloud.worker_slots, sim.cloud.ps_slots) == (4, 2)
