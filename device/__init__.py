"""The device: frame sources, preprocessing, and the session that runs frames over the servers."""

import os

# FFmpeg (inside OpenCV) prints its own lines for a stream it cannot open; our error says it in one line.
os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")
os.environ.setdefault("OPENCV_LOG_LEVEL", "SILENT")
