"""YOLOv8n's published architecture (Ultralytics, 2023) with seeded weights: CSP backbone, PAN neck, anchor-free heads.

Width multiple 0.25, depth multiple 0.33, as in ``yolov8n.yaml``: a C2f backbone down to stride 32 with
SPPF, a PAN neck (nearest x2 upsampling and Concat on the way up, strided convolutions and Concat on
the way down) and decoupled heads at strides 8, 16 and 32 (box: 4 x 16 DFL bins, classes: 80). Each
scale is one output, ``p3``/``p4``/``p5`` = Concat(box bins, Sigmoid(class logits)) per pixel; the DFL
decoding and anchor grid of Ultralytics' ``Detect`` are left to post-processing, as exporters with
``--no-decode`` do, so every output row depends on a bounded band of image rows.

C2f splits its first convolution's channels with two channel slices rather than ``chunk`` (one Slice
each instead of one Split): the same arithmetic.
"""

from __future__ import annotations

import torch
from torch import nn

NUM_CLASSES = 80
REG_MAX = 16
OUTPUT_NAMES = ("p3", "p4", "p5")


class Conv(nn.Module):
    """Conv2d (no bias) + BatchNorm + SiLU, 'same' padding for odd kernels (Ultralytics' Conv)."""

    def __init__(self, cin: int, cout: int, k: int = 1, s: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, s, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=1e-3, momentum=0.03)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    """Two 3x3 Convs, with a residual add when asked and the channels agree."""

    def __init__(self, c: int, shortcut: bool):
        super().__init__()
        self.cv1, self.cv2 = Conv(c, c, 3), Conv(c, c, 3)
        self.add = shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C2f(nn.Module):
    """CSP bottleneck with two convolutions: split, n bottlenecks on one half, concat every stage, 1x1 conv."""

    def __init__(self, cin: int, cout: int, n: int = 1, shortcut: bool = False):
        super().__init__()
        self.c = cout // 2
        self.cv1 = Conv(cin, 2 * self.c, 1)
        self.cv2 = Conv((2 + n) * self.c, cout, 1)
        self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv1(x)
        ys = [y[:, : self.c], y[:, self.c :]]
        for m in self.m:
            ys.append(m(ys[-1]))
        return self.cv2(torch.cat(ys, 1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: three chained 5x5 max-pools, concatenated."""

    def __init__(self, cin: int, cout: int, k: int = 5):
        super().__init__()
        hidden = cin // 2
        self.cv1 = Conv(cin, hidden, 1)
        self.cv2 = Conv(hidden * 4, cout, 1)
        self.m = nn.MaxPool2d(k, 1, k // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = [self.cv1(x)]
        for _ in range(3):
            y.append(self.m(y[-1]))
        return self.cv2(torch.cat(y, 1))


class Detect(nn.Module):
    """Decoupled anchor-free head of one scale: box DFL bins and class probabilities per pixel."""

    def __init__(self, cin: int, c2: int, c3: int, nc: int = NUM_CLASSES):
        super().__init__()
        self.cv2 = nn.Sequential(Conv(cin, c2, 3), Conv(c2, c2, 3), nn.Conv2d(c2, 4 * REG_MAX, 1))
        self.cv3 = nn.Sequential(Conv(cin, c3, 3), Conv(c3, c3, 3), nn.Conv2d(c3, nc, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.cv2(x), torch.sigmoid(self.cv3(x))], 1)


class YOLOv8n(nn.Module):
    """YOLOv8n: backbone to P5/32 + SPPF, PAN neck, heads at P3/8, P4/16, P5/32 (three outputs)."""

    output_names = OUTPUT_NAMES

    def __init__(self, nc: int = NUM_CLASSES):
        super().__init__()
        self.b0, self.b1, self.b2 = Conv(3, 16, 3, 2), Conv(16, 32, 3, 2), C2f(32, 32, 1, True)
        self.b3, self.b4 = Conv(32, 64, 3, 2), C2f(64, 64, 2, True)
        self.b5, self.b6 = Conv(64, 128, 3, 2), C2f(128, 128, 2, True)
        self.b7, self.b8, self.b9 = Conv(128, 256, 3, 2), C2f(256, 256, 1, True), SPPF(256, 256)
        self.up = nn.Upsample(scale_factor=2.0, mode="nearest")
        self.n12 = C2f(384, 128)
        self.n15 = C2f(192, 64)
        self.n16, self.n18 = Conv(64, 64, 3, 2), C2f(192, 128)
        self.n19, self.n21 = Conv(128, 128, 3, 2), C2f(384, 256)
        c2, c3 = max(16, 64 // 4, 4 * REG_MAX), max(64, min(nc, 100))
        self.detect = nn.ModuleList(Detect(c, c2, c3, nc) for c in (64, 128, 256))
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                # non-trivial statistics so that BatchNormalization is exercised, as in the ResNets
                nn.init.uniform_(m.weight, 0.5, 1.5)
                nn.init.uniform_(m.bias, -0.2, 0.2)
                nn.init.uniform_(m.running_mean, -0.2, 0.2)
                nn.init.uniform_(m.running_var, 0.5, 1.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p3 = self.b4(self.b3(self.b2(self.b1(self.b0(x)))))
        p4 = self.b6(self.b5(p3))
        p5 = self.b9(self.b8(self.b7(p4)))
        h12 = self.n12(torch.cat([self.up(p5), p4], 1))
        h15 = self.n15(torch.cat([self.up(h12), p3], 1))
        h18 = self.n18(torch.cat([self.n16(h15), h12], 1))
        h21 = self.n21(torch.cat([self.n19(h18), p5], 1))
        return tuple(d(h) for d, h in zip(self.detect, (h15, h18, h21), strict=True))


def yolov8n() -> YOLOv8n:
    """An untrained YOLOv8n (weights from the current torch RNG state)."""
    return YOLOv8n()
