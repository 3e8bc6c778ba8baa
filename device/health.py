"""The device's view of its servers' health during a run: failover, rejoin and live adaptation.

- **Failover.** A server that fails a frame (an error, a dropped connection, a deadline) is marked down and
  left out of a new plan (``replan(down)``, e.g. the same paper algorithm without it, or the staged
  planner's best); the frame is run again on it. A server that answers wrongly (a tensor that does not fit
  the plan) is down *for good*: it is never probed back. A down server is removed from every stage of the
  new plan, because the plan is made again without it.
- **Rejoin.** Every PROBE_SECONDS the down servers (not the liars) are asked whether they are ready. With
  live adaptation those that are join through it: the plan the current rates suggest with them is tried on
  live frames (whatever the cost model predicts of it) and switched to if it measures faster. Without, the
  device replans with them at once. Either way the new runner uploads the plan's models again (a restarted
  server lost them).
- **Live adaptation** (device/adaptation.py): every frame of the running plan feeds the live rates; on a
  change point a better plan is tried on every other frame and switched to if it measures faster, with one
  line: from, to, why.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from deepco_device.adaptation import Adaptation, Trial
from deepco_device.records import FrameTiming

from deepco.errors import UserError
from deepco.planning.staged import StagedPlan
from deepco.wire.client import ServerError, WrongAnswer

PROBE_SECONDS = 0.5  # how often a down server is asked whether it is back


def _described(err: Exception) -> str:
    """A background task's failure in a line: a UserError's own message, else the bug's type and message."""
    return str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {err}"


