"""`deepco bench --scenario NAME`: the emulated network changes in the middle of a run of `auto`, and the
report says how each phase went and how soon the run adapted.

Scenarios (`CHANGES`):
- ``bandwidth-drop``: every antenna to a tenth of its rate; ``bandwidth-rise``: the reverse (the antennas start
  at a tenth and rise to the full rate);
- ``server-slowdown``: the server that carried the most work in the first phase cut to a quarter of its CPU
  share;
- ``server-join``: the last server of the cluster file is down at the start (the device sets up and calibrates
  on the others) and comes up after the first phase;
- ``contention``: a second device (its own CPU share, the same antennas: one radio cell; `deepco run
  --algorithm auto`), set up on the same servers before the first device starts and then paused, goes on
  streaming after the first phase and runs to the end (`Contention`).

One run of `deepco run --algorithm auto` (live adaptation on) streams the frames of a clip in the testbed's
device namespace, one in flight. Its first frames calibrate (live calibration: they are results too); once
``--phase-frames`` frames after calibration are logged the change is applied, and the run goes on for at least
as many frames again. Then, under each phase's conditions in turn (the change applied, then undone): every
static plan (`STATICS`: local, offload and round-robin side by side on one setup, as `deepco bench` measures
them; after the change also auto's first-phase plan kept fixed, `deepco run --plan`) on ``--static-frames``
frames, and a fresh `deepco run --algorithm auto` (a new setup and calibration) whose frames after calibration
give that phase's reference (the first phase's is the scenario's run itself: a fresh setup under those
conditions). Per phase: auto's p50 and p95 (the first phase's after
calibration), the statics' and the fresh setup's, frames lost (missing, failed or out of order), every output's
error against the whole model; and the frames until adapted: the first frame after the change from which the
p50 of every 10 consecutive frames is at most 15% above the fresh setup's p50 under the new conditions.
``--repeat N`` runs the whole scenario N times on fresh testbeds; the report gives medians.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from deepco.errors import UserError
from deepco.plots import save_figure
from deepco_bench.testbed import ServerSpec, Testbed, TestbedSpec
from deepco_bench.testbed_servers import set_up_servers, shares_for, start_server

SCENARIOS = ("bandwidth-drop", "bandwidth-rise", "server-slowdown", "server-join", "contention")
STATICS = ("local", "offload", "round-robin", "auto-fixed")
ADAPTED_WINDOW = 10  # frames whose p50 must stay ...
ADAPTED_WITHIN = 0.15  # ... at most 15% above the fresh setup's p50 (faster than a fresh setup is adapted too)
# frames beyond the two phases: live calibration's, which come first. At 100 Mbit/s it takes up to ~55; at 10
# Mbit/s (bandwidth-rise's first phase) it took 83-87, which left the phase after the change 33-37 frames of
# its 60 (the run's length is fixed when it starts). A frame is 70-150 ms: the spare room costs seconds.
CALIBRATION_ROOM = 120
FRESH_FRAMES = 20  # a fresh setup's frames after its calibration
POLL = 0.05  # seconds between looks at a run's log (orchestration, not a test: the run goes at its own pace)
PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"


def frames_until_adapted(latencies: list[float], fresh_p50: float) -> int | None:
    """Frames after the change (``latencies``: the second phase's, in order) before the first one from which
    every ``ADAPTED_WINDOW`` consecutive frames have a p50 at most ``ADAPTED_WITHIN`` above ``fresh_p50`` (None:
    never within the phase). A run faster than a fresh setup under the same conditions has adapted: the
    reference is what setting up again would give, not a level to stay near (a fresh setup over a radio cut to
    a tenth spent its 80 frames calibrating at 379 ms while the adapted run ran at 142)."""
    n = len(latencies)
    ok = [statistics.median(latencies[i:i + ADAPTED_WINDOW]) / fresh_p50 - 1 <= ADAPTED_WITHIN
          for i in range(n - ADAPTED_WINDOW + 1)]
    for start in range(len(ok)):
        if all(ok[start:]):
            return start
    return None


def calibration_frames(printed: str) -> int | None:
    """Frames a `deepco run` printed before its plan's announcement (auto: live calibration's), None before it
    was printed."""
    count = 0
    for line in printed.splitlines():
        if "predicted with" in line and "frame(s) in flight" in line:
            return count
        count += line.startswith("frame ")
    return None


def _past_calibration(records: list[dict], printed: str, frames: int) -> bool:
    """Whether a run has logged ``frames`` frames after its calibration's."""
    calibrated = calibration_frames(printed)
    return calibrated is not None and len(records) >= calibrated + frames


