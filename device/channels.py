"""The pool of per-antenna channels: one gRPC channel to each server over each antenna, opened on first use."""

from __future__ import annotations

import threading
import time

from deepco.cluster import Cluster
from deepco.wire.client import InferenceClient, ServerError
from deepco.wire.security import ChannelSecurity

REACH_SECONDS = 10.0  # how long the start waits for a server when none is ready yet
REACH_GRACE = 2.0  # and for the others once one is: a server that is down delays the start by this much


class Channels:
    """Clients of the cluster's servers, one per (server, antenna)."""

    def __init__(self, cluster: Cluster, security: ChannelSecurity | None = None, timeout: float = 120.0):
        self.cluster, self.security, self.timeout = cluster, security, timeout
        self._clients: dict[tuple[str, int], InferenceClient] = {}
        self._index = {s.name: k for k, s in enumerate(cluster.servers)}

    def client(self, server: int | str, antenna: int) -> InferenceClient:
        """The channel to ``server`` (its index in the cluster, or its name) over ``antenna``."""
        k = self._index[server] if isinstance(server, str) else server
        key = (self.cluster.servers[k].name, antenna)
        if key not in self._clients:
            address = self.cluster.address_on(self.cluster.servers[k], antenna)
            self._clients[key] = InferenceClient(address, timeout=self.timeout, security=self.security)
        return self._clients[key]

    def server_at(self, address: str) -> str | None:
        """The server listening at ``address`` (on any antenna), or None."""
        cluster = self.cluster
        return next((s.name for s in cluster.servers for m in range(len(cluster.device.antennas))
                     if cluster.address_on(s, m) == address), None)

    def ready(self, server: str) -> bool:
        """Whether ``server`` says it is ready (within a second)."""
        return self.not_ready(server) is None

    def reach(self, timeout: float = REACH_SECONDS, grace: float = REACH_GRACE) -> dict[str, str]:
        """Wait for the servers to be ready, all at once: until every one is, or ``grace`` seconds after the
        first one is, or ``timeout`` seconds in all. Returns why each server that is not ready is not (e.g.
        'connection refused'), by name; {} when all are. Servers started together with the device get
        ``grace`` to come up; one that is down delays the start by ``grace``, not ``timeout``."""
        names = [s.name for s in self.cluster.servers]
        clients = {name: self.client(name, 0) for name in names}  # opened here: `client` is not for threads
        reached: set[str] = set()
        changed = threading.Condition()

        def wait(name: str) -> None:  # a thread each: a server that is down waits out ``timeout`` on its own
            try:
                clients[name].wait_ready(timeout)
            except ServerError:
                return
            with changed:
                reached.add(name)
                changed.notify_all()

        for name in names:
            threading.Thread(target=wait, args=(name,), daemon=True, name=f"deepco-reach-{name}").start()
        start = time.monotonic()
        first = None
        with changed:
            while True:
                if first is None and reached:
                    first = time.monotonic()
                end = start + timeout if first is None else min(start + timeout, first + grace)
                if len(reached) == len(names) or time.monotonic() >= end:
                    break
                changed.wait(end - time.monotonic())
        return {name: why for name in names if (why := self.not_ready(name)) is not None}

    def not_ready(self, name: str) -> str | None:
        """None when ``name`` says it is ready, else why not in a few words (the call fails at once on a
        channel that could not connect: its error says why)."""
        try:
            return None if self.client(name, 0).server_ready(timeout=1.0) else "not ready"
        except ServerError as exc:
            details = f"{exc.code.name}: {exc.details}"
            return "connection refused" if "connection refused" in details.lower() else details

    def bytes_sent(self) -> int:
        """Request bytes sent to the servers over every channel opened so far (closed ones not counted)."""
        return sum(c.bytes_sent for c in self._clients.values())

    def close(self) -> None:
        """Close every channel."""
        for c in self._clients.values():
            c.close()
        self._clients.clear()
