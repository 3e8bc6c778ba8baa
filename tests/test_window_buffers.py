"""A split job's windows are assembled into arrays the server reuses from frame to frame (server/window_buffers.py):
what a window holds is exactly its rows, frame after frame; the pool keeps what it may and no more."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from deepco_server import window_buffers
from deepco_server.app import ServeConfig, Server
from deepco_server.errors import Kind, ServerFault
from deepco_server.split_jobs import Held, SplitJobs, rows_of
from deepco_server.window_buffers import WindowBuffers

from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire.step_times import StepClock

RNG = np.random.default_rng(0)


def rows(h: int, c: int = 4, w: int = 6) -> np.ndarray:
    return RNG.standard_normal((1, c, h, w)).astype(np.float32)


def test_an_array_given_back_is_taken_again_for_its_shape_and_dtype_only():
    pool = WindowBuffers()
    a = pool.take((1, 4, 10, 6), np.float32)
    pool.give(a)
    assert pool.take((1, 4, 11, 6), np.float32) is not a
    assert pool.take((1, 4, 10, 6), np.float64) is not a
    assert pool.take((1, 4, 10, 6), np.float32) is a
    assert pool.take((1, 4, 10, 6), np.float32) is not a  # taken: not handed out twice
    assert pool.pooled_bytes == 0


def test_the_pool_keeps_at_most_its_bytes_dropping_the_least_recently_given_first():
    first, second, third = (np.empty((1, 4, 10 + k, 6), np.float32) for k in range(3))
    pool = WindowBuffers(max_bytes=first.nbytes + second.nbytes)
    pool.give(first)
    pool.give(second)
    assert pool.pooled_bytes == first.nbytes + second.nbytes <= pool.max_bytes
    pool.give(third)  # over the bound with all three: the least recently given goes
    assert pool.pooled_bytes <= pool.max_bytes
    assert pool.take(first.shape, np.float32) is not first
    assert pool.take(third.shape, np.float32) is third
    pool.give(np.empty((1, 4, 100, 6), np.float32))  # alone over the bound: not kept
    pool.give(third[:, :, 1:])  # a view: its memory is another array's
    assert pool.take((1, 4, 100, 6), np.float32).base is None and pool.pooled_bytes <= second.nbytes


def test_the_pool_is_dropped_once_unused_for_its_keep_time_only(monkeypatch):
    pool = WindowBuffers()
    pool.give(np.empty((1, 4, 10, 6), np.float32))
    assert not pool.expire() and pool.pooled_bytes > 0  # just used: kept through a quiet second
    monkeypatch.setattr(window_buffers, "KEEP_SECONDS", 0.0)
    assert pool.expire() and pool.pooled_bytes == 0
    assert not pool.expire()  # nothing left to drop


def _window(pool: WindowBuffers, band: np.ndarray, peer_rows: dict[int, np.ndarray], own: tuple[int, int],
            lo: int, hi: int) -> tuple[Held, np.ndarray]:
    pending, start = {}, {}
    for peer, array in peer_rows.items():
        start[peer] = own[1] if peer > 0 else own[0] - array.shape[2]
        pending[peer] = (start[peer], start[peer] + array.shape[2])
    held = Held(SimpleNamespace(id="job"), 1, [(own[0], band)], pending, pool)
    window = held.window(lo, hi, lambda peer, _rows: peer_rows[peer], StepClock(dpb.StepTimes(), 0.0), 1)
    return held, window


def test_a_window_is_exactly_its_rows_frame_after_frame_in_the_same_array():
    pool = WindowBuffers()
    arrays = []
    for _frame in range(3):
        band, above, below = rows(8), rows(2), rows(3)
        held, window = _window(pool, band, {-1: above, 1: below}, (10, 18), 8, 21)
        np.testing.assert_array_equal(window, np.concatenate([above, band, below], axis=2))
        arrays.append(window)
        held.release([np.zeros(1)])  # the run's output is memory of its own
    assert arrays[1] is arrays[0] and arrays[2] is arrays[0]  # the second frame took no new memory
    # a window that is the band itself, contiguous, is not copied and not the pool's
    band = rows(8)
    held, window = _window(pool, band, {}, (10, 18), 10, 18)
    assert np.shares_memory(window, band) and held.lent == []
    # one piece of a band that is not contiguous: copied, exactly
    held, window = _window(pool, band, {}, (10, 18), 12, 16)
    np.testing.assert_array_equal(window, band[:, :, 2:6])
    assert window.flags.c_contiguous and window.base is None


def test_a_window_an_output_shares_is_not_given_back():
    pool = WindowBuffers()
    held, window = _window(pool, rows(8), {1: rows(2)}, (0, 8), 0, 10)
    held.release([window[:, :, 1:3]])  # e.g. a segment whose output is a view of its input
    assert pool.pooled_bytes == 0
    held, again = _window(pool, rows(8), {1: rows(2)}, (0, 8), 0, 10)
    assert again is not window
    held.release([])
    assert pool.pooled_bytes == again.nbytes


def test_a_peers_rows_of_another_type_are_refused_naming_both_types():
    """A window is written into an array of the band's type: a peer's rows of another type (float64 sent for
    float32) are refused INVALID_ARGUMENT, not cast into it."""
    server = Server(ServeConfig(port=0, device="cpu", threads=1))
    try:
        jobs = SplitJobs(server.state)
        jobs.mailboxes.claim("job", 2)
        jobs.mailboxes.deliver("job", 1, 1, np.zeros((1, 4, 2, 6), np.float64), 8, "peer")
        job = SimpleNamespace(id="job", timeout=5.0, peers=["127.0.0.1:1", "127.0.0.1:2"], me=0)
        outgoing = SimpleNamespace(opened=lambda: [])
        with pytest.raises(ServerFault) as err:
            jobs._take(job, 1, 1, (8, 10), rows(8), outgoing, lambda: True, dpb.SplitResult())
        assert err.value.kind == Kind.INVALID_ARGUMENT and "float64" in str(err.value) and "float32" in str(err.value)
        jobs.mailboxes.deliver("job", 1, 2, rows(2), 8, "peer")  # the same rows as float32 are taken
        got = jobs._take(job, 1, 2, (8, 10), rows(8), outgoing, lambda: True, dpb.SplitResult())
        assert got.dtype == np.float32 and got.shape == (1, 4, 2, 6)
    finally:
        server.stop(0)


def test_rows_read_from_a_bands_pieces_are_exactly_those_rows_a_view_where_one_piece_holds_them():
    """A segment run in parts leaves its band as the parts made it (server/split_jobs.py `rows_of`): the rows
    for a peer, or any rows of the band, read across the pieces equal the stitched band's."""
    pieces = [(10, rows(4)), (14, rows(3)), (17, rows(5))]
    band = np.concatenate([p for _, p in pieces], axis=2)
    for a, b in [(10, 22), (11, 13), (13, 18), (14, 17), (20, 22), (16, 17)]:
        got = rows_of(pieces, a, b)
        np.testing.assert_array_equal(got, band[:, :, a - 10:b - 10])
        assert np.shares_memory(got, band) is False
    assert any(np.shares_memory(rows_of(pieces, 14, 16), p) for _, p in pieces)  # within one piece: no copy
