"""The layers are checked, not hoped for: `lint-imports` keeps every contract in pyproject.toml's [tool.importlinter]
(the server and the device never import each other; the core imports neither, nor the orchestration; no cycles)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from test_server_support import ROOT, child_env


def test_every_import_contract_is_kept() -> None:
    # The venv's own script first: a lint-imports elsewhere on PATH would analyse another environment's packages.
    linter = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert linter, "lint-imports is missing: pip install -e '.[test]'"
    done = subprocess.run([linter, "--no-cache", "--no-logo"], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    kept = [line for line in done.stdout.splitlines() if " KEPT" in line]
    assert len(contracts) >= 5 and len(kept) == len(contracts), done.stdout  # none skipped, none misnamed
