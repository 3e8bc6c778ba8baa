"""Split jobs on the server: run a disjoint band level by level, exchanging boundary rows with the peers directly.

A job (one frame) arrives as DeepcoService.SplitRun with this server's band of the image and the row
tables of every level (see deepco.planning.bands). For each segment j the server
  1. sends each peer the rows of level j-1 that peer's window needs from this server's band, on one
     SplitExchange client stream per (job, peer): server to server, nothing relayed by the device;
  2. waits (bounded) for the rows it needs from the peers, which their streams deliver into this job's
     mailbox here;
  3. assembles its window, runs segment j, and crops its band of level j.
Both sides compute what flows from the same tables with the same functions, so a message is expected
exactly when it is sent. A job whose levels have several tensors (a U-Net's or a detector's scales, SplitLevel
.tensors: a plan across scales, deepco.planning.scales) holds its band of every tensor of a level, skips
included, exchanges each tensor's halo rows (RowsMessage.tensor) before the segment that reads it, and returns
its band of every tensor of the last level by name (or sends them to the server that gathers them).

With lookahead the device may stream the window: the SplitRun then carries the window's first rows and names
the rest (SplitRequest.input_rest), which the device sends after it as a peer would (level 0, this server's
own index, on a SplitExchange stream); the first segment's parts are then sub-bands, the first computed
while the rest is in flight, and the rest is taken when a run first needs it, like a halo.

Peers may send rows before this server has received its own SplitRun (the device sends the image bands
one after another over an antenna), so a mailbox is created by whichever comes first; one never claimed
by a SplitRun expires. Memory and threads are bounded: at most MAX_JOBS jobs run at once, at most
MAX_MAILBOXES mailboxes of jobs not running here (yet) and MAX_MAILBOX_BYTES of rows are held, and every wait
has a deadline. A running job's mailbox never waits for room: those opened early live in a pool of their own,
at most ORPHANS_PER_SENDER per sender (its certificate's identity, the token group, or without either its
connection), and when the pool is full a sender takes the place of the oldest of the sender holding the most,
if that one holds more than it does, so made-up job ids fill only their sender's share (17 of them blocked
every split job for a minute before). A job holds one of this server's gRPC worker threads for its SplitRun
and one for each peer's incoming SplitExchange stream; a job is admitted only while the running jobs' threads
fit the thread budget (see `Mailboxes`), so that jobs cannot starve each other's exchange streams of threads.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import grpc
import numpy as np
from deepco_server.dataplane import ServerState
from deepco_server.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    Internal,
    Kind,
    PermissionDenied,
    ResourceExhausted,
    ServerFault,
    invalid,
)
from deepco_server.models import Registry
from deepco_server.peers import MAX_PEER_CHANNELS, PeerChannels, peer_allowed
from deepco_server.window_buffers import WindowBuffers

from deepco.planning.bands import NOT_A_SERVER, check_tables, receives, sends
from deepco.planning.overlap import MAX_PARTS
from deepco.planning.plan import PlanningError
from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire import deepco_service_pb2_grpc as dpb_grpc
from deepco.wire.rows import decode_rows, encode_rows
from deepco.wire.split_jobs import gatherer, named_rows
from deepco.wire.step_times import StepClock
from deepco.wire.tensors import TensorError

MAX_JOBS = 2  # jobs running here at once; see the module doc for the threads each holds
MAX_MAILBOXES = 16  # of jobs not running here, opened by their peers first (expiring after ORPHAN_SECONDS)
ORPHANS_PER_SENDER = 4  # of those, opened by one sender
MAX_MAILBOX_BYTES = 1 << 30  # rows received and not yet used, all jobs together
ORPHAN_SECONDS = 60.0
DEFAULT_EXCHANGE_TIMEOUT = 30.0
MAX_EXCHANGE_TIMEOUT = 300.0
MAX_JOB_ID = 128
MAX_TENSOR_NAME = 256
POLL_SECONDS = 0.05  # how often a wait looks at cancellation and at failed outgoing streams


@dataclass
class Mailbox:
    """Rows received for one job: (level, sender) -> (array, start row)."""

    created: float
    claimed: bool = False
    sender: str = ""  # who opened it, if a peer's rows came before the job's SplitRun
    rows: dict[tuple[int, int, str], tuple[np.ndarray, int]] = field(default_factory=dict)


class Mailboxes:
    """Per-job mailboxes, shared by the SplitRun and SplitExchange handlers."""

    def __init__(self, max_jobs: int = MAX_JOBS, max_mailboxes: int = MAX_MAILBOXES,
                 max_bytes: int = MAX_MAILBOX_BYTES, threads: int | None = None,
                 per_sender: int = ORPHANS_PER_SENDER):
        self.max_jobs, self.max_mailboxes, self.max_bytes = max_jobs, max_mailboxes, max_bytes
        self.per_sender = per_sender
        self.threads = threads  # worker threads split jobs may hold together (None: no limit)
        self.bytes = 0
        self._held: dict[str, int] = {}  # threads each running job holds
        self.cond = threading.Condition()
        self.boxes: dict[str, Mailbox] = {}
        self.finished: collections.deque[str] = collections.deque(maxlen=256)  # late rows for these are dropped

    def _sweep(self) -> None:
        now = time.monotonic()
        for job in [j for j, b in self.boxes.items() if not b.claimed and now - b.created > ORPHAN_SECONDS]:
            self._discard(job)

    def _discard(self, job: str) -> None:
        box = self.boxes.pop(job, None)
        if box is not None:
            self.bytes -= sum(array.nbytes for array, _ in box.rows.values())

    def _box(self, job: str, sender: str | None = None) -> Mailbox:
        """The mailbox of ``job``, made if need be: for a job starting here (``sender`` None) always (the
        claims are bounded by MAX_JOBS), for a peer's early rows within the pool of jobs not running here."""
        self._sweep()
        box = self.boxes.get(job)
        if box is None:
            if sender is not None:
                self._make_room(sender)
            box = self.boxes[job] = Mailbox(time.monotonic(), sender=sender or "")
        return box

    def _make_room(self, sender: str) -> None:
        """Room for one more mailbox opened early by ``sender`` (module doc), or RESOURCE_EXHAUSTED."""
        early = [(box.created, job, box.sender) for job, box in self.boxes.items() if not box.claimed]
        held = collections.Counter(who for _, _, who in early)
        if held[sender] >= self.per_sender:
            raise ResourceExhausted(f"split jobs: this sender already opened {held[sender]} mailboxes for jobs not "
                                    f"running here, the limit ({self.per_sender}); retry later")
        if len(early) >= self.max_mailboxes:
            # Room is taken from a sender holding more than this one (never from itself): the largest's oldest.
            larger = {who: n for who, n in held.items() if who != sender and n > held[sender]}
            if not larger:
                raise ResourceExhausted(f"split jobs: {len(early)} mailboxes for jobs not running here are open, the "
                                        "limit, and this sender holds as many as any other; retry later")
            most = max(larger.values())
            oldest = min((created, job) for created, job, who in early if larger.get(who) == most)
            self._discard(oldest[1])

    def claim(self, job: str, threads: int = 1) -> Mailbox:
        """The mailbox of a job starting here that holds ``threads`` worker threads (RESOURCE_EXHAUSTED past
        MAX_JOBS or the thread budget, ALREADY_EXISTS if it ran here before)."""
        with self.cond:
            running = sum(b.claimed for b in self.boxes.values())
            if job in self.boxes and self.boxes[job].claimed or job in self.finished:
                raise AlreadyExists(f"split job {job!r} already ran here")
            if running >= self.max_jobs:
                raise ResourceExhausted(f"server busy: {running} split jobs already running (limit {self.max_jobs})")
            if self.threads is not None:
                if threads > self.threads:
                    raise ResourceExhausted(f"split job {job!r} needs {threads} worker threads here (its run and "
                                            f"{threads - 1} peers' streams), more than the {self.threads} this server "
                                            "gives split jobs; start it with a larger --max-inflight")
                held = sum(self._held.values())
                if held + threads > self.threads:
                    raise ResourceExhausted(f"server busy: split jobs hold {held} of {self.threads} worker threads, "
                                            f"this one needs {threads}")
            box = self._box(job)
            box.claimed = True
            self._held[job] = threads
            return box

    def deliver(self, job: str, level: int, sender: int, array: np.ndarray, start: int, who: str = "",
                tensor: str = "") -> None:
        """File rows (of ``tensor``, for a level of several) peer ``who`` sent as server ``sender`` (creating
        the mailbox if the job has not started here yet)."""
        with self.cond:
            if job in self.finished:
                return  # the job ended (e.g. failed) here: nobody will read them
            box = self._box(job, who)
            if (level, sender, tensor) in box.rows:
                raise invalid(f"split job {job!r}: rows of level {level} {tensor[:80]!r} from server {sender} sent "
                              "twice")
            if self.bytes + array.nbytes > self.max_bytes:
                raise ResourceExhausted(f"split jobs: {self.bytes} bytes of peers' rows held, the limit is "
                                        f"{self.max_bytes}")
            box.rows[(level, sender, tensor)] = (array, start)
            self.bytes += array.nbytes
            self.cond.notify_all()

    def take(self, job: str, level: int, sender: int, timeout: float,
             tensor: str = "") -> tuple[np.ndarray, int] | None:
        """The rows once they are here, or None after ``timeout`` seconds (called in short slices)."""
        with self.cond:
            box = self.boxes[job]
            if (level, sender, tensor) not in box.rows:
                self.cond.wait(timeout)
            got = box.rows.pop((level, sender, tensor), None)
            if got is not None:
                self.bytes -= got[0].nbytes
            return got

    def drop(self, job: str) -> None:
        """Forget a job (finished or failed): its mailbox and any rows still in it."""
        with self.cond:
            self._discard(job)
            self._held.pop(job, None)
            self.finished.append(job)


