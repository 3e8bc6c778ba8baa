"""`--cut auto`: pick the cut, by predicted completion time on a cluster or by a halo budget."""

from __future__ import annotations

from dataclasses import dataclass

from deepco.partition.graph import PartitionError
from deepco.partition.partitioner import Cut, Partitioner

DEFAULT_MAX_HALO = 0.25


@dataclass(frozen=True)
class Choice:
    """The chosen cut, why, and (with a cluster) the predicted completion time of every cut."""

    cut: Cut
    reason: str
    times: dict[str, float] | None = None


def predicted_time(p: Partitioner, cut: Cut, cluster) -> float:
    """THREAD on the head's share of the work with the cut's exact halo, plus the tail on the best server.

    The cluster's [workload] gives the image's data size s and total work w; the head costs
    w * head_flops / total_flops and carries the prefetch ratio r_o = halo / image height (at most 1),
    the tail costs the rest and runs once on the strongest server. Moving the cut tensor to that
    server is not modelled.
    """
    from deepco.planning import Instance, make_plan  # planning may one day import partition: keep lazy

    wl = cluster.require_workload()
    share = cut.head_flops / p.total_flops if p.total_flops else 1.0
    head_work = wl.work * share
    tail_time = wl.work * (1.0 - share) / max(s.capacity for s in cluster.servers)
    inst = Instance(
        names=tuple(s.name for s in cluster.servers),
        capacities=tuple(s.capacity * wl.data_size / head_work for s in cluster.servers),
        antenna_names=tuple(a.name for a in cluster.device.antennas),
        bandwidths=tuple(a.bandwidth for a in cluster.device.antennas),
        data_size=wl.data_size,
        prefetch_ratio=min(1.0, cut.halo / p.height),
    )
    return make_plan(inst, "thread").completion_time + tail_time


def choose_cut(p: Partitioner, cluster=None, max_halo: float = DEFAULT_MAX_HALO) -> Choice:
    """With a cluster: the cut of least predicted completion time; else the deepest cut whose exact halo
    is at most ``max_halo`` of the input height (the shallowest cut if none is)."""
    if cluster is not None:
        times = {c.name: predicted_time(p, c, cluster) for c in p.cuts}
        best = min(p.cuts, key=lambda c: (times[c.name], -p.cuts.index(c)))
        runner = sorted((t, n) for n, t in times.items() if n != best.name)
        other = f"; next best {runner[0][1]} at {runner[0][0]:.6g}" if runner else ""
        return Choice(
            best,
            f"least predicted completion time on {cluster.source}: {times[best.name]:.6g} "
            f"(THREAD on the head with r_o = {min(1.0, best.halo / p.height):.4f}, "
            f"tail on the strongest server){other}",
            times,
        )
    if not max_halo > 0:
        raise PartitionError(f"--max-halo must be positive, got {max_halo:g}")
    fits = [c for c in p.cuts if c.halo <= max_halo * p.height]
    if fits:
        c = fits[-1]
        return Choice(
            c,
            f"deepest cut whose halo ({c.halo} rows = {c.halo / p.height:.1%} of {p.height}) "
            f"is at most {max_halo:.0%} of the input height",
        )
    c = p.cuts[0]
    return Choice(
        c,
        f"no cut has a halo of at most {max_halo:.0%} of the input height; "
        f"the shallowest ({c.halo} rows) is used",
    )
