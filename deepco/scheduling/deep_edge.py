"""Deep-Edge (Bhattacharjee et al.): pick edge workers, batch sizes and data shards for one model update so
that the latency-critical task on each worker keeps its deadline (Alg. 1), with the performance and
interference models fitted on this machine (``deep_edge_models``).

On DeepCo the latency-critical background task is the partitioned inference a server serves: its deadline
delta_i^a is the SLO (e.g. the completion time of the THREAD plan), and its pressure (eq. 8) is the head
latency ``EstExecTime`` predicts with the training beside it.

Ambiguities and choices:

- GetMaxBatchSize (line 6) bounds b by memory; memory never binds on this machine, so it returns the
  largest profiled batch (16). Line 6's min(., d_i) then takes effect only for tiny shards.
- Alg. 1 removes a worker whose background task would miss its deadline; it does not try a smaller batch
  first. We follow it (``shrink_batch=True`` tries the smaller profiled batches before removing, our
  extension, off by default).
- A worker without a latency-critical task (``slo_ms=None``) has no pressure constraint.
- d_i is real-valued in Alg. 1 line 10; the final shards are rounded by largest remainder to sum to |M|.
- epochTime (line 29) is max_i d_i t_i^total; with a removed worker the loop of lines 5-28 runs again on
  the remaining workers, as line 34 implies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from deepco.cluster import Cluster, Server
from deepco.errors import UserError
from deepco.scheduling.deep_edge_models import DeepEdgeModels, load_models


@dataclass(frozen=True)
class EdgeWorker:
    """A candidate worker w_i: its state X_i and its latency-critical task's deadline."""

    name: str
    quota: float  # CPU cores of its cgroup quota
    load: float = 0.0  # background load (fraction of a core)
    slo_ms: float | None = None  # delta_i^a of its inference task (None: no latency-critical task)
    link_mbps: float | None = 100.0  # to the parameter server (None: it is the PS's host)


@dataclass
class DeepEdgePlan:
    """Alg. 1's output and its predictions."""

    workers: list[str]
    batch: dict[str, int]
    shards: dict[str, int]
    epoch_s: float
    per_sample_s: dict[str, float]
    inference_ms: dict[str, float]  # predicted head latency with the training beside it
    removed: dict[str, str] = field(default_factory=dict)  # worker -> why
    samples: int = 0

    def to_dict(self) -> dict[str, object]:
        """JSON row of `deepco schedule --policy deep-edge`: times in seconds; ``preemptions``, ``utilization``
        and ``cloud_jobs`` are null (a plan of one update, not a simulated run)."""
        return {"policy": "deep-edge", "jobs": 1, "avg_jct": self.epoch_s, "total_jct": self.epoch_s,
                "makespan": self.epoch_s, "preemptions": None, "utilization": None, "cloud_jobs": None,
                "samples": self.samples,
                "workers": self.workers, "batch": self.batch, "shards": self.shards, "epoch_seconds": self.epoch_s,
                "predicted_inference_ms": self.inference_ms, "removed": self.removed}

    def table(self) -> str:
        """Human-readable plan."""
        lines = [f"deep-edge: {self.samples} samples, predicted epoch {self.epoch_s:.2f} s",
                 f"{'worker':<10} {'batch':>5} {'shard':>6} {'s/sample':>9} {'infer ms':>9}"]
        for w in self.workers:
            lines.append(f"{w:<10} {self.batch[w]:>5} {self.shards[w]:>6} {self.per_sample_s[w]:>9.4f} "
                         f"{self.inference_ms[w]:>9.1f}")
        for w, why in self.removed.items():
            lines.append(f"{w:<10} not used: {why}")
        return "\n".join(lines)


def _totals(ws: list[EdgeWorker], batch: dict[str, int], models: DeepEdgeModels) -> dict[str, float]:
    """t_i^total = t_i^compute + t_i^update / b_i (line 9)."""
    return {w.name: models.compute_time(w.quota, w.load, batch[w.name])
            + models.update_time(w.link_mbps, len(ws)) / batch[w.name] for w in ws}


