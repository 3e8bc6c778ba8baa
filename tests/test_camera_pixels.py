"""The pixels a camera sends (device.preprocess.pixels, and Pixels, which keeps the resized frame's buffer from
frame to frame): the frame centre-cropped or not, resized with area averaging, in the model's channel order,
1xCxHxW uint8; checked against OpenCV's own colour conversion and a plain transpose. And OpenCV's threads on a
camera of a fraction of a core (device.preprocess.fit_threads)."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from deepco_device.preprocess import Pixels, center_crop, fit_threads, pixels

from deepco.modelcard import Preprocessing


def _reference(frame: np.ndarray, height: int, width: int, how: Preprocessing) -> np.ndarray:
    """What the pixels must be, step by step with OpenCV's colour conversions and numpy's transpose."""
    if how.channels == 1:
        frame = cv2.cvtColor(frame, cv2.COLOR_BGR2GRAY)
    if how.center_crop:  # the crop's own arithmetic is center_crop's (not what this test is about)
        frame = center_crop(frame, width / height)
    resized = cv2.resize(frame, (width, height), interpolation=cv2.INTER_AREA)
    if how.channels == 1:
        return resized[None, None]
    if how.rgb:
        resized = cv2.cvtColor(resized, cv2.COLOR_BGR2RGB)
    return resized.transpose(2, 0, 1)[None]


@pytest.mark.parametrize("how", [Preprocessing(), Preprocessing(rgb=False), Preprocessing(resize="stretch"),
                                 Preprocessing(channels=1, mean=(0.5,), std=(0.25,))],
                         ids=["rgb-crop", "bgr-crop", "rgb-stretch", "grey"])
@pytest.mark.parametrize("size", [(72, 128), (61, 47)])
def test_pixels_are_the_frame_resized_in_the_models_channel_order(how, size):
    frame = np.random.default_rng(3).integers(0, 256, (97, 133, 3), dtype=np.uint8)
    frame[:, :, 0] //= 3  # channels that differ, so that a swapped order shows
    height, width = size
    expected = _reference(frame, height, width, how)
    px = pixels(frame, height, width, how)
    assert px.dtype == np.uint8 and px.flags.c_contiguous
    assert px.shape == (1, how.channels, height, width)
    np.testing.assert_array_equal(px, expected)
    kept = Pixels(height, width, how)
    first = kept(frame)
    second = kept(255 - frame)  # the next frame goes through the same buffer
    np.testing.assert_array_equal(first, expected)  # and leaves the pixels already handed out as they were
    np.testing.assert_array_equal(second, _reference(255 - frame, height, width, how))


def test_opencv_runs_on_the_callers_thread_on_a_fraction_of_a_core_and_keeps_its_threads_on_several():
    try:
        cv2.setNumThreads(4)
        assert fit_threads(8.0) == 4  # several cores: left as it was
        assert fit_threads(0.1) == 1  # a camera's tenth of a core: no workers to spin
        assert fit_threads(1.5) == 1
    finally:
        cv2.setNumThreads(-1)  # OpenCV's default again for the other tests
