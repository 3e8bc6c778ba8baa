"""The models a device uploads: content-addressed names, and unloaded again when the device closes.

A device uploads under :func:`deepco.wire.client.content_name` names, so it only ever shares a model with
byte-identical uploads (the server adds a reference rather than a copy, and refuses other bytes under the
name). What it uploaded it unloads on close, also after Ctrl-C; if it dies without closing, the server's
``--model-lease`` unloads the models once nobody uses them.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
from deepco_device.backpressure import while_busy

from deepco.errors import UserError
from deepco.partition.derive import Dims
from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire.client import InferenceClient, ServerError, content_name_of

UNLOAD_TIMEOUT = 5.0  # per model on close: a frozen server must not hold up the device's exit
DERIVES = "deepco_derive_stages"  # ServerMetadata's extension of a server that derives stage models
PARTS = "deepco_whole_parts"  # ServerMetadata's extension of a server that takes a whole model in parts
MIN_PART_BYTES = 1 << 20  # a whole model smaller than two of these crosses one antenna: parts would only cost calls
SMALL_STAGE = 0.25  # a stage under this share of the whole model is sent at once, not after a whole on its way


@dataclass(frozen=True)
class StageSource:
    """How a server that derives stage models (`deepco serve`, server/derived.py) makes a stage model itself:
    from the device's whole model, held there once, and the stage's description (deepco.StageDescription)."""

    whole: Callable[[], bytes]  # the whole model's bytes (made on first need, then kept by the device)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dims: int  # deepco.partition.derive.Dims
    name: str  # the stage model's graph name
    height: int
    width: int
    open_rows: int = 0  # a segment's open sides (deepco.partition.open_rows.sides_bits)

    def description(self, whole_sha256: str) -> bytes:
        """The serialized description of this stage of the whole model of digest ``whole_sha256``."""
        return dpb.StageDescription(whole_sha256=whole_sha256, inputs=self.inputs, outputs=self.outputs,
                                    dims=self.dims, name=self.name, height=self.height, width=self.width,
                                    open_rows=self.open_rows).SerializeToString()


class NoRoom(UserError):
    """A server refused a model because its model slots (``--max-models``) or bytes (``--max-model-bytes``) are
    taken: the plan that needs it does not fit there now. Not back-pressure, so never waited for."""

    def __init__(self, address: str, problem: str):
        super().__init__(f"server {address}: no room: {problem}")
        self.address = address


def no_room(client: InferenceClient, size: int) -> str | None:
    """Why ``client``'s server cannot take a model of ``size`` bytes now (its slots or bytes are full, as far as
    this client can see: under mutual TLS other identities' models are not listed), or None."""
    meta = client.server_metadata()
    index = client.model_index()
    slots, limit = meta.get("deepco_max_models"), meta.get("deepco_max_model_bytes")
    if slots is not None and len(index) >= int(slots):
        return f"{len(index)} models are loaded and its limit (--max-models) is {slots}"
    if limit is not None:
        held = sum(int(m.reason.split("bytes=", 1)[1].split()[0]) for m in index if "bytes=" in m.reason)
        if held + size > int(limit):
            return f"its models hold {held} bytes, this one needs {size} and its limit (--max-model-bytes) is {limit}"
    return None


def load_with_room(client: InferenceClient, model_bytes: bytes, name: str, sha256: str | None = None,
                   call: Callable[[], None] | None = None) -> None:
    """Load ``model_bytes`` as ``name`` on ``client``'s server, waiting for a busy server (back-pressure) but
    raising `NoRoom` at once when its model slots or bytes are full. ``sha256``: the bytes' digest, where
    known (else computed again). ``call``: the load to make instead of uploading the bytes (a derivation, or
    a whole model to hold), refused for room as an upload of them would be."""

    def load() -> None:
        try:
            if call is not None:
                call()
            else:
                client.load_model(model_bytes, name, sha256=sha256)
        except ServerError as exc:
            if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            why = no_room(client, len(model_bytes))
            if why is not None:
                raise NoRoom(client.address, f"cannot load {name}: {why}") from None
            raise  # back-pressure: while_busy waits and asks again

    while_busy(load)


