"""A segment's rows to its peers are written before the server computes (server/split_jobs.py, `Outgoing.flush`):
gRPC writes them on a thread of its own in the server's CPU quota, which a run beside it starved."""

from __future__ import annotations

import threading
import time

from deepco_server.split_jobs import Outgoing

from deepco.wire import deepco_service_pb2 as dpb


class SlowWire:
    """A stand-in for the SplitExchange stub: consumes the messages as gRPC does, asking for the next only once
    the last is written, each write taking ``seconds``."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.written: list[tuple[float, dpb.RowsMessage]] = []
        self.SplitExchange = self

    def future(self, messages, timeout):
        done = threading.Event()

        def consume():
            for message in messages:
                time.sleep(self.seconds)
                self.written.append((time.perf_counter(), message))
            done.set()

        threading.Thread(target=consume, daemon=True).start()
        return _Future(done)


class _Future:
    def __init__(self, done: threading.Event):
        self._done = done

    def done(self) -> bool:
        return self._done.is_set()

    def cancelled(self) -> bool:
        return False

    def exception(self):
        return None


def test_flush_returns_once_every_queued_message_is_written():
    wire = SlowWire(0.05)
    out = Outgoing(wire, 1, "peer", 10.0)
    assert out.flush(0.0)  # nothing queued: nothing to wait for
    for level in range(2):
        out.send(dpb.RowsMessage(job_id="j", sender=0, level=level))
    began = time.perf_counter()
    assert out.flush(5.0)
    flushed = time.perf_counter()
    assert len(wire.written) == 2 and all(at <= flushed for at, _ in wire.written)
    assert flushed - began >= 0.09  # two writes of 50 ms each
    out.end()


def test_flush_gives_up_after_its_timeout_and_the_message_still_goes():
    wire = SlowWire(0.3)
    out = Outgoing(wire, 1, "peer", 10.0)
    out.send(dpb.RowsMessage(job_id="j", sender=0, level=1))
    began = time.perf_counter()
    assert not out.flush(0.02)
    assert time.perf_counter() - began < 0.25 and not wire.written
    assert out.flush(5.0) and [m.level for _, m in wire.written] == [1]
    out.end()
