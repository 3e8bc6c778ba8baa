"""The server's data plane: the state the servicers share and the admission of compute, free of any transport.

The servicers (server.service) translate the protocol into calls on these and on the registry
(server.models) and split jobs (server.split_jobs); what goes wrong here raises a server.errors.ServerFault,
which the servicers map to a status.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator

from deepco_server.errors import ResourceExhausted
from deepco_server.models import Registry
from deepco_server.peers import PeerChannels
from deepco_server.refusals import Refusals
from deepco_server.triton_extensions import EXTENSIONS, Statistics
from deepco_server.whole_parts import WholeParts
from deepco_server.window_buffers import WindowBuffers

from deepco.wire.security import ChannelSecurity


class Admission:
    """At most ``limit`` compute requests (ModelInfer, Profile, a slice) admitted at once, the excess refused
    at once; of those, at most ``running`` run at once and the rest wait their turn.

    Refusing (RESOURCE_EXHAUSTED) rather than queueing keeps latency bounded and tells the device to try
    another server, which is what a partitioned frame with a deadline wants.

    Running one at a time is Triton's default too (one execution instance per model): ONNX Runtime already
    spreads one run over the cores it is given, so two runs at once on one CPU share only slow each other
    down. On a server held to 0.45 core, ResNet-18 at 224x224 sent two frames at a time: taking turns, 7.5 runs
    a second at a median of 198 ms; both at once, 7.2 at 288 ms (bench/concurrent_runs.py, bench/README.md).
    The planner's cost model charges a server's frames one after another, which this makes true.
    """

    def __init__(self, limit: int, running: int = 1):
        self.limit, self.running = limit, running
        self._slots = threading.BoundedSemaphore(limit)
        self._turns = threading.BoundedSemaphore(running)

    def __enter__(self) -> Admission:
        if not self._slots.acquire(blocking=False):
            raise ResourceExhausted(f"server busy: {self.limit} inference requests already in flight "
                                    "(--max-inflight); retry later or elsewhere")
        self._turns.acquire()  # at most `limit` wait here, each for runs already admitted
        return self

    def __exit__(self, *exc: object) -> None:
        self._turns.release()
        self._slots.release()

    @contextlib.contextmanager
    def waiting(self, timeout: float) -> Iterator[None]:
        """Like ``with admission:``, but wait up to ``timeout`` seconds for a slot and a turn (a pipelined
        slice)."""
        deadline = time.monotonic() + timeout
        if not self._slots.acquire(timeout=timeout):
            raise ResourceExhausted(f"server busy: no compute slot free within {timeout:g}s "
                                    f"(--max-inflight {self.limit})")
        try:
            if not self._turns.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise ResourceExhausted(f"server busy: no turn to run within {timeout:g}s "
                                        f"(--concurrent-runs {self.running})")
            try:
                yield
            finally:
                self._turns.release()
        finally:
            self._slots.release()


class ServerState:
    """What the servicers share: the models (and the whole models being sent in parts), the admission limit, how to
    reach split-job peers, and whether we are draining.

    ``peer_security`` is how this server dials its peers (split jobs' exchanges, ProbePeer, whole models fetched
    from a peer), ``peers`` the peers (host:port) it may dial beyond loopback ones (``--peers``); ``peer_channels``
    is the one way it dials them (server.peers).
    """

    def __init__(self, registry: Registry, admission: Admission, peer_security: ChannelSecurity | None = None,
                 peers: Iterable[str] = (), refusals: Refusals | None = None):
        self.registry, self.admission = registry, admission
        self.parts = WholeParts(registry)  # whole models sent in parts over several antennas (server.whole_parts)
        self.refusals = refusals if refusals is not None else Refusals()  # budget refusals, counted and logged
        self.peer_security = peer_security if peer_security is not None else ChannelSecurity()
        self.peers = frozenset(peers)
        self.peer_channels = PeerChannels(self.peers, self.peer_security)
        self.window_buffers = WindowBuffers()  # split jobs' windows, reused from frame to frame
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
                f"deepco_max_inflight={self.admission.limit}", f"deepco_concurrent_runs={self.admission.running}",
                *([f"deepco_server_id={self.server_id}"] if self.server_id else []),
                *(["deepco_derive_stages", "deepco_whole_parts"] if registry.derive_stages else [])]