class Uploads:
    """Models this device loaded on servers, with how many runners use each; unloaded when the last user drops
    them (`drop`) or on :meth:`release`.

    Kept by server (the cluster's name for it), not by address: a device reaches a server at one address per
    antenna (deepco.cluster.Cluster.address_on) and loads a server's models over the antenna its frames take, so
    a model that crossed one antenna is held for a runner that reaches the server over another, and a server's
    models are forgotten, or left alone while it is down, whichever antennas they crossed.

    ``peer_address`` gives the host:port a server reaches another one at, by name (None: unknown), for servers
    that fetch a whole model from a peer (`_fetch_whole`); ``log`` takes the warning when that fails.
    ``routes`` gives a server's channels over the antennas that reach it at distinct addresses, each with its
    share of the bytes (the antenna's measured bandwidth): a whole model crosses them in parts, at once
    (`_send_whole`). The device sets it once it has measured; until then a whole model crosses one antenna."""

    def __init__(self, log: Callable[[str], None] = print,
                 peer_address: Callable[[str], str | None] = lambda server: None,
                 routes: Callable[[str], list[tuple[InferenceClient, float]]] = lambda server: []) -> None:
        self.log, self.peer_address, self.routes = log, peer_address, routes
        self._held: dict[tuple[str, str], tuple[InferenceClient, int]] = {}  # (server, name) -> (client, users)
        # id(bytes) -> (those bytes, their content name): a weak camera hashes a 45 MB model in about a second,
        # which a switch to a plan whose models are already held must not cost (the bytes are kept, so no id is
        # reused while its entry lives)
        self._names: dict[int, tuple[bytes, str]] = {}  # id -> (bytes, SHA-256 hex digest)
        self._wholes: dict[tuple[str, str], InferenceClient] = {}  # (server, name) -> client: whole models held
        self._extensions: dict[str, set[str]] = {}  # server -> its ServerMetadata extensions (asked once)
        # whole model name -> {server: set once the whole model on its way there has landed, or failed}
        self._arriving: dict[str, dict[str, threading.Event]] = {}
        self._unfetchable: set[str] = set()  # servers whose whole model a peer failed to fetch
        self._direct: dict[str, int] = {}  # server -> bytes of stage models uploaded there instead of derived
        self._sent = 0  # bytes sent in model loads (`sent_bytes`)
        self._loading = 0  # model loads and measurements under way (`quiet_since`)
        # the servers the running plan's frames use: a whole model is fetched from a peer outside them if one
        # holds it (a 45 MB send took a 0.45-core server's frames from 80 ms to 1.3 s)
        self.serving: set[str] = set()
        self._quiet_since = 0.0  # perf_counter when the last one ended
        self._lock = threading.Lock()

    def digest(self, model_bytes: bytes) -> str:
        """The SHA-256 (hex) of ``model_bytes``, computed once per bytes object."""
        with self._lock:
            known = self._names.get(id(model_bytes))
        if known is not None and known[0] is model_bytes:
            return known[1]
        digest = hashlib.sha256(model_bytes).hexdigest()
        with self._lock:
            self._names[id(model_bytes)] = (model_bytes, digest)
        return digest

    def name_of(self, model_bytes: bytes, base: str) -> str:
        """The content-addressed name ``model_bytes`` are uploaded under (as `content_name`, hashed once)."""
        return content_name_of(base, self.digest(model_bytes))

    def holds(self, server: str, model_bytes: bytes, base: str) -> bool:
        """Whether this device holds ``model_bytes`` loaded on ``server`` (a runner that needs them there uploads
        nothing)."""
        name = self.name_of(model_bytes, base)
        with self._lock:
            return (server, name) in self._held

    def upload(self, server: str, client: InferenceClient, model_bytes: bytes, base: str,
               source: StageSource | None = None) -> str:
        """Load ``model_bytes`` on ``server`` through ``client`` (one of its antennas' channels) under a
        content-addressed name from ``base``; the name.
        Each call is one more user of the model (`drop` gives it back). A model this device already holds
        there is not loaded again (a replan then costs no call to a server that may be frozen); after `forget`
        it is. With a ``source``, a server that derives stage models makes it itself from the whole model
        (sent there once, when that pays: `_derive`) and the stage's description, else the bytes are uploaded.
        A server without room for it raises `NoRoom` at once; a busy one is waited for."""
        name = self.name_of(model_bytes, base)
        key = (server, name)
        with self._lock:
            if key in self._held:
                self._held[key] = (self._held[key][0], self._held[key][1] + 1)
                return name

        if source is None or not self._derives(server, client) or \
                not self._derive(server, client, model_bytes, name, base, source):
            self._send(client, model_bytes, name, len(model_bytes))  # the server checks the digest
        with self._lock:
            users = self._held.get(key, (client, 0))[1]
            self._held[key] = (client, users + 1)
        return name

    @property
    def sent_bytes(self) -> int:
        """Bytes this device sent in model loads so far (uploaded models, whole models, stage descriptions)."""
        with self._lock:
            return self._sent

    def quiet_since(self) -> float | None:
        """When (time.perf_counter) this device's last model load or measurement (`busy`) ended; None while one
        is under way. A frame that overlapped one shared the antennas and the device's CPU with it: its times
        measure this device's own work, not the network (live adaptation once read a trial's upload over an 8
        Mbit/s radio as the antennas 3.2x slower, and a joining server's measurement as an antenna 7.8x slower)."""
        with self._lock:
            return None if self._loading else self._quiet_since

    @contextmanager
    def busy(self) -> Iterator[None]:
        """While this runs, frames measure nothing (`quiet_since`): a measurement of a server or an antenna
        beside the live frames."""
        with self._lock:
            self._loading += 1
        try:
            yield
        finally:
            with self._lock:
                self._loading -= 1
                self._quiet_since = time.perf_counter()

    def _send(self, client: InferenceClient, model_bytes: bytes, name: str, nbytes: int,
              call: Callable[[], None] | None = None) -> None:
        """`load_with_room`, counting the ``nbytes`` each try sends and the time it is under way."""

        def counted() -> None:
            with self._lock:
                self._sent += nbytes
            with self.busy():
                if call is not None:
                    call()
                else:
                    client.load_model(model_bytes, name, sha256=self.digest(model_bytes))

        load_with_room(client, model_bytes, name, call=counted)

    def _derives(self, server: str, client: InferenceClient) -> bool:
        """Whether ``server`` derives stage models (asked through ``client`` once, and again after `forget`)."""
        return DERIVES in self._extensions_of(server, client)

    def _extensions_of(self, server: str, client: InferenceClient) -> set[str]:
        """``server``'s ServerMetadata extensions, asked through ``client`` once (and again after `forget`)."""
        with self._lock:
            known = self._extensions.get(server)
        if known is None:
            known = set(while_busy(client.server_metadata)["extensions"])
            with self._lock:
                self._extensions[server] = known
        return known

    def _derive(self, server: str, client: InferenceClient, model_bytes: bytes, name: str, base: str,
                source: StageSource) -> bool:
        """Have ``server`` (through ``client``) derive the stage ``source`` describes as ``name``, holding the
        whole model there first if it does not yet; False where it cannot (no room for the whole model, or its
        stage differs from ``model_bytes``), or where it does not pay yet: then the caller uploads the stage.

        The whole model is sent to a server only once the stage models uploaded there would outweigh it (or
        for an offload, whose model it is): a cold setup that needs only a prefix of a ResNet's weights on a
        server (its last blocks are most of them) would otherwise send more, not less; so a server never gets
        more than twice the bytes the cheaper of the two ways would have sent it (a ski rental). Where another
        server holds the whole model already, it is fetched from there at once (`_fetch_whole`): that costs the
        radio nothing; if that fails, the ski rental decides again."""
        whole = source.whole()
        whole_digest = self.digest(whole)
        whole_key = (server, content_name_of(f"{base}-whole", whole_digest))
        with self._lock:
            uploaded = self._direct.get(server, 0) + len(model_bytes)
            renting = whole_key not in self._wholes and source.dims != Dims.WHOLE and uploaded <= len(whole)
            # a whole model on its way to a server is as good as held, but for a stage small enough to send now
            coming = bool(self._arriving.get(whole_key[1])) and len(model_bytes) >= SMALL_STAGE * len(whole)
            if renting and self._holder(whole_key[1], server) is None and not coming:
                self._direct[server] = uploaded
                return False
        description = source.description(whole_digest)
        digest = self.digest(model_bytes)
        for _ in range(2):  # a second time after the server lost the whole model (its lease, a restart)
            try:
                # renting: a fetch costs the radio nothing, sending the whole model does not pay yet
                if not self._hold_whole(server, client, whole, whole_key[1], whole_digest, send=not renting):
                    with self._lock:
                        self._direct[server] = uploaded
                    return False
            except NoRoom:
                return False
            try:
                self._send(client, model_bytes, name, len(description),
                           call=lambda: client.derive_model(description, name, sha256=digest))
                return True
            except ServerError as exc:
                if exc.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                    # the server's extraction differs from this device's, or it cannot make this stage (another
                    # version of the partition code): upload the stage itself
                    return False
                if exc.code != grpc.StatusCode.NOT_FOUND:
                    raise
                with self._lock:
                    self._wholes.pop(whole_key, None)
        return False

    def hold_whole(self, server: str, client: InferenceClient, whole: bytes, base: str) -> None:
        """Have ``server`` (through ``client``) hold the whole model ``whole`` for the stage models it will derive
        (nothing where it derives none): fetched from a peer holding it, or one on its way there, else sent, in
        parts over its antennas. A cold start sends it while the device plans (device.runners.send_whole_early)."""
        if self._derives(server, client):
            digest = self.digest(whole)
            self._hold_whole(server, client, whole, content_name_of(f"{base}-whole", digest), digest)

    def _hold_whole(self, server: str, client: InferenceClient, whole: bytes, name: str, digest: str,
                    send: bool = True) -> bool:
        """Whether ``server`` holds whole model ``name`` once this returns: it does already; or it is fetched from
        a peer that does, after waiting for one on its way to another server (the radio carries it once); or,
        where ``send``, it is sent (`_send_whole`). Several servers asking at once: one is sent it, the others
        fetch it from there."""
        key = (server, name)
        while True:
            with self._lock:
                if key in self._wholes:
                    return True
                arriving = self._arriving.setdefault(name, {})
                waiting = arriving.get(server) or next(iter(arriving.values()), None)
                if waiting is None:
                    done = arriving[server] = threading.Event()
                    break
            waiting.wait()
        try:
            if not self._fetch_whole(client, whole, name, digest, server):
                if not send:
                    return False
                self._send_whole(server, client, whole, name, digest)
            with self._lock:
                self._wholes[key] = client
            return True
        finally:
            with self._lock:
                arriving = self._arriving.get(name, {})
                arriving.pop(server, None)
                if not arriving:
                    self._arriving.pop(name, None)
            done.set()

    def _send_whole(self, server: str, client: InferenceClient, whole: bytes, name: str, digest: str) -> None:
        """Send whole model ``name`` to ``server``: in parts, at once, one over each antenna that reaches it at an
        address of its own (``routes``), each part in proportion to its antenna's bandwidth, where the server takes
        parts; else over ``client``. Two 8 Mbit/s antennas carry a ResNet-18 (45 MB) in ~23 s instead of ~45."""
        def over_one() -> None:
            self._send(client, whole, name, len(whole),
                       call=lambda: client.load_model(whole, name, sha256=digest, whole=True))

        routes = [(c, w) for c, w in self.routes(server) if w > 0]
        if len(routes) < 2 or len(whole) < 2 * MIN_PART_BYTES or PARTS not in self._extensions_of(server, client):
            over_one()
            return
        total, weight, ends, acc = len(whole), sum(w for _, w in routes), [], 0.0
        for _, w in routes:
            acc += w
            ends.append(round(total * acc / weight))
        ends[-1] = total
        view = memoryview(whole)
        parts = [(c, a, b) for (c, _), a, b in zip(routes, [0, *ends[:-1]], ends, strict=True) if b > a]

        def in_parts() -> None:
            with ThreadPoolExecutor(len(parts), thread_name_prefix="deepco-part") as pool:
                futures = [pool.submit(c.load_whole_part, view[a:b], name, digest, a, total) for c, a, b in parts]
            errors = [f.exception() for f in futures if f.exception() is not None]
            if errors:
                raise next((e for e in errors if getattr(e, "code", None) == grpc.StatusCode.RESOURCE_EXHAUSTED),
                           errors[0])

        try:
            self._send(client, whole, name, len(whole), call=in_parts)
        except ServerError as exc:  # an antenna's channel failed: the plan's own antenna carries it all
            self.log(f"warning: whole model to {server} in parts over {len(parts)} antennas failed "
                     f"({exc.code.name}); sending it over one")
            over_one()

    def _fetch_whole(self, client: InferenceClient, whole: bytes, name: str, digest: str, server: str) -> bool:
        """Have ``server`` (through ``client``) fetch the whole model ``name`` from another server this device
        loaded it on, over their LAN rather than this device's radio (`deepco serve`'s ``deepco_peer``,
        server/whole_fetch.py); whether it did. The radio carries only the request. The peer is named by the
        address servers reach it at (``peer_address``: the one split plans give servers for their peers). A fetch
        refused or failed (the peer lost the model, or holds it for another identity; an address outside the
        server's --peers) costs a warning and the bytes are sent; that peer is not asked again. `NoRoom` as for
        an upload."""
        with self._lock:
            holder = self._holder(name, server)
        peer = None if holder is None else self.peer_address(holder)
        if peer is None:
            return False
        try:
            self._send(client, whole, name, len(name) + len(digest) + len(peer),
                       call=lambda: client.fetch_whole_model(name, digest, peer))
        except ServerError as exc:  # NoRoom is no ServerError: it goes up, as for an upload
            with self._lock:
                self._unfetchable.add(holder)
            details = " ".join((exc.details or "").split())[:200]
            self.log(f"warning: server {server} could not fetch the whole model from {holder} ({peer}): "
                     f"{exc.code.name}: {details}; sending the model instead")
            return False
        return True

    def _holder(self, name: str, server: str) -> str | None:
        """A server other than ``server`` this device loaded whole model ``name`` on and that no fetch failed
        from, one the running plan's frames do not use first (`serving`), or None (called with the lock held)."""
        holders = [holder for holder, held in self._wholes if held == name and holder != server
                   and holder not in self._unfetchable]
        return min(holders, key=lambda holder: holder in self.serving, default=None)

    def reload(self, client: InferenceClient, model_bytes: bytes, base: str) -> str:
        """Load ``model_bytes`` again on ``client``'s server, which lost them while this device held them (its
        lease ran out, e.g. while the device was suspended): their users stay as they were. The name."""
        name = self.name_of(model_bytes, base)
        self._send(client, model_bytes, name, len(model_bytes))
        return name

    def drop(self, held: list[tuple[str, str]]) -> list[str]:
        """One user fewer of each (server, name) in ``held`` (a runner's `upload` results); unload the models
        nobody uses any more. Returns one line per model that could not be unloaded."""
        unused = []
        with self._lock:
            for key in held:
                if key not in self._held:
                    continue
                client, users = self._held[key]
                if users > 1:
                    self._held[key] = (client, users - 1)
                else:
                    del self._held[key]
                    unused.append((key[0], client, key[1]))
        return _unload(unused, set())

    def forget(self, server: str) -> None:
        """``server`` lost its models (it restarted): upload them again when asked, and do not unload them on
        release."""
        with self._lock:
            self._held = {k: v for k, v in self._held.items() if k[0] != server}
            self._wholes = {k: v for k, v in self._wholes.items() if k[0] != server}
            self._extensions.pop(server, None)
            self._unfetchable.discard(server)
            self._direct.pop(server, None)

    def names(self) -> set[str]:
        """The names of the models this device holds loaded on servers (whole models held for derivation
        aside)."""
        with self._lock:
            return {name for _, name in self._held}

    def release(self, names: set[str] | None = None, skip: set[str] = frozenset()) -> list[str]:
        """Unload what was uploaded (``names``: only those), each load once, so other devices' references
        stay; returns one line per model that could not be unloaded (its server's lease will). The servers
        named in ``skip`` (known down), and a server once it did not answer, are not asked."""
        with self._lock:
            held = [(k[0], c, k[1]) for k, (c, _) in self._held.items() if names is None or k[1] in names]
            self._held = {k: v for k, v in self._held.items() if names is not None and k[1] not in names}
            if names is None:  # the whole models held for derivation go with the last of their stages
                held = [(k[0], c, k[1]) for k, c in self._wholes.items()] + held
                self._wholes = {}
        return _unload(list(reversed(held)), set(skip))


