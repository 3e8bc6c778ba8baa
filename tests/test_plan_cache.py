"""The plan cache (device/plan_cache.py): a cold `deepco run` calibrates on its first live frames, every one of
them a result, and keeps the plan it settles on; a warm one, with the same key, runs its first frame on that
plan without measuring or calibrating. `deepco run` in-process against in-process servers with ids of their
own on loopback, on a small conv net (a cold start uploads every plan it times: kilobytes here)."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from deepco_server.app import ServeConfig, Server, default_server_id
from test_server_support import conv_model

from deepco.cli import main
from deepco.errors import UserError
from deepco.wire.client import InferenceClient

PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"
# enough for calibration to settle on this net: it took 30 frames in each of 12 cold starts beside four busy
# loops, and a runoff of two close plans takes 12 more, a longer one 12 again (a CI run ran out at 40)
FRAMES = 80
SHORT = 4  # one on the device while the whole model is on its way (maybe), a warm-up and two timed frames: calibration
# logs its first plan, then the source ends


@pytest.fixture(scope="module")
def net(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan-cache") / "net.onnx"
    path.write_bytes(conv_model(channels=(3, 16, 16, 16, 16, 8), strides=(2, 1, 2, 1)))
    return path


@contextlib.contextmanager
def serving(server_id: str, port: int = 0) -> Iterator[Server]:
    server = Server(ServeConfig(port=port, device="cpu", threads=1, server_id=server_id))
    try:
        yield server
    finally:
        server.stop(grace=0)


def cluster_of(path: Path, *servers: Server) -> Path:
    path.write_text("".join(f'[[servers]]\naddress = "{s.address}"\n' for s in servers))
    return path


def run(capsys, cluster: Path, net: Path, *flags: str, frames: int = FRAMES, size: str = "64x64") -> str:
    """`deepco run`'s stdout; it must succeed, without a traceback."""
    code = main(["run", "--cluster", str(cluster), "--model", str(net), "--input-size", size, "--source", str(PHOTO),
                 "--frames", str(frames), "--quiet", *flags])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in out + err, err
    return out


def exact(net: Path, saved: Path, frames: int) -> None:
    """Every frame has an output, and it equals ONNX Runtime on the whole net (1e-4 of its scale)."""
    data = np.load(saved)
    assert data["outputs"].shape[0] == data["inputs"].shape[0] == frames
    session = ort.InferenceSession(str(net), providers=["CPUExecutionProvider"])
    want = np.concatenate([session.run(None, {"input": x[None]})[0] for x in data["inputs"]])
    assert np.abs(data["outputs"] - want).max() <= 1e-4 * np.abs(want).max()


def plan_line(out: str) -> str:
    """The `plan:` line's plan and prediction (without the bytes sent so far)."""
    return next(line for line in out.splitlines() if line.startswith("plan: ")).split(" ms, ")[0]


def sent_mb(out: str) -> float:
    return float(re.search(r"; ([\d.]+) MB sent to the servers so far", out).group(1))


