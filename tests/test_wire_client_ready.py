"""Waiting for a server leaves nothing behind: a wait that times out, or that is abandoned when the channel
closes, keeps no thread polling the channel (grpc.channel_ready_future's poller did, and it printed a
"Channel closed" traceback from its thread once the device closed its channels)."""

from __future__ import annotations

import socket
import sys
import threading
import time

import grpc
import pytest
from deepco_server.app import ServeConfig, Server

from deepco.errors import UserError
from deepco.wire import inference_pb2 as pb
from deepco.wire import inference_pb2_grpc as pb_grpc
from deepco.wire.client import InferenceClient, ServerError
from deepco.wire.security import make_channel


def _refused_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _pollers() -> list[str]:
    """Threads inside gRPC's connectivity poller now."""
    return [str(tid) for tid, frame in sys._current_frames().items()
            if any(f.f_code.co_name == "_poll_connectivity" for f in _stack(frame))]


def _stack(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


def test_a_wait_for_a_server_that_is_down_times_out_in_one_line_and_leaves_no_poller():
    failures: list[BaseException] = []
    old, threading.excepthook = threading.excepthook, lambda args: failures.append(args.exc_value)
    try:
        client = InferenceClient(_refused_address())
        with pytest.raises(ServerError) as err:
            client.wait_ready(timeout=0.5)
        assert "not reachable within 0.5s" in str(err.value)
        assert _pollers() == []
        client.close()
    finally:
        threading.excepthook = old
    assert failures == []


def test_a_wait_for_a_server_that_is_up_answers_ready():
    server = Server(ServeConfig(port=0, device="cpu", threads=1))
    try:
        with InferenceClient(server.address) as client:
            client.wait_ready(timeout=10.0)
            assert _pollers() == []
    finally:
        server.stop(grace=0)


def _ready(channel: grpc.Channel, timeout: float) -> str:
    """'ok', or the status a ServerReady on ``channel`` ended with."""
    try:
        pb_grpc.GRPCInferenceServiceStub(channel).ServerReady(pb.ServerReadyRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        return exc.code().name
    return "ok"


def test_a_new_channel_reaches_a_server_back_on_an_address_another_channel_saw_refused():
    """A server stops and another comes up on its port while an older channel to the port sits in reconnect
    backoff: a channel opened now connects at once (gRPC's shared subchannels answered it with the older
    channel's "Connection refused": a CI run failed on it)."""
    first = Server(ServeConfig(port=0, device="cpu", threads=1))
    address, port = first.address, first.port
    first.stop(0)
    stale = make_channel(address)
    try:
        assert _ready(stale, timeout=2) == "UNAVAILABLE"  # the old channel has seen the port refuse
        second = None
        deadline = time.monotonic() + 10  # gRPC releases a stopped server's port a moment after stop() returns
        while second is None:
            try:
                second = Server(ServeConfig(port=port, device="cpu", threads=1))
            except UserError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        try:
            with make_channel(address) as fresh:
                assert _ready(fresh, timeout=0.2) == "ok"
        finally:
            second.stop(0)
    finally:
        stale.close()



def test_a_stopped_server_closes_the_channels_it_dialled_to_its_peers():
    """A server's channels to its peers are reused across jobs; once it stops they are closed, not left
    retrying a peer that may be gone (in-process servers stopped in a test run leaked them)."""
    peer = Server(ServeConfig(port=0, device="cpu", threads=1))
    server = Server(ServeConfig(port=0, device="cpu", threads=1))
    opened: list[grpc.Channel] = []
    dial = server.state.peer_channels.open_channel
    server.state.peer_channels.open_channel = lambda address, options: opened.append(dial(address, options)) \
        or opened[-1]
    try:
        server.state.peer_channels.checked_stub(peer.address)
        assert len(opened) == 1 and _ready(opened[0], timeout=2) == "ok"
        server.stop(0)
        with pytest.raises(ValueError, match="closed channel"):
            _ready(opened[0], timeout=2)
    finally:
        server.stop(0)
        peer.stop(0)