class Outgoing:
    """One SplitExchange client stream to a peer for one job: messages are queued, gRPC sends them in order."""

    def __init__(self, stub: dpb_grpc.DeepcoServiceStub, peer: int, address: str, timeout: float):
        self.peer, self.address = peer, address
        self.queue: queue.Queue[dpb.RowsMessage | None] = queue.Queue()
        self.ended = False
        self.future = stub.SplitExchange.future(self._messages(), timeout=timeout)

    def _messages(self) -> Iterator[dpb.RowsMessage]:
        while (message := self.queue.get()) is not None:
            yield message

    def error(self) -> ServerFault | None:
        """The stream's failure, if it has failed, as the error to answer the job with."""
        if not self.future.done() or self.future.cancelled():
            return None
        exc = self.future.exception()
        if exc is None:
            return None
        if isinstance(exc, grpc.RpcError):
            status, details = exc.code().name, exc.details()
        else:
            status, details = Kind.UNKNOWN.name, str(exc)
        # The job fails with the peer's own status (UNAVAILABLE, DEADLINE_EXCEEDED, ...): the device reads it.
        kind = Kind.__members__.get(status, Kind.UNKNOWN)
        return ServerFault(f"cannot send rows to peer {self.peer} ({self.address}): {status}: {details}", kind)

    def send(self, message: dpb.RowsMessage) -> None:
        """Queue a message (raising the stream's error if it already failed)."""
        if (err := self.error()) is not None:
            raise err
        self.queue.put(message)

    def end(self) -> None:
        """End the stream (once): the peer acknowledges when it has taken every message."""
        if not self.ended:
            self.ended = True
            self.queue.put(None)

    def finish(self, timeout: float) -> None:
        """End the stream and wait for the peer's acknowledgement."""
        self.end()
        try:
            self.future.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            self.future.cancel()
            raise DeadlineExceeded(f"peer {self.peer} ({self.address}) did not acknowledge its rows within "
                                   f"{timeout:g}s") from None
        except grpc.RpcError:
            pass
        if (err := self.error()) is not None:
            raise err

    def cancel(self) -> None:
        """Abandon the stream (the job failed)."""
        self.queue.put(None)
        self.future.cancel()


