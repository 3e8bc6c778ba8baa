"""The split-job contract's two conventions (who gathers, outputs as NCHW rows) and the request the device
builds for one participant."""

from __future__ import annotations

import numpy as np
import pytest

from deepco.wire.rows import decode_rows
from deepco.wire.split_jobs import from_rows, gather_field, gatherer, job_request, rows_shape, to_rows


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
