"""Helpers for gRPC server interceptors: rebuild a method handler around a wrapped behaviour.

gRPC Python's server interceptors only see the method name and metadata; to act on the call itself
(time it, read its status, check its request) an interceptor replaces the handler with one whose
behaviour wraps the original. The four handler kinds are built by four different functions, hence this.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

Behavior = Callable[..., Any]
# gRPC Python runs a call on the pool its behaviour names in this attribute (grpc/_server.py,
# _select_thread_pool_for_behavior), else on the server's executor; server.budgets gives each class of call
# its own pool this way, and rebuild() keeps the pool when an interceptor wraps a behaviour.
POOL_ATTRIBUTE = "experimental_thread_pool"
_REFUSAL_ATTRIBUTE = "deepco_refusal"


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
    old = behavior(handler)
    for attribute in (POOL_ATTRIBUTE, _REFUSAL_ATTRIBUTE):
        if hasattr(old, attribute) and not hasattr(new_behavior, attribute):
            setattr(new_behavior, attribute, getattr(old, attribute))
    make = getattr(grpc, f"{kind(handler)}_rpc_method_handler")
    return make(new_behavior, request_deserializer=deserializer, response_serializer=handler.response_serializer)


def on_pool(handler: grpc.RpcMethodHandler, pool: futures.ThreadPoolExecutor) -> grpc.RpcMethodHandler:
    """``handler``, run on ``pool``'s threads."""
    inner = behavior(handler)

    def call(request: Any, context: grpc.ServicerContext) -> Any:
        return inner(request, context)

    setattr(call, POOL_ATTRIBUTE, pool)
    return rebuild(handler, call)


def refusal(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that answers every call with ``code`` and ``message`` without reading the request: a
    malformed request is refused for the first reason, not answered "cannot parse", and a large one costs
    no thread time and no memory (gRPC drops what arrives after the status)."""

    def refuse(requests: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    setattr(refuse, _REFUSAL_ATTRIBUTE, True)
    # A request stream, whatever the method's kind: gRPC hands the behaviour an unread stream at once, where a
    # unary request would first be read whole on the worker thread.
    streaming_response = handler is not None and handler.response_streaming
    make = grpc.stream_stream_rpc_method_handler if streaming_response else grpc.stream_unary_rpc_method_handler
    return make(refuse, response_serializer=handler.response_serializer if handler is not None else None)


def is_refusal(handler: grpc.RpcMethodHandler) -> bool:
    """Whether ``handler`` was made by :func:`refusal` (and wrapped since, perhaps)."""
    return bool(getattr(behavior(handler), _REFUSAL_ATTRIBUTE, False))


def split_method(full: str) -> tuple[str, str]:
    """("inference.GRPCInferenceService", "ModelInfer") from "/inference.GRPCInferenceService/ModelInfer"."""
    service, _, method = full.lstrip("/").rpartition("/")
    return service, method