class Streams:
    """A job's outgoing exchange streams, one per peer it feeds, opened on a thread of their own as the job
    starts: opening a stream (a gRPC call, and the thread that feeds it) then overlaps the first segment's
    compute instead of delaying the first rows the job sends (bench/step_overhead.py's Gantt chart showed it
    as the first send's bar)."""

    def __init__(self, open_one: Callable[[int], Outgoing], peers: list[int]):
        self._streams: dict[int, Outgoing] = {}
        self._failed: BaseException | None = None
        self._opened = threading.Event()
        if peers:
            threading.Thread(target=self._open_all, args=(open_one, peers), daemon=True).start()
        else:
            self._opened.set()

    def _open_all(self, open_one: Callable[[int], Outgoing], peers: list[int]) -> None:
        try:
            for peer in peers:
                self._streams[peer] = open_one(peer)
        except BaseException as exc:  # noqa: BLE001 - raised to the job by the first use
            self._failed = exc
        finally:
            self._opened.set()

    def opened(self) -> list[Outgoing]:
        """Every stream opened (opening waits on nothing remote: this returns at once)."""
        self._opened.wait()
        return list(self._streams.values())

    def __getitem__(self, peer: int) -> Outgoing:
        self._opened.wait()
        if self._failed is not None:
            raise self._failed
        return self._streams[peer]


@dataclass
class Job:
    """A validated SplitRequest."""

    id: str
    me: int
    peers: list[str]
    models: list  # LoadedModel per segment
    bands: list[list[tuple[int, int]]]
    windows: list[list[tuple[int, int]]]
    crops: list[list[int]]
    image: np.ndarray
    timeout: float
    lookahead: bool = False  # `image` is this server's whole window for segment 1: no level-0 exchange
    gather_to: int | None = None  # the server that gathers the last level and runs `tail` (None: the device)
    tail: object | None = None  # LoadedModel
    # levels of several tensors (a plan across scales), per level: name -> (band, crop, window per server)
    scales: list[dict[str, TensorRows]] = field(default_factory=list)
    # per level, this server's segment runs (SplitLevel.parts: interior first, then the borders as the halo
    # lands), each ((rows), (window), crop); an empty list runs the segment once on its window
    parts: list[list[tuple[tuple[int, int], tuple[int, int], int]]] = field(default_factory=list)
    # lookahead: the rows of this server's window the device sends after the request (SplitRequest.input_rest),
    # taken like a peer's rows (level 0, this server's own index) when a run of segment 1 first needs them
    rest: tuple[int, int] | None = None

    def runs(self, j: int) -> list[tuple[tuple[int, int], tuple[int, int], int]]:
        """The runs of segment ``j`` here: its parts, or one run on the whole window."""
        if j < len(self.parts) and self.parts[j]:
            return self.parts[j]
        return [(self.bands[j][self.me], self.windows[j][self.me], self.crops[j][self.me])]

    def receives(self, level: int) -> dict[int, tuple[int, int]]:
        """Rows of ``level`` this server gets from each peer before segment ``level`` + 1 (levels of several
        tensors: the peers it gets rows of some tensor from, their rows being `tensor_rows`')."""
        if level == 0 and self.lookahead:
            return {}
        if self.scales:
            return {peer: rows for got in self.tensor_rows(level, receives).values() for peer, rows in got.items()}
        return receives(self.bands, self.windows, level, self.me)

    def sends(self, level: int) -> dict[int, tuple[int, int]]:
        """Rows of ``level`` this server sends each peer before segment ``level`` + 1 (levels of several
        tensors: the peers, as in `receives`)."""
        if level == 0 and self.lookahead:
            return {}
        if self.scales:
            return {peer: rows for got in self.tensor_rows(level, sends).values() for peer, rows in got.items()}
        return sends(self.bands, self.windows, level, self.me)

    def tensor_rows(self, level: int, which: Callable) -> dict[str, dict[int, tuple[int, int]]]:
        """Per tensor of ``level`` read by the next segment, the rows this server sends each peer (``which``
        = bands.sends) or gets from each (bands.receives): its band against their windows, or theirs against
        its window (none at level 0 with lookahead: the device sent the whole window)."""
        if level == 0 and self.lookahead:
            return {}
        return {t: which([owned], [[], window], 0, self.me) for t, (owned, _, window) in self.scales[level].items()
                if window}

    @property
    def feeds(self) -> list[int]:
        """The peers this server sends rows to (exchanges, and its band to the one that gathers)."""
        fed = {peer for level in range(len(self.models)) for peer in self.sends(level)}
        if self.gather_to is not None and self.gather_to != self.me:
            fed.add(self.gather_to)
        return sorted(fed)

    @property
    def threads(self) -> int:
        """Worker threads the job holds on this server: its SplitRun and every feeding peer's stream."""
        feeders = {peer for level in range(len(self.models)) for peer in self.receives(level)}
        if self.gather_to == self.me:
            feeders |= set(range(len(self.peers))) - {self.me}
        return 1 + len(feeders) + (self.rest is not None)  # the device's stream of the window's rest


Pieces = list[tuple[int, np.ndarray]]  # a server's rows of a level as its runs made them: (first row, rows), in order


def rows_of(pieces: Pieces, a: int, b: int) -> np.ndarray:
    """Rows [a, b) of ``pieces`` (which hold them): a view where one piece holds them all, else a new array."""
    parts = [array[:, :, max(a, s) - s:min(b, s + array.shape[2]) - s] for s, array in pieces
             if s < b and a < s + array.shape[2]]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=2)


