"""The pool of per-antenna channels: one gRPC channel to each server over each antenna, opened on first use."""

from __future__ import annotations

from deepco.cluster import Cluster
from deepco.wire.client import InferenceClient, ServerError
from deepco.wire.security import ChannelSecurity


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
        try:
            return self.client(server, 0).server_ready(timeout=1.0)
        except ServerError:
            return False

    def bytes_sent(self) -> int:
        """Request bytes sent to the servers over every channel opened so far (closed ones not counted)."""
        return sum(c.bytes_sent for c in self._clients.values())

    def close(self) -> None:
        """Close every channel."""
        for c in self._clients.values():
            c.close()
        self._clients.clear()
