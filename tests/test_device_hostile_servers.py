"""Servers that lie or freeze (issue 13, findings 5 and 6): the device checks every answer against the plan,
drops a server that answered wrongly, and ends a run that no longer succeeds with one line and a non-zero
exit, never a traceback or a hang.

The liars are real `deepco serve` processes whose DeepcoService.Run / SplitRun answers are rewritten
(tests/lying_server.py); the frozen server is a real one stopped with SIGSTOP.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from deepco_device.modnn import ModnnRunner
from deepco_device.preprocess import normalise
from deepco_device.session import Device
from deepco_device.sources import make_pan_zoom_clip
from deepco_device.staged import StagedPlanner, StagedRunner
from test_server_support import ROOT, ServeProcess, child_env, serve_process

from deepco.cluster import parse_cluster
from deepco.errors import UserError
from deepco.planning.staged import offload_plan, split_plan
from deepco.wire.client import WrongAnswer

PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"
SIZE = "96x128"
H, W = 96, 128


@contextlib.contextmanager
def lying_server(lie: str, *flags: str) -> Iterator[ServeProcess]:
    """tests/lying_server.py LIE, lying from the start, as a ServeProcess."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "lying_server.py"), lie, "--from-start", "--",
                             "--port", "0", "--threads", "1", *flags], cwd=ROOT,
                            env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        match = re.fullmatch(r"deepco serve: listening on (\S+)\n", lines.get(timeout=30))
        assert match, "the lying server did not start"
        yield ServeProcess(proc, match.group(1))
    finally:
        proc.kill()
        proc.wait(timeout=30)


def cluster_text(servers: list[ServeProcess]) -> str:
    return "[device]\nantennas = 1\nbandwidth = 100.0\n" + "".join(
        f'[[servers]]\nname = "s{i}"\ncapacity = 1.0\naddress = "{s.address}"\n' for i, s in enumerate(servers))


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []  # the frames' lines, not the servers' down and up events
    return [r for line in path.read_text().splitlines() if line.endswith("}") and "frame" in (r := json.loads(line))]


def one_line_error(err: str) -> str:
    """The run's last stderr line, after checking that nothing else went wrong on the way."""
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hostile")


