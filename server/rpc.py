"""Helpers for gRPC server interceptors: rebuild a method handler around a wrapped behaviour.

gRPC Python's server interceptors only see the method name and metadata; to act on the call itself
(time it, read its status, check its request) an interceptor replaces the handler with one whose
behaviour wraps the original. The four handler kinds are built by four different functions, hence this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Behavior = Callable[..., Any]


def kind(handler: grpc.RpcMethodHandler) -> str:
    """"unary_unary", "unary_stream", "stream_unary" or "stream_stream"."""
    return (("stream" if handler.request_streaming else "unary") + "_"
            + ("stream" if handler.response_streaming else "unary"))


def behavior(handler: grpc.RpcMethodHandler) -> Behavior:
    """The function that serves calls of ``handler``."""
    return getattr(handler, kind(handler))


def rebuild(handler: grpc.RpcMethodHandler, new_behavior: Behavior,
            request_deserializer: Callable[[bytes], Any] | None | bool = True) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` serving with ``new_behavior``; ``request_deserializer``
    True keeps the original one, anything else replaces it (None: the behaviour gets the raw bytes)."""
    deserializer = handler.request_deserializer if request_deserializer is True else request_deserializer
    make = getattr(grpc, f"{kind(handler)}_rpc_method_handler")
    return make(new_behavior, request_deserializer=deserializer, response_serializer=handler.response_serializer)


def refusal(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that answers every call with ``code`` and ``message`` without reading the request (so a
    malformed request is refused for the first reason, not answered "cannot parse")."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(refuse)
    return rebuild(handler, refuse, request_deserializer=None)


def split_method(full: str) -> tuple[str, str]:
    """("inference.GRPCInferenceService", "ModelInfer") from "/inference.GRPCInferenceService/ModelInfer"."""
    service, _, method = full.lstrip("/").rpartition("/")
    return service, method
