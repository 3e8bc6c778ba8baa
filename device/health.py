"""The device's view of its servers' health during a run: failover, rejoin and drift.

- **Failover.** A server that fails a frame (an error, a dropped connection, a deadline) is marked down and
  left out of a new plan (``replan(down)``, e.g. the same paper algorithm without it, or the staged
  planner's best); the frame is run again on it. A server that answers wrongly (a tensor that does not fit
  the plan) is down *for good*: it is never probed back. A down server is removed from every stage of the
  new plan, because the plan is made again without it.
- **Rejoin.** Every PROBE_SECONDS the down servers (not the liars) are asked whether they are ready; those
  that are rejoin with another replan (the new runner uploads the plan's models again: a restarted server
  lost them).
- **Drift.** `DriftWatch`: a server computing, or an antenna sending, persistently off the plan (more than
  ``threshold`` for ``samples`` frames in a row, all in the same direction) gets its measured speed rescaled
  by the median of what was seen, and the device replans.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from deepco_device.records import FrameTiming, Measurements

from deepco.errors import UserError
from deepco.planning.staged import DEVICE, CostModel, StagedPlan
from deepco.wire.client import ServerError, WrongAnswer

PROBE_SECONDS = 0.5  # how often a down server is asked whether it is back
DRIFT_THRESHOLD = 0.5  # replan when a server or link is this much (50%) off the plan ...
DRIFT_SAMPLES = 5  # ... for this many frames in a row, all in the same direction


class DriftWatch:
    """Online re-profiling of split plans: compares each participant's measured compute (the server's own
    ONNX Runtime time) and its antenna's transfer (until the server reported the input received) with what
    the plan's rates predict, and rescales ``measured`` when they stay off. Paced antennas are exact by
    construction and are not watched."""

    def __init__(self, costs: CostModel, measured: Measurements, threshold: float = DRIFT_THRESHOLD,
                 samples: int = DRIFT_SAMPLES):
        self.costs, self.measured = costs, measured
        self.threshold, self.samples = threshold, samples
        self._windows: dict[str, collections.deque] = {}
        self._lock = threading.Lock()

    def planned(self, plan: StagedPlan, i: int) -> tuple[float, float]:
        """(compute, transfer) seconds participant ``i`` of ``plan`` should take at the measured rates."""
        names: list[str | None] = [None, *plan.levels]
        flops = sum(self.costs.window(names[j - 1], names[j], *plan.bands[j][i]).flops for j in range(1, len(names)))
        m = self.measured
        a, b = plan.windows[0][i]
        transfer = (b - a) * self.costs.row_bytes(None) / m.antenna_bytes_per_second[plan.antennas[i]]
        return flops / m.server_flops_per_second[plan.servers[i]], transfer + m.request_overhead

    def observe(self, plan: StagedPlan, timing: FrameTiming) -> list[str]:
        """Feed one frame's timing of ``plan``; what was rescaled (empty: nothing), e.g. ``server s0 at 3.10x
        the planned time``."""
        if self.threshold <= 0 or plan.kind != "split":
            return []
        samples: dict[str, float] = {}
        for i, s in enumerate(timing.servers):
            if s.name == DEVICE:
                continue
            compute, transfer = self.planned(plan, i)
            if compute > 0:
                samples[f"server {s.name}"] = s.compute / compute
            if not self.measured.paced and transfer > 1e-3:
                samples.setdefault(f"antenna {s.antenna}", (s.received - s.send_start) / transfer)
        changed = []
        with self._lock:
            for key, ratio in samples.items():
                window = self._windows.setdefault(key, collections.deque(maxlen=self.samples))
                window.append(ratio)
                if len(window) < self.samples:
                    continue
                high = all(r > 1 + self.threshold for r in window)
                low = all(r < 1 / (1 + self.threshold) for r in window)
                if not (high or low):
                    continue
                factor = statistics.median(window)
                kind, name = key.split(" ", 1)
                if kind == "server":
                    self.measured.server_flops_per_second[name] /= factor
                else:
                    self.measured.antenna_bytes_per_second[int(name)] /= factor
                window.clear()
                changed.append(f"{key} at {factor:.2f}x the planned time")
        return changed


class Health:
    """Which servers are down, and the runner frames use now: replaced on a failure, a rejoin or drift.

    ``make(plan)`` builds a runner for a plan; ``replan(down)`` makes a plan without the servers in ``down``
    (None: no failover, a failed frame is an error); ``ready(server)`` asks a server whether it is ready;
    ``server_at(address)`` names the server listening at an address."""

    def __init__(self, device, runner, make: Callable[[StagedPlan], Any],
                 replan: Callable[[set[str]], StagedPlan] | None, ready: Callable[[str], bool],
                 server_at: Callable[[str], str | None], drift: DriftWatch | None = None):
        self.device, self.runner, self.make, self.replan = device, runner, make, replan
        self.ready, self.server_at, self.drift = ready, server_at, drift
        self.down: set[str] = set()
        self.liars: set[str] = set()  # answered wrongly: down for good, never probed back in
        self.lock = threading.Lock()  # the sets and the runner: held briefly, never across a call to a server
        self._replanning = threading.Lock()  # one replan at a time (it may upload models)
        self._probed = time.monotonic()

    def current(self):
        """The runner a frame should use now."""
        with self.lock:
            return self.runner

    def _rebuild(self) -> Any:
        """A runner for a new plan without the servers down now (the caller holds ``_replanning``)."""
        with self.lock:
            down = set(self.down)
        runner = self.make(self.replan(down))
        with self.lock:
            self.runner = runner
        return runner

    def failed(self, runner, exc: ServerError) -> str | None:
        """A frame on ``runner`` failed with ``exc``: mark its server down and (once per failure) replan
        without it. Returns why the frame cannot be tried again, or None (try again on `current`)."""
        if self.replan is None:
            return str(exc)
        server = self.server_at(exc.address)
        wrong = isinstance(exc, WrongAnswer)
        why = f"answered wrongly: {exc.details}" if wrong else exc.code.name
        good = " for good: it answered wrongly" if wrong else ""
        with self._replanning:
            with self.lock:
                newly = bool(server) and server not in self.down
                if server and wrong:
                    self.liars.add(server)
                if newly:
                    self.down.add(server)
                    self.device.down.add(server)  # not asked to unload on close (a frozen one stalls it)
                stale = self.runner is not runner and server not in self.runner.plan.servers
            if stale:  # another frame already replanned without it
                if newly:
                    self.device.log(f"server {server} down ({why}){good}; the plan in use already leaves it out")
                return None
            detected = time.perf_counter()
            try:
                new = self._rebuild()
            except UserError as err:
                if newly:
                    self.device.log(f"server {server} down ({why}){good}; no plan is left: {err}")
                return f"{exc}; and no plan is left: {err}"
        took = time.perf_counter() - detected
        if newly:
            self.device.events.append({"event": "down", "server": server, "at": detected, "why": why,
                                       "replanned_in": took})
            self.device.log(f"server {server} down ({why}){good}; replanned in {took * 1e3:.1f} ms: "
                            f"{new.plan.describe()}")
        return None

    def rejoin(self) -> None:
        """Every PROBE_SECONDS, ask the down servers (not the liars) whether they are back; replan with those
        that are (their models are uploaded again: a restarted server lost them)."""
        with self.lock:
            if not self.down - self.liars or self.replan is None or time.monotonic() - self._probed < PROBE_SECONDS:
                return
            self._probed = time.monotonic()
            candidates = sorted(self.down - self.liars)
        back = [s for s in candidates if self.ready(s)]
        if not back:
            return
        with self._replanning:
            with self.lock:
                self.down.difference_update(back)
            for name in back:
                self.device.uploads.forget(self.device.pool.client(name, 0).address)
            try:
                new = self._rebuild()
            except UserError as err:  # ServerError included: it answers but the upload failed
                with self.lock:
                    self.down.update(back)
                self.device.log(f"server(s) {', '.join(back)} answer again but could not rejoin: {err}")
                return
        self.device.down.difference_update(back)
        for name in back:
            self.device.events.append({"event": "up", "server": name, "at": time.perf_counter()})
            self.device.log(f"server {name} is back; replanned: {new.plan.describe()}")

    def observe(self, runner, timing: FrameTiming) -> None:
        """Drift: feed a successful frame's timing; replan when a rate was rescaled."""
        if self.drift is None or self.replan is None:
            return
        changed = self.drift.observe(runner.plan, timing)
        if not changed:
            return
        with self._replanning:
            try:
                new = self._rebuild()
            except UserError as err:
                self.device.log(f"drift: {'; '.join(changed)}: re-profiled, but could not replan: {err}")
                return
        self.device.events.append({"event": "drift", "what": changed, "at": time.perf_counter()})
        self.device.log(f"drift: {'; '.join(changed)}: re-profiled and replanned: {new.plan.describe()}")

    def waiting_for(self) -> str:
        """What frames in flight wait on, for a give-up message."""
        with self.lock:
            servers = self.runner.plan.servers
            down = sorted(self.down)
        return (f"servers {', '.join(servers)}" if servers else "the device") + (
            f" ({', '.join(down)} down)" if down else "")
