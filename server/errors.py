"""The refusals of the server: every problem a client can cause, with the gRPC status to answer it with."""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """A request the server refuses, with the gRPC status to answer and a message naming the problem."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def invalid(message: str) -> RequestError:
    """An INVALID_ARGUMENT refusal."""
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)
