"""The server's data plane: the state the servicers share and the admission of compute, free of any transport.

The servicers (server.service) translate the protocol into calls on these and on the registry
(server.models) and split jobs (server.split_jobs); what goes wrong here raises a server.errors.ServerFault,
which the servicers map to a status.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

from deepco_server.errors import ResourceExhausted
from deepco_server.models import Registry
from deepco_server.refusals import Refusals
from deepco_server.triton_extensions import EXTENSIONS, Statistics

from deepco.wire.security import ChannelSecurity


class Admission:
    """At most ``limit`` compute requests (ModelInfer, Profile) at once; the excess is refused at once.

    Refusing (RESOURCE_EXHAUSTED) rather than queueing keeps latency bounded and tells the device to try
    another server, which is what a partitioned frame with a deadline wants.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)

    def __enter__(self) -> Admission:
        if not self._slots.acquire(blocking=False):
            raise ResourceExhausted(f"server busy: {self.limit} inference requests already in flight "
                                    "(--max-inflight); retry later or elsewhere")
        return self

    def __exit__(self, *exc: object) -> None:
        self._slots.release()

    @contextlib.contextmanager
    def waiting(self, timeout: float) -> Iterator[None]:
        """Like ``with admission:``, but wait up to ``timeout`` seconds for a slot (a pipelined slice)."""
        if not self._slots.acquire(timeout=timeout):
            raise ResourceExhausted(f"server busy: no compute slot free within {timeout:g}s "
                                    f"(--max-inflight {self.limit})")
        try:
            yield
        finally:
            self._slots.release()


class ServerState:
    """What the servicers share: the models, the admission limit, how to reach split-job peers, and whether we
    are draining.

    ``peer_security`` is how this server dials its peers (server.split_jobs's server-to-server channels), ``peers``
    the split-job peers (host:port) it may dial beyond loopback ones (``--peers``).
    """

    def __init__(self, registry: Registry, admission: Admission, peer_security: ChannelSecurity | None = None,
                 peers: Iterable[str] = (), refusals: Refusals | None = None):
        self.registry, self.admission = registry, admission
        self.refusals = refusals if refusals is not None else Refusals()  # budget refusals, counted and logged
        self.peer_security = peer_security if peer_security is not None else ChannelSecurity()
        self.peers = frozenset(peers)
        self.draining = threading.Event()
        self.statistics = Statistics()  # Triton's statistics extension, per loaded model
        self.server_id = ""  # ServerMetadata's deepco_server_id (set by server.app.Server once it listens)

    def extensions(self) -> list[str]:
        """ServerMetadata's extensions: the protocol extensions served, then DeepCo's facts as key=value."""
        registry = self.registry
        runtime = registry.runtime
        return [*EXTENSIONS, "deepco_profile", f"deepco_device={runtime.device}",
                f"deepco_execution_provider={runtime.provider}", f"deepco_intra_op_threads={runtime.threads}",
                f"deepco_max_models={registry.max_models}", f"deepco_max_model_bytes={registry.max_model_bytes}",
                f"deepco_max_inflight={self.admission.limit}",
                *([f"deepco_server_id={self.server_id}"] if self.server_id else [])]