def test_a_warm_start_runs_the_cached_plan_without_measuring_or_calibrating(capsys, net, tmp_path):
    folder = Path(os.environ["XDG_CACHE_HOME"]) / "deepco"  # the default place (this test's own: conftest.py)
    with serving("box-1") as a, serving("box-2") as b:
        cluster = cluster_of(tmp_path / "cluster.toml", a, b)
        log = tmp_path / "cold.jsonl"
        cold = run(capsys, cluster, net, "--save-outputs", str(tmp_path / "cold.npz"), "--json-log", str(log))
        assert "calibration (planned)" in cold and "warm start" not in cold
        (written,) = folder.glob("plan-*.json")
        assert f"plan cache: wrote {written}" in cold, cold
        # the live frames calibration timed plans on are results like the rest: every frame, in order, exact
        records = [r for line in log.read_text().splitlines() if "frame" in (r := json.loads(line))]  # no events
        assert [r["frame"] for r in records] == list(range(FRAMES)) and all(r["error"] is None for r in records)
        exact(net, tmp_path / "cold.npz", FRAMES)

        warm = run(capsys, cluster, net, "--save-outputs", str(tmp_path / "warm.npz"), frames=4)
        assert f"plan cache: warm start from {written}" in warm
        assert "calibration (" not in warm and "plan cache: wrote" not in warm
        assert plan_line(warm) == plan_line(cold)  # the same plan, predicted the same
        assert sent_mb(warm) == 0.0 < sent_mb(cold)  # no probe, no calibration: nothing sent before the plan
        exact(net, tmp_path / "warm.npz", 4)

        # another input size is another key: calibrated afresh (and nothing written: the source ends first)
        other = run(capsys, cluster, net, frames=SHORT, size="96x96")
        assert "warm start" not in other and "calibration (planned)" in other
        assert "plan cache: nothing written: the source ended before calibration settled" in other

        # --no-plan-cache neither reads the cache (it calibrates) nor writes it (the file is the cold run's)
        before = written.read_bytes(), written.stat().st_mtime_ns
        off = run(capsys, cluster, net, "--no-plan-cache")
        assert "calibration (planned)" in off and "plan cache" not in off
        assert (written.read_bytes(), written.stat().st_mtime_ns) == before and list(folder.iterdir()) == [written]

        # a file that cannot be read, or that another format wrote, or whose fitted antenna factor would divide a
        # rate by zero: one warning line, and the run goes on cold
        zero = json.dumps(json.loads(written.read_text()) | {"links": {"0": 0.0}})
        for content, why in [(written.read_text()[:100], "unreadable"), ('{"format": 999}', "written in format 999"),
                             ("[1, 2]", "unreadable (not a JSON object)"), (zero, "antenna factors")]:
            written.write_text(content)
            out = run(capsys, cluster, net, frames=SHORT)
            warnings = [line for line in out.splitlines() if line.startswith("warning: plan cache")]
            assert len(warnings) == 1 and why in warnings[0] and str(written) in warnings[0], out
            assert "calibration (planned)" in out and "0 failed" in out


def test_a_server_with_another_id_is_a_cache_miss_and_a_restart_with_its_id_is_not(capsys, net, tmp_path):
    cache = tmp_path / "cache"
    with serving("box-1") as server:
        port = server.port
        with InferenceClient(server.address) as c:
            assert c.server_metadata()["deepco_server_id"] == "box-1"
        cluster = cluster_of(tmp_path / "cluster.toml", server)
        cold = run(capsys, cluster, net, "--plan-cache", str(cache))
        assert "plan cache: wrote" in cold, cold
    for server_id, warm in [("box-2", False), ("box-1", True)]:  # the same address, restarted
        with serving(server_id, port):
            out = run(capsys, cluster, net, "--plan-cache", str(cache), frames=SHORT)
        assert ("plan cache: warm start" in out) == warm and ("calibration (" in out) != warm, (server_id, out)
        assert ("reports id 'box-2', not 'box-1' as when it was written; calibrating afresh" in out) != warm, out
    # without --server-id a server's id stays the same across restarts on the same host, port and runtime
    runtime = server.runtime
    assert default_server_id("127.0.0.1", port, runtime) == default_server_id("127.0.0.1", port, runtime)
    assert default_server_id("127.0.0.1", port, runtime) != default_server_id("127.0.0.1", port + 1, runtime)
    with pytest.raises(UserError, match="--server-id must be"):
        ServeConfig(server_id="no spaces")


