"""Model lifecycle across real processes: `deepco run` unloads what it uploaded when it ends (also on Ctrl-C),
a SIGKILLed device's models go when their lease runs out, and `deepco models` lists and clears models."""

from __future__ import annotations

import contextlib
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from deepco_device.sources import make_pan_zoom_clip
from test_server_support import ROOT, child_env, conv_model, serve_process

from deepco.wire.client import InferenceClient

PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"
SIZE = "64x80"
LEASE = 3.0


def deepco(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepco", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.fixture(scope="module")
def servers():
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(serve_process("--threads", "1", "--model-lease", str(LEASE))) for _ in range(2)]


@pytest.fixture(scope="module")
def setup(servers, tmp_path_factory):
    """(cluster file, exported model, a long clip)."""
    work = tmp_path_factory.mktemp("lifecycle")
    model = work / "resnet18.onnx"
    result = deepco("export", "--model", "resnet18", "--input-size", SIZE, "--output", str(model))
    assert result.returncode == 0, result.stderr
    cluster = work / "cluster.toml"
    lines = ["[device]", "antennas = 1", "bandwidth = 100.0"]
    for i, s in enumerate(servers):
        lines += ["[[servers]]", f'name = "s{i}"', "capacity = 1.0", f'address = "{s.address}"']
    cluster.write_text("\n".join(lines) + "\n")
    clip = make_pan_zoom_clip(PHOTO, work / "clip.avi", frames=400, size=(80, 64))
    return cluster, model, clip


def _loaded(servers) -> list[list[str]]:
    out = []
    for s in servers:
        with InferenceClient(s.address, timeout=5) as c:
            out.append(c.loaded_models())
    return out


def _run_args(setup, frames: int) -> list[str]:
    cluster, model, clip = setup
    return ["run", "--cluster", str(cluster), "--model", str(model), "--input-size", SIZE, "--source", str(clip),
            "--frames", str(frames), "--algorithm", "thread", "--cut", "layer1", "--quiet"]


def _start_run(setup) -> subprocess.Popen:
    """A run of 400 frames that prints a line per frame (read by `_wait_for_frames`)."""
    args = [a for a in _run_args(setup, 400) if a != "--quiet"]
    return subprocess.Popen([sys.executable, "-m", "deepco", *args], cwd=ROOT, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_frames(proc: subprocess.Popen, done: int, timeout: float = 120.0) -> None:
    """Return once the run has printed ``done`` frames: its models are uploaded and, with frames left to
    run, the next ones are in flight. An AssertionError at the deadline or when the run ended first."""
    seen: queue.Queue = queue.Queue()

    def read() -> None:
        count = 0
        for line in proc.stdout:
            count += line.startswith("frame ")
            if count >= done:
                seen.put(True)
                break
        else:
            seen.put(False)

    threading.Thread(target=read, daemon=True).start()
    try:
        assert seen.get(timeout=timeout), proc.stderr.read() if proc.stderr else ""
    except queue.Empty:
        raise AssertionError(f"the run printed no {done} frames within {timeout:g} s") from None


def test_run_unloads_what_it_uploaded(servers, setup) -> None:
    result = deepco(*_run_args(setup, 2))
    assert result.returncode == 0, result.stderr
    assert _loaded(servers) == [[], []]


def test_ctrl_c_still_unloads(servers, setup) -> None:
    proc = _start_run(setup)
    try:
        _wait_for_frames(proc, 2)  # uploaded, and frames in flight
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _loaded(servers) == [[], []]


def test_a_killed_devices_models_go_when_the_lease_ends(servers, setup) -> None:
    proc = _start_run(setup)
    try:
        _wait_for_frames(proc, 1)  # uploaded
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed = time.monotonic()
    assert any(names for names in _loaded(servers))  # left behind by the dead device...
    while any(_loaded(servers)) and time.monotonic() - killed < LEASE + 10:
        time.sleep(0.5)
    assert _loaded(servers) == [[], []]  # ...until its lease ran out
    assert time.monotonic() - killed >= LEASE - 1.0


def test_models_command_lists_and_clears(tmp_path) -> None:
    # servers of its own, without the short lease: between two commands a loaded model must not expire
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(serve_process("--threads", "1")) for _ in range(2)]
        cluster = tmp_path / "cluster.toml"
        cluster.write_text("[device]\nantennas = 1\nbandwidth = 100.0\n" + "".join(
            f'[[servers]]\nname = "s{i}"\ncapacity = 1.0\naddress = "{s.address}"\n' for i, s in enumerate(servers)))
        _models_command_lists_and_clears(servers, cluster)


