"""The README's commands run as written: the Quick start's two are `.ci/run`'s, the serve-and-run block runs
here (free ports for its two, a real video file for its source), and any other block says it needs root."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

from deepco_device.sources import make_pan_zoom_clip
from test_server_support import ROOT, child_env

README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"(<!--[^\n]*-->\n)?```sh\n(.*?)```", README, flags=re.S)
PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_command_block_is_run_by_ci_or_here_or_needs_root() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    for marker, block in BLOCKS:
        for line in filter(None, (line.strip() for line in block.splitlines())):
            assert line in ci or "tests/test_readme.py" in marker or line.endswith("# needs root"), line


def test_the_serve_and_run_example_runs_as_written(tmp_path) -> None:
    [block] = [block for marker, block in BLOCKS if "tests/test_readme.py" in marker]
    clip = make_pan_zoom_clip(PHOTO, tmp_path / "clip.avi", frames=8)
    script = block.replace(".venv/bin/deepco", str(Path(sys.executable).parent / "deepco"))
    script = script.replace("50051", str(_free_port())).replace("50052", str(_free_port()))
    script = script.replace("video.mp4", str(clip))
    done = subprocess.run(["bash", "-c", "set -e\ntrap 'kill $(jobs -p) 2>/dev/null' EXIT\n" + script],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert re.search(r"\b8 frames\b.*\b0 failed\b", done.stdout), done.stdout[-2000:]


def test_the_readme_stays_short_and_its_links_resolve() -> None:
    assert len(README.splitlines()) < 250  # the reference lives in docs/
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        assert (ROOT / target).exists(), target