class Held:
    """The rows of one level a job holds for its next segment: its own band (in the pieces its runs made), and
    each peer's rows once taken (a peer's are taken when a run's window first needs them, so the interior runs
    while they are in flight)."""

    def __init__(self, job: Job, level: int, own: Pieces, pending: dict[int, tuple[int, int]] | None = None,
                 buffers: WindowBuffers | None = None):
        self.job, self.level = job, level
        self.pieces: Pieces = list(own)
        # peer -> its rows [a, b) not taken yet (default: the level's one tensor's)
        self.pending = dict(job.receives(level) if pending is None else pending)
        self.buffers = buffers if buffers is not None else WindowBuffers(0)
        self.lent: list[np.ndarray] = []  # windows assembled into the buffers' arrays, until `release`

    def window(self, lo: int, hi: int, take: Callable[[int, tuple[int, int]], np.ndarray], clock: StepClock,
               j: int) -> np.ndarray:
        """Rows [lo, hi) of the level (contiguous), waiting (timed as halo) for the peers' rows among them;
        ``take(peer, rows)`` waits for a peer's rows. The copy into one array is timed as assemble."""
        needed = [peer for peer, (a, b) in self.pending.items() if a < hi and lo < b]
        if needed:
            waited = time.perf_counter()
            for peer in needed:
                self.pieces.append((self.pending[peer][0], take(peer, self.pending.pop(peer))))
            clock.since("halo", waited, j)
        copying = time.perf_counter()
        parts = sorted(((max(lo, a), array[:, :, max(lo, a) - a:min(hi, a + array.shape[2]) - a])
                        for a, array in self.pieces if a < hi and lo < a + array.shape[2]), key=lambda p: p[0])
        if sum(x.shape[2] for _, x in parts) != hi - lo:
            raise Internal(f"split job {self.job.id!r}: assembled {sum(x.shape[2] for _, x in parts)} rows of level "
                           f"{self.level}, expected [{lo}, {hi})")
        if len(parts) == 1 and parts[0][1].flags.c_contiguous:
            return parts[0][1]
        first = parts[0][1]
        window = self.buffers.take_like(first, hi - lo)
        if len(parts) == 1:
            np.copyto(window, first)
        else:
            np.concatenate([x for _, x in parts], axis=2, out=window)
        self.lent.append(window)
        clock.since("assemble", copying, j)
        return window

    def release(self, outputs: Iterable[np.ndarray] = ()) -> None:
        """Give the windows assembled so far back to the buffers, now that the runs on them are done; one that
        shares memory with any of ``outputs`` (a segment whose output is its input) is not given back."""
        outputs = list(outputs)
        for window in self.lent:
            if not any(np.may_share_memory(window, y) for y in outputs):
                self.buffers.give(window)
        self.lent.clear()


TensorRows = tuple[list[tuple[int, int]], list[int], list[tuple[int, int]]]  # band, crop, window per server


def _sender(job: Job, level: int, peer: int) -> str:
    """Who sends ``job`` its rows of ``level`` from ``peer``: a peer server, or the device (its window's rest)."""
    if level == 0 and peer == job.me:
        return "the device (the rest of this server's window)"
    return f"peer {peer} ({job.peers[peer]})"


def _interval(r: dpb.RowRange) -> tuple[int, int]:
    return int(r.start), int(r.stop)


def parse_request(request: dpb.SplitRequest, registry: Registry, owner: str = "",
                  allowed_peers: frozenset[str] = frozenset()) -> Job:
    """Check a SplitRequest: INVALID_ARGUMENT naming the problem, NOT_FOUND for a model not loaded (for
    ``owner``), PERMISSION_DENIED for a peer address outside ``allowed_peers`` and loopback."""
    job = request.job_id
    if not job or len(job) > MAX_JOB_ID:
        raise invalid(f"SplitRun: job_id must be 1 to {MAX_JOB_ID} characters, got {len(job)}")
    peers = list(request.peers)
    if not peers or any(not p for p in peers):
        raise invalid("SplitRun: peers must list every server's host:port, none empty")
    me = request.server_index
    if me >= len(peers):
        raise invalid(f"SplitRun: server_index {me} is not an index of the {len(peers)} peers")
    if len(peers) > MAX_PEER_CHANNELS or any(len(p) > 256 for p in peers):
        raise invalid(f"SplitRun: at most {MAX_PEER_CHANNELS} peers of at most 256 characters each")
    segments = len(request.segment_models)
    if segments < 1:
        raise invalid("SplitRun: no segment_models")
    if len(request.levels) != segments + 1:
        raise invalid(f"SplitRun: {len(request.levels)} levels for {segments} segments, expected {segments + 1}")
    timeout = request.exchange_timeout_seconds or DEFAULT_EXCHANGE_TIMEOUT
    if not 0 < timeout <= MAX_EXCHANGE_TIMEOUT:
        raise invalid(f"SplitRun: exchange_timeout_seconds must be in (0, {MAX_EXCHANGE_TIMEOUT:g}], got {timeout:g}")
    bands = [[_interval(r) for r in level.owned] for level in request.levels]
    windows = [[_interval(r) for r in level.window] for level in request.levels]
    crops = [[int(c) for c in level.crop] for level in request.levels]
    heights = [level[-1][1] if level else 0 for level in bands]
    if len(bands[0]) != len(peers):
        raise invalid(f"SplitRun: level 0 has bands for {len(bands[0])} servers, but {len(peers)} peers")
    try:
        check_tables(bands, windows, heights)
    except PlanningError as exc:
        raise invalid(f"SplitRun: {exc}") from None
    for j in range(1, len(crops)):
        if len(crops[j]) != len(peers) or any(c < 0 for c in crops[j]):
            raise invalid(f"SplitRun: level {j} needs one non-negative crop per server")
    models = [registry.get(name, owner=owner) for name in request.segment_models]
    tables = _level_tables(request, models, len(peers))
    for model in models:
        if (len(model.inputs) != 1 or len(model.outputs) != 1) and not tables:
            raise invalid(f"SplitRun: segment model {model.name!r} must have one input and one output")
    try:
        image, start = decode_rows(request.input, "SplitRun input")
    except TensorError as exc:
        raise invalid(str(exc)) from None
    a, b = windows[1][me] if request.lookahead else bands[0][me]
    rest = _interval(request.input_rest) if request.HasField("input_rest") else None
    if rest is not None:
        if not request.lookahead or tables:
            raise invalid("SplitRun: input_rest streams a window: only for a job with lookahead and one tensor per "
                          "level")
        if not a < rest[0] < rest[1] == b:
            raise invalid(f"SplitRun: input_rest [{rest[0]}, {rest[1]}) must be the last rows of server {me}'s window "
                          f"[{a}, {b}), leaving some to the input")
        b = rest[0]
    if start != a or image.shape[2] != b - a:
        what = "needs the window" if request.lookahead else "owns"
        raise invalid(f"SplitRun: input holds rows [{start}, {start + image.shape[2]}) of the image, but server "
                      f"{me} {what} [{a}, {b})")
    tail = None
    try:
        gather_to = gatherer(request.gather_to, len(peers))
    except ValueError as exc:
        raise invalid(f"SplitRun: {exc}") from None
    if gather_to == me:
        if not request.tail_model:
            raise invalid("SplitRun: gather_to names this server but no tail_model is given")
        tail = registry.get(request.tail_model, owner=owner)
        if len(tail.inputs) != 1 and not tables or tables and any(i.name not in tables[-1] for i in tail.inputs):
            raise invalid(f"SplitRun: tail model {tail.name!r} must have one input, or read only tensors of the "
                          "last level")
    result = Job(job, me, peers, models, bands, windows, crops, image, timeout, bool(request.lookahead), gather_to,
                 tail, tables, [_parts(level, me, bands[j], windows[j], j) for j, level in enumerate(request.levels)],
                 rest)
    talks_to = {k for level in range(len(models)) for k in (*result.sends(level), *result.receives(level))}
    if gather_to is not None:
        talks_to |= {gather_to} if gather_to != me else set(range(len(peers))) - {me}
    if any(peers[k] == NOT_A_SERVER for k in talks_to):
        raise invalid(f"SplitRun: the tables make this server exchange rows with a participant that is not a "
                      f"server ({NOT_A_SERVER!r}: the device)")
    # This server dials its peers with its own token or client certificate: a client must not be able to
    # point those credentials at an address of its choosing. Only the peers the tables make it talk to count
    # (a one-stage split with lookahead talks to none, so it needs no --peers).
    for k in sorted(talks_to):
        if not peer_allowed(peers[k], allowed_peers):
            raise PermissionDenied(f"SplitRun: peer {peers[k][:80]!r} is not an allowed peer of this server; start "
                                   "it with --peers listing its split-job peers (loopback is always allowed)")
    return result


