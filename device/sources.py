"""Frame sources, all decoded by OpenCV: a camera index, a video file, an RTSP/HTTP URL, an image file, or a
directory of images. Each yields BGR uint8 frames (OpenCV's order); a source that cannot be opened or
read raises a UserError naming it. `open_feed` puts a source behind the queue the pipeline takes its frames
from (device/feed.py: a live source keeps its latest frame, and counts the ones it drops).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import cv2
import cv2.utils.logging
import numpy as np
from deepco_device.feed import DROP_MODES, Feed, IterFeed, LiveFeed

from deepco.errors import UserError

# OpenCV's own warnings (e.g. "can't open camera by index") would duplicate our one-line errors.
cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}
URL_SCHEMES = ("rtsp://", "rtsps://", "http://", "https://", "rtmp://", "udp://", "tcp://")
LIVE = ("camera", "url")  # sources that make frames on their own clock, whether the engine keeps up or not


def describe(source: str) -> str:
    """What kind of source a string names: camera, url, directory, image or video."""
    if source.isdigit():
        return "camera"
    if source.lower().startswith(URL_SCHEMES):
        return "url"
    path = Path(source)
    if path.is_dir():
        return "directory"
    if path.suffix.lower() in IMAGE_SUFFIXES:
        return "image"
    return "video"


def _read_image(path: Path) -> np.ndarray:
    frame = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if frame is None:
        raise UserError(f"source {str(path)!r}: not an image OpenCV can decode")
    return frame


def _capture(source: str, kind: str) -> Iterator[np.ndarray]:
    capture = cv2.VideoCapture(int(source) if kind == "camera" else source)
    try:
        if not capture.isOpened():
            what = {"camera": f"camera {source}", "url": f"URL {source!r}"}.get(kind, f"video {source!r}")
            raise UserError(f"source {source!r}: cannot open {what}")
        first = True
        while True:
            ok, frame = capture.read()
            if not ok:
                if first:
                    raise UserError(f"source {source!r}: opened, but no frame could be decoded")
                return
            first = False
            yield frame
    finally:
        capture.release()


def open_source(source: str, limit: int | None = None) -> Iterator[np.ndarray]:
    """Frames of ``source``, at most ``limit`` of them (an image source repeats its picture ``limit`` times)."""
    kind = describe(source)
    if kind in ("image", "video") and not Path(source).exists():
        raise UserError(f"source {source!r}: no such file")
    if kind == "image":
        frame = _read_image(Path(source))
        frames: Iterator[np.ndarray] = (frame.copy() for _ in range(limit if limit is not None else 1))
    elif kind == "directory":
        files = sorted(p for p in Path(source).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise UserError(f"source {source!r}: the directory holds no image files")
        frames = (_read_image(p) for p in files)
    else:
        frames = _capture(source, kind)
    for count, frame in enumerate(frames):
        if limit is not None and count >= limit:
            return
        yield frame


def drop_mode(source: str, drop: str | None, source_fps: float | None) -> str:
    """What `deepco run --drop` means for ``source``: as given, else ``late`` for a live source (a camera, a
    network stream, or a file, image or directory played with ``--source-fps``) and ``never`` for the rest.
    Bad flags fail here, in one line, before anything starts."""
    kind = describe(source)
    if source_fps is not None:
        if kind in LIVE:
            raise UserError(f"--source-fps plays a file, image or directory as a live source; {source!r} is a "
                            f"{kind}, with a clock of its own")
        if not source_fps > 0:
            raise UserError(f"--source-fps must be positive, got {source_fps:g}")
    if drop is not None and drop not in DROP_MODES:
        raise UserError(f"--drop must be one of {', '.join(DROP_MODES)}, got {drop!r}")
    return drop or ("late" if kind in LIVE or source_fps is not None else "never")


def open_feed(source: str, limit: int | None, drop: str | None, source_fps: float | None,
              prepare: Callable[[np.ndarray], np.ndarray]) -> Feed:
    """The frames of ``source`` (at most ``limit``) as the pipeline takes them (device.feed): a live source,
    or any source with ``--drop late``, read on a thread of its own behind a queue of one frame (played at
    ``source_fps`` when given); files, images and directories otherwise one by one as the pipeline has room.
    ``prepare`` turns a frame taken into the pixels the runners take."""
    mode = drop_mode(source, drop, source_fps)
    frames = open_source(source, limit)
    if describe(source) in LIVE or source_fps is not None or mode == "late":
        return LiveFeed(mode, source_fps, prepare).start(frames)
    return IterFeed(frames, prepare)


def first_frame_check(source: str) -> None:
    """Open ``source`` and decode one frame, so a bad source fails before any server is contacted."""
    generator = open_source(source, limit=1)
    try:
        next(generator)
    except StopIteration:
        raise UserError(f"source {source!r}: no frames") from None
    finally:
        generator.close()


def make_pan_zoom_clip(image_path: str | Path, out_path: str | Path, frames: int = 24,
                       size: tuple[int, int] = (256, 300), fps: float = 12.0) -> Path:
    """A short clip that pans and zooms over a still picture, written with OpenCV's VideoWriter.

    Frame 0 is the whole picture, unmoved (resized to ``size``, (width, height), by default the aspect
    of matplotlib's grace_hopper.jpg); later frames zoom in up to 1.5x while panning left to right.
    """
    image = _read_image(Path(image_path))
    h, w = image.shape[:2]
    out_path = Path(out_path)
    # FFV1 is lossless: JPEG-style codecs shift this picture's top-1 class (measured: MJPG gives
    # "academic gown" where the picture itself gives "military uniform").
    writer = cv2.VideoWriter(str(out_path), cv2.VideoWriter_fourcc(*"FFV1"), fps, size)
    if not writer.isOpened():
        raise UserError(f"cannot write a video to {str(out_path)!r}")
    try:
        for i in range(frames):
            t = i / max(1, frames - 1)
            zoom = 1.0 + 0.5 * t
            cw, ch = int(w / zoom), int(h / zoom)
            x0 = int((w - cw) * t)
            y0 = (h - ch) // 2
            writer.write(cv2.resize(image[y0:y0 + ch, x0:x0 + cw], size, interpolation=cv2.INTER_AREA))
    finally:
        writer.release()
    return out_path