def _models_command_lists_and_clears(servers, cluster) -> None:
    for s in servers:
        with InferenceClient(s.address) as c:
            c.load_model(conv_model(), "a")
            c.load_model(conv_model(), "a")  # two references: a plain unload would leave it
            c.load_model(conv_model(seed=1), "b")
    listing = deepco("models", "--cluster", str(cluster))
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.count("2 model(s) loaded") == 2 and "refs=2" in listing.stdout
    one = deepco("models", "--cluster", str(cluster), "--unload", "a")
    assert one.returncode == 0 and one.stdout.count("unloaded a") == 2, one.stderr
    assert _loaded(servers) == [["b"], ["b"]]
    missing = deepco("models", "--cluster", str(cluster), "--unload", "nope")
    assert missing.returncode == 2 and "no server" in missing.stderr
    everything = deepco("models", "--cluster", str(cluster), "--all")
    assert everything.returncode == 0, everything.stderr
    assert _loaded(servers) == [[], []]
    assert everything.stdout.strip().splitlines()[-1] == "unloaded 2 model(s) from 2 server(s)"
    again = deepco("models", "--cluster", str(cluster), "--all")  # nothing left: still a line saying so
    assert again.returncode == 0 and again.stdout.strip() == "unloaded 0 model(s) from 2 server(s)", again.stdout


def test_capacity_check_before_setup(servers) -> None:
    from deepco_device.lifecycle import check_capacity

    from deepco.errors import UserError

    with InferenceClient(servers[0].address) as c:
        check_capacity(c, 8)  # `deepco serve`'s default --max-models 8, none loaded
        c.load_model(conv_model(), "occupant")
        try:
            with pytest.raises(UserError, match="1 of its 8 model slots taken"):
                check_capacity(c, 8)
        finally:
            c.unload_model("occupant")


def test_models_names_an_unreachable_server_once(tmp_path) -> None:
    cluster = tmp_path / "gone.toml"
    cluster.write_text('[device]\nantennas = 1\nbandwidth = 10.0\n[[servers]]\nname = "gone"\ncapacity = 1.0\n'
                       'address = "127.0.0.1:9"\n')
    listing = deepco("models", "--cluster", str(cluster), "--timeout", "2")
    assert listing.returncode == 1
    # once from us (gRPC's own details may repeat it, which is its text, not ours)
    assert listing.stdout.startswith("gone: error: server 127.0.0.1:9: UNAVAILABLE"), listing.stdout


def test_models_shows_a_server_named_by_its_address_once(tmp_path) -> None:
    """A cluster file of addresses only names each server by its address: every line shows it once."""
    with serve_process("--threads", "1") as server:
        cluster = tmp_path / "addresses.toml"
        cluster.write_text(f'[[servers]]\naddress = "{server.address}"\n')
        with InferenceClient(server.address) as c:
            c.load_model(conv_model(), "a")
        listing = deepco("models", "--cluster", str(cluster))
        assert listing.returncode == 0, listing.stderr
        assert listing.stdout.splitlines()[0] == f"{server.address}: 1 model(s) loaded"
        everything = deepco("models", "--cluster", str(cluster), "--all")
        assert everything.returncode == 0, everything.stderr
        assert everything.stdout.splitlines() == [f"{server.address}: unloaded a",
                                                  "unloaded 1 model(s) from 1 server(s)"]
    gone = tmp_path / "gone.toml"
    gone.write_text('[[servers]]\naddress = "127.0.0.1:9"\n')
    listing = deepco("models", "--cluster", str(gone), "--timeout", "2")
    assert listing.returncode == 1 and listing.stdout.startswith("error: server 127.0.0.1:9: UNAVAILABLE")