def _parts(level: dpb.SplitLevel, me: int, bands: list[tuple[int, int]], windows: list[tuple[int, int]],
           j: int) -> list[tuple[tuple[int, int], tuple[int, int], int]]:
    """This server's checked runs of level ``j``'s segment (SplitLevel.parts): their rows tile its band, each
    window lies in its window of the level before, crops are non-negative; [] when it has none."""
    if not level.parts:
        return []
    if j == 0 or len(level.parts) != len(bands):
        raise invalid(f"SplitRun: level {j} lists parts for {len(level.parts)} servers; a segment's level needs one "
                      f"list per server ({len(bands)})")
    runs = [(_interval(p.rows), _interval(p.window), int(p.crop)) for p in level.parts[me].part]
    if not runs:
        return []
    if len(runs) > MAX_PARTS:  # each part is an ORT run: a band cut row by row would multiply the job's compute
        raise invalid(f"SplitRun: level {j} lists {len(runs)} parts for this server; at most {MAX_PARTS} (the "
                      "interior and the two borders)")
    lo, hi = windows[me]
    cursor, rows = bands[me][0], sorted(r for r, _, _ in runs)
    for a, b in rows:
        if a != cursor or b <= a:
            break
        cursor = b
    if cursor != bands[me][1] or any(not (lo <= w[0] < w[1] <= hi) or c < 0 for _, w, c in runs):
        raise invalid(f"SplitRun: the parts of level {j} must tile this server's band {list(bands[me])} with windows "
                      f"inside its window [{lo}, {hi}) and non-negative crops")
    return runs


def _level_tables(request: dpb.SplitRequest, models: list, servers: int) -> list[dict[str, TensorRows]]:
    """The checked tensor tables of a job across scales (SplitLevel.tensors), per level; [] when it has none.
    Level 0 lists the image (the first segment's input); every later level lists every tensor alive at it:
    each output of its segment with one non-negative crop per server, the others carried from the level
    before with the same bands; every input of the next segment has one window per server; bands tile the
    tensor's rows, windows lie inside them. Such a job runs each segment once (no parts)."""
    if not any(level.tensors for level in request.levels):
        return []
    if any(level.parts for level in request.levels):
        raise invalid("SplitRun: a job across scales (levels of several tensors) runs each segment once, without "
                      "parts")
    tables: list[dict[str, TensorRows]] = []
    for j, level in enumerate(request.levels):
        made = {o.name for o in models[j - 1].outputs} if j else set()
        reads = {i.name for i in models[j].inputs} if j < len(models) else set()
        mine: dict[str, TensorRows] = {}
        for t in level.tensors:
            mine[t.name] = _tensor_rows(t, j, servers, mine, t.name in made, t.name in reads,
                                        tables[-1] if tables else {})
        missing = sorted((made | reads) - set(mine))
        if missing or not j and len(mine) != 1:
            raise invalid(f"SplitRun: level {j} must list every output of its segment and every input of the next "
                          f"(level 0: the image alone); missing {[m[:80] for m in missing][:4]}")
        tables.append(mine)
    image = next(iter(tables[0].values()))
    a = [_interval(r) for r in request.levels[1].window]
    if image[0] != [_interval(r) for r in request.levels[0].owned] or image[2] != a:
        raise invalid("SplitRun: the image's band and window at level 0 must be levels[0].owned and levels[1].window")
    return tables