def test_servers_that_stop_during_live_calibration_lose_no_frame(net, tmp_path):
    """Calibration runs on the run's frames: when the servers stop under it, the frame that failed goes back
    to the source, the run goes on without them, and every frame still gives its exact result, in order."""
    from deepco_device.planner import LiveFrames, StagedPlanner
    from deepco_device.preprocess import IMAGENET, normalise
    from deepco_device.runners import StagedRunner
    from deepco_device.session import Device

    from deepco.cluster import load_cluster

    frames = [np.random.default_rng(k).integers(0, 256, (1, 3, 64, 64), dtype=np.uint8) for k in range(30)]
    servers = [Server(ServeConfig(port=0, device="cpu", threads=1, server_id=f"box-{k}")) for k in range(2)]
    results, stopped_after = [], []

    def emit(result, predicted: float) -> None:
        results.append(result)
        if result.servers and not stopped_after:  # a plan on the servers (offload is always timed): its next
            stopped_after.append(result.index)   # frame fails under calibration's feet
            for server in servers:
                server.stop(grace=0)

    try:
        with Device(load_cluster(cluster_of(tmp_path / "cluster.toml", *servers)), str(net), 64, 64,
                    log=lambda _: None) as dev:
            dev.setup(rows=False)
            live = LiveFrames(iter(frames), emit)
            plan = StagedPlanner(dev).calibrate(live=live)
            assert stopped_after and live.stopped and not live.settled and plan.kind == "local"
            runner = StagedRunner(dev, plan)
            results += runner.run_frames(live.rest(), first=live.taken)
    finally:
        for server in servers:
            server.stop(grace=0)
    assert [r.index for r in results] == list(range(len(frames))) and all(r.error is None for r in results)
    session = ort.InferenceSession(str(net), providers=["CPUExecutionProvider"])
    for r, px in zip(results, frames, strict=True):
        want = session.run(None, {"input": normalise(px, IMAGENET)})[0]
        assert np.abs(r.output - want).max() <= 1e-4 * np.abs(want).max()


def test_the_key_changes_with_the_model_the_size_the_preprocessing_and_the_servers(net, tmp_path):
    """Each part of the key moves the file (a miss: calibrated afresh); the same device gets the same file."""
    from deepco_device.plan_cache import PlanCache, cache_key
    from deepco_device.session import Device

    from deepco.cluster import load_cluster
    from deepco.modelcard import Preprocessing

    other = tmp_path / "other.onnx"  # the same layers, other weights: another model
    other.write_bytes(conv_model(channels=(3, 16, 16, 16, 16, 8), strides=(2, 1, 2, 1), seed=1))
    files = PlanCache(tmp_path / "cache", lambda line: None)
    with serving("box-1") as a, serving("box-2") as b:

        def file(*servers: Server, model: Path = net, size: int = 64, objective: str = "latency", **kw) -> Path:
            cluster = load_cluster(cluster_of(tmp_path / "cluster.toml", *(servers or (a,))))
            with Device(cluster, str(model), size, size, log=lambda line: None, **kw) as dev:
                dev.load()
                return files.path(cache_key(dev, objective))

        base = file()
        assert file() == base
        others = {"model": file(model=other), "input size": file(size=96), "another server": file(b),
                  "a server more": file(a, b), "the servers' order": file(b, a),
                  "objective": file(objective="throughput"),
                  "preprocessing": file(preprocessing=Preprocessing(mean=(0.5, 0.5, 0.5)))}
    assert base not in others.values() and len(set(others.values())) == len(others), others