def _frames(lines: list[str]) -> list[dict]:
    """The frames' lines of a run's JSON log (not its servers' down and up events)."""
    return [r for x in lines if x.endswith("}") and "frame" in (r := json.loads(x))]


def _logged(log: Path) -> list[dict]:
    """Every frame a run's JSON log holds."""
    return _frames(log.read_text().splitlines()) if log.exists() else []


class Tail:
    """A growing file, read from where the last look ended (whole lines only). Waiting on a run, the bench
    looks every POLL seconds: reading and parsing the whole log each time took 8 ms a look at 180 frames (16%
    of a core), outside every quota, on a machine whose two cores the testbed's quotas nearly fill."""

    def __init__(self, path: Path):
        self.path, self._offset, self.lines = path, 0, []

    def read(self) -> list[str]:
        """Every whole line so far."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                new = f.read()
        except FileNotFoundError:
            return self.lines
        end = new.rfind(b"\n") + 1
        self._offset += end
        self.lines += new[:end].decode().splitlines()
        return self.lines


class Runs:
    """`deepco run`s in one testbed's device namespace: the scenario's run, the statics and the fresh setups."""

    def __init__(self, tb: Testbed, args: argparse.Namespace, cluster: Path, clip: Path, workdir: Path):
        self.tb, self.args, self.cluster, self.clip, self.workdir = tb, args, cluster, clip, workdir

    def start(self, name: str, frames: int, *how: str, group: str | None = None,
              source: Path | None = None) -> tuple[subprocess.Popen, Path]:
        """Start a run ``name`` of ``frames`` frames of ``source`` (default: the clip; ``how``: its plan flags); its
        process and JSON log (its prints go to the log's .out file: a file, not a pipe, so nothing blocks them)."""
        log = self.workdir / f"{name}.jsonl"
        argv = [sys.executable, "-m", "deepco", "run", "--cluster", str(self.cluster), "--model", self.args.model,
                "--input-size", self.args.input_size, "--source", str(source or self.clip), "--frames", str(frames),
                "--depth", "1", "--no-plan-cache", "--json-log", str(log), *how]
        with log.with_suffix(".out").open("w") as printed:
            proc = self.tb.spawn(argv, stdout=printed, stderr=subprocess.STDOUT, group=group)
        return proc, log

    def wait_for(self, proc: subprocess.Popen, log: Path, ready: Callable[[list[dict], str], bool]) -> list[dict]:
        """Poll until ``ready(logged records, printed text)`` or the run ends; the records logged then."""
        deadline = time.monotonic() + self.args.timeout
        logged, out = Tail(log), Tail(log.with_suffix(".out"))
        records: list[dict] = []
        while True:
            seen = len(logged.lines)
            records += _frames(logged.read()[seen:])
            if ready(records, "\n".join(out.read())) or proc.poll() is not None:
                return records
            if time.monotonic() > deadline:
                raise UserError(f"scenario: {log.stem} made no progress within --timeout {self.args.timeout:g} s")
            time.sleep(POLL)

    @staticmethod
    def printed(log: Path) -> str:
        out = log.with_suffix(".out")
        return out.read_text() if out.exists() else ""

    def finish(self, proc: subprocess.Popen, log: Path, stop: bool = False) -> list[dict]:
        """Wait for the run (``stop``: stop it first, as Ctrl-C does); its records. A failed run is an error."""
        if stop and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=self.args.timeout)
        if code not in ((0, 130) if stop else (0,)):
            raise UserError(f"scenario: the run {log.stem} failed (exit {code}): {self.printed(log).strip()[-400:]}")
        return _logged(log)

    def fresh(self, name: str) -> dict:
        """A fresh `deepco run --algorithm auto` (setup and calibration) under the conditions now: p50 and p95 of
        ``FRESH_FRAMES`` frames after its calibration."""
        proc, log = self.start(name, CALIBRATION_ROOM + FRESH_FRAMES, "--algorithm", "auto")
        self.wait_for(proc, log, lambda records, printed: _past_calibration(records, printed, FRESH_FRAMES))
        records = self.finish(proc, log, stop=True)
        calibrated = calibration_frames(self.printed(log))
        # a setup still calibrating when its frames ran out: its frames all count, and the report says so
        return _stats(records[calibrated or 0:]) | {"calibrated": calibrated is not None}

    def static(self, name: str, how: list[str]) -> dict:
        """A static plan on ``--static-frames`` frames (the first two untimed: uploads, first allocations)."""
        proc, log = self.start(name, self.args.static_frames + 2, *how)
        return _stats(self.finish(proc, log)[2:])

    def side_by_side(self, name: str, algorithms: list[str]) -> tuple[dict, float]:
        """``algorithms`` (of local, offload, round-robin) measured by `deepco bench`'s device side on one setup,
        frames interleaved, ``--static-frames`` each (deepco_bench.benchmark); p50 and p95 of each, and the
        physical bound on latency under these conditions as that setup measured them (`benchmark.bound`)."""
        out = self.workdir / f"{name}.json"
        argv = [sys.executable, "-m", "deepco_bench.benchmark", "--cluster", str(self.cluster), "--model",
                self.args.model, "--input-size", self.args.input_size, "--algorithms", ",".join(algorithms),
                "--frames", str(self.args.static_frames), "--fps-frames", "0", "--out", str(out)]
        with (self.workdir / f"{name}.out").open("w") as printed:
            proc = self.tb.spawn(argv, stdout=printed, stderr=subprocess.STDOUT)
        if proc.wait(timeout=self.args.timeout) != 0:
            raise UserError(f"scenario: {name} failed: {(self.workdir / f'{name}.out').read_text().strip()[-400:]}")
        document = json.loads(out.read_text())
        measured = document["algorithms"]
        return {a: {"frames": measured[a]["frames"], "failed": 0, "p50": measured[a]["p50"], "p95": measured[a]["p95"],
                    "max_relative_error": measured[a]["max_relative_error"]} for a in algorithms}, \
            document["bound"]["latency"]


