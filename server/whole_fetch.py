"""Whole models fetched from a peer server instead of crossing the device's radio again (issue 27).

A device that loaded its whole model on server A (RepositoryModelLoad with ``deepco_whole``, server.derived) asks
server B to load it from A: RepositoryModelLoad with ``deepco_whole: true``, ``sha256`` (the model's digest) and
``deepco_peer`` (A's host:port as servers reach it) in place of the file. B then pulls the bytes from A with
DeepcoService.FetchWhole, over the servers' LAN. Both ends distrust the other:

- B dials A only where it may dial at all (server.peers: loopback or ``--peers``; PERMISSION_DENIED before any
  connection), with its own credentials, so A answers it as any client: its token, its certificate's identity.
- A serves only a whole model it holds for the caller's identity, found by its exact digest; any other digest is
  NOT_FOUND, and the message says nothing of what A holds. B says whom it loads the model for (its own caller's
  identity), and A serves only where that is B's identity too (PERMISSION_DENIED otherwise): under mutual TLS a
  device with a certificate of its own cannot have B pull what B's identity holds on A, nor B hand one
  identity's model to another.
- B takes at most the room ``--max-model-bytes`` leaves (a larger size, declared or sent, is RESOURCE_EXHAUSTED),
  counts what it buffers against ``--max-held-bytes`` as it arrives, cuts A off after ``STALL_SECONDS`` without
  a chunk or ``FETCH_SECONDS`` in all (DEADLINE_EXCEEDED), and checks the bytes' SHA-256 before anything parses
  them: bytes other than the digest named are DATA_LOSS (the request was right, what crossed the LAN is not the
  model it names; FAILED_PRECONDITION already means "derived another stage" to the device), and nothing is
  loaded. The bytes then go through `Registry.load_whole`, the very checks and limits of an uploaded whole model.
- Whatever A answers, B answers the device with a status of its own (NOT_FOUND: A does not hold it; else
  UNAVAILABLE naming A's status), and the device sends the bytes itself.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping

import grpc
from deepco_server.budgets import reserve
from deepco_server.dataplane import ServerState
from deepco_server.derived import PEER_PARAMETER, WHOLE_PARAMETER
from deepco_server.errors import (
    Cancelled,
    DeadlineExceeded,
    Kind,
    NotFound,
    ResourceExhausted,
    ServerFault,
    Unavailable,
    invalid,
)
from deepco_server.models import SHA256_HEX, sha256_text

from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire import deepco_service_pb2_grpc as dpb_grpc

log = logging.getLogger("deepco.serve")

CHUNK_BYTES = 1 << 20  # one FetchWhole message: the server's stream window, so a chunk is never held up half-sent
FETCH_SECONDS = 600.0  # a whole fetch at most (1 GiB at 15 MB/s), or the device's own deadline if sooner
STALL_SECONDS = 10.0  # a peer that sends nothing this long is cut off
WATCH_SECONDS = 0.25  # how often the watch looks at the peer's progress and at the device's call


class DataLoss(ServerFault):
    """What a peer sent is not what was asked for (other bytes than the digest named, or another size)."""

    kind = Kind.DATA_LOSS


def fetch_from_load_request(parameters: Mapping[str, object]) -> tuple[str, str] | None:
    """(peer host:port, SHA-256 hex) from a load's ``deepco_peer`` parameter, or None for a load without one;
    INVALID_ARGUMENT for a fetch that is not of a whole model, has a file too, or names no exact digest."""
    peer = parameters.get(PEER_PARAMETER)
    if peer is None:
        return None
    if peer.WhichOneof("parameter_choice") != "string_param":
        raise invalid(f"parameter '{PEER_PARAMETER}' must be a string (the host:port of a server holding the model)")
    whole = parameters.get(WHOLE_PARAMETER)
    if whole is None or whole.WhichOneof("parameter_choice") != "bool_param" or not whole.bool_param:
        raise invalid(f"parameter '{PEER_PARAMETER}' fetches a whole model only: add '{WHOLE_PARAMETER}': true")
    if any(k.startswith("file:") for k in parameters):
        raise invalid(f"a load has either a model file or a '{PEER_PARAMETER}' to fetch it from, not both")
    digest = sha256_text(parameters)
    if not SHA256_HEX.fullmatch(digest):
        raise invalid(f"a load from a peer needs the model's exact 'sha256' (64 hex digits): the peer serves it "
                      f"by digest and this server checks the bytes against it (got {digest[:80]!r})")
    return peer.string_param, digest


def load_from_peer(state: ServerState, name: str, peer: str, sha256: str, owner: str = "",
                   active: Callable[[], bool] = lambda: True, timeout: float | None = None) -> None:
    """Hold as ``owner``'s whole model ``name`` the one of digest ``sha256`` that server ``peer`` holds, fetched
    over the servers' LAN (the module doc); ``active``: whether the device still waits, ``timeout``: its deadline."""
    state.peer_channels.check(peer)  # before anything else: a refused address costs nothing, and is never dialled
    room = state.registry.whole_room(name, sha256, owner)
    if room is None:  # held already under this name: one more reference
        return
    # One chunk and its framing per message: a peer's single oversized message is refused by gRPC unread.
    with state.peer_channels.dialled(peer, CHUNK_BYTES + (64 << 10)) as stub:
        model_bytes = fetch_whole(stub, peer, sha256, room, owner, active, timeout)
    state.registry.load_whole(name, model_bytes, owner)
    log.info("whole model %r (sha256 %s...) fetched from peer %s: %d bytes", name, sha256[:16], peer, len(model_bytes))