def test_deepco_plan_calibrates_into_the_cache_that_run_starts_warm_from(capsys, net, tmp_path):
    """`deepco plan --algorithm auto` keeps its calibrated plan where `deepco run` looks (and reads it back);
    with --json its stdout stays one JSON object, the cache's lines going to stderr."""
    cache = tmp_path / "cache"
    with serving("box-1") as a, serving("box-2") as b:
        cluster = cluster_of(tmp_path / "cluster.toml", a, b)
        plan = ["plan", "--cluster", str(cluster), "--model", str(net), "--input-size", "64x64", "--algorithm", "auto"]
        assert main([*plan, "--plan-cache", str(cache), "--json"]) == 0
        out, err = capsys.readouterr()
        cold = json.loads(out)["staged"]
        (written,) = cache.glob("plan-*.json")
        assert f"plan cache: wrote {written}" in err and "calibration (planned)" in err
        assert json.loads(written.read_text())["plan"] == cold  # the plan printed is the plan kept

        assert main([*plan, "--plan-cache", str(cache), "--json"]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["staged"] == cold and f"plan cache: warm start from {written}" in err
        assert "calibration (" not in err

        warm = run(capsys, cluster, net, "--plan-cache", str(cache), frames=4)
        assert f"plan cache: warm start from {written}" in warm and "calibration (" not in warm

        assert main([*plan, "--no-plan-cache"]) == 0
        out, _ = capsys.readouterr()
        assert "calibration (planned)" in out and "plan cache" not in out
    assert list(cache.iterdir()) == [written]


def test_a_warm_start_with_a_server_down_leaves_it_out_as_setup_does(capsys, net, tmp_path):
    """The server the cached plan runs on is down at a restart: the run starts warm all the same (no measuring,
    no calibration), on the best plan without it planned on the cached measurements, exact, and writes
    nothing back. The cached plan is made an offload (this net's calibration may well settle on local)."""
    cache, saved = tmp_path / "cache", tmp_path / "offload.json"
    with serving("box-1") as a, serving("box-2") as b:
        cluster = cluster_of(tmp_path / "cluster.toml", a, b)
        cold = run(capsys, cluster, net, "--plan-cache", str(cache))
        assert "plan cache: wrote" in cold, cold
        assert main(["plan", "--cluster", str(cluster), "--model", str(net), "--input-size", "64x64",
                     "--algorithm", "offload", "--save", str(saved)]) == 0
        capsys.readouterr()
        (written,) = cache.glob("plan-*.json")
        offload = json.loads(saved.read_text())["plan"]
        written.write_text(json.dumps(json.loads(written.read_text()) | {"plan": offload}))
        stopped = a if offload["servers"] == [a.address] else b  # an address-only server is named by its address
        stopped.stop(grace=0)
        out = run(capsys, cluster, net, "--plan-cache", str(cache), "--save-outputs", str(tmp_path / "o.npz"),
                  frames=4)
    down = stopped.address
    assert f"down at start: {down}" in out and f"plan cache: warm start from {written}" in out, out
    assert f"plan cache: the cached plan runs on {down}, down at start: starting on" in out, out
    assert "calibration (" not in out and "plan cache: wrote" not in out, out
    assert json.loads(written.read_text())["plan"] == offload  # not written over
    exact(net, tmp_path / "o.npz", 4)


def test_the_servers_speeds_against_each_other_are_kept_and_an_older_file_without_them_reads_as_none(tmp_path):
    """Calibration's balance (each server's slowness on the model against the others') goes into the cache with
    the compute scale, so that a warm start plans on the rates the cold one settled on; a file written before
    it was kept reads as no balance (the probe's rates as they are)."""
    from deepco_device.measuring import Measurements
    from deepco_device.plan_cache import Cached, PlanCache

    from deepco.planning.staged import StagedPlan

    measured = Measurements({"s0": 2e9, "s1": 4e9}, [1e6, 1e6], paced=False, request_overhead=0.001,
                            device_flops_per_second=1e9, peer_bytes_per_second=1e8, peer_overhead=0.0005,
                            device_seconds_per_byte=1e-9)
    plan = StagedPlan.from_dict({"kind": "local", "servers": [], "predicted": 0.1, "algorithm": "local"})
    key = {"format": 2, "servers": [{"name": "s0", "addresses": ["a:1"], "id": "x"},
                                    {"name": "s1", "addresses": ["b:1"], "id": "y"}], "input_size": [64, 64]}
    cache = PlanCache(tmp_path, lambda line: pytest.fail(line))
    path = cache.store(key, "net.onnx", Cached(plan, measured, 1.5, 0.004, 1.0, {"s0": 0.5, "s1": 2.0}))
    again = cache.load(key)
    assert (again.compute_scale, again.step_overhead, again.balance) == (1.5, 0.004, {"s0": 0.5, "s1": 2.0})
    older = json.loads(path.read_text())
    del older["balance"]
    path.write_text(json.dumps(older))
    assert cache.load(key).balance == {}
