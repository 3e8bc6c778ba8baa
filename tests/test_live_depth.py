"""`deepco run` on a live source that drops late frames, without --depth, settles the frames in flight by
measurement (deepco.planning.lean_depth) and says so in one line; with --depth it keeps what it was given.
In-process `deepco run` against an in-process server on loopback, on a small conv net."""

from __future__ import annotations

from pathlib import Path

import pytest
from deepco_server.app import ServeConfig, Server
from test_server_support import conv_model

from deepco.cli import main

PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("live-depth")
    net = folder / "net.onnx"
    net.write_bytes(conv_model(channels=(3, 16, 16, 8), strides=(2, 1, 2)))
    server = Server(ServeConfig(port=0, device="cpu", threads=1))
    cluster = folder / "cluster.toml"
    cluster.write_text(f'[[servers]]\naddress = "{server.address}"\n')
    yield net, cluster
    server.stop(grace=0)


def run(capsys, net: Path, cluster: Path, *flags: str) -> str:
    code = main(["run", "--cluster", str(cluster), "--model", str(net), "--input-size", "64x64", "--source",
                 str(PHOTO), "--algorithm", "offload", "--source-fps", "2000", "--frames", "3000", "--quiet", *flags])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in out + err, err
    return out


def test_a_live_source_settles_its_frames_in_flight_by_measurement(capsys, setup):
    out = run(capsys, *setup)
    lines = [line for line in out.splitlines() if line.startswith("live source: ")]
    assert len(lines) == 1, out
    assert "frame(s) in flight, the fewest that keep the frame rate (measured: 1 in flight" in lines[0]


def test_a_given_depth_is_kept(capsys, setup):
    out = run(capsys, *setup, "--depth", "2")
    assert "live source: " not in out and "2 frame(s) in flight" in out