def whole_chunks(model_bytes: bytes) -> Iterator[dpb.WholeChunk]:
    """FetchWhole's answer: ``model_bytes`` in chunks, the first saying their size."""
    view = memoryview(model_bytes)
    for start in range(0, max(len(view), 1), CHUNK_BYTES):
        yield dpb.WholeChunk(size=len(view) if start == 0 else 0, data=bytes(view[start:start + CHUNK_BYTES]))


class _Watch:
    """Cancels a fetch whose peer sent nothing for ``stall`` seconds, or whose device went away."""

    def __init__(self, call: grpc.Call, active: Callable[[], bool], stall: float):
        self.call, self.active, self.stall = call, active, stall
        self.last = time.monotonic()
        self.stalled = self.abandoned = False
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="deepco-fetch-watch", daemon=True).start()

    def touch(self) -> None:
        """A chunk came."""
        self.last = time.monotonic()

    def stop(self) -> None:
        """The fetch is over: stop watching."""
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(WATCH_SECONDS):
            self.abandoned = not self.active()
            self.stalled = time.monotonic() - self.last > self.stall
            if self.abandoned or self.stalled:
                self.call.cancel()
                return


def fetch_whole(stub: dpb_grpc.DeepcoServiceStub, peer: str, sha256: str, limit: int, identity: str = "",
                active: Callable[[], bool] = lambda: True, timeout: float | None = None) -> bytes:
    """The bytes of the whole model of digest ``sha256`` from the server ``peer`` (``stub``, dialled as server.peers
    allows), at most ``limit`` of them, for a caller of ``identity``; checked against the digest. See the module
    doc for the refusals."""
    call = stub.FetchWhole(dpb.FetchWholeRequest(sha256=sha256, identity=identity),
                           timeout=FETCH_SECONDS if timeout is None else min(timeout, FETCH_SECONDS))
    watch = _Watch(call, active, STALL_SECONDS)
    pieces: list[bytes] = []
    digest, size, got = hashlib.sha256(), -1, 0
    try:
        for chunk in call:
            watch.touch()
            if size < 0:
                size = chunk.size
                if size > limit:
                    raise ResourceExhausted(f"cannot fetch whole model {sha256[:16]}... from {peer}: it is {size} "
                                            f"bytes and this server's --max-model-bytes leaves room for {limit}")
            got += len(chunk.data)
            if got > size:  # a peer that declared less than it sends is cut off at what it declared
                raise DataLoss(f"peer {peer} sent more than the {size} bytes it declared for {sha256[:16]}...")
            if not reserve(len(chunk.data)):  # what is buffered here counts as a request's bytes would
                raise ResourceExhausted(f"cannot fetch whole model {sha256[:16]}... from {peer} now: the bytes held "
                                        "by admitted calls would pass --max-held-bytes; retry later")
            digest.update(chunk.data)
            pieces.append(chunk.data)
    except grpc.RpcError as exc:
        raise _peer_failure(peer, sha256, exc, watch) from None
    except BaseException:
        call.cancel()
        raise
    finally:
        watch.stop()
    if size < 0 or got != size:
        raise DataLoss(f"peer {peer} sent {got} bytes of the {max(size, 0)} it declared for {sha256[:16]}...")
    if digest.hexdigest() != sha256:
        raise DataLoss(f"peer {peer} sent bytes whose sha256 is {digest.hexdigest()[:16]}..., not the "
                       f"{sha256[:16]}... asked for: refused, nothing loaded")
    return b"".join(pieces)


def _peer_failure(peer: str, sha256: str, exc: grpc.RpcError, watch: _Watch) -> ServerFault:
    """This server's own status for a fetch the peer failed: never the peer's, which would read as this server's
    (a peer's PERMISSION_DENIED is not the device's)."""
    if watch.abandoned:
        return Cancelled(f"the load was cancelled while fetching whole model {sha256[:16]}... from {peer}")
    if watch.stalled:
        return DeadlineExceeded(f"peer {peer} sent nothing for {STALL_SECONDS:g}s while sending whole model "
                                f"{sha256[:16]}...: cut off")
    code = exc.code()
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(f"peer {peer} does not hold whole model {sha256[:16]}... for this server: send the file")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"peer {peer} did not send whole model {sha256[:16]}... in time: cut off")
    return Unavailable(f"cannot fetch whole model {sha256[:16]}... from peer {peer}: it answered {code.name}: "
                       f"{(exc.details() or '')[:200]}")
