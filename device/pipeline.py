"""The frame pipeline: a stream of frames through a staged runner, ``depth`` frames in flight, results in order.

Each frame runs on the runner `device.health.Health` says is current; a frame whose server fails is tried
again on the plan made without that server (up to MAX_RETRIES times), so every frame yields its output or
an explicit error and none is lost. While frames wait, a `GiveUp` decides whether the run has failed for
too long; then every call in flight is cancelled. Each result carries its timeline (`FrameResult.servers`:
per participant, seconds from the frame's start; `dispatch`, `stitch`, `tail`), and which server a
recomputed frame was first sent to (``recovered_from``), and when the frame was captured and its result
delivered (``captured``, ``delivered``: its capture-to-result latency). Frames come from a `device.feed.Feed`,
taken only when fewer than ``depth`` are in flight: a live source's feed keeps the latest frame meanwhile and
counts the ones it drops, which never entered; every frame that entered leaves with a result or an error.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
from deepco_device.feed import EndOfFeed, Feed, Frame, IterFeed
from deepco_device.giveup import TICK, GaveUp, GiveUp
from deepco_device.health import Health
from deepco_device.records import FrameResult, FrameTiming, ServerTiming

from deepco.errors import UserError
from deepco.planning.staged import StagedPlan
from deepco.wire.client import ServerError

MAX_RETRIES = 3  # a frame whose servers fail is tried again on a new plan this many times


class RunStopped(UserError):
    """The run stopped (gave up) while this frame was in flight: its calls were cancelled."""


def timeline(result: FrameResult, timing: FrameTiming, plan: StagedPlan, offset: float,
             recovered_from: str | None) -> None:
    """Fill ``result``'s breakdown from a runner's ``timing`` of one try that began ``offset`` seconds after
    the frame: per participant (an offloaded frame's server included) its send, transfer (until it reported
    its input received, at most what its own times leave), queue, compute and the rest (exchanges, the
    answer's return); the hand-over to the stitch (``dispatch``), the stitch and the tail. They add up to
    ``result.latency``."""
    result.staged = timing
    result.stitch, result.tail = timing.stitch, timing.tail
    servers = []
    for s in timing.servers:
        send, finish = offset + s.send_start, offset + s.finish
        total = finish - send
        transfer = max(0.0, min(s.received - s.send_start, total - s.compute - s.queue))
        servers.append(ServerTiming(s.name, s.antenna, s.band, send, transfer, s.queue,
                                    s.compute, total - transfer - s.queue - s.compute, finish, recovered_from))
    result.servers = servers
    critical = max((t.finish for t in servers), default=offset)
    result.dispatch = max(0.0, result.latency - critical - result.stitch - result.tail)


def run_one(health: Health, inflight, frame: Frame) -> FrameResult:
    """One frame on the current runner, tried again on a new plan when a server fails (see the module doc)."""
    result = FrameResult(frame.index, captured=frame.captured)
    x = frame.pixels
    began = time.perf_counter()
    health.rejoin_soon()
    recovered_from = None
    for _ in range(MAX_RETRIES + 1):
        current = health.current()
        try:
            outputs, timing = current.run_frame(x)
        except ServerError as exc:
            if inflight.stopped.is_set():
                result.error = f"the run stopped ({exc})"
                break
            why = health.failed(current, exc)
            result.error = str(exc)
            if why is not None:
                result.error = why
                break
            recovered_from = health.server_at(exc.address) or recovered_from
            continue
        except RunStopped as exc:
            result.error = str(exc)
            break
        now = time.perf_counter()
        result.outputs, result.error = outputs, None  # an earlier try's failure was recovered from
        result.latency = now - began
        timeline(result, timing, current.plan, now - timing.latency - began, recovered_from)
        health.observe(current, timing)
        return result
    result.latency = time.perf_counter() - began
    return result


def _outcome(future, health: Health, give_up: GiveUp) -> FrameResult:
    """The frame's result once it is there (stamped with when it was delivered); meanwhile, ask
    ``give_up`` whether to stop."""
    while not wait([future], timeout=TICK).done:
        give_up.check(True, health.waiting_for())
    try:
        result = future.result()
    except UserError:
        raise
    except Exception as exc:  # the device's own code failed: one line, not a traceback
        raise UserError(f"the device's frame worker failed: {type(exc).__name__}: {exc}") from exc
    result.delivered = time.perf_counter()
    return result


def run_frames(health: Health, inputs: Iterable[np.ndarray] | Feed, depth: int, give_up: GiveUp,
               inflight, first: int = 0, in_flight: Callable[[], int] | None = None) -> Iterator[FrameResult]:
    """Every input's result in order (see the module doc). ``inputs``: a `Feed` (device.feed: a live source
    behind its queue of one frame) or frames to take one by one, numbered from ``first``. ``inflight`` tracks
    the calls of every runner so that a run that stops cancels them all at once. ``in_flight``: how many frames
    may be in flight now (at most ``depth``; `--objective slo` lowers it when the bound is missed).

    Raises GaveUp (a UserError) when ``give_up`` says the run has failed for too long; a failure of the
    device's own code, or of the frame source, is a one-line UserError (the frames already in come first)."""
    feed = inputs if isinstance(inputs, Feed) else IterFeed(inputs, first=first)
    pending: collections.deque = collections.deque()
    source_failed: UserError | None = None
    with ThreadPoolExecutor(max_workers=depth) as pool:
        try:
            while True:
                give_up.check(bool(pending))
                # a finished frame leaves at once, and with ``depth`` in flight the oldest is waited for
                room = depth if in_flight is None else max(1, min(depth, in_flight()))
                if pending and (len(pending) >= room or pending[0].done()):
                    result = _outcome(pending.popleft(), health, give_up)
                    yield result
                    give_up.seen(result)
                    continue
                try:
                    frame = feed.take(TICK)
                except EndOfFeed:
                    break
                except UserError as exc:  # the frames already in still come out
                    source_failed = exc
                    break
                except Exception as exc:
                    source_failed = UserError(f"the frame source failed: {type(exc).__name__}: {exc}")
                    break
                if frame is None:  # nothing came yet, or a frame in flight is done
                    continue
                future = pool.submit(run_one, health, inflight, frame)
                future.add_done_callback(lambda _: feed.wake())
                pending.append(future)
            while pending:
                result = _outcome(pending.popleft(), health, give_up)
                yield result
                give_up.seen(result)
        except BaseException as exc:  # gave up, failed, or the consumer stopped: no frame waits for its deadline
            silent = inflight.cancel_all()
            if isinstance(exc, GaveUp):  # what the run waited on in vain: Device.close() does not wait again
                health.device.down.update(silent)
            raise
        finally:
            feed.close()
    if source_failed is not None:
        raise source_failed
