"""The one home of request parsing on the server: when a request message is parsed, and what a message that
does not parse becomes.

gRPC Python runs a method's request deserializer on its one polling thread, which also admits every new call:
parsing 8 MiB requests there made readiness probes wait behind them. So server.budgets hands admitted calls
:func:`deferred` deserializers that only wrap the bytes in a :class:`Deferred`, and the message is parsed on
the call's own thread by the first reader: server.metrics.ObservingInterceptor, through :func:`checked_stream`
(which turns a parse failure into INVALID_ARGUMENT, not gRPC's INTERNAL), or else :func:`parsed`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from deepco.wire.tensors import TensorError


class Deferred:
    """A request message received but not parsed yet (see the module doc)."""

    __slots__ = ("data", "parse")

    def __init__(self, data: bytes, parse: Callable[[bytes], Any]):
        self.data, self.parse = data, parse


def deferred(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """A deserializer that only wraps the bytes in a :class:`Deferred` (None stays None: raw bytes)."""
    if deserializer is None:
        return None

    def defer(data: bytes) -> Deferred:
        return Deferred(data, deserializer)

    return defer


class Malformed:
    """What a request that does not parse deserializes to; the behaviour answers INVALID_ARGUMENT."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


class MalformedRequest(TensorError):
    """Raised inside a servicer that iterates a request stream holding a message that does not parse.

    A TensorError, so the servicers' error handling already answers it INVALID_ARGUMENT with its message;
    server.metrics' interceptor makes sure of that status for servicers that let it escape.
    """


def tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserializer``, but a parse failure yields a :class:`Malformed` instead of gRPC's INTERNAL
    "Exception deserializing request!" (the client sent it: that is INVALID_ARGUMENT)."""
    if deserializer is None:
        return None
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    type_name = getattr(descriptor, "full_name", "the request message")

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            return Malformed(f"malformed request: {len(data)} bytes do not parse as {type_name} "
                             f"({type(exc).__name__})")

    return parse


def checked_stream(requests: Iterator[Any], seen: list[str], models: list[str | None]) -> Iterator[Any]:
    """The messages of a request stream, parsed here if deferred; a malformed one is remembered in ``seen``
    and raises MalformedRequest; the model the first one names goes to ``models`` (server.budgets reads a
    unary request as a stream)."""
    for request in requests:
        if isinstance(request, Deferred):  # parsed here, on the call's thread
            request = tolerant(request.parse)(request.data)
        if isinstance(request, Malformed):
            seen.append(request.message)
            raise MalformedRequest(request.message)
        if not models:
            models.append(model_of(request))
        yield request


def parsed(requests: Iterator[Any]) -> Iterator[Any]:
    """The messages of a request stream, parsed here if no reader before did (a parse failure raises)."""
    for request in requests:
        yield request.parse(request.data) if isinstance(request, Deferred) else request


def model_of(request: Any) -> str | None:
    """The model a request names, for the log line."""
    for field in ("model_name", "name"):
        value = getattr(request, field, None)
        if isinstance(value, str) and value:
            return value[:128]
    return None
