"""`deepco run --save-outputs`' inputs (device.run_report.Saved): written as the unpartitioned model takes them,
and nothing kept (or computed) for a run that saves nothing."""

from __future__ import annotations

import numpy as np
from deepco_device.run_report import Saved

from deepco.modelcard import Preprocessing


def _frames(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, (1, 3, 6, 5), dtype=np.uint8) for _ in range(n)]


def test_saved_inputs_are_each_frames_pixels_normalised_in_float32_with_the_models_own_constants(tmp_path):
    how = Preprocessing(mean=(0.5, 0.25, 0.125), std=(0.5, 2.0, 4.0), scale=1.0 / 128)  # not ImageNet's
    path = tmp_path / "saved.npz"
    saved = Saved(str(path), how)
    frames = _frames(3)
    for px in frames:
        saved.input(px)
    saved.write(3, 6, 5)
    inputs = np.load(path)["inputs"]
    assert inputs.dtype == np.float32 and inputs.shape == (3, 3, 6, 5)
    for k, px in enumerate(frames):
        for c in range(3):
            expected = (px[0, c].astype(np.float64) / 128 - how.mean[c]) / how.std[c]
            np.testing.assert_allclose(inputs[k, c], expected, rtol=1e-6, atol=1e-6)


def test_a_run_that_saves_nothing_keeps_no_frame():
    saved = Saved(None)
    for px in _frames(4):
        saved.input(px)
    assert saved.pixels == []
    saved.write(3, 6, 5)  # writes nothing, raises nothing