class Health:
    """Which servers are down, and the runner frames use now: replaced on a failure, a rejoin or a switch.

    ``make(plan)`` builds a runner for a plan; ``replan(down)`` makes a plan without the servers in ``down``
    (None: no failover, a failed frame is an error); ``ready(server)`` asks a server whether it is ready;
    ``server_at(address)`` names the server listening at an address; ``adapt``: live adaptation (None: the
    plan changes only on failures and rejoins)."""

    @staticmethod
    def background(fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on a thread of its own (a trial's uploads, a rejoin: frames go on meanwhile)."""
        threading.Thread(target=fn, args=args, daemon=True, name="deepco-trial").start()

    def __init__(self, device, runner, make: Callable[[StagedPlan], Any],
                 replan: Callable[[set[str]], StagedPlan] | None, ready: Callable[[str], bool],
                 server_at: Callable[[str], str | None], adapt: Adaptation | None = None, *,
                 unreached: Iterable[str] = (), measure: Callable[[str], None] | None = None):
        self.device, self.runner, self.make, self.replan = device, runner, make, replan
        self._serving(runner)
        self.ready, self.server_at, self.adapt = ready, server_at, adapt
        self.measure = measure  # measures a server down since the start before it rejoins (it has no rate yet)
        self.trial: Trial | None = None  # a candidate plan being tried on live frames (its runner ready)
        self._considering = False  # a candidate is being planned and uploaded
        self._joins_waiting: list[str] = []  # servers back while a trial was under way: tried after it
        # a change point seen while a candidate was being planned (on the rates before it): planned again after it
        self._changes_waiting: str | None = None
        self.down: set[str] = set(unreached)  # down at the start: probed and rejoin like any other
        self.liars: set[str] = set()  # answered wrongly: down for good, never probed back in
        self.lock = threading.Lock()  # the sets and the runner: held briefly, never across a call to a server
        self._replanning = threading.Lock()  # one replan at a time (it may upload models)
        self._probed = time.monotonic()
        self._rejoining = False  # `rejoin_soon`'s probe is under way
        # live adaptation's reserve (`_reserve`): asked for at the first quiet frame; its runner kept for the run
        self._reserve_asked = not (isinstance(adapt, Adaptation) and adapt.keep_reserve)
        self.reserves: list[Any] = []

    def current(self):
        """The runner a frame should use now: the running plan's, or on every other frame a trial's."""
        with self.lock:
            trial = self.trial
            if trial is not None and trial.takes_frame():
                return trial.runner
            return self.runner

    def _rebuild(self) -> Any:
        """A runner for a new plan without the servers down now (the caller holds ``_replanning``)."""
        with self.lock:
            down = set(self.down)
        runner = self.make(self.replan(down))
        with self.lock:
            self.runner = runner
        self._serving(runner)
        return runner

    def _serving(self, runner) -> None:
        """``runner``'s plan carries the frames now: whole models are fetched from other servers first."""
        self.device.uploads.serving = set(runner.plan.servers)

    def failed(self, runner, exc: ServerError) -> str | None:
        """A frame on ``runner`` failed with ``exc``: mark its server down and (once per failure) replan
        without it. Returns why the frame cannot be tried again, or None (try again on `current`)."""
        if self._abandon(runner, exc):
            return None
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
                            f"{new.plan.brief()}")
        return None

    def rejoin_soon(self) -> None:
        """`rejoin` on a thread of its own when a probe is due and none is under way: a frame never waits for
        it (measuring a server that came up, inside a frame, took that frame on a 0.1-core camera from 80 ms to
        1.3 s)."""
        with self.lock:
            if (self._rejoining or not self.down - self.liars or self.replan is None
                    or time.monotonic() - self._probed < PROBE_SECONDS):
                return
            self._rejoining = True

        def probe() -> None:
            try:
                self.rejoin()
            except Exception as err:  # noqa: BLE001 - a UserError (ServerError) or a bug: one line, never silent
                what = _described(err)
                self.device.log(f"adapt: asking the servers down whether they are back failed: {what}")
            finally:
                with self.lock:
                    self._rejoining = False

        self.background(probe)

    def rejoin(self) -> None:
        """Every PROBE_SECONDS, ask the down servers (not the liars) whether they are back; those that are join
        through live adaptation (a trial of the plan with them), or without it by a replan at once (their
        models are uploaded again either way: a restarted server lost them)."""
        with self.lock:
            if not self.down - self.liars or self.replan is None or time.monotonic() - self._probed < PROBE_SECONDS:
                return
            self._probed = time.monotonic()
            candidates = sorted(self.down - self.liars)
        back = [s for s in candidates if self.ready(s) and self._measured(s)]
        if not back:
            return
        with self._replanning:
            with self.lock:
                self.down.difference_update(back)
            for name in back:
                self.device.uploads.forget(name)
            if self.adapt is None:
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
            if self.adapt is None:
                self.device.log(f"server {name} is back; replanned: {new.plan.brief()}")
            else:
                self.device.log(f"server {name} is back")
        if self.adapt is not None:  # tried whatever the prediction (its rates may be stale): the frames decide
            self._consider(f"{', '.join(back)} back", margin=-math.inf, gentle=True, back=back)

    def _measured(self, server: str) -> bool:
        """Whether ``server``, which answers again, can be planned on: one down since the start is measured
        first (a failure is one line, and it is probed again later)."""
        if self.measure is None:
            return True
        try:
            with self.device.uploads.busy():  # the frames meanwhile share the antennas and the CPU with it
                self.measure(server)
        except UserError as err:  # ServerError included
            self.device.log(f"server {server} answers but could not be measured: {err}")
            return False
        return True

    def observe(self, runner, timing: FrameTiming) -> None:
        """Live adaptation: feed a successful frame's timing. A frame of the running plan feeds the live rates
        (and may start a trial); a trial's frames and those interleaved with them decide it."""
        if self.adapt is None or self.replan is None:
            return
        with self.lock:
            trial, running = self.trial, self.runner
        if trial is not None:
            if runner is trial.runner or runner is running:
                trial.record(runner is trial.runner, timing.latency)
            if runner is trial.runner and self._quiet(timing):  # its own level, beside the running plan's
                trial.samples.append(self.adapt.samples(trial.plan, timing))
            if trial.decided:
                self._decide(trial)
            return
        if runner is not running or not self._quiet(timing):
            return
        if not self._reserve_asked:
            self._reserve_asked = True
            self.background(self._reserve, running)
        due = self.adapt.recheck_due(time.perf_counter(), running.plan)  # not under the lock: it predicts plans
        with self.lock:
            recheck = due and self.trial is None and not self._considering
            self._considering = self._considering or recheck
        if recheck:
            self.background(self._recheck)
        changes = self.adapt.observe(runner.plan, timing)
        if changes:
            self.device.events.append({"event": "change", "what": [c.describe() for c in changes],
                                       "at": time.perf_counter()})
            if not self.adapt.matters(changes):  # too small to make another plan better by the margin
                return
            # the running plan no slower (a link faster, a server it leaves idle slower): the search need not
            # take the frames' CPU
            self._consider(", ".join(c.describe() for c in changes), gentle=not self.adapt.worse)
        elif self.adapt.slowed is not None:  # the frames slowed and no rate moved: the plans on the servers
            why = f"its frames {self.adapt.slowed:.2f}x slower, no rate moved"
            self.device.events.append({"event": "change", "what": [why], "at": time.perf_counter()})
            self._consider(why, search=False)

    def _recheck(self) -> None:
        """Live adaptation's periodic look at the antennas (`Adaptation.recheck`), beside the frames; where one
        reads faster, a search that need not hurry (the running plan got no slower); one line."""
        found, began = None, time.perf_counter()
        try:
            found = self.adapt.recheck()
        except Exception as err:  # noqa: BLE001 - a bug: one line, never silent, and the run goes on
            self.device.log(f"adapt: the antennas could not be probed again: {_described(err)}")
        # an event, not a line, whatever it found: the JSON log says what the rechecks cost the frames beside them
        self.device.events.append({"event": "recheck", "found": found, "at": began,
                                   "seconds": time.perf_counter() - began})
        with self.lock:
            self._considering = False
        if found is None:
            self._next()
            return
        self.device.log(f"adapt: the antennas probed again: {found}")
        self._consider(found, gentle=True)

    def _reserve(self, running) -> None:
        """Put live adaptation's reserve on the servers (`Adaptation.reserve`: the best plan without the server
        the running plan gives the most work), beside the frames, which measure nothing meanwhile; one line."""
        with self.lock:
            down = set(self.down)
        try:
            found = self.adapt.reserve(running.plan, down)
            if found is None:
                return
            plan, without = found
            with self.device.uploads.busy():
                runner = self.make(plan)
        except Exception as err:  # noqa: BLE001 - a UserError (ServerError, NoRoom) or a bug: one line, never silent
            what = _described(err)
            self.device.log(f"adapt: no reserve: {what}")
            return
        self.reserves.append(runner)  # its models stay on the servers for the run (held ones too: one more user)
        self.adapt.known.append(plan)
        self.device.log(f"adapt: in reserve without {without} (its models on the servers): {plan.brief()}")

    def _quiet(self, timing: FrameTiming) -> bool:
        """Whether the frame just ended (``timing``) ran while this device loaded no model, measured nothing and
        searched for no plan: only such frames measure the network and the servers
        (device.lifecycle.Uploads.quiet_since)."""
        quiet = self.device.uploads.quiet_since()
        return quiet is not None and time.perf_counter() - timing.latency >= quiet

    def _consider(self, why: str, margin: float | None = None, quick: bool = True, gentle: bool = False,
                  back: list[str] | tuple[str, ...] = (), search: bool = True) -> None:
        """Ask live adaptation, in the background (planning and uploads take time; frames go on meanwhile),
        for a better plan than the running one (by ``margin``, default live adaptation's), and put it on trial
        once its models are on the servers. ``gentle``, ``search``: as `Adaptation.candidate`'s."""
        with self.lock:
            if self.trial is not None or self._considering:
                if margin == -math.inf:  # servers back: tried once the trial under way is decided
                    self._joins_waiting = sorted({*self._joins_waiting, *back})
                elif self._considering and search:  # the rates moved under the search: else nothing would look
                    self._changes_waiting = why  # again (the frames alone slower: the search under way covers it)
                return
            self._considering = True
            running, down = self.runner, set(self.down)
        self.background(self._propose, running, down, why, margin, quick, gentle, back, search)

    def _next(self) -> None:
        """A trial was decided (or none made): the servers that came back meanwhile are tried now, or else the
        rates that changed while the candidate was planned are planned on (a step seen once is not seen again:
        without this a change that came during a search on the rates before it would never be acted on)."""
        with self.lock:
            joins, self._joins_waiting = self._joins_waiting, []
            change, self._changes_waiting = self._changes_waiting, None
        if joins:  # planned on the current rates: the change is covered too
            self._consider(f"{', '.join(joins)} back", margin=-math.inf, gentle=True, back=joins)
        elif change is not None:
            self._consider(change)

    def _propose(self, running, down: set[str], why: str, margin: float | None, quick: bool = True,
                 gentle: bool = False, back: list[str] | tuple[str, ...] = (), search: bool = True) -> None:
        """`_consider`'s work: the candidate and its runner (None where the running plan stays)."""
        trial = None
        try:
            trial = self.adapt.candidate(running.plan, down, why, margin, quick, gentle, back, search)
            if self.adapt.passed_over:  # the plans on the servers not tried, and why: the JSON log's account
                self.device.events.append({"event": "passed over", "why": why, "plans": list(self.adapt.passed_over),
                                           "at": time.perf_counter()})
            if trial is not None:
                # its models uploaded before any frame runs on it; the frames meanwhile measure nothing: a weak
                # camera cuts and hashes the stage models on its own CPU between the uploads (on the testbed,
                # frames beside that read a link held at 10 Mbit/s as 16x faster, then slower again)
                with self.device.uploads.busy():
                    trial.runner = self.make(trial.plan)
        except Exception as err:  # noqa: BLE001 - a UserError (ServerError, NoRoom) or a bug: one line, never silent
            what = _described(err)
            self.device.log(f"adapt: {why}, but " + (f"could not try {trial.plan.brief()}: {what}" if trial
                                                     else f"no plan: {what}"))
            trial = None
        if trial is None:  # not a line on a change point (on a busy machine they come often, and nothing changes)
            self.device.events.append({"event": "kept", "why": why, "at": time.perf_counter()})
            if margin == -math.inf:  # but servers back and left idle are said (the plan has no work for them)
                self.device.log(f"adapt: {why}, but the plan with them is the running one: {running.plan.brief()}")
        with self.lock:
            self._considering = False
            if trial is not None and self.runner is running:
                self.trial = trial
                return
        if trial is not None:  # the plan changed meanwhile (a failover): this trial is moot
            trial.runner.close()
        self._next()

    def _decide(self, trial: Trial) -> None:
        """Switch to the trial's plan if it measured faster, else give its models back; one line either way."""
        with self.lock:
            if self.trial is not trial:
                return
            self.trial = None
            old, switched = self.runner, trial.faster
            if switched:
                self.runner = trial.runner
        if switched:
            self._serving(trial.runner)
        was, now = old.plan.brief_beside(trial.plan), trial.plan.brief_beside(old.plan)
        if switched:
            self.adapt.known.append(old.plan)  # its models stay on the servers: a way back without uploads
            self.adapt.live.restart(trial.own())  # its samples have a bias of their own, which its trial read
            self.device.events.append({"event": "switch", "from": old.plan.describe(), "to": trial.plan.describe(),
                                       "why": trial.why, "at": time.perf_counter()})
            self.device.log(f"switch: {was} -> {now}: {trial.why}; measured {trial.verdict()}")
        else:
            self.device.log(f"kept {was}: tried {now} ({trial.why}); measured {trial.verdict()}")
            trial.runner.close()
        if trial.cause and switched and self.adapt.settled(trial):
            self.device.log(f"adapt: no search after the switch: {now} measured "
                            f"{statistics.median(trial.tried) * 1e3:.1f} ms, within {self.adapt.margin:.0%} of the "
                            f"{self.adapt.level_before * 1e3:.1f} ms before the change, no rate faster beyond it")
        elif trial.cause:  # a quick trial (a plan already on the servers): now the search for the best, paced
            # where the switch was made (the frames are out of the slow plan) or the change made the running plan
            # no slower (a link read faster): then the search need not hurry. (Hurried after every kept trial, a
            # trial on a noisy change point cost a search that took the camera's CPU from the frames.)
            self._consider(trial.cause, quick=False, gentle=switched or not self.adapt.worse)
        self._next()

    def _abandon(self, runner, exc: ServerError) -> bool:
        """Whether ``runner`` is a trial's: then the trial ends (the frame is run again on the running plan)."""
        with self.lock:
            trial = self.trial
            if trial is None or trial.runner is not runner:
                return False
            self.trial = None
        self.device.log(f"adapt: the trial of {trial.plan.brief()} failed ({exc}); kept the running plan")
        self._next()
        return True

    def waiting_for(self) -> str:
        """What frames in flight wait on, for a give-up message."""
        with self.lock:
            servers = self.runner.plan.servers
            down = sorted(self.down)
        return (f"servers {', '.join(servers)}" if servers else "the device") + (
            f" ({', '.join(down)} down)" if down else "")
