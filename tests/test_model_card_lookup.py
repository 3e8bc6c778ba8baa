"""Where a model's card is found: ``<stem>.toml`` beside the model, else ``model.toml`` in its folder; the
stem's wins, and the preprocessing says which card it came from."""

from __future__ import annotations

import argparse

from deepco.modelcard import card_path, from_args


def test_the_stems_card_then_the_folders_model_toml(tmp_path):
    model = tmp_path / "unet.onnx"
    model.write_bytes(b"")
    assert card_path(str(model)) is None
    (tmp_path / "model.toml").write_text('[input]\nchannels = 1\nmean = [0.5]\nstd = [0.25]\n')
    assert card_path(str(model)) == tmp_path / "model.toml"
    how = from_args(str(model), argparse.Namespace())
    assert how.channels == 1 and str(tmp_path / "model.toml") in how.describe()
    (tmp_path / "unet.toml").write_text('[input]\nchannels = 3\norder = "bgr"\n')
    assert card_path(str(model)) == tmp_path / "unet.toml"
    how = from_args(str(model), argparse.Namespace())
    assert how.channels == 3 and not how.rgb and str(tmp_path / "unet.toml") in how.describe()
