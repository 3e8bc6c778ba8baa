"""The device: one model over the servers of a cluster file (the facade of the device's parts).

    dev = Device(cluster, "resnet18", 720, 1280, algorithm="thread"); dev.setup()   # measure, plan
    runner = StagedRunner(dev, dev.plan)                                            # device/staged.py
    for result in runner.run_frames(frames, replan=dev.replan("thread")): ...

Setup exports (or reads) the model, puts the normalisation into its graph (the device sends uint8 pixels),
analyses it with the exact partitioner, and measures the device, the servers and the antennas
(device/measuring.py) over the pool of per-antenna channels (device/channels.py). With ``rows=True`` it
also makes the paper's plan for ``algorithm`` (deepco/planning/paper_plans.py: THREAD's association and
order, integer rows on the exact cost model, at the cut of least predicted frame time), a StagedPlan that
the staged runtime executes like every other plan (device/staged.py; frames in flight: device/pipeline.py;
failover, rejoin, live adaptation: device/health.py, device/adaptation.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from deepco_device.measuring import device_session, measure, probe_link, server_rates
from deepco_device.parts import Links, Measured, ModelArtefacts
from deepco_device.preprocess import Preprocessing, preprocessing_for
from deepco_device.records import Measurements

from deepco.cluster import Cluster
from deepco.errors import UserError
from deepco.partition import Cut
from deepco.planning import paper_plans
from deepco.planning.staged import MIN_STAGE_FLOPS, Rates, StagedPlan
from deepco.wire.client import InferenceClient
from deepco.wire.security import ChannelSecurity

ALGORITHMS = paper_plans.ALGORITHMS  # the paper's row plans `deepco run --algorithm` takes besides auto/local/offload


class Device:
    """A device running one model over the servers of a cluster file: the facade of its parts (device.parts),
    its model artefacts (``artefacts``), its links to the servers (``links``: channels and uploads) and its
    measurements with calibration's fit (``measurements``)."""

    def __init__(self, cluster: Cluster, model: str, height: int, width: int, *, algorithm: str = "thread",
                 cut: str = "auto", weights: str | None = None, pace: bool = False, depth: int = 2,
                 log: Callable[[str], None] = print, security: ChannelSecurity | None = None,
                 preprocessing: Preprocessing | None = None):
        if algorithm not in ALGORITHMS:
            raise UserError(f"unknown algorithm {algorithm!r} (choose from {', '.join(ALGORITHMS)})")
        if depth < 1:
            raise UserError(f"pipeline depth must be >= 1, got {depth}")
        self.algorithm, self.cut_spec, self.depth = algorithm, cut, depth
        self.log = log
        # the preprocessing is checked against the model in load()
        self.artefacts = ModelArtefacts(model, height, width, weights, preprocessing or preprocessing_for(model))
        self.links = Links(cluster, security, pace, log)
        self.links.uploads.routes = self._routes
        self.measurements = Measured(cluster)
        self.down: set[str] = set()  # servers a run found down: not asked to unload on close
        self.events: list[dict] = []  # down / up / change / switch, with times (perf_counter): device.health
        self.plan: StagedPlan | None = None
        self.cut: Cut | None = None
        self._reached: dict[str, str] | None = None  # `reach`'s answer, once asked
        self.progress: Callable[[str], None] = lambda what: None  # a step of setup or calibration begins
        self._probe_cut: Cut | None = None  # what setup sized the servers' compute probe by

    # ---- the parts' attributes, as callers knew them -----------------------------------------------------
    cluster = property(lambda self: self.links.cluster, doc="The cluster file's servers and antennas.")
    pace = property(lambda self: self.links.pace, doc="Whether sends are paced (EMULATED bandwidth).")
    security = property(lambda self: self.links.security, doc="The channels' TLS settings.")
    pool = property(lambda self: self.links.pool, doc="The per-antenna channels (device.channels).")
    uploads = property(lambda self: self.links.uploads, doc="The models uploaded (device.lifecycle).")
    model_spec = property(lambda self: self.artefacts.spec, doc="The model as given (zoo name or .onnx path).")
    height = property(lambda self: self.artefacts.height, doc="Input rows.")
    width = property(lambda self: self.artefacts.width, doc="Input columns.")
    weights = property(lambda self: self.artefacts.weights, doc="A zoo model's state-dict file, if any.")
    preprocessing = property(lambda self: self.artefacts.preprocessing, doc="How pixels are normalised.")
    channels = property(lambda self: self.artefacts.channels, doc="Colour channels of the pixels sent.")
    tag = property(lambda self: self.artefacts.tag, doc="The model's name as uploaded models are tagged.")
    reference_model = property(lambda self: self.artefacts.reference_model, doc="The model as loaded.")
    model = property(lambda self: self.artefacts.model, doc="The model with the normalisation in its graph.")
    partitioner = property(lambda self: self.artefacts.partitioner, doc="The exact partitioner (after load()).")
    stage_models = property(lambda self: self.artefacts.stage_models, doc="Stage models per chain of levels.")
    costs = property(lambda self: self.artefacts.costs, doc="The staged planner's cost model of the model.")
    measured = property(lambda self: self.measurements.measurements, doc="What setup measured (None before).")

    def rates(self, exclude: Iterable[str] = ()) -> Rates:
        """The measured rates, with calibration's fit, without the servers in ``exclude``."""
        return self.measurements.rates(exclude)

    def servers(self, exclude: Iterable[str] = ()) -> list[str]:
        """Names of the servers not in ``exclude``, in cluster order."""
        return self.measurements.servers(exclude)

    # ---- channels -------------------------------------------------------------------------------------
    def client(self, server: int, antenna: int) -> InferenceClient:
        """The channel to ``server`` (index in the cluster) over ``antenna`` (opened once)."""
        return self.links.client(server, antenna)

    def _routes(self, name: str) -> list[tuple[InferenceClient, float]]:
        """Server ``name``'s channels over the antennas that reach it at addresses of their own, each with the
        antenna's measured bandwidth (device.lifecycle.Uploads sends a whole model over them in parts); none
        before measuring. Antennas that share an address are one route: parts over them would share one link."""
        measured = self.measured
        if measured is None:
            return []
        server = next(s for s in self.cluster.servers if s.name == name)
        routes, seen = [], set()
        for m, rate in enumerate(measured.antenna_bytes_per_second):
            address = self.cluster.address_on(server, m)
            if address not in seen:
                seen.add(address)
                routes.append((self.pool.client(name, m), rate))
        return routes

    def close(self) -> None:
        """Unload what this device uploaded (not from servers marked down), then close every channel."""
        self.links.close(self.down, self.log)

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- setup ----------------------------------------------------------------------------------------
    def load(self) -> None:
        """Load (or export) the model, check its input and build its partitioner: what a camera has done
        before it is switched on (`setup` does it if it has not been done)."""
        self.artefacts.load()

    def setup(self, rows: bool = True) -> StagedPlan | None:
        """Load and measure; with ``rows`` also plan ``algorithm`` the paper's way (printed through ``log``)
        and return that plan. ``rows=False`` stops after measuring: the staged planner (device/planner.py)
        plans for itself, and the paper's plans over every cut would only cost time (seconds per cut on a
        weak device). Nothing is uploaded here: a runner uploads what its plan needs."""
        if self.partitioner is None:
            self.progress("loading the model")
            self.load()
        p = self.partitioner
        self.progress("waiting for the servers")
        down = self.reach()
        x = np.zeros((1, self.channels, self.height, self.width), np.uint8)
        whole = device_session(self.model.SerializeToString())
        self.measurements.measurements, self.measurements.probe_ratio = measure(
            self.pool, p, whole, x, self._probe_reference(), pace=self.pace, tag=self.tag, log=self.log, skip=down,
            step=self.progress)
        if not rows:
            return None
        self.plan = self.paper_plan(self.algorithm, cut=None if self.cut_spec == "auto" else self.cut_spec)
        self.cut = p.cut(self.plan.levels[0])
        if self.cut_spec == "auto":
            self.log(f"cut: {self.cut.name} (least predicted frame time)")
        return self.plan

    def _probe_reference(self) -> Cut:
        """The cut whose head's work sizes the servers' compute probe: of the candidate cuts, the one of most
        work (the steadiest FLOP/s measurement)."""
        if self._probe_cut is None:
            p = self.partitioner
            cuts = p.cuts if self.cut_spec == "auto" else [p.cut(self.cut_spec)]
            if self.cut_spec == "auto":  # a cut with next to no work before it only sends float32, not pixels
                cuts = [c for c in cuts if c.head_flops >= MIN_STAGE_FLOPS * p.total_flops] or cuts
            self._probe_cut = max(cuts, key=lambda c: c.head_flops)
        return self._probe_cut

    def reach(self) -> dict[str, str]:
        """The servers down at the start (name -> why), asked once (device.channels: all at once, so one that
        is down delays the start by seconds, not ten per server): left out of measuring and planning until
        they answer (then `measure_server` measures each, and it joins as a server back from down does:
        device.health). One line names them; a UserError when no server answers."""
        if self._reached is None:
            self._reached = self.pool.reach()
            names = [s.name for s in self.cluster.servers]
            if len(self._reached) == len(names):
                raise UserError("no server is reachable: " + "; ".join(
                    f"{self.pool.client(n, 0).address}: {why}" for n, why in self._reached.items()))
            self.measurements.unreached = dict(self._reached)
            self.down.update(self._reached)  # nothing of ours is on them: not asked to unload on close
            for name, why in self._reached.items():
                self.events.append({"event": "down", "server": name, "at": time.perf_counter(),
                                    "why": f"at start: {why}"})
            if self._reached:
                self.log("down at start: " + ", ".join(f"{n} ({self.pool.client(n, 0).address}: {why})"
                                                       for n, why in self._reached.items())
                         + f"; starting on {', '.join(n for n in names if n not in self._reached)}; "
                         "they join when they answer")
        return self._reached

    def measure_antenna(self, antenna: int) -> float:
        """Antenna ``antenna``'s bandwidth now (bytes/s), probed as setup probes it, over the first server up: live
        adaptation asks for the antennas its running plan does not use, whose rates its frames cannot show."""
        up = next((k for k, s in enumerate(self.cluster.servers) if s.name not in self.down), None)
        if up is None:
            raise UserError("no server is up to probe an antenna through")
        return probe_link(self.client(up, antenna), self.measured.device_seconds_per_byte)[0]

    def measure_server(self, name: str) -> None:
        """Measure a server that was down at the start and now answers (its probe rate, as setup measured the
        others), so that plans can count on it."""
        if name not in self.measurements.unreached or self.measured is None:
            return
        if self.measurements.probe_ratio is not None:  # None: a cache that did not keep it; its rate stands
            rate = self.server_rates_now([name])[name]
            self.measured.server_flops_per_second[name] = rate
            self.log(f"server {name} measured on joining: {rate / 1e9:.2f} GFLOP/s")
        del self.measurements.unreached[name]

    def server_rates_now(self, names: Iterable[str]) -> dict[str, float]:
        """The compute rate (FLOP/s, in the units setup measured them in) of each server in ``names``, probed
        as setup probes them, one thread each: each server has a CPU of its own, and a slow spell of the machine
        they share then weighs on them alike. Empty where setup's probe ratio is unknown (a warm start from a
        cache that did not keep it)."""
        ratio, names = self.measurements.probe_ratio, list(names)
        if ratio is None or not names:
            return {}
        everyone = {s.name for s in self.cluster.servers}
        with ThreadPoolExecutor(max_workers=len(names)) as threads:
            found = threads.map(lambda n: server_rates(self.pool, self._probe_reference(), self.tag,
                                                    skip=everyone - {n})[n], names)
            return {name: rate * ratio for name, rate in zip(names, found, strict=True)}

    def restore(self, measured: Measurements, compute_scale: float, step_overhead: float,
                probe_ratio: float | None = None, balance: dict[str, float] | None = None,
                links: dict[int, float] | None = None) -> None:
        """Take what an earlier setup measured and its calibration fitted (the plan cache, device.plan_cache)
        instead of measuring: a warm start sends nothing but its frames. ``probe_ratio``: that setup's (a server
        down at this start is measured with it when it answers; None: its cached rate is kept); ``balance``: the
        servers' slowness against each other that calibration fitted; ``links``: each antenna's time against its
        probe's that it fitted."""
        if self.partitioner is None:
            self.load()
        self.measurements.measurements = measured
        self.measurements.compute_scale, self.measurements.step_overhead = compute_scale, step_overhead
        self.measurements.balance = dict(balance or {})
        self.measurements.links = dict(links or {})
        self.measurements.probe_ratio = probe_ratio

    def paper_plan(self, algorithm: str, exclude: Iterable[str] = (), cut: str | None = None,
                   rates: Rates | None = None) -> StagedPlan:
        """The paper's plan for ``algorithm`` on the servers not in ``exclude``, at ``cut`` (None: the cut of
        least predicted frame time), as a StagedPlan (deepco.planning.paper_plans), on ``rates`` (default: the
        measured ones)."""
        if algorithm not in ALGORITHMS:
            raise UserError(f"unknown algorithm {algorithm!r} (choose from {', '.join(ALGORITHMS)})")
        rates = rates or self.rates(exclude)
        return paper_plans.paper_plan(self.costs, rates, self.servers(exclude), algorithm, cut)

    def plan_for(self, algorithm: str) -> StagedPlan:
        """Another algorithm's plan at the chosen cut, on the same measurements (for side-by-side runs)."""
        assert self.cut is not None, "setup() first"
        return self.paper_plan(algorithm, cut=self.cut.name)

    def replan(self, algorithm: str) -> Callable[..., StagedPlan]:
        """Failover and live adaptation for a paper plan: ``replan(down, rates=None)`` is the same algorithm at
        the same cut without the servers that are down (on ``rates``, default: the measured ones)."""
        assert self.cut is not None, "setup() first"
        name = self.cut.name
        return lambda down, rates=None: self.paper_plan(algorithm, exclude=down, cut=name, rates=rates)

    # ---- describing -----------------------------------------------------------------------------------
    def describe_measurements(self) -> str:
        """One line: what setup measured."""
        m = self.measured
        assert m is not None, "setup() first"
        peer = (f"; server to server {m.peer_bytes_per_second * 8 / 1e6:.1f} Mbit/s" if m.peer_bytes_per_second
                else "")
        return ("measured: " + ", ".join(f"{n} {r / 1e9:.2f} GFLOP/s" for n, r in m.server_flops_per_second.items())
                + "; antennas " + ", ".join(f"{b * 8 / 1e6:.1f} Mbit/s" for b in m.antenna_bytes_per_second)
                + (" (paced: EMULATED by app-level pacing)" if m.paced else "")
                + f"; request overhead {m.request_overhead * 1e3:.2f} ms{peer}; device "
                f"{m.device_flops_per_second / 1e9:.2f} GFLOP/s, {m.device_seconds_per_byte * 1e9:.2f} ns of its CPU "
                "per byte sent")

    def describe_plan(self, plan: StagedPlan | None = None) -> str:
        """A paper plan (default: setup's) as a table, with what was measured."""
        plan = plan or self.plan
        assert plan is not None and self.measured is not None, "setup() first"
        cut = self.partitioner.cut(plan.levels[0])
        rows = plan.breakdown.get("rows", {})
        timeline = {s["name"]: s for s in rows.get("slices", [])}
        lines = [f"plan: {plan.algorithm} at cut {cut.name} ({cut.height} rows, halo {cut.halo_top}+"
                 f"{cut.halo_bottom}, stride {cut.stride}); predicted frame {plan.predicted * 1e3:.1f} ms "
                 f"(the row sizing's own model: slices {rows.get('completion_time', 0) * 1e3:.1f} + tail "
                 f"{rows.get('tail_time', 0) * 1e3:.1f})",
                 self.describe_measurements(),
                 f"{'server':<10} {'antenna':>7} {'order':>5} {'rows':>9} {'image rows':>10} {'tx start':>9} "
                 f"{'tx':>8} {'compute':>8} {'return':>8} {'finish':>8}  (ms, the row sizing's model)"]
        for i in sorted(range(len(plan.servers)), key=lambda i: (plan.antennas[i], plan.order[i])):
            name, (a, b), (lo, hi) = plan.servers[i], plan.bands[1][i], plan.windows[0][i]
            s = timeline.get(name, {})
            times = " ".join(f"{s.get(k, 0) * 1e3:>{w}.1f}" for k, w in (
                ("transfer_start", 9), ("transfer_time", 8), ("compute_time", 8), ("return_time", 8),
                ("finish_time", 8)))
            lines.append(f"{name:<10} {plan.antennas[i]:>7} {plan.order[i]:>5} {f'{a}-{b}':>9} {f'{lo}-{hi}':>10} "
                         f"{times}")
        return "\n".join(lines)