def schedule_update(workers: list[EdgeWorker], samples: int, models: DeepEdgeModels | None = None, *,
                    epsilon: float = 1.0, max_iter: int = 20, shrink_batch: bool = False) -> DeepEdgePlan:
    """Alg. 1 of Deep-Edge. Raises UserError when no worker can take the update without a deadline miss."""
    if samples < 1:
        raise UserError(f"deep-edge: the update needs >= 1 data sample, got {samples}")
    if not workers:
        raise UserError("deep-edge: no candidate workers")
    models = models or load_models()
    b_max = max(models.batches)
    live = list(workers)
    removed: dict[str, str] = {}
    best: tuple[float, list[EdgeWorker], dict[str, int], dict[str, float], dict[str, float]] | None = None
    while live:
        d = {w.name: math.inf for w in live}
        it = 0
        while True:  # lines 5-28
            batch = {w.name: int(min(b_max, d[w.name])) if d[w.name] >= 1 else min(models.batches)
                     for w in live}
            tot = _totals(live, batch, models)
            inv = sum(1 / tot[w.name] for w in live)
            d_new = {w.name: samples / (tot[w.name] * inv) for w in live}
            for w in list(live):  # lines 11-22: the interference constraint (4)
                if w.slo_ms is None:
                    continue
                b = batch[w.name]
                ok = models.inference_ms(w.quota, w.load, b) <= w.slo_ms
                if not ok and shrink_batch:
                    for smaller in sorted((x for x in models.batches if x < b), reverse=True):
                        if models.inference_ms(w.quota, w.load, smaller) <= w.slo_ms:
                            batch[w.name], ok = smaller, True
                            break
                if not ok:
                    removed[w.name] = (f"predicted inference {models.inference_ms(w.quota, w.load, b):.1f} ms > "
                                       f"SLO {w.slo_ms:.1f} ms with training at batch {b}")
                    live.remove(w)
                    d_new.pop(w.name)
            it += 1
            if not live:
                break
            diff = math.sqrt(sum((d_new[n] - d.get(n, 0.0)) ** 2 if math.isfinite(d.get(n, 0.0)) else math.inf
                                 for n in d_new))
            d = d_new
            if diff <= epsilon or it >= max_iter:
                break
            if any(n not in d_new for n in d):
                continue
        if not live:
            break
        tot = _totals(live, batch, models)
        inv = sum(1 / tot[w.name] for w in live)
        d = {w.name: samples / (tot[w.name] * inv) for w in live}
        epoch = max(d[w.name] * tot[w.name] for w in live)  # line 29
        if best is None or epoch < best[0]:
            best = (epoch, list(live), dict(batch), d, tot)
            slowest = max(live, key=lambda w: tot[w.name])  # lines 33-34
            live.remove(slowest)
            removed.setdefault(slowest.name, "removing the slowest worker did not shorten the epoch")
        else:
            break
    if best is None:
        raise UserError("deep-edge: every worker would push its inference past its SLO; no placement")
    epoch, ws, batch, d, tot = best
    for w in ws:
        removed.pop(w.name, None)
    shards = _round({w.name: d[w.name] for w in ws}, samples)
    return DeepEdgePlan(workers=[w.name for w in ws], batch={w.name: batch[w.name] for w in ws}, shards=shards,
                        epoch_s=max(shards[w.name] * tot[w.name] for w in ws),
                        per_sample_s={w.name: tot[w.name] for w in ws},
                        inference_ms={w.name: models.inference_ms(w.quota, w.load, batch[w.name]) for w in ws},
                        removed=removed, samples=samples)


def _round(d: dict[str, float], total: int) -> dict[str, int]:
    """Largest-remainder rounding of the shards so they sum to |M| (constraint (3))."""
    names = list(d)
    raw = np.array([d[n] for n in names])
    out = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - out), kind="stable")[: total - int(out.sum())]:
        out[i] += 1
    return {n: int(v) for n, v in zip(names, out, strict=True)}


def fair_plan(workers: list[EdgeWorker], samples: int, models: DeepEdgeModels | None = None) -> DeepEdgePlan:
    """The paper's comparison: the fairness scheduler, equal shards on every worker at the largest batch,
    blind to interference (the "naive placement")."""
    models = models or load_models()
    b = max(models.batches)
    shards = _round({w.name: samples / len(workers) for w in workers}, samples)
    batch = {w.name: b for w in workers}
    tot = _totals(workers, batch, models)
    return DeepEdgePlan(workers=[w.name for w in workers], batch=batch, shards=shards,
                        epoch_s=max(shards[w.name] * tot[w.name] for w in workers), per_sample_s=tot,
                        inference_ms={w.name: models.inference_ms(w.quota, w.load, b) for w in workers},
                        samples=samples)


def capacity_left(cluster: Cluster, plan: DeepEdgePlan, workers: list[EdgeWorker],
                  models: DeepEdgeModels | None = None) -> Cluster:
    """The cluster the inference planner should see while ``plan`` trains: each training server's capacity
    scaled by (head latency alone) / (head latency with the training), the slowdown EstExecTime predicts."""
    import dataclasses

    models = models or load_models()
    by = {w.name: w for w in workers}
    servers: list[Server] = []
    for srv in cluster.servers:
        w = by.get(srv.name)
        if w is not None and srv.name in plan.batch and srv.capacity is not None:
            alone = models.inference_ms(w.quota, w.load, 0)
            beside = models.inference_ms(w.quota, w.load, plan.batch[srv.name])
            srv = dataclasses.replace(srv, capacity=srv.capacity * alone / beside)
        servers.append(srv)
    return dataclasses.replace(cluster, servers=tuple(servers))


def sites_to_protect(workers: list[EdgeWorker], models: DeepEdgeModels | None = None, batch: int | None = None
                     ) -> set[str]:
    """The workers (servers or sites) where training at ``batch`` (default: the largest profiled) would push
    the latency-critical inference past its SLO, by EstExecTime: where a PS scheduler (``Okita(blocked=...)``)
    must not place training."""
    models = models or load_models()
    b = batch or max(models.batches)
    return {w.name for w in workers if w.slo_ms is not None and models.inference_ms(w.quota, w.load, b) > w.slo_ms}


def plan_from_cluster(cluster: Cluster, *, samples: int, slo_ms: float | None = None,
                      profile: str | None = None) -> DeepEdgePlan:
    """Alg. 1 over a cluster TOML's servers: each server's ``cpus`` is its CPU quota (cores; 1 when unset;
    it must lie within the profiled quotas: the models do not extrapolate), each serves inference with the
    SLO ``slo_ms`` (default: twice its predicted head latency alone)."""
    models = load_models(profile)
    quotas = models.source.get("quotas") or [1.0]
    lo, hi = min(quotas), max(quotas)
    workers = []
    for srv in cluster.servers:
        quota = srv.resources.cpus or 1.0
        if not lo <= quota <= hi:
            raise UserError(f"{cluster.source}: server {srv.name}: cpus {quota:g} is outside the profiled CPU "
                            f"quotas [{lo:g}, {hi:g}] (re-profile with bench/deep_edge_profile.py)")
        slo = slo_ms if slo_ms is not None else 2 * models.inference_ms(quota, 0.0, 0)
        workers.append(EdgeWorker(srv.name, quota=quota, slo_ms=slo))
    return schedule_update(workers, samples, models)
