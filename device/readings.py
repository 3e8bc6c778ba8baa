"""What a frame's outputs mean to a user, by the model card's ``[output] kind`` (deepco.modelcard): the top
labels of a classifier, the boxes of a detector (decoded from YOLOv8-style heads, NMS with OpenCV), the
classes per pixel of a segmenter. Each reading gives the frame's line and draws itself on the frame
(``deepco run --annotate``).

A detector's heads are YOLOv8's without the ``Detect`` decoding (the zoo's ``yolov8n``, an Ultralytics
export's raw heads): one output per stride, ``1 x (4*16 + classes) x h x w``, the first 64 channels the
DFL bins of the box's distances left, top, right, bottom (16 bins each, in grid cells), then each class's
score (already a probability). The stride of a head is the input's height over its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from deepco.modelcard import Preprocessing

REG_MAX = 16  # DFL bins per box side (YOLOv8)
SHOWN = 5  # detections or classes named on a frame's line
RED = (0, 0, 255)  # BGR


@dataclass(frozen=True)
class Detection:
    """One box in the model input's pixels: corners (x0, y0, x1, y1), its class and score."""

    box: tuple[float, float, float, float]
    cls: int
    score: float


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def candidates(heads: list[np.ndarray], height: int) -> tuple[np.ndarray, np.ndarray]:
    """Every anchor's box (N x 4 corners, input pixels) and class scores (N x classes) from YOLOv8 heads."""
    boxes, scores = [], []
    for head in heads:
        if head.ndim != 4 or head.shape[0] != 1 or head.shape[1] <= 4 * REG_MAX:
            raise ValueError(f"a detection head is 1 x (64 + classes) x h x w (YOLOv8: 16 DFL bins per box side, "
                             f"then class scores), got {'x'.join(map(str, head.shape))}")
        _, c, h, w = head.shape
        stride = height / h
        flat = head[0].reshape(c, h * w).astype(np.float64)
        bins = _softmax(flat[:4 * REG_MAX].reshape(4, REG_MAX, h * w), axis=1)
        dist = (bins * np.arange(REG_MAX).reshape(1, REG_MAX, 1)).sum(axis=1)  # 4 x hw: left, top, right, bottom
        ys, xs = np.divmod(np.arange(h * w), w)
        ax, ay = xs + 0.5, ys + 0.5  # anchor points: cell centres, in cells
        boxes.append(np.stack([ax - dist[0], ay - dist[1], ax + dist[2], ay + dist[3]], axis=1) * stride)
        scores.append(flat[4 * REG_MAX:].T)
    return np.concatenate(boxes), np.concatenate(scores)


def detect(heads: list[np.ndarray], height: int, score_threshold: float, iou_threshold: float) -> list[Detection]:
    """The boxes of one frame: each anchor's best class over ``score_threshold``, then non-maximum suppression
    per class (OpenCV's ``dnn.NMSBoxesBatched``: a box is dropped where it overlaps a better one of its class by
    more than ``iou_threshold``); best first."""
    boxes, scores = candidates(heads, height)
    cls = scores.argmax(axis=1)
    best = scores[np.arange(len(cls)), cls]
    keep = np.flatnonzero(best >= score_threshold)
    if keep.size == 0:
        return []
    b = boxes[keep]
    xywh = np.stack([b[:, 0], b[:, 1], b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]], axis=1)
    kept = cv2.dnn.NMSBoxesBatched(xywh.tolist(), best[keep].tolist(), cls[keep].tolist(),
                                   score_threshold, iou_threshold)
    found = [Detection(tuple(float(v) for v in b[i]), int(cls[keep][i]), float(best[keep][i]))
             for i in np.asarray(kept, dtype=np.int64).reshape(-1)]
    return sorted(found, key=lambda d: -d.score)


def mask_of(output: np.ndarray) -> np.ndarray:
    """Each pixel's class (H x W) of a segmenter's ``1 x C x H x W`` output: the channel with the largest value;
    one channel: foreground (1) where its value is over 0.5, read as a probability when the output lies in
    [0, 1], else as a logit (sigmoid over 0.5, i.e. over 0)."""
    if output.ndim != 4 or output.shape[0] != 1:
        raise ValueError(f"a mask output is 1 x classes x H x W, got {'x'.join(map(str, output.shape))}")
    if output.shape[1] > 1:
        return output[0].argmax(axis=0)
    one = output[0, 0]
    probability = float(one.min()) >= 0.0 and float(one.max()) <= 1.0
    return (one > (0.5 if probability else 0.0)).astype(np.int64)


def colour(i: int) -> tuple[int, int, int]:
    """A distinct BGR colour per class (golden-angle hues)."""
    hue = int(i * 137.508) % 180
    b, g, r = cv2.cvtColor(np.uint8([[[hue, 220, 255]]]), cv2.COLOR_HSV2BGR)[0, 0]
    return int(b), int(g), int(r)


