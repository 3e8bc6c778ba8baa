"""Client-side channel security for DeepCo's gRPC channels: TLS, mutual TLS and a shared bearer token.

One small value, :class:`ChannelSecurity`, says how to reach a server; :func:`make_channel` turns it into a
gRPC channel. The device, :class:`deepco.wire.client.InferenceClient` and server-to-server (split-job) channels
all use the same two names, so a cluster is secured by handing every party the same settings::

    security = ChannelSecurity(ca="ca.pem", cert="client.pem", key="client.key", token="s3cret")
    channel = make_channel("10.0.0.7:50051", security)

- ``ca`` set: the channel is TLS and the server's certificate must chain to this CA (PEM file or bytes).
  ``use_tls=True`` without ``ca``: TLS checked against the system's CAs. Otherwise the channel is plain
  text, which `deepco serve` only accepts quietly on loopback.
- ``cert`` + ``key``: the client certificate for mutual TLS (servers started with ``--tls-ca``).
- ``token``: sent on every call as gRPC metadata ``authorization: Bearer <token>`` (servers started with
  ``--token``/``--token-file``). It works on plain and TLS channels alike; over plain text it is readable
  on the network, so use it with TLS off loopback.

A client command gets the same flags as `deepco serve` (``--tls-ca``, ``--tls-cert``, ``--tls-key``,
``--token``, ``--token-file``) with :func:`add_arguments` and reads them back with :func:`from_args`.
"""

from __future__ import annotations

import argparse
import collections
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from deepco.errors import UserError
from deepco.wire import GRPC_MESSAGE_OPTIONS

Pem = str | Path | bytes  # a PEM file's path, or the PEM bytes themselves


def read_pem(value: Pem, what: str) -> bytes:
    """The PEM bytes of ``value`` (bytes are taken as they are; a str or Path is a file to read)."""
    if isinstance(value, bytes):
        return value
    try:
        return Path(value).read_bytes()
    except OSError as exc:
        raise UserError(f"{what}: cannot read {str(value)!r}: {exc.strerror}") from None


def _label(value: Pem) -> str:
    return "(bytes)" if isinstance(value, bytes) else repr(str(value))


def read_token_file(path: str | Path) -> str:
    """The token in ``path`` (surrounding whitespace, e.g. the final newline, stripped); empty is an error."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"token file {str(path)!r}: cannot read it: {getattr(exc, 'strerror', None) or exc}") \
            from None
    if not token:
        raise UserError(f"token file {str(path)!r} is empty")
    return token


def check_token(token: str, what: str = "token") -> str:
    """``token`` if it can travel as an HTTP/2 header value (printable ASCII, no spaces), else UserError."""
    if not token or not all(33 <= ord(c) <= 126 for c in token):
        raise UserError(f"{what} must be non-empty printable ASCII without spaces")
    return token


@dataclass(frozen=True)
class ChannelSecurity:
    """How to secure a channel to a DeepCo server; the default (all None) is plain text without a token."""

    ca: Pem | None = None  # CA that signed the server's certificate: TLS on
    cert: Pem | None = None  # client certificate (mutual TLS), with ``key``
    key: Pem | None = None  # client private key
    token: str | None = None  # shared bearer token, sent as ``authorization: Bearer <token>``
    server_name: str | None = None  # TLS name to check instead of the address's host (tests, NAT)
    use_tls: bool = False  # TLS even without ``ca`` (then the system's CAs check the server)

    @property
    def tls(self) -> bool:
        """Whether channels made with these settings use TLS."""
        return self.use_tls or self.ca is not None or self.cert is not None

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC TLS channel credentials (only meaningful when :attr:`tls`)."""
        if (self.cert is None) != (self.key is None):
            raise UserError("a client certificate needs both cert and key")
        ca = read_pem(self.ca, "CA certificate") if self.ca is not None else None
        if ca is not None:
            # gRPC would only fail later, at connect time, as UNAVAILABLE; say what is wrong now.
            try:
                ssl.create_default_context(cadata=ca.decode("ascii", "replace"))
            except (ssl.SSLError, ValueError) as exc:
                raise UserError(f"CA certificate {_label(self.ca)}: not PEM certificates ({exc})") from None
        return grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=read_pem(self.key, "client key") if self.key is not None else None,
            certificate_chain=read_pem(self.cert, "client certificate") if self.cert is not None else None)


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                   "wait_for_ready", "compression")),
               grpc.ClientCallDetails):
    pass


class TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                       grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call of a channel.

    An interceptor rather than call credentials because gRPC only sends call credentials over TLS, and a
    token on a loopback plain-text channel is a legitimate setup (tests, one machine).
    """

    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {check_token(token)}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [m for m in (details.metadata or ()) if m[0] != "authorization"]
        metadata.append(self._header)
        return _Details(details.method, details.timeout, metadata, details.credentials,
                        getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation: Callable, details: grpc.ClientCallDetails, request: Any) -> Any:
        """Unary call with the token."""
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable, details: grpc.ClientCallDetails, request: Any) -> Any:
        """Server-streaming call with the token."""
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable, details: grpc.ClientCallDetails,
                               request_iterator: Any) -> Any:
        """Client-streaming call with the token."""
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation: Callable, details: grpc.ClientCallDetails,
                                request_iterator: Any) -> Any:
        """Bidirectional call with the token."""
        return continuation(self._details(details), request_iterator)


# A channel to a server that is down retries with exponential backoff, by default up to two minutes: a server
# that comes back (or up for the first time) would not be seen for that long. A device probes its down servers
# every half second (device.health), so it reconnects at least every second.
RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                     ("grpc.max_reconnect_backoff_ms", 1000))
# By default gRPC shares one connection (a subchannel) between every channel of a process to the same address,
# with its backoff: a new channel to a server that came back on an address another channel saw refused failed
# at once with that channel's "Connection refused" (a CI run hit it), and two antennas' channels to one server
# would share one TCP connection. Each channel keeps its own.
CHANNEL_OPTIONS = (*RECONNECT_OPTIONS, ("grpc.use_local_subchannel_pool", 1))


def make_channel(address: str, security: ChannelSecurity | None = None,
                 options: Sequence[tuple[str, Any]] = GRPC_MESSAGE_OPTIONS) -> grpc.Channel:
    """A channel to ``address`` secured as ``security`` says (plain text when None), with DeepCo's message
    size options. Close it with ``.close()`` as any gRPC channel."""
    security = security or ChannelSecurity()
    opts = [*options, *CHANNEL_OPTIONS]
    if security.server_name:
        opts.append(("grpc.ssl_target_name_override", security.server_name))
    if security.tls:
        channel = grpc.secure_channel(address, security.credentials(), options=opts)
    else:
        channel = grpc.insecure_channel(address, options=opts)
    if security.token is not None:
        channel = grpc.intercept_channel(channel, TokenInterceptor(security.token))
    return channel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Client-side security flags, named as `deepco serve`'s: --tls-ca, --tls-cert, --tls-key, --token(-file)."""
    group = parser.add_argument_group("channel security (default: plain text, no token)")
    group.add_argument("--tls-ca", type=Path, metavar="PEM", help="CA of the servers' certificates: use TLS")
    group.add_argument("--tls-cert", type=Path, metavar="PEM", help="client certificate, for mutual TLS")
    group.add_argument("--tls-key", type=Path, metavar="PEM", help="private key of --tls-cert")
    token = group.add_mutually_exclusive_group()
    token.add_argument("--token", metavar="TOKEN", help="shared token the servers require (visible in ps: "
                                                        "prefer --token-file)")
    token.add_argument("--token-file", type=Path, metavar="FILE", help="read the shared token from FILE")


def from_args(args: argparse.Namespace) -> ChannelSecurity:
    """The ChannelSecurity the flags of :func:`add_arguments` describe (UserError if they do not fit)."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UserError("--tls-cert and --tls-key go together")
    token = read_token_file(args.token_file) if args.token_file is not None else args.token
    if token is not None:
        check_token(token, "--token")
    return ChannelSecurity(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, token=token)