def _unload(held: list[tuple[str, InferenceClient, str]], silent: set[str]) -> list[str]:
    """Unload each (server, client, name), skipping the servers in ``silent`` and any that stops answering (a
    frozen server would cost a timeout per model, whichever of its antennas' channels asks); one line per model
    not unloaded."""
    problems = []
    for server, client, name in held:
        if server in silent:
            problems.append(f"did not unload {name} from {client.address}: the server is down")
            continue
        try:
            client.unload_model(name, timeout=UNLOAD_TIMEOUT)
        except (UserError, ValueError) as exc:  # gone, refused, or its channel closed: its lease will do
            problems.append(f"could not unload {name} from {client.address}: {exc}")
            if getattr(exc, "code", None) in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                silent.add(server)
    return problems


def check_capacity(client: InferenceClient, needed: int) -> None:
    """Refuse (UserError) before an expensive setup if ``client``'s server has fewer than ``needed`` free
    model slots (`deepco serve --max-models`, from ServerMetadata; models this client can see count as taken,
    so under mutual TLS other identities' models are not counted and the load itself may still be refused)."""
    limit = while_busy(client.server_metadata).get("deepco_max_models")
    if limit is None:
        return
    loaded = while_busy(client.loaded_models)
    if len(loaded) + needed > int(limit):
        raise UserError(f"server {client.address} has {len(loaded)} of its {limit} model slots taken and this "
                        f"device needs {needed}; unload some (`deepco models --cluster FILE --all`) or start it "
                        "with a larger --max-models")
