"""The split-job contract's two conventions (who gathers, outputs as NCHW rows) and the request the device
builds for one participant."""

from __future__ import annotations

import numpy as np
import pytest

from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire.rows import decode_rows
from deepco.wire.split_jobs import (
    from_rows,
    gather_field,
    gatherer,
    input_rows,
    job_request,
    job_skeleton,
    request_bytes,
    rest_bytes,
    rest_message,
    rows_shape,
    to_rows,
)


@pytest.mark.parametrize("tail", [None, 0, 1, 2])
def test_who_gathers_survives_the_wire(tail):
    assert gatherer(gather_field(tail), 3) == tail


@pytest.mark.parametrize("field", [-1, 4, 99])
def test_a_gatherer_that_is_no_participant_is_refused(field):
    with pytest.raises(ValueError, match=f"gather_to {field} is not 1 \\+ an index of the 3 peers"):
        gatherer(field, 3)


@pytest.mark.parametrize("shape", [(1, 1000), (1, 3, 7), (1, 2, 5, 6)])
def test_outputs_of_any_rank_up_to_four_travel_as_rows_and_come_back(shape):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    wire = to_rows(x)
    assert wire.ndim == 4 and wire.shape == rows_shape(shape)
    assert np.array_equal(from_rows(wire, len(shape)), x)
    with pytest.raises(ValueError):
        to_rows(np.zeros((1, 1, 1, 1, 1)))


def test_a_participant_gets_its_window_of_the_image_and_the_tail_only_if_it_gathers():
    image = np.arange(2 * 10 * 4, dtype=np.uint8).reshape(1, 2, 10, 4)
    bands = [[(0, 5), (5, 10)], [(0, 3), (3, 5)]]
    windows = [[(0, 7), (3, 10)], [(0, 4), (2, 5)]]
    crops = [[0, 0], [0, 1]]
    kwargs = dict(segment_models=["seg"], peers=["a:1", "b:2"], bands=bands, windows=windows, crops=crops,
                  image=image, exchange_timeout=5.0, lookahead=True, tail=1, tail_model="tail")
    first, second = (job_request("job", i, **kwargs) for i in (0, 1))
    rows, start = decode_rows(second.input)
    assert start == 3 and np.array_equal(rows, image[:, :, 3:10, :])
    assert first.tail_model == "" and second.tail_model == "tail" and second.gather_to == 2
    assert [(r.start, r.stop) for r in second.levels[1].window] == windows[1] and list(second.levels[1].crop) == [0, 1]
    assert not second.levels[0].window  # level 0's windows are what the device sends, not part of the level


LAYOUTS = ["contiguous", "a transposed view", "big-endian floats"]


def _frame(layout: str, seed: int) -> np.ndarray:
    image = np.random.default_rng(seed).integers(0, 256, (1, 3, 10, 6), dtype=np.uint8)
    if layout == "a transposed view":  # the same pixels, not C-contiguous
        return np.ascontiguousarray(image.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    if layout == "big-endian floats":  # the wire's raw contents are little-endian whatever the array's order
        return image.astype(">f4")
    return image


@pytest.mark.parametrize("index, rest, tensors, parts", [
    (0, None, (), ()),  # a window from row 0: its start is the default, not on the wire
    (1, None, (), ()),  # the gatherer
    (1, (8, 10), (), ()),  # a streamed window: the request carries the rows above its rest
    (0, None, ({}, {"t": {"owned": [(0, 3), (3, 5)], "crop": [0, 1], "window": [(0, 4), (2, 5)]}}), ()),
    (1, None, (), ([], [[], [((3, 4), (2, 5), 1), ((4, 5), (3, 5), 2)]])),  # its segment's runs
])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_request_as_wire_bytes_is_the_request_built_as_a_message(index, rest, tensors, parts, layout):
    image = _frame(layout, index)
    tables = dict(segment_models=["seg"], peers=["a:1", "b:2"], bands=[[(0, 5), (5, 10)], [(0, 3), (3, 5)]],
                  windows=[[(0, 7), (3, 10)], [(0, 4), (2, 5)]], crops=[[0, 0], [0, 1]], exchange_timeout=5.0,
                  lookahead=True, tail=1, tail_model="tail", tensors=tensors, parts=parts, rest=rest)
    skeleton = job_skeleton(index, **tables).SerializeToString()
    wire = request_bytes(skeleton, "job-7", image, input_rows(tables["windows"], index, rest))
    built = job_request("job-7", index, image=image, **tables)
    parsed = dpb.SplitRequest.FromString(wire)
    assert parsed == built
    rows, start = decode_rows(parsed.input)
    a, b = input_rows(tables["windows"], index, rest)
    assert start == a and np.array_equal(rows, image[:, :, a:b, :])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("index, rest", [(0, (7, 10)), (1, (3, 5))])
def test_a_windows_rest_as_wire_bytes_is_the_rows_message_built(layout, index, rest):
    image = _frame(layout, index)
    parsed = dpb.RowsMessage.FromString(rest_bytes("job-7", index, image, rest))
    assert parsed == rest_message("job-7", index, image, rest)
    rows, start = decode_rows(parsed.rows)
    assert start == rest[0] and np.array_equal(rows, image[:, :, rest[0]:rest[1], :])


def test_a_frame_of_another_rank_is_refused_before_any_bytes_are_made():
    with pytest.raises(ValueError, match="1xCxHxW"):
        request_bytes(b"", "job", np.zeros((3, 10, 6), np.uint8), (0, 2))
