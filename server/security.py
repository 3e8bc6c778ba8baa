"""Server-side security of `deepco serve`: TLS / mutual TLS credentials and the shared bearer token.

- ``--tls-cert``/``--tls-key``: the listening port speaks TLS only.
- ``--tls-ca``: mutual TLS: a client must present a certificate signed by that CA, or its handshake fails
  (the client sees UNAVAILABLE).
- ``--token``/``--token-file``: every RPC except the liveness probes (ServerLive, ServerReady and
  grpc.health.v1.Health/Check, which orchestrators call without credentials) must carry the metadata
  ``authorization: Bearer <token>``; none or an ill-formed one is UNAUTHENTICATED, a wrong one
  PERMISSION_DENIED.
- Plain text off loopback: `deepco serve` starts but prints a one-line warning on stderr (see
  :func:`plaintext_warning`); refusing would break the emulated testbeds that bind 0.0.0.0 inside network
  namespaces.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from deepco_server.rpc import refusal

from deepco.errors import UserError
from deepco.wire.security import ChannelSecurity, check_token, read_pem

# Callable without a token: liveness/readiness probes carry no secrets and must work for orchestrators.
# They are unary and answered at once; Health/Watch, a stream that holds a worker thread while open, needs
# the token like every other call (a caller without it must not hold resources).
OPEN_METHODS = frozenset({
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
    "/grpc.health.v1.Health/Check",
})


@dataclass(frozen=True)
class ServerSecurity:
    """TLS files (PEM paths) and the token of a server; all None is plain text without authentication."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None  # set: clients must present a certificate signed by it (mutual TLS)
    token: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise UserError("--tls-cert and --tls-key go together")
        if self.ca is not None and self.cert is None:
            raise UserError("--tls-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.token is not None:
            check_token(self.token, "--token")

    @property
    def tls(self) -> bool:
        """Whether the port speaks TLS."""
        return self.cert is not None

    def credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials for the TLS port (reads the files now, so a bad path fails at start-up)."""
        assert self.cert is not None and self.key is not None
        pair = (read_pem(self.key, "--tls-key"), read_pem(self.cert, "--tls-cert"))
        ca = read_pem(self.ca, "--tls-ca") if self.ca is not None else None
        # gRPC only says "cannot add port" (plus C++ log lines) for a bad file; Python's ssl names the problem.
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            probe.load_cert_chain(self.cert, self.key)
        except ssl.SSLError as exc:
            raise UserError(f"--tls-cert {str(self.cert)!r} / --tls-key {str(self.key)!r}: not a PEM certificate "
                            f"and its matching private key ({exc.reason or exc})") from None
        if self.ca is not None:
            try:
                probe.load_verify_locations(cafile=self.ca)
            except ssl.SSLError as exc:
                raise UserError(f"--tls-ca {str(self.ca)!r}: not PEM CA certificates ({exc.reason or exc})") \
                    from None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def peer_security(self) -> ChannelSecurity:
        """How this server reaches its peers (split jobs' server-to-server channels), assuming they are set up
        like itself: the same token; with mutual TLS, the same CA and its own certificate as the client
        certificate (which must allow clientAuth); with TLS alone, TLS checked against the system's CAs.
        """
        if self.ca is not None:
            return ChannelSecurity(ca=self.ca, cert=self.cert, key=self.key, token=self.token)
        return ChannelSecurity(use_tls=self.tls, token=self.token)


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def plaintext_warning(host: str, security: ServerSecurity) -> str | None:
    """The warning line for a plain-text port reachable from other machines, or None."""
    if security.tls or is_loopback(host):
        return None
    return (f"warning: listening on {host} without TLS: requests, models"
            f"{' and the token' if security.token else ''} cross the network in plain text "
            "(use --tls-cert/--tls-key)")


def client_identity(context: grpc.ServicerContext) -> str:
    """Who is calling, as far as the transport proves it: under mutual TLS, the client certificate's common
    name (``cn:NAME``; its SHA-256 fingerprint ``cert:HEX`` if it has none); otherwise "" (every caller is
    the same client: a token only proves membership of the group that holds it)."""
    auth = context.auth_context() or {}
    names = auth.get("x509_common_name") or []
    if names:
        return "cn:" + names[0].decode(errors="replace")
    pems = auth.get("x509_pem_cert") or []
    if pems:
        return "cert:" + hashlib.sha256(pems[0]).hexdigest()[:32]
    return ""


def sender_identity(context: grpc.ServicerContext) -> str:
    """Who sent a call, for sharing what callers may hold between them: the certificate's identity under
    mutual TLS; "token" for a caller that sent a token (the group that holds it: the token check refused it
    otherwise, where a token is set); else its connection (``ipv4:HOST:PORT``), the most a transport without
    credentials proves."""
    identity = client_identity(context)
    if identity:
        return identity
    if any(key == "authorization" for key, _ in context.invocation_metadata() or ()):
        return "token"
    return "peer:" + context.peer()


def metrics_warning(port: int | None, host: str, token: str | None) -> str | None:
    """The warning line for a metrics endpoint others can reach without a token, or None."""
    if port is None or token is not None or is_loopback(host):
        return None
    return (f"warning: metrics on {host} without --metrics-token: anyone who reaches the port reads the "
            "loaded models' names and the request counts (use --metrics-token, or --metrics-host 127.0.0.1)")


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses every RPC outside OPEN_METHODS unless it carries ``authorization: Bearer <token>``."""

    def __init__(self, token: str):
        self._token = check_token(token, "--token").encode()

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        """The method's handler, or one that refuses the call."""
        if details.method in OPEN_METHODS:
            return continuation(details)
        values = [v for k, v in details.invocation_metadata or () if k == "authorization"]
        if not values:
            return refusal(continuation(details), grpc.StatusCode.UNAUTHENTICATED,
                           "missing token: send metadata 'authorization: Bearer <token>'")
        scheme, _, given = (values[0] if isinstance(values[0], str) else "").partition(" ")
        if len(values) != 1 or scheme.lower() != "bearer" or not given:
            return refusal(continuation(details), grpc.StatusCode.UNAUTHENTICATED,
                           "ill-formed authorization metadata: expected one 'Bearer <token>'")
        # compare_digest: the time taken does not tell an attacker how much of the token was right
        if not hmac.compare_digest(given.strip().encode(), self._token):
            return refusal(continuation(details), grpc.StatusCode.PERMISSION_DENIED, "wrong token")
        return continuation(details)