def _tensor_rows(t: dpb.LevelTensor, j: int, servers: int, listed: dict, made: bool, read: bool,
                 before: dict[str, TensorRows]) -> TensorRows:
    """One tensor's checked tables at level ``j`` (see `_level_tables`)."""
    what = f"SplitRun: level {j} tensor {t.name[:80]!r}"
    if not t.name or len(t.name) > MAX_TENSOR_NAME or t.name in listed:
        raise invalid(f"{what}: a name of 1 to {MAX_TENSOR_NAME} characters, listed once")
    owned, crop = [_interval(r) for r in t.owned], [int(c) for c in t.crop]
    window = [_interval(r) for r in t.window]
    if len(owned) != servers:
        raise invalid(f"{what}: needs one band per server ({servers})")
    try:
        check_tables([owned], [[]], [owned[-1][1]])
    except PlanningError as exc:
        raise invalid(f"{what}: {exc}") from None
    if made and (len(crop) != servers or any(c < 0 for c in crop)):
        raise invalid(f"{what}: an output of the segment needs one non-negative crop per server")
    if not made and (crop or j and (t.name not in before or before[t.name][0] != owned)):
        raise invalid(f"{what}: is not an output of the segment, so it is carried from level {j - 1} with its "
                      "bands (and no crop)")
    height = owned[-1][1]
    if read != bool(window) or read and (len(window) != servers or any(not 0 <= lo < hi <= height
                                                                          for lo, hi in window)):
        raise invalid(f"{what}: an input of the next segment needs one window per server inside its {height} "
                      "rows; any other tensor none")
    return owned, crop, window


