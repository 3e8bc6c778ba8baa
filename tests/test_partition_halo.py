"""The computed dependency equals what autograd measures on the torch model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepco import zoo
from deepco.partition import Partitioner

_cache: dict = {}


def _setup(partition_zoo, name: str, height: int, width: int):
    key = (name, height, width)
    if key not in _cache:
        model, _ = partition_zoo(name, height, width)
        net = zoo.build(name, height, width).double()  # float64: no gradient underflows to zero
        _cache[key] = (Partitioner(model, height, width), net)
    return _cache[key]


def _measured_rows(
    net: torch.nn.Module, module: str, a: int, b: int, height: int, width: int
) -> tuple[int, int]:
    """Input rows whose gradient is non-zero for sum(output rows [a, b) of ``module``)."""
    outputs = []
    handle = net.get_submodule(module).register_forward_hook(lambda _m, _i, out: outputs.append(out))
    x = torch.randn(
        1,
        3,
        height,
        width,
        dtype=torch.float64,
        generator=torch.Generator().manual_seed(a),
        requires_grad=True,
    )
    try:
        net(x)
    finally:
        handle.remove()
    assert len(outputs) == 1, f"module {module} ran {len(outputs)} times"
    outputs[0][:, :, a:b, :].sum().backward()
    rows = np.nonzero(x.grad.abs().sum(dim=(0, 1, 3)).numpy())[0]
    return int(rows.min()), int(rows.max()) + 1


def _module_cuts(part: Partitioner, net: torch.nn.Module) -> list:
    """Cuts named after a module that runs once (a block, a stage, the stem's pool)."""
    names = dict(net.named_modules())
    return [
        c
        for c in part.cuts
        if c.name in names and not c.name.endswith("_swish") and not isinstance(names[c.name], torch.nn.ReLU)
    ]


@pytest.mark.parametrize(
    ("name", "height", "width"),
    [
        ("resnet18", 224, 48),
        ("resnet50", 131, 40),
        ("efficientnet-lite0", 97, 40),
    ],
)
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_halo_equals_autograd_dependency(partition_zoo, name, height, width, data):
    part, net = _setup(partition_zoo, name, height, width)
    cut = data.draw(st.sampled_from(_module_cuts(part, net)))
    a = data.draw(st.integers(0, cut.height - 1))
    b = data.draw(st.integers(a + 1, cut.height))
    assert part.needed_input_rows(cut, a, b) == _measured_rows(net, cut.name, a, b, height, width)


def test_resnet18_stage_halos_at_224(partition_zoo):
    """Interior halos of ResNet-18's stages at 224x224, checked against autograd on an interior row."""
    part, net = _setup(partition_zoo, "resnet18", 224, 48)
    expected = {"layer1": (4, 21, 18), "layer2": (8, 49, 42), "layer3": (16, 105, 90)}
    for stage, (stride, top, bottom) in expected.items():
        cut = part.cut(stage)
        assert (cut.stride, cut.halo_top, cut.halo_bottom) == (stride, top, bottom)
        row = cut.height // 2
        assert _measured_rows(net, stage, row, row + 1, 224, 48) == (
            row * stride - top,
            (row + 1) * stride + bottom,
        )
