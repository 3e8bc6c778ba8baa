"""A U-Net segmenter (Ronneberger et al., 2015) with seeded weights: 4 levels of 32-256 channels.

Encoder: a double 3x3 convolution per level, 2x2 max-pooling between levels (strides 1, 2, 4, 8).
Decoder: bilinear upsampling to the skip's size, ``F.interpolate(size=skip.shape[2:])`` as ordinary
PyTorch U-Nets write it (it exports as Shape -> Slice -> Concat -> Resize, which the partitioner folds
for a fixed input size), Concat with the skip, a double convolution; a 1x1 convolution and a Softmax
over the classes per pixel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 (torch's own convention)
from torch import nn

CHANNELS = (32, 64, 128, 256)
NUM_CLASSES = 4
OUTPUT_NAMES = ("probabilities",)


class DoubleConv(nn.Module):
    """(3x3 Conv, BatchNorm, ReLU) twice."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Up(nn.Module):
    """Bilinear upsampling to the skip's size, Concat [skip, up], DoubleConv."""

    def __init__(self, cin: int, cskip: int, cout: int):
        super().__init__()
        self.conv = DoubleConv(cin + cskip, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, size=skip.shape[2:], mode="bilinear", align_corners=False)
        return self.conv(torch.cat([skip, x], 1))


class UNet(nn.Module):
    """Four levels (32, 64, 128, 256 channels), three poolings, three Up blocks, per-pixel Softmax."""

    output_names = OUTPUT_NAMES

    def __init__(self, num_classes: int = NUM_CLASSES):
        super().__init__()
        c1, c2, c3, c4 = CHANNELS
        self.inc = DoubleConv(3, c1)
        self.down = nn.ModuleList(DoubleConv(a, b) for a, b in ((c1, c2), (c2, c3), (c3, c4)))
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ModuleList(Up(a, s, b) for a, s, b in ((c4, c3, c3), (c3, c2, c2), (c2, c1, c1)))
        self.outc = nn.Conv2d(c1, num_classes, 1)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                nn.init.uniform_(m.weight, 0.5, 1.5)
                nn.init.uniform_(m.bias, -0.2, 0.2)
                nn.init.uniform_(m.running_mean, -0.2, 0.2)
                nn.init.uniform_(m.running_var, 0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = [self.inc(x)]
        for down in self.down:
            skips.append(down(self.pool(skips[-1])))
        x = skips.pop()
        for up in self.up:
            x = up(x, skips.pop())
        return torch.softmax(self.outc(x), dim=1)


def unet() -> UNet:
    """An untrained U-Net (weights from the current torch RNG state)."""
    return UNet()