class SplitJobs:
    """The split-job handlers of DeepcoService (wired in by server.service.DeepcoServicer)."""

    def __init__(self, state: ServerState, threads: int | None = None,
                 channel_factory: Callable[[str], grpc.Channel] | None = None):
        # channel_factory opens the channel to a peer's address; by default the server's one home for dialling
        # peers (server.peers: its allow-list, and its own credentials, state.peer_security from server.app).
        self.state = state
        self.peers = state.peer_channels if channel_factory is None else \
            PeerChannels(state.peers, state.peer_security, lambda address, _: channel_factory(address))
        self.mailboxes = Mailboxes(threads=threads)

    def peer_stub(self, address: str) -> dpb_grpc.DeepcoServiceStub:
        """A stub to a peer server (checked address; the channel is reused)."""
        return self.peers.stub(address)

    def _stub(self, address: str) -> dpb_grpc.DeepcoServiceStub:
        return self.peers.checked_stub(address)  # a job's peers were checked with its tables (parse_request)

    def exchange(self, messages: Iterator[dpb.RowsMessage], who: str = "") -> dpb.ExchangeAck:
        """SplitExchange: file each message's rows in its job's mailbox; ``who`` sent them (its identity)."""
        count = 0
        for message in messages:
            try:
                array, start = decode_rows(message.rows, f"rows of level {message.level} from server {message.sender}")
            except TensorError as exc:
                raise invalid(f"SplitExchange: {exc}") from None
            if not message.job_id or len(message.job_id) > MAX_JOB_ID or len(message.tensor) > MAX_TENSOR_NAME:
                raise invalid(f"SplitExchange: job_id must be 1 to {MAX_JOB_ID} characters, a tensor's name at most "
                              f"{MAX_TENSOR_NAME}")
            try:
                self.mailboxes.deliver(message.job_id, message.level, message.sender, array, start, who,
                                       message.tensor)
            except ResourceExhausted as exc:
                self.state.refusals.count("mailbox", str(exc))
                raise
            count += 1
        return dpb.ExchangeAck(messages=count)

    def run(self, job: Job, active: Callable[[], bool], began: float | None = None,
            decoded: float | None = None) -> dpb.SplitResult:
        """Run a claimed job to its band of the last level (see the module doc); ``active`` says whether the
        client still waits for it (its waits end CANCELLED once not). ``began``..``decoded`` (perf_counter):
        the call's start and when its input was decoded, the step's first phase (default: now, none)."""
        result = dpb.SplitResult()
        origin = time.perf_counter() if began is None else began
        clock = StepClock(result.times, origin)
        if decoded is not None:
            clock.add("input", origin, decoded)
        deadline_total = job.timeout * (len(job.models) + 1) + 60.0
        outgoing = Streams(lambda peer: Outgoing(self._stub(job.peers[peer]), peer, job.peers[peer], deadline_total),
                           job.feeds)
        ok = False
        try:
            if job.scales:
                self._run_scales(job, outgoing, active, result, clock)
            else:
                self._run_bands(job, outgoing, active, result, clock)
            last = len(job.models)
            sending = time.perf_counter()
            for out in outgoing.opened():  # every stream ended first: the peers' acknowledgements overlap
                out.end()
            for out in outgoing.opened():
                out.finish(job.timeout)
            clock.since("send", sending, last)
            clock.finish()
            ok = True
            return result
        finally:
            if not ok:
                for out in outgoing.opened():
                    out.cancel()

    def _run_bands(self, job: Job, outgoing: Streams, active: Callable[[], bool], result: dpb.SplitResult,
                   clock: StepClock) -> None:
        """The segments of a job of one tensor per level, then its band of the last level answered, sent to the
        server that gathers, or gathered here with the tail run."""
        # with lookahead the device sent this server's window of the image (or its first rows), else its band
        first = job.windows[1][job.me][0] if job.lookahead else job.bands[0][job.me][0]
        pieces: Pieces = [(first, job.image)]
        for j, model in enumerate(job.models, start=1):
            pieces = self._segment(job, j, model, pieces, outgoing, active, result, clock)
        band = pieces[0][1]
        if len(pieces) > 1:  # the last segment ran in parts: its rows stitched into one band
            stitching = time.perf_counter()
            band = self.state.window_buffers.take_like(band, sum(r.shape[2] for _, r in pieces))
            np.concatenate([r for _, r in pieces], axis=2, out=band)
            clock.since("assemble", stitching, len(job.models))
        if job.gather_to is None:
            self._answer(result, band, job.bands[-1][job.me][0], clock, len(job.models))
        elif job.gather_to != job.me:
            self._send_band(job, band, outgoing, result, clock)
        else:
            self._gather_and_finish(job, band, outgoing, result, active, clock)
        if len(pieces) > 1:  # copied into the answer, the message to the gatherer, or the gathered tail input
            self.state.window_buffers.give(band)

    def _segment(self, job: Job, j: int, model, own: Pieces, outgoing: Streams, active: Callable[[], bool],
                 result: dpb.SplitResult, clock: StepClock) -> Pieces:
        """Segment ``j`` of the job: send the peers their rows of level j-1 from ``own`` (this server's band of
        that level, as the runs of the segment before made it: never stitched), gather each run's window from
        it and the peers' rows, run the segment; this server's band of level j, a piece per run."""
        level = j - 1
        for peer, (a, b) in job.sends(level).items():
            encoding = time.perf_counter()
            piece = rows_of(own, a, b)
            message = dpb.RowsMessage(job_id=job.id, sender=job.me, level=level)
            encode_rows(piece, a, into=message.rows)  # one copy of the rows, straight into the message
            sending = clock.since("encode", encoding, j)
            outgoing[peer].send(message)
            clock.since("send", sending, j)
            result.messages_sent += 1
            result.bytes_sent += piece.nbytes
        pending = None
        if j == 1 and job.lookahead:  # the device sent the window, or its first rows with the rest to follow
            pending = {job.me: job.rest} if job.rest else {}
        held = Held(job, level, own, pending, self.state.window_buffers)
        like = own[0][1]

        def take(peer: int, rows: tuple[int, int]) -> np.ndarray:
            return self._take(job, level, peer, rows, like, outgoing, active, result)

        rows: list[tuple[int, np.ndarray]] = []
        for (a, b), (lo, hi), crop in job.runs(j):  # the interior first: it needs no peer's rows
            window = held.window(lo, hi, take, clock, j)
            y = self._compute(job, model, {model.inputs[0].name: window}, [model.outputs[0].name], clock, j)
            y = y[model.outputs[0].name]
            held.release([y])
            if crop + (b - a) > y.shape[2]:
                raise invalid(f"split job {job.id!r}: segment {model.name!r} gave {y.shape[2]} rows on "
                              f"[{lo}, {hi}); crop {crop} + rows {b - a} does not fit")
            rows.append((a, y[:, :, crop:crop + b - a]))
        rows.sort(key=lambda r: r[0])
        return rows

    def _compute(self, job: Job, model, feeds: dict[str, np.ndarray], outputs: list[str], clock: StepClock,
                 level: int) -> dict[str, np.ndarray]:
        """``model`` on ``feeds`` once a compute slot is free, the wait timed as queue, the run as compute."""
        queued = time.perf_counter()
        with self.state.admission.waiting(job.timeout):
            started = clock.since("queue", queued, level)
            output = model.run(feeds, outputs)
            clock.since("compute", started, level)
        return output

    def _run_scales(self, job: Job, outgoing: Streams, active: Callable[[], bool], result: dpb.SplitResult,
                    clock: StepClock) -> None:
        """A job across scales: its band of every tensor of each level in turn (skips kept until read), then of
        the last level answered by name, sent to the server that gathers, or gathered here with the tail run."""
        image = next(iter(job.scales[0]))
        start = job.windows[1][job.me][0] if job.lookahead else job.bands[0][job.me][0]
        held: dict[str, tuple[int, np.ndarray]] = {image: (start, job.image)}
        for j, model in enumerate(job.models, start=1):
            held = self._scales_segment(job, j, model, held, outgoing, active, result, clock)
        last = len(job.models)
        encoding = time.perf_counter()
        if job.gather_to is None:
            for name, (a, band) in held.items():
                encode_rows(band, a, into=result.outputs.add(name=name).rows)
            clock.since("encode", encoding, last)
        elif job.gather_to != job.me:
            for name, (a, band) in held.items():
                message = dpb.RowsMessage(job_id=job.id, sender=job.me, level=last, tensor=name)
                encode_rows(band, a, into=message.rows)
                outgoing[job.gather_to].send(message)
                result.messages_sent += 1
                result.bytes_sent += band.nbytes
            clock.since("send", encoding, last)
        else:
            self._gather_scales(job, held, outgoing, result, active, clock)

    def _scales_segment(self, job: Job, j: int, model, held: dict[str, tuple[int, np.ndarray]], outgoing: Streams,
                        active: Callable[[], bool], result: dpb.SplitResult,
                        clock: StepClock) -> dict[str, tuple[int, np.ndarray]]:
        """Segment ``j`` across scales: send each peer its rows of every tensor it reads from ``held`` (this
        server's bands of level j-1, by name: (first row, rows)), assemble each input's window from ours and
        the peers' rows, run the segment once; this server's bands of level j (outputs cropped, skips kept)."""
        level = j - 1
        for t, peers in job.tensor_rows(level, sends).items():
            start, band = held[t]
            for peer, (a, b) in peers.items():
                encoding = time.perf_counter()
                message = dpb.RowsMessage(job_id=job.id, sender=job.me, level=level, tensor=t)
                encode_rows(band[:, :, a - start:b - start], a, into=message.rows)
                sending = clock.since("encode", encoding, j)
                outgoing[peer].send(message)
                clock.since("send", sending, j)
                result.messages_sent += 1
                result.bytes_sent += (b - a) * band[:, :, :1].nbytes
        pending = job.tensor_rows(level, receives)
        feeds, windows = {}, []
        for i in model.inputs:
            start, band = held[i.name]

            def take(peer: int, rows: tuple[int, int], t: str = i.name, like: np.ndarray = band) -> np.ndarray:
                return self._take(job, level, peer, rows, like, outgoing, active, result, t)

            lo, hi = job.scales[level][i.name][2][job.me]
            windows.append(Held(job, level, [(start, band)], pending.get(i.name, {}), self.state.window_buffers))
            feeds[i.name] = windows[-1].window(lo, hi, take, clock, j)
        made = [name for name, (_, crop, _) in job.scales[j].items() if crop]
        output = self._compute(job, model, feeds, made, clock, j)
        for window in windows:
            window.release(output.values())
        out = {}
        for name, (owned, crop, _) in job.scales[j].items():
            if not crop:
                out[name] = held[name]
                continue
            y, (a, b), c = output[name], owned[job.me], crop[job.me]
            if y.ndim != 4 or c + (b - a) > y.shape[2]:
                raise invalid(f"split job {job.id!r}: segment {model.name!r} gave {list(y.shape)} for {name[:80]!r}; "
                              f"crop {c} + band {b - a} does not fit")
            out[name] = (a, y[:, :, c:c + b - a])
        return out

    def _gather_scales(self, job: Job, held: dict[str, tuple[int, np.ndarray]], outgoing: Streams,
                       result: dpb.SplitResult, active: Callable[[], bool], clock: StepClock) -> None:
        """Every peer's bands of the last level's tensors, stitched with ours, through the tail model: every
        output of the model, by name, into ``result.outputs``."""
        last = len(job.models)
        waited = time.perf_counter()
        pieces = {}
        for name, (a, band) in held.items():
            pieces[name] = [(a, band)]
            for peer in range(len(job.peers)):
                if peer != job.me:
                    rows = job.scales[last][name][0][peer]
                    pieces[name].append((rows[0], self._take(job, last, peer, rows, band, outgoing, active, result,
                                                             name)))
        copying = clock.since("halo", waited, last + 1)
        whole = {name: np.ascontiguousarray(np.concatenate([p for _, p in sorted(got, key=lambda p: p[0])], axis=2))
                 for name, got in pieces.items()}
        clock.since("assemble", copying, last + 1)
        self._run_tail(job, {i.name: whole[i.name] for i in job.tail.inputs}, result, clock)

    def _run_tail(self, job: Job, feeds: dict[str, np.ndarray], result: dpb.SplitResult, clock: StepClock) -> None:
        """The tail model on the gathered ``feeds``: every output of the model, by name, into ``result.outputs``."""
        last = len(job.models)
        job.tail.check_inputs(feeds)
        outputs = self._compute(job, job.tail, feeds, [o.name for o in job.tail.outputs], clock, last + 1)
        encoding = time.perf_counter()
        try:
            named_rows(outputs, result.outputs)
        except ValueError as exc:
            raise invalid(f"SplitRun: the tail's output: {exc}") from None
        clock.since("encode", encoding, last + 1)

    @staticmethod
    def _answer(result: dpb.SplitResult, rows: np.ndarray, start: int, clock: StepClock, level: int) -> None:
        """Put ``rows`` (starting at row ``start``) into the answer to the device, timed as encoding."""
        encoding = time.perf_counter()
        encode_rows(rows, start, into=result.output)
        clock.since("encode", encoding, level)

    def _send_band(self, job: Job, band: np.ndarray, outgoing: Streams, result: dpb.SplitResult,
                   clock: StepClock) -> None:
        """This server's band of the last level, to the server that gathers it."""
        peer, last = job.gather_to, len(job.models)
        encoding = time.perf_counter()
        message = dpb.RowsMessage(job_id=job.id, sender=job.me, level=last)
        encode_rows(band, job.bands[-1][job.me][0], into=message.rows)
        sending = clock.since("encode", encoding, last)
        outgoing[peer].send(message)
        clock.since("send", sending, last)
        result.messages_sent += 1
        result.bytes_sent += band.nbytes

    def _gather_and_finish(self, job: Job, band: np.ndarray, outgoing: Streams,
                           result: dpb.SplitResult, active: Callable[[], bool],
                           clock: StepClock) -> None:
        """Every peer's band of the last level, stitched with ours, through the tail model: every output of
        the model, by name, into ``result.outputs``."""
        last = len(job.models)
        pieces = [(job.bands[-1][job.me][0], band)]
        waited = time.perf_counter()
        for peer in range(len(job.peers)):
            if peer != job.me:
                rows = job.bands[-1][peer]
                pieces.append((rows[0], self._take(job, last, peer, rows, band, outgoing, active, result)))
        copying = clock.since("halo", waited, last + 1)
        pieces.sort(key=lambda p: p[0])
        whole = np.ascontiguousarray(np.concatenate([p for _, p in pieces], axis=2))
        clock.since("assemble", copying, last + 1)
        self._run_tail(job, {job.tail.inputs[0].name: whole}, result, clock)

    def _take(self, job: Job, level: int, peer: int, rows: tuple[int, int], like: np.ndarray,
              outgoing: Streams, active: Callable[[], bool], result: dpb.SplitResult, tensor: str = "") -> np.ndarray:
        """Rows [a, b) of ``level`` (its ``tensor``, for a level of several) from ``peer``, checked against the
        tables (and shaped like ``like`` but for the rows, of its type: they are copied into a window of it);
        counted in ``result``."""
        a, b = rows
        array, start = self._wait(job, level, peer, outgoing, active, tensor)
        if start != a or array.shape[2] != b - a or array.shape[:2] != like.shape[:2] \
                or array.shape[3] != like.shape[3] or array.dtype != like.dtype:
            raise invalid(f"job {job.id!r}: {_sender(job, level, peer)} sent rows [{start}, "
                          f"{start + array.shape[2]}) shape {list(array.shape)} {array.dtype} of level {level}, "
                          f"expected rows [{a}, {b}) {like.dtype}")
        result.messages_received += 1
        result.bytes_received += array.nbytes
        return array

    def _wait(self, job: Job, level: int, peer: int, outgoing: Streams,
              active: Callable[[], bool], tensor: str = "") -> tuple[np.ndarray, int]:
        """The rows of ``level`` from ``peer``: DEADLINE_EXCEEDED naming it if they do not come in time;
        fails at once if the job is cancelled or one of our own streams to a peer broke."""
        until = time.monotonic() + job.timeout
        while True:
            got = self.mailboxes.take(job.id, level, peer, POLL_SECONDS, tensor)
            if got is not None:
                return got
            if not active():
                raise Cancelled(f"split job {job.id!r} cancelled")
            for out in outgoing.opened():
                if (err := out.error()) is not None:
                    raise err
            if time.monotonic() > until:
                raise DeadlineExceeded(f"split job {job.id!r}: no rows of level {level} {tensor[:80]} from "
                                       f"{_sender(job, level, peer)} within {job.timeout:g}s")
