"""The models a device uploads: content-addressed names, and unloaded again when the device closes.

A device uploads under :func:`deepco.wire.client.content_name` names, so it only ever shares a model with
byte-identical uploads (the server adds a reference rather than a copy, and refuses other bytes under the
name). What it uploaded it unloads on close, also after Ctrl-C; if it dies without closing, the server's
``--model-lease`` unloads the models once nobody uses them.
"""

from __future__ import annotations

import threading

import grpc
from deepco_device.backpressure import while_busy

from deepco.errors import UserError
from deepco.wire.client import InferenceClient, content_name

UNLOAD_TIMEOUT = 5.0  # per model on close: a frozen server must not hold up the device's exit


class Uploads:
    """Models this device loaded on servers, to unload on :meth:`release`."""

    def __init__(self) -> None:
        self._held: list[tuple[InferenceClient, str]] = []
        self._lock = threading.Lock()

    def upload(self, client: InferenceClient, model_bytes: bytes, base: str) -> str:
        """Load ``model_bytes`` on ``client``'s server under a content-addressed name from ``base``; the name.
        A model this device already holds there is not loaded again (a replan then costs no call to a server
        that may be frozen); after `forget` it is."""
        name = content_name(base, model_bytes)
        with self._lock:
            if any(c.address == client.address and n == name for c, n in self._held):
                return name
        while_busy(lambda: client.load_model(model_bytes, name))
        with self._lock:
            self._held.append((client, name))
        return name

    def forget(self, address: str) -> None:
        """The server at ``address`` lost its models (it restarted): upload them again when asked, and do not
        unload them on release."""
        with self._lock:
            self._held = [(c, n) for c, n in self._held if c.address != address]

    def release(self, names: set[str] | None = None, skip: set[str] = frozenset()) -> list[str]:
        """Unload what was uploaded (``names``: only those), each load once, so other devices' references
        stay; returns one line per model that could not be unloaded (its server's lease will). Servers at the
        addresses in ``skip`` (known down), and a server once it did not answer, are not asked."""
        with self._lock:
            held = [(c, n) for c, n in self._held if names is None or n in names]
            self._held = [(c, n) for c, n in self._held if names is not None and n not in names]
        problems = []
        silent = set(skip)  # not asked (again): a frozen server would cost a timeout per model
        for client, name in reversed(held):
            if client.address in silent:
                problems.append(f"did not unload {name} from {client.address}: the server is down")
                continue
            try:
                client.unload_model(name, timeout=UNLOAD_TIMEOUT)
            except (UserError, ValueError) as exc:  # gone, refused, or its channel closed: its lease will do
                problems.append(f"could not unload {name} from {client.address}: {exc}")
                if getattr(exc, "code", None) in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                    silent.add(client.address)
        return problems


def check_capacity(client: InferenceClient, needed: int) -> None:
    """Refuse (UserError) before an expensive setup if ``client``'s server has fewer than ``needed`` free
    model slots (`deepco serve --max-models`, from ServerMetadata; models this client can see count as taken,
    so under mutual TLS other identities' models are not counted and the load itself may still be refused)."""
    limit = while_busy(client.server_metadata).get("deepco_max_models")
    if limit is None:
        return
    loaded = while_busy(client.loaded_models)
    if len(loaded) + needed > int(limit):
        raise UserError(f"server {client.address} has {len(loaded)} of its {limit} model slots taken and this "
                        f"device needs {needed}; unload some (`deepco models --cluster FILE --all`) or start it "
                        "with a larger --max-models")