def label(image: np.ndarray, text: str, at: tuple[int, int], bgr: tuple[int, int, int]) -> None:
    """``text`` on a filled box of colour ``bgr`` at ``at`` (its top left), in place."""
    (tw, th), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, 0.4, 1)
    x, y = max(0, at[0]), max(th + base, at[1])
    cv2.rectangle(image, (x, y - th - base), (x + tw + 2, y), bgr, -1)
    cv2.putText(image, text, (x + 1, y - base), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (255, 255, 255), 1, cv2.LINE_AA)


@dataclass
class Detections:
    """A detector's reading of one frame."""

    found: list[Detection]
    how: Preprocessing
    noise: bool = False

    def line(self) -> str:
        """``3 detections (class 0 0.91, ...)``."""
        named = ", ".join(f"{self.how.class_name(d.cls)} {d.score:.2f}" for d in self.found[:SHOWN])
        more = ", ..." if len(self.found) > SHOWN else ""
        text = f"{len(self.found)} detection{'s' if len(self.found) != 1 else ''}" + (f" ({named}{more})" if named
                                                                                      else "")
        return f"random weights: {text}" if self.noise else text

    def draw(self, image: np.ndarray) -> None:
        """Each box with its class and score, in place."""
        for d in self.found:
            x0, y0, x1, y1 = (round(v) for v in d.box)
            cv2.rectangle(image, (x0, y0), (x1, y1), colour(d.cls), 2)
            label(image, f"{self.how.class_name(d.cls)} {d.score:.2f}", (x0, y0), colour(d.cls))


@dataclass
class Mask:
    """A segmenter's reading of one frame: each pixel's class."""

    classes: np.ndarray
    how: Preprocessing

    def line(self) -> str:
        """``mask 64x64: class 0 41%, class 2 30%, ...`` (the share of pixels per class, largest first)."""
        counts = np.bincount(self.classes.reshape(-1))
        order = [int(c) for c in np.argsort(-counts) if counts[c] > 0]
        shares = ", ".join(f"{self.how.class_name(c)} {100 * counts[c] / self.classes.size:.0f}%"
                           for c in order[:SHOWN])
        more = ", ..." if len(order) > SHOWN else ""
        return f"mask {self.classes.shape[0]}x{self.classes.shape[1]}: {shares}{more}"

    def draw(self, image: np.ndarray) -> None:
        """A coloured overlay, half opaque, in place (a mask of another size is resized to the frame's)."""
        classes = self.classes
        if classes.shape != image.shape[:2]:
            classes = cv2.resize(classes.astype(np.int32), image.shape[1::-1], interpolation=cv2.INTER_NEAREST)
        palette = np.array([colour(c) for c in range(int(classes.max()) + 1)], np.uint8)
        image[:] = cv2.addWeighted(image, 0.5, palette[classes], 0.5, 0)


@dataclass
class Labels:
    """A classifier's reading of one frame: its top classes with probabilities."""

    top: list[tuple[str, float]]
    noise: bool = False

    def line(self) -> str:
        """``tabby 0.61, tiger cat 0.20, ...``."""
        text = ", ".join(f"{n} {p:.2f}" for n, p in self.top)
        return f"random weights: {text}" if self.noise else text

    def draw(self, image: np.ndarray) -> None:
        """The top label, in place."""
        name, p = self.top[0]
        label(image, f"{name} {p:.2f}", (2, 2), (40, 40, 40))


def _detections(values: list[np.ndarray], how: Preprocessing, height: int, noise: bool) -> Detections:
    return Detections(detect(values, height, how.score_threshold, how.iou_threshold), how, noise)


def _mask(values: list[np.ndarray], how: Preprocessing, height: int, noise: bool) -> Mask:
    return Mask(mask_of(values[0]), how)  # a segmenter's first output is its mask


def _labels(values: list[np.ndarray], how: Preprocessing, height: int, noise: bool) -> Labels | None:
    from deepco_device.preprocess import top_labels

    return Labels(top_labels(values[0], 3), noise) if len(values) == 1 else None


READERS = {"detections": _detections, "mask": _mask, "labels": _labels}


def read(kind: str, outputs: dict[str, np.ndarray], how: Preprocessing, height: int,
         noise: bool = False) -> Detections | Mask | Labels | None:
    """The reading of one frame's ``outputs`` as ``kind`` (detections, mask, labels); None for another kind,
    or labels of a model with several outputs. ValueError (one line) where the outputs do not fit the kind."""
    reader = READERS.get(kind)
    return reader(list(outputs.values()), how, height, noise) if reader else None
