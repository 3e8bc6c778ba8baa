"""The refusals of the server's data plane, free of any transport: what went wrong, not how to say it.

The work (server.models' registry, server.service's admission, server.split_jobs's split jobs, server.model_checks)
raises a :class:`ServerFault` subclass naming the kind of problem; the servicer layer (server.service) maps
each kind to its gRPC status in one function, ``status_of``. Nothing here imports gRPC: the same logic could
answer over another protocol with another mapping.
"""

from __future__ import annotations

import enum


class Kind(enum.Enum):
    """The kinds of failure. The names are gRPC's status names on purpose: the servicers map them by name,
    and a peer's status (server.split_jobs) is carried through unchanged."""

    CANCELLED = enum.auto()
    UNKNOWN = enum.auto()
    INVALID_ARGUMENT = enum.auto()
    DEADLINE_EXCEEDED = enum.auto()
    NOT_FOUND = enum.auto()
    ALREADY_EXISTS = enum.auto()
    PERMISSION_DENIED = enum.auto()
    RESOURCE_EXHAUSTED = enum.auto()
    FAILED_PRECONDITION = enum.auto()
    ABORTED = enum.auto()
    OUT_OF_RANGE = enum.auto()
    UNIMPLEMENTED = enum.auto()
    INTERNAL = enum.auto()
    UNAVAILABLE = enum.auto()
    DATA_LOSS = enum.auto()
    UNAUTHENTICATED = enum.auto()


class ServerFault(Exception):
    """A request the server refuses or could not serve, with a message naming the problem for the client."""

    kind: Kind = Kind.UNKNOWN

    def __init__(self, message: str, kind: Kind | None = None):
        super().__init__(message)
        if kind is not None:
            self.kind = kind


class InvalidArgument(ServerFault):
    """The request itself is wrong (a bad tensor, model file, parameter or table)."""

    kind = Kind.INVALID_ARGUMENT


class NotFound(ServerFault):
    """The request names a model that is not loaded (for this client)."""

    kind = Kind.NOT_FOUND


class AlreadyExists(ServerFault):
    """The request would replace something that must not change (a loaded name, a split job that ran)."""

    kind = Kind.ALREADY_EXISTS


class FailedPrecondition(ServerFault):
    """The request needs a state the server is not in (a stage derived from a whole model that differs)."""

    kind = Kind.FAILED_PRECONDITION


class PermissionDenied(ServerFault):
    """The request asks the server to dial an address it is not allowed to."""

    kind = Kind.PERMISSION_DENIED


class ResourceExhausted(ServerFault):
    """A budget is spent (slots, models, bytes, memory a request may take); retrying later may work."""

    kind = Kind.RESOURCE_EXHAUSTED


class Unavailable(ServerFault):
    """The server is shutting down, or a peer it needs cannot be reached."""

    kind = Kind.UNAVAILABLE


class DeadlineExceeded(ServerFault):
    """Something the request waits for (a peer's rows or acknowledgement) did not come in time."""

    kind = Kind.DEADLINE_EXCEEDED


class Cancelled(ServerFault):
    """The client went away while the work waited."""

    kind = Kind.CANCELLED


class Internal(ServerFault):
    """A state the server should never reach (a bug of ours, or of a peer's tables)."""

    kind = Kind.INTERNAL


def invalid(message: str) -> InvalidArgument:
    """An InvalidArgument refusal (the commonest one, hence the short name)."""
    return InvalidArgument(message)
