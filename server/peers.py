"""The one way `deepco serve` dials another server: which addresses it may dial, and with what credentials.

A server dials peers for split jobs' exchanges (server.split_jobs), link probes (ProbePeer) and whole models
fetched from a peer (server.whole_fetch). Each dial carries this server's own token or client certificate, so a
client must not be able to point them at an address of its choosing: only loopback addresses (servers sharing
this machine) and those listed in ``--peers`` are dialled, and the check comes before any connection is made.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc
from deepco_server.errors import PermissionDenied, invalid
from deepco_server.security import is_loopback

from deepco.parsing import split_address
from deepco.wire import GRPC_MESSAGE_OPTIONS, MAX_MESSAGE_BYTES
from deepco.wire import deepco_service_pb2_grpc as dpb_grpc
from deepco.wire.security import ChannelSecurity, make_channel

MAX_PEER_CHANNELS = 64
MAX_ADDRESS_CHARS = 256
Opener = Callable[[str, Sequence[tuple[str, Any]]], grpc.Channel]  # (address, channel options) -> a channel


def peer_allowed(address: str, allowed: frozenset[str]) -> bool:
    """Whether this server may dial ``address`` (host:port): it is in ``allowed`` (`deepco serve --peers`), or its
    host is a loopback address (servers sharing this machine)."""
    if address in allowed:
        return True
    try:
        host, _ = split_address(address)
    except ValueError:
        return False
    return is_loopback(host)


class PeerChannels:
    """Channels to the peers this server may dial (``allowed`` and loopback), secured by ``security`` (how this
    server's own clients are: server.security.ServerSecurity.peer_security), one per address and reused: a
    frame should not pay a TCP handshake per peer."""

    def __init__(self, allowed: Iterable[str] = (), security: ChannelSecurity | None = None,
                 open_channel: Opener | None = None):
        self.allowed = frozenset(allowed)
        self.security = security if security is not None else ChannelSecurity()
        # public and looked up at each dial, so that a test can see that a refused address is never dialled
        self.open_channel: Opener = open_channel or (lambda address, options: make_channel(address, self.security,
                                                                                           options))
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def check(self, address: str) -> None:
        """INVALID_ARGUMENT for what is not host:port, PERMISSION_DENIED for an address this server may not
        dial; nothing is dialled either way."""
        if not address or len(address) > MAX_ADDRESS_CHARS or ":" not in address:
            raise invalid(f"peer address must be host:port, got {address[:64]!r}")
        if not peer_allowed(address, self.allowed):
            raise PermissionDenied(f"peer {address[:80]!r} is not an allowed peer of this server; start it with "
                                   "--peers listing its peers' host:port (loopback is always allowed)")

    def stub(self, address: str) -> dpb_grpc.DeepcoServiceStub:
        """A stub to the peer at ``address``, checked first (`check`)."""
        self.check(address)
        return self.checked_stub(address)

    def checked_stub(self, address: str) -> dpb_grpc.DeepcoServiceStub:
        """A stub to ``address``, which the caller has checked already (a split job's tables, checked once)."""
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                if len(self._channels) >= MAX_PEER_CHANNELS:
                    self._channels.pop(next(iter(self._channels))).close()
                channel = self._channels[address] = self.open_channel(address, GRPC_MESSAGE_OPTIONS)
            return dpb_grpc.DeepcoServiceStub(channel)

    def close(self) -> None:
        """Close every reused channel (a stopped server keeps no connection to its peers retrying)."""
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()

    @contextlib.contextmanager
    def dialled(self, address: str, max_receive: int) -> Iterator[dpb_grpc.DeepcoServiceStub]:
        """A stub to the peer at ``address`` (checked first) on a channel of its own, closed after, that takes no
        message over ``max_receive`` bytes: what a peer sends then never costs this server more than that before
        it is looked at (the shared channels take a split job's rows, up to 256 MiB a message)."""
        self.check(address)
        channel = self.open_channel(address, [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                              ("grpc.max_receive_message_length", max_receive)])
        try:
            yield dpb_grpc.DeepcoServiceStub(channel)
        finally:
            channel.close()