def _stats(records: list[dict]) -> dict:
    latencies = [r["latency"] for r in records if r["error"] is None]
    p50, p95 = np.percentile(latencies, [50, 95]) if latencies else (float("nan"), float("nan"))
    return {"frames": len(records), "failed": sum(r["error"] is not None for r in records), "p50": float(p50),
            "p95": float(p95)}


class Conditions:
    """One scenario's change on a testbed: `begin` sets the first phase's conditions, `change` applies the
    change (returns it in words), `undo` and `redo` switch between the two phases for the statics."""

    def __init__(self, tb: Testbed, args: argparse.Namespace, shares: list[float], servers: list):
        self.tb, self.args, self.shares, self.servers = tb, args, shares, servers

    def begin(self, runs: Runs) -> None:
        """Before the scenario's run starts."""

    def change(self, records: list[dict], runs: Runs) -> str:
        raise NotImplementedError

    def undo(self) -> None:
        raise NotImplementedError

    def redo(self, runs: Runs) -> None:
        raise NotImplementedError


class Bandwidth(Conditions):
    """Every antenna from ``first`` to ``then`` Mbit/s."""

    def __init__(self, *a, first: float, then: float):
        super().__init__(*a)
        self.first, self.then = first, then

    def change(self, records: list[dict], runs: Runs) -> str:
        self.tb.set_antennas(self.then)
        return f"every antenna from {self.first:g} to {self.then:g} Mbit/s"

    def undo(self) -> None:
        self.tb.set_antennas(self.first)

    def redo(self, runs: Runs) -> None:
        self.tb.set_antennas(self.then)


class Slowdown(Conditions):
    """The server that did the most work in the first phase to a quarter of its CPU share."""

    k = 0

    def change(self, records: list[dict], runs: Runs) -> str:
        work: dict[str, float] = {}
        for record in records:
            for s in record["servers"]:
                work[s["name"]] = work.get(s["name"], 0.0) + s["compute"]
        if not work:
            raise UserError("server-slowdown: auto ran no frame on a server in the first phase; nothing to slow down")
        name = max(work, key=work.get)
        self.k = [s.name for s in self.tb.spec.servers].index(name)
        self.redo(runs)
        return f"server {name} (most work) from {self.shares[self.k]:g} to {self.shares[self.k] / 4:g} of a core"

    def undo(self) -> None:
        self.tb.set_server_cpu(self.k, self.shares[self.k])

    def redo(self, runs: Runs) -> None:
        self.tb.set_server_cpu(self.k, self.shares[self.k] / 4)


