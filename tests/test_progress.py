"""A progress bar for setup and calibration where stderr is a terminal (a pseudo-terminal here), and none
where it is not (a pipe: logs and tests get the lines alone). A real `deepco plan --model` on a real server."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import threading

from test_input_size import _conv_model
from test_server_support import ROOT, child_env, serve_process


def _read_all(fd: int, into: list[bytes]) -> None:
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the other side closed
            return
        if not chunk:
            return
        into.append(chunk)


def test_setup_and_calibration_show_a_bar_on_a_terminal_and_none_on_a_pipe(tmp_path):
    model = _conv_model(tmp_path / "small.onnx", 48, 64)
    with serve_process("--threads", "1") as server:
        cluster = tmp_path / "cluster.toml"
        cluster.write_text(f'[[servers]]\naddress = "{server.address}"\n')
        argv = [sys.executable, "-m", "deepco", "plan", "--cluster", str(cluster), "--model", str(model),
                "--algorithm", "auto"]
        master, slave = pty.openpty()
        got: list[bytes] = []
        reader = threading.Thread(target=_read_all, args=(master, got), daemon=True)
        reader.start()
        try:
            run = subprocess.run(argv, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=slave, text=True,
                                 timeout=300)
        finally:
            os.close(slave)
        reader.join(timeout=30)
        os.close(master)
        on_tty = b"".join(got).decode(errors="replace")
        assert run.returncode == 0, on_tty
        assert "waiting for the servers" in on_tty and "measuring the servers" in on_tty, on_tty
        assert "calibrating: timing" in on_tty and " steps [" in on_tty, on_tty
        assert "plan: " in run.stdout and "\r" not in run.stdout  # the results print without the bar
        piped = subprocess.run(argv, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
        assert piped.returncode == 0, piped.stderr
        assert " steps [" not in piped.stderr and "\r" not in piped.stderr + piped.stdout
