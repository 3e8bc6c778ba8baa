"""A progress bar (tqdm, on stderr) for what `deepco run` and `deepco plan --model` do before their first
result: setup's steps (loading the model, waiting for the servers, measuring) and calibration's timed plans.

Only where stderr is a terminal: a log file, a pipe or a test gets the lines alone. While the bar is up, the
device's lines are written through tqdm, so that they print above it instead of through it.
"""

from __future__ import annotations

import shutil
import sys
import threading
from typing import TextIO

_WRITING = threading.Lock()  # one line at a time on stdout, whichever thread writes it


class Progress:
    """The bar (None where stderr is not a terminal, or once `close` was called)."""

    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None):
        stream = stream or sys.stderr
        if enabled is None:
            enabled = hasattr(stream, "isatty") and stream.isatty()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            # a terminal that reports no size (0x0, e.g. a fresh pseudo-terminal) would get no bar at all from
            # tqdm: 80x24 then
            size = shutil.get_terminal_size()
            self.bar = tqdm(desc="setup", unit=" step", file=stream, leave=False, ncols=size.columns,
                            nrows=size.lines, mininterval=0,
                            bar_format="{desc}: {n_fmt} steps [{elapsed}]")

    def step(self, what: str) -> None:
        """A step begins: ``what`` it is (e.g. 'measuring the servers')."""
        if self.bar is not None:
            self.bar.set_description_str(what, refresh=False)
            self.bar.update()

    def write(self, line: str) -> None:
        """Print ``line`` on stdout (above the bar while it is up), whole: live adaptation's lines come from
        threads of their own beside the frames' (`print` writes the line and its newline apart, and a run once
        printed "... the running one: offload to s1frame 135: ...")."""
        with _WRITING:
            if self.bar is not None:
                from tqdm import tqdm

                tqdm.write(line, file=sys.stdout)
            else:
                sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Take the bar down (the first result is about to print)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