class Join(Conditions):
    """The last server, down at the start, comes up."""

    def change(self, records: list[dict], runs: Runs) -> str:
        self.redo(runs)
        return f"server {self.tb.spec.servers[-1].name} (down so far) comes up"

    def undo(self) -> None:
        self.tb.stop(self.servers[-1])
        self.servers[-1] = None

    def redo(self, runs: Runs) -> None:
        k = len(self.servers) - 1
        self.servers[k] = start_server(self.tb, k, subprocess.DEVNULL)
        self.tb.set_server_cpu(k, self.shares[k])


class Contention(Conditions):
    """A second device streams to the same servers (and runs on to the end). It sets up (measures, uploads its
    models, calibrates on its frames) before the first device starts, and pauses (SIGSTOP); the change is that
    it goes on (SIGCONT). So the change is a step of load on the servers, as when a second camera starts
    streaming: its own half minute of start-up on a tenth of a core (imports, measurements, uploads, trial
    plans) is not part of the change, which it would otherwise spread over hundreds of the first device's
    frames as a moving load that no reference measures."""

    second: subprocess.Popen | None = None

    def begin(self, runs: Runs) -> None:
        self._start(runs, frames=5)
        self.second.send_signal(signal.SIGSTOP)

    def change(self, records: list[dict], runs: Runs) -> str:
        self.second.send_signal(signal.SIGCONT)
        return "a second device (set up before the first, then paused) streams to the same servers"

    def undo(self) -> None:
        if self.second is not None:
            self.tb.stop(self.second)
            self.second = None

    def redo(self, runs: Runs) -> None:
        """The second device again, until it has calibrated (its plan is what it loads the servers with)."""
        self._start(runs)

    def _start(self, runs: Runs, frames: int = 0) -> None:
        """Start the second device (a photo as its source: repeated, no end) and wait until it has run
        ``frames`` frames after its calibration."""
        self.second, log = runs.start("second-device", 100_000, "--algorithm", "auto", "--quiet",
                                      group=self.tb.add_device("2"), source=PHOTO)
        runs.wait_for(self.second, log, lambda records, printed: _past_calibration(records, printed, frames))
        if self.second.poll() is not None:
            raise UserError(f"scenario: the second device ended: {runs.printed(log).strip()[-400:]}")


CHANGES: dict[str, type[Conditions]] = {"bandwidth-drop": Bandwidth, "bandwidth-rise": Bandwidth,
                                        "server-slowdown": Slowdown, "server-join": Join, "contention": Contention}