@pytest.fixture(scope="module")
def model(workdir) -> Path:
    out = workdir / "resnet18.onnx"
    subprocess.run([sys.executable, "-m", "deepco", "export", "--model", "resnet18", "--input-size", SIZE,
                    "--output", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def clip(workdir) -> Path:
    return make_pan_zoom_clip(PHOTO, workdir / "clip.avi", frames=200)


def deepco_run(cluster: Path, model: Path, clip: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "deepco", "run", "--cluster", str(cluster), "--model", str(model),
                             "--input-size", SIZE, "--source", str(clip), "--cut", "layer2", "--quiet", *flags],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ---- finding 5: wrong answers -----------------------------------------------------------------------------
@pytest.mark.parametrize("lie", ["shape", "dtype", "rows", "garbage"])
def test_the_only_server_lying_ends_the_run_with_one_line(tmp_path, model, clip, lie):
    with lying_server(lie) as liar:
        cluster = tmp_path / "cluster.toml"
        cluster.write_text(cluster_text([liar]))
        run = deepco_run(cluster, model, clip, "--algorithm", "equal", "--frames", "20", "--max-failed-frames", "2")
        out, err = run.communicate(timeout=60)  # before the fix: a traceback in `finisher`, then a hang
    assert run.returncode == 2, err + out
    line = one_line_error(err)
    assert line.startswith("deepco run: error: gave up after 2 failed frames in a row (--max-failed-frames 2)")
    assert "wrong answer" in line
    assert "down" in out and "answered wrongly" in out
    assert re.search(r"frame 1: ERROR .*wrong answer", out)


def test_a_lying_server_is_dropped_and_every_frame_is_still_exact(tmp_path, model, clip):
    frames = 6
    with contextlib.ExitStack() as stack:
        honest = stack.enter_context(serve_process("--threads", "1"))
        liar = stack.enter_context(lying_server("shape"))
        cluster = tmp_path / "cluster.toml"
        cluster.write_text(cluster_text([honest, liar]))
        log, saved = tmp_path / "log.jsonl", tmp_path / "out.npz"
        run = deepco_run(cluster, model, clip, "--algorithm", "equal", "--frames", str(frames), "--json-log",
                         str(log), "--save-outputs", str(saved))
        out, err = run.communicate(timeout=60)
    assert run.returncode == 0, err + out
    assert "server s1 down" in out and "for good: it answered wrongly" in out
    got = records(log)
    assert [r["frame"] for r in got] == list(range(frames)) and all(r["error"] is None for r in got)
    assert any(s["recovered_from"] == "s1" for s in got[0]["servers"])  # its rows were computed again on s0
    assert all("s1" not in {s["name"] for s in r["servers"]} for r in got[1:])  # ... and it is never asked again
    data = np.load(saved)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    want = np.concatenate([session.run(None, {name: data["inputs"][i:i + 1]})[0] for i in range(frames)])
    assert np.abs(data["outputs"] - want).max() <= 1e-4 * np.abs(want).max()


@pytest.fixture(scope="module")
def mixed():
    """A device over one honest server (s0) and two liars: s1 shifts rows, s2 answers float64."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(serve_process("--threads", "1", "--max-models", "64")),
                   stack.enter_context(lying_server("rows", "--max-models", "64")),
                   stack.enter_context(lying_server("dtype", "--max-models", "64"))]
        data = {"device": {"antennas": 1, "bandwidth": 100.0},
                "servers": [{"name": f"s{i}", "capacity": 1.0, "address": s.address} for i, s in enumerate(servers)]}
        with Device(parse_cluster(data), "resnet18", H, W, log=lambda _: None) as dev:
            dev.setup()  # Profile and Echo: the liars answer those honestly
            yield dev


def pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (1, 3, H, W), dtype=np.uint8)


def reference(dev: Device, px: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(dev.reference_model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: normalise(px, dev.preprocessing)})[0]


@pytest.mark.parametrize(("servers", "tail", "problem"), [
    (["s2"], "offload", r"the output of s2 has data type float64, expected float32"),
    (["s0", "s1"], None, r"the band of s1 starts at row \d+, expected \d+"),
    (["s0", "s1"], "s1", r"the output of s1 starts at row 1, expected 0"),
    (["s0", "s2"], "s2", r"the output of s2 has data type float64, expected float32"),
])
def test_staged_runtime_refuses_wrong_answers(mixed, servers, tail, problem):
    planner = StagedPlanner(mixed)
    if tail == "offload":
        plan = offload_plan(planner.costs, planner.rates(), servers[0])
    else:
        plan = split_plan(planner.costs, planner.rates(), servers, ["layer1", "layer3"], True, tail)
    with pytest.raises(WrongAnswer, match=problem):
        StagedRunner(mixed, plan).run_frame(pixels(0))


def test_staged_run_frames_drops_liars_and_loses_nothing(mixed):
    planner = StagedPlanner(mixed)
    plan = split_plan(planner.costs, planner.rates(), ["s0", "s1", "s2"], ["layer1", "layer3"], True, None)
    frames = [pixels(k) for k in range(3)]
    results = list(StagedRunner(mixed, plan).run_frames(frames, depth=1, replan=lambda down: planner.best(
        exclude=down)))
    assert [r.index for r in results] == [0, 1, 2]
    for r, px in zip(results, frames, strict=True):
        assert r.error is None, r.error
        want = reference(mixed, px)
        assert float(np.abs(r.output - want).max()) / float(np.abs(want).max()) < 1e-4


def test_modnn_runner_refuses_wrong_answers(mixed):
    with pytest.raises(WrongAnswer, match=r"the band of s[12]"):
        ModnnRunner(mixed, "modnn-sa").run_frame(pixels(0))


# ---- no device thread dies silently ------------------------------------------------------------------------
def test_a_failing_source_ends_the_run_with_one_line_after_the_frames_already_in(mixed):
    def frames():
        yield pixels(0)
        raise OSError("camera unplugged")

    runner = StagedRunner(mixed, StagedPlanner(mixed).named("local"))
    results = []
    with pytest.raises(UserError, match=r"^the frame source failed: OSError: camera unplugged$"):
        for result in runner.run_frames(frames()):
            results.append(result)
    assert [r.index for r in results] == [0] and results[0].error is None


def test_a_failing_staged_worker_ends_the_run_with_one_line(mixed, monkeypatch):
    planner = StagedPlanner(mixed)
    runner = StagedRunner(mixed, planner.named("local"))
    monkeypatch.setattr(runner, "run_frame", lambda x: 1 / 0)
    with pytest.raises(UserError, match=r"^the device's frame worker failed: ZeroDivisionError"):
        list(runner.run_frames([pixels(k) for k in range(3)]))


# ---- finding 6: a frozen server ----------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["equal", "offload"])  # a paper plan and an offload, both staged
def test_a_frozen_only_server_ends_the_run_within_the_bound(tmp_path, model, clip, algorithm):
    bound = 2.0
    with serve_process("--threads", "1") as server:
        cluster = tmp_path / "cluster.toml"
        cluster.write_text(cluster_text([server]))
        log = tmp_path / "log.jsonl"
        # paced (EMULATED 100 Mbit/s) so that the run is surely still going when the server freezes
        run = deepco_run(cluster, model, clip, "--algorithm", algorithm, "--frames", "200", "--pace",
                         "--json-log", str(log), "--give-up-after", f"{bound:g}", "--max-failed-frames", "0")
        deadline = time.monotonic() + 60
        while len(records(log)) < 5 and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(server.proc.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            out, err = run.communicate(timeout=60)
            took = time.monotonic() - frozen
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
    assert run.returncode == 2, err + out
    assert len(records(log)) < 200, "the run ended before the freeze: make it longer"
    line = one_line_error(err)
    assert line.startswith(f"deepco run: error: gave up: no frame succeeded for {bound:g} s (--give-up-after "
                           f"{bound:g}); waiting for servers s0"), line
    # the bound, plus a slice's deadline (2 s) in flight and the exit; before the fix: never
    assert took < bound + 6, f"took {took:.1f} s after the freeze"
    print(f"\n{algorithm}: the run stopped {took:.1f} s after its only server froze (--give-up-after {bound:g})")


def test_bad_give_up_bounds_are_refused(tmp_path):
    result = subprocess.run([sys.executable, "-m", "deepco", "run", "--cluster", str(tmp_path / "none.toml"),
                             "--model", "resnet18", "--source", "x.jpg", "--max-failed-frames", "-1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert one_line_error(result.stderr) == "deepco run: error: --max-failed-frames must be >= 0, got -1"
