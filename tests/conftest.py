"""Shared fixtures. Partition tests: zoo models exported once per session, and ORT runners."""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np
import onnx
import pytest

ORT_SESSIONS_KEPT = 4  # a whole model and the head and tail of the split being checked, and one spare


def _session(model: onnx.ModelProto):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2  # CI has two cores
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """Zoo models exported once for the whole suite (deepco.model_cache), in a folder of its own that every
    child process inherits: an export costs 5-7 s of CPU, and the suite asks for the same few dozens of times."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEEPCO_MODEL_CACHE", str(tmp_path_factory.mktemp("model-cache")))
        yield


@pytest.fixture(scope="session", autouse=True)
def _no_plan_cache_of_the_user(tmp_path_factory):
    """`deepco run` keeps the plans auto settles on in $XDG_CACHE_HOME/deepco (device/plan_cache.py): the suite's
    runs, those that module fixtures start included, never read or write the user's."""
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _a_plan_cache_of_its_own(tmp_path_factory, monkeypatch):
    """Each test, and every `deepco run` process it starts, gets an empty plan cache of its own: no test
    warm-starts from another's plans."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))


@pytest.fixture(scope="session")
def partition_zoo(tmp_path_factory) -> Callable[[str, int, int], tuple[onnx.ModelProto, str]]:
    """(model, path of its .onnx file) for a zoo model, exported once per session.

    ResNets have dynamic height and width, so one export serves every size; EfficientNet-Lite0's
    'SAME' padding depends on the size, so it is exported per size.
    """
    from deepco import zoo

    cache: dict[tuple[str, int, int], tuple[onnx.ModelProto, str]] = {}
    folder = tmp_path_factory.mktemp("partition-zoo")

    def get(name: str, height: int, width: int) -> tuple[onnx.ModelProto, str]:
        key = (name, height, width) if name == "efficientnet-lite0" else (name, 0, 0)
        if key not in cache:
            model = zoo.export(name, height or 224, width or 224)
            path = folder / f"{name}-{key[1]}x{key[2]}.onnx"
            onnx.save(model, str(path))
            cache[key] = (model, str(path))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def partition_ort() -> Callable[[onnx.ModelProto, dict[str, np.ndarray]], list[np.ndarray]]:
    """Run an ONNX model with ONNX Runtime on named inputs (the last few sessions cached by model identity:
    every split makes new head and tail models, and keeping all their sessions held ~10 GB by the end of a
    suite run)."""
    sessions: collections.OrderedDict[int, tuple[onnx.ModelProto, object]] = collections.OrderedDict()

    def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        key = id(model)
        if key in sessions and sessions[key][0] is model:
            sessions.move_to_end(key)
        else:  # the model is kept with its session, so its id cannot be reused while cached
            sessions[key] = (model, _session(model))
            while len(sessions) > ORT_SESSIONS_KEPT:
                sessions.popitem(last=False)
        return sessions[key][1].run(None, feeds)

    return run


@pytest.fixture(scope="session")
def partition_sliced_run(partition_ort):
    """Run a model the partitioned way: head per slice, crop, concatenate, tail; return the tail's outputs."""

    def run(part, cut, boundaries: list[int], image: np.ndarray) -> list[np.ndarray]:
        head, tail = part.split(cut)
        c = part.cut(cut)
        inp = head.graph.input[0].name
        pieces = []
        for s in part.slices(c, boundaries):
            assert s.input_rows[0] % c.stride == 0  # slice starts align to the total stride
            (y,) = partition_ort(head, {inp: image[:, :, s.input_rows[0] : s.input_rows[1]]})
            assert 0 <= s.crop[0] < s.crop[1] <= y.shape[2], (s, y.shape)
            pieces.append(y[:, :, s.crop[0] : s.crop[1]])
        stitched = np.concatenate(pieces, axis=2)
        assert stitched.shape[2] == c.height
        return partition_ort(tail, {tail.graph.input[0].name: stitched})

    return run


def partition_rel_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| relative to the output's scale (max |want|)."""
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


@pytest.fixture(scope="session")
def partition_compare(partition_ort, partition_sliced_run):
    """Assert that the partitioned run equals ORT on the whole model within 1e-4 of the output's scale."""

    def check(model: onnx.ModelProto, part, cut, boundaries: list[int], image: np.ndarray) -> float:
        name = part.graph.input_name
        want = partition_ort(model, {name: image})
        got = partition_sliced_run(part, cut, boundaries, image)
        assert len(got) == len(want)
        err = max(partition_rel_error(g, w) for g, w in zip(got, want, strict=True))
        assert err <= 1e-4, f"cut {part.cut(cut).name} boundaries {boundaries}: relative error {err:g}"
        return err

    return check


@pytest.fixture(scope="module")
def two_servers():
    """Two in-process servers on loopback for one test module, with room for every plan's models (a split in
    stages uploads a model per stage and server)."""
    import contextlib

    from deepco_server.app import ServeConfig, Server

    with contextlib.ExitStack() as stack:
        srvs = [Server(ServeConfig(port=0, device="cpu", threads=1, max_models=64, max_inflight=4)) for _ in range(2)]
        for srv in srvs:
            stack.callback(srv.stop, 0)
        yield srvs


@pytest.fixture(scope="module")
def three_server_processes():
    """Three `deepco serve` processes for one test module (one thread each, room for every plan's models)."""
    import contextlib

    from test_server_support import serve_process

    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(serve_process("--threads", "1", "--max-models", "64")) for _ in range(3)]


@pytest.fixture(scope="module")
def two_servers_cluster(two_servers, tmp_path_factory):
    """A cluster file naming `two_servers` s0 and s1."""
    path = tmp_path_factory.mktemp("cluster") / "cluster.toml"
    path.write_text("".join(f'[[servers]]\nname = "s{i}"\naddress = "{s.address}"\n'
                            for i, s in enumerate(two_servers)))
    return path