def frame_errors(saved_npz: Path, model: str, size: str) -> list[float]:
    """Each saved frame's relative error against the whole model (ONNX Runtime) on its saved input: the worst
    of its outputs, each judged on its own scale (a detector's heads); NaN for a failed frame."""
    import onnxruntime as ort
    from deepco_device.answers import relative_error
    from deepco_device.run_report import saved_key

    from deepco.parsing import parse_size
    from deepco.partition import load_model

    saved = np.load(saved_npz)
    height, width = parse_size(size)
    session = ort.InferenceSession(load_model(model, height, width).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    name, names = session.get_inputs()[0].name, [o.name for o in session.get_outputs()]
    out = []
    for i, x in enumerate(saved["inputs"]):
        got = {n: saved[saved_key(n, len(names))][i:i + 1] for n in names}
        want = dict(zip(names, session.run(None, {name: x[None].astype(np.float32)}), strict=True))
        failed = any(np.isnan(v).any() for v in got.values())
        out.append(float("nan") if failed else relative_error(got, want))
    return out


def _testbed(args: argparse.Namespace, shares: list[float]) -> TestbedSpec:
    full = args.bandwidth
    start = full / 10 if args.scenario == "bandwidth-rise" else full
    return TestbedSpec(antenna_mbps=(start,) * args.antennas,
                       servers=tuple(ServerSpec(f"s{k}", cpu) for k, cpu in enumerate(shares)),
                       device_cpu=args.device_share, mtu=args.mtu)


def _conditions(tb: Testbed, args: argparse.Namespace, shares: list[float], servers: list) -> Conditions:
    kind = CHANGES[args.scenario]
    if kind is Bandwidth:
        first = tb.spec.antenna_mbps[0]
        then = first * 10 if args.scenario == "bandwidth-rise" else first / 10
        return Bandwidth(tb, args, shares, servers, first=first, then=then)
    return kind(tb, args, shares, servers)


def run_scenario(args: argparse.Namespace, workdir: Path) -> dict:
    """One scenario on a fresh testbed (see the module doc): its result as a dict."""
    from deepco_device.sources import make_pan_zoom_clip

    phase = args.phase_frames
    frames = 2 * phase + CALIBRATION_ROOM
    shares = shares_for(args, args.servers)
    clip = make_pan_zoom_clip(PHOTO, workdir / "clip.avi", frames=frames)
    with Testbed(_testbed(args, shares), defer_cpu_limits=True) as tb:
        if not tb.kernel:
            raise UserError(f"--scenario needs the kernel emulation (tc, network namespaces): {tb.reason}")
        print(tb.label, flush=True)
        up = len(shares) - 1 if args.scenario == "server-join" else None
        cluster, servers, _ = set_up_servers(tb, workdir, "scenario", up)
        tb.apply_device_cpu_limit()
        runs = Runs(tb, args, cluster, clip, workdir)
        cond = _conditions(tb, args, shares, servers)
        result = _auto_run(runs, cond, frames)
        result["phases"], result["bound"] = _phases(runs, cond, workdir / "auto-plan.json", result["auto"]["before"])
    after = result["phases"]["after"]
    latencies = [r["latency"] for r in result.pop("records")[result["changed_after"]:] if r["error"] is None]
    result.update({"scenario": args.scenario, "label": tb.label, "phase_frames": phase,
                   "fresh_p50": after["fresh"]["p50"],
                   "frames_until_adapted": frames_until_adapted(latencies, after["fresh"]["p50"])})
    return result


def _auto_run(runs: Runs, cond: Conditions, frames: int) -> dict:
    """The scenario's run of auto: the change applied once ``--phase-frames`` frames after calibration are
    logged; its records, where it changed, and what it lost."""
    args = runs.args
    cond.begin(runs)
    proc, log = runs.start("scenario", frames, "--algorithm", "auto", "--save-outputs",
                           str(runs.workdir / "scenario.npz"), "--save-plan", str(runs.workdir / "auto-plan.json"))
    before = runs.wait_for(proc, log, lambda records, printed: _past_calibration(records, printed, args.phase_frames))
    calibrated = calibration_frames(runs.printed(log))
    if proc.poll() is not None or calibrated is None:
        runs.finish(proc, log)
        raise UserError(f"scenario: the run ended before its first phase: {runs.printed(log).strip()[-400:]}")
    changed = cond.change(before[calibrated:], runs)  # the plan auto settled on, not calibration's trials
    split = len(before)  # the frames logged before the change (the log is written frame by frame)
    print(f"after frame {split - 1}: {changed}", flush=True)
    records = runs.finish(proc, log)
    adapted = _adaptation_lines(runs.printed(log))
    changes = _logged_events(log)
    errors = frame_errors(runs.workdir / "scenario.npz", args.model, args.input_size)
    failed = [r["error"] is not None for r in records]
    return {"change": changed, "calibration_frames": calibrated, "changed_after": split, "records": records,
            "auto": {"before": _stats(records[calibrated:split]), "after": _stats(records[split:])},
            "lost": {"before": sum(failed[:split]), "after": frames - len(records) + sum(failed[split:])},
            "in_order": [r["frame"] for r in records] == list(range(len(records))),
            "max_relative_error": max(errors, default=float("nan")),
            "switches": [a for a in adapted if a["line"].startswith("switch: ")], "adaptation": adapted,
            "change_points": changes, "rechecks": _logged_events(log, "recheck"),
            "latencies": [r["latency"] for r in records]}


def _phases(runs: Runs, cond: Conditions, auto_plan: Path, first: dict) -> tuple[dict, dict[str, float]]:
    """Every static plan and a fresh setup under the second phase's conditions (as the run left them), then
    the statics under the first's (the change undone). The first phase's fresh setup is the scenario's run
    itself (``first``: its frames after calibration, before the change): it set up and calibrated under those
    conditions, with no plan cache; and its plan kept fixed there is what it ran, so `auto-fixed` is measured
    after the change only. That spares two setups of the slow camera a repeat (about 3 of its 11 minutes).
    Also each phase's physical bound on latency (seconds; the statics' setup measured it)."""
    out, bounds = {}, {}
    for phase in ("after", "before"):
        if phase == "before":
            cond.undo()
        out[phase] = {}
        if runs.args.static_frames > 0:  # local, offload (the best server) and round-robin (over the servers up)
            out[phase], bounds[phase] = runs.side_by_side(f"{phase}-statics", list(STATICS[:3]))
            if phase == "after":
                out[phase]["auto-fixed"] = runs.static(f"{phase}-auto-fixed", ["--plan", str(auto_plan)])
        out[phase]["fresh"] = runs.fresh(f"{phase}-fresh") if phase == "after" else first | {
            "calibrated": True, "the_scenario_run": True}
    return out, bounds


ADAPTATION_LINES = ("switch: ", "kept ", "adapt: ", "server ")  # switches, trials kept, joins and downs


def _logged_events(log: Path, event: str = "change") -> list[dict]:
    """The ``event`` records of a run's JSON log, each with the last frame logged before it: live adaptation's
    change points (they print no line), or with ``event="recheck"`` its looks at the antennas (found: what read
    faster, or None; seconds: how long the probes took, beside the frames)."""
    last, found = -1, []
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if "frame" in record:
            last = record["frame"]
        elif record.get("event") == event:
            found.append({"after_frame": last} | {k: v for k, v in record.items() if k not in ("event", "at")})
    return found


def _adaptation_lines(out: str) -> list[dict]:
    """The run's lines about adapting (a switch, a trial that kept the plan, a server back or down, a server back
    that the plan gives no work), each with the last frame reported before it."""
    last, found = -1, []
    for line in out.splitlines():
        if line.startswith("frame ") and ":" in line:
            last = int(line.split()[1].rstrip(":"))
        elif line.startswith(ADAPTATION_LINES):
            found.append({"after_frame": last, "line": line})
    return found


def run_repeats(args: argparse.Namespace, workdir: Path) -> dict:
    """``--repeat`` runs of the scenario (each on a fresh testbed, a zoo model exported once at full speed: the
    device would load it under its CPU share); every run and the medians over them."""
    if not args.model.endswith(".onnx"):
        model = workdir / "model.onnx"
        subprocess.run([sys.executable, "-m", "deepco", "export", "--model", args.model, "--input-size",
                        args.input_size, "--output", str(model)], check=True, capture_output=True)
        args = argparse.Namespace(**{**vars(args), "model": str(model)})
    runs = []
    for k in range(args.repeat):
        print(f"scenario {args.scenario}, repeat {k + 1}/{args.repeat}", flush=True)
        here = workdir / f"repeat-{k}"
        here.mkdir()
        runs.append(run_scenario(args, here))
    return {"scenario": args.scenario, "repeats": len(runs), "median": medians(runs), "runs": runs}


def _median(values: list) -> float | None:
    known = [v for v in values if v is not None and v == v]
    return float(statistics.median(known)) if known else None


def medians(runs: list[dict]) -> dict:
    """Medians over the repeats of every figure the report shows (frames until adapted: None where a run did
    not adapt within its phase, counted as the whole phase)."""
    first = runs[0]
    out: dict = {"fresh_p50": _median([r["fresh_p50"] for r in runs]),
                 "frames_until_adapted": _median([r["frames_until_adapted"] if r["frames_until_adapted"] is not None
                                                  else len(r["latencies"]) - r["changed_after"] for r in runs]),
                 "lost": sum(r["lost"]["before"] + r["lost"]["after"] for r in runs),
                 "in_order": all(r["in_order"] for r in runs),
                 "max_relative_error": max(r["max_relative_error"] for r in runs),
                 "bound": {phase: _median([r.get("bound", {}).get(phase) for r in runs])
                           for phase in ("before", "after")}}
    for phase in ("before", "after"):
        rows = {"auto": [r["auto"][phase] for r in runs]}
        rows |= {name: [r["phases"][phase][name] for r in runs] for name in first["phases"][phase]}
        out[phase] = {name: {"p50": _median([s["p50"] for s in got]), "p95": _median([s["p95"] for s in got])}
                      for name, got in rows.items()}
    return out


def report(result: dict) -> str:
    """The scenario's report, in lines (medians over the repeats)."""
    runs, m = result["runs"], result["median"]
    lines = [runs[0]["label"], f"scenario {result['scenario']}: {runs[0]['change']} (after {runs[0]['changed_after']} "
             f"frames, {runs[0]['calibration_frames']} of them calibration's); medians of {result['repeats']} "
             "repeat(s), ms"]
    for phase in ("before", "after"):
        cells = "  ".join(f"{name} {row['p50'] * 1e3:.1f}/{row['p95'] * 1e3:.1f}" for name, row in m[phase].items()
                          if row["p50"] is not None)
        lines.append(f"{phase:<6} p50/p95: {cells}")
        if m["bound"][phase]:
            lines.append(f"       physical bound {m['bound'][phase] * 1e3:.1f} ms; auto's p50 over it "
                         f"{m[phase]['auto']['p50'] / m['bound'][phase]:.2f}x")
        unfinished = sum(not r["phases"][phase]["fresh"].get("calibrated", True) for r in runs)
        if unfinished:
            lines.append(f"       the fresh setup had not finished calibrating after {CALIBRATION_ROOM + FRESH_FRAMES} "
                         f"frames in {unfinished} of {len(runs)} repeat(s): its p50 there is of every frame it ran")
    short = [(k + 1, r["auto"][side]["frames"]) for k, r in enumerate(runs) for side in ("before", "after")
             if r["auto"][side]["frames"] < r.get("phase_frames", 0)]
    lines += [f"WARNING: repeat {k} has {n} frames on one side of the change, fewer than --phase-frames"
              for k, n in short]
    adapted = [r["frames_until_adapted"] for r in runs]
    lines += [f"frames until adapted: {m['frames_until_adapted']:g} (per repeat: "
              f"{', '.join('not within the phase' if a is None else str(a) for a in adapted)})",
              f"frames lost: {m['lost']}; in order: {m['in_order']}; max relative error {m['max_relative_error']:.1e}"]
    for k, r in enumerate(runs):
        lines += [f"  repeat {k + 1}, after frame {s['after_frame']}: {s['line']}" for s in r["adaptation"]]
        lines += [f"  repeat {k + 1}, after frame {c['after_frame']}: change point: {', '.join(c['what'])}"
                  for c in r.get("change_points", [])]
        rechecks = r.get("rechecks", [])
        if rechecks:
            lines.append(f"  repeat {k + 1}: {len(rechecks)} recheck(s) of the antennas, after frames "
                         f"{', '.join(str(c['after_frame']) for c in rechecks)}; "
                         f"{sum(c['found'] is not None for c in rechecks)} found one faster")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Latency per frame of every repeat; the end of calibration, the change and the switches marked, and the
    fresh setups' p50 in each phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for k, r in enumerate(result["runs"]):
        line, = ax.plot([v * 1e3 for v in r["latencies"]], marker=".", linewidth=0.8, label=f"auto, repeat {k + 1}")
        ax.axvline(r["calibration_frames"] - 0.5, color="grey", linestyle="-.", linewidth=0.8,
                   label="calibration ends" if k == 0 else None)
        ax.axvline(r["changed_after"] - 0.5, color="red", linestyle="--", label=r["change"] if k == 0 else None)
        for j, s in enumerate(r["switches"]):
            ax.axvline(s["after_frame"] + 0.5, color=line.get_color(), linestyle=":",
                       label="switch" if k == 0 and j == 0 else None)
    r = result["runs"][0]
    n, split = len(r["latencies"]), r["changed_after"]
    for phase, (a, b) in (("before", (0, split)), ("after", (split, n))):
        ax.hlines(result["median"][phase]["fresh"]["p50"] * 1e3, a, b, color="black", linewidth=1.2,
                  label="fresh setup p50 in each phase" if phase == "before" else None)
        if result["median"].get("bound", {}).get(phase):
            ax.hlines(result["median"]["bound"][phase] * 1e3, a, b, color="red", linewidth=1.0, linestyle=":",
                      label="physical bound in each phase" if phase == "before" else None)
    # calibration's first frames (uploads, first runs) can be seconds: they would flatten the phases
    phases = [v for r in result["runs"] for v in r["latencies"][r["calibration_frames"]:]]
    top = 1.15 * max(phases, default=0) * 1e3
    clipped = top > 0 and any(v * 1e3 > top for r in result["runs"] for v in r["latencies"])
    if top > 0:
        ax.set_ylim(0, top)
    ax.set_xlabel("frame")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"scenario {result['scenario']} on an EMULATED edge network"
                 + (" (calibration's slowest frames off the top)" if clipped else ""))
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
