"""``deepco run --annotate out.mp4``: the processed frames (the model's input size, after crop or stretch) as a
video, with what the model saw drawn on each (device.readings): boxes, a mask overlay or the top label.

Every frame that entered the pipeline is written once, in order: a failed frame unannotated with a red
``failed`` label, a frame that entered but got no result (the run was interrupted or gave up) with a red
``no result``. Frames a live source dropped never entered, so they are not in the video.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

import cv2
import numpy as np
from deepco_device.readings import RED, label

from deepco.errors import UserError

DEFAULT_FPS = 10.0
CODECS = {".mp4": "mp4v", ".m4v": "mp4v", ".mov": "mp4v", ".avi": "MJPG", ".mkv": "MJPG"}


def video_fps(source: str, source_fps: float | None) -> float:
    """The annotated video's frame rate: ``--source-fps`` when given, else a video file's own, else 10."""
    from deepco_device.sources import describe

    if source_fps:
        return float(source_fps)
    if describe(source) == "video":
        capture = cv2.VideoCapture(source)
        fps = capture.get(cv2.CAP_PROP_FPS)
        capture.release()
        if fps and 0 < fps < 1000:  # some containers report nonsense: the default then
            return float(fps)
    return DEFAULT_FPS


def bgr(px: np.ndarray, rgb: bool) -> np.ndarray:
    """The device's 1xCxHxW uint8 pixels (RGB, BGR or grey) as a new HxWx3 BGR image to draw on."""
    image = np.ascontiguousarray(px[0].transpose(1, 2, 0))
    if image.shape[2] == 1:
        return cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
    return cv2.cvtColor(image, cv2.COLOR_RGB2BGR) if rgb else image.copy()


class Annotated:
    """The video being written: ``entered`` keeps each frame's pixels as it enters, ``result`` writes it with
    its reading once its result comes (results come in the order frames entered)."""

    def __init__(self, path: str, height: int, width: int, fps: float, rgb: bool):
        p = Path(path)
        codec = CODECS.get(p.suffix.lower())
        if p.is_dir():
            raise UserError(f"--annotate {path!r} is a directory, not a file")
        if codec is None:
            raise UserError(f"--annotate {path!r}: the video must end in {', '.join(CODECS)}")
        if not p.parent.is_dir():
            raise UserError(f"--annotate {path!r}: directory {str(p.parent)!r} does not exist")
        if not os.access(p.parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
            raise UserError(f"--annotate {path!r} is not writable")
        self.writer = cv2.VideoWriter(str(p), cv2.VideoWriter_fourcc(*codec), fps, (width, height))
        if not self.writer.isOpened():
            raise UserError(f"--annotate {path!r}: OpenCV cannot write a {p.suffix} video there")
        self.path, self.rgb, self.written = path, rgb, 0
        self.waiting: deque[np.ndarray] = deque()

    def entered(self, px: np.ndarray) -> None:
        """A frame's pixels, as it enters the pipeline."""
        self.waiting.append(px)

    def result(self, reading, error: str | None) -> None:
        """The next frame's result: drawn with ``reading`` (None: drawn plain), or marked failed."""
        image = self._next()
        if error is not None:
            label(image, "failed", (2, 2), RED)
        elif reading is not None:
            reading.draw(image)
        self._write(image)

    def close(self) -> None:
        """Write the frames that entered but got no result (marked so), and close the file."""
        while self.waiting:
            image = self._next()
            label(image, "no result", (2, 2), RED)
            self._write(image)
        self.writer.release()

    def _next(self) -> np.ndarray:
        return bgr(self.waiting.popleft(), self.rgb)

    def _write(self, image: np.ndarray) -> None:
        self.writer.write(image)
        self.written += 1
