"""The `deepco` shell itself: --version, and a reader that goes away (`deepco ... | head`)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

from test_server_support import ROOT

EXAMPLE = ROOT / "examples" / "paper-example1.toml"


def test_version_is_the_packages() -> None:
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    result = subprocess.run([sys.executable, "-m", "deepco", "--version"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 0 and result.stdout == f"deepco {expected}\n"


def _closed_stdout(*args: str) -> tuple[int, str]:
    """(exit code, stderr) of `deepco ARGS` whose reader went away before it wrote, like `| head` exiting."""
    proc = subprocess.Popen([sys.executable, "-m", "deepco", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT)
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    return proc.wait(timeout=60), stderr


def test_a_closed_stdout_ends_quietly_without_a_traceback() -> None:
    code, stderr = _closed_stdout("plan", "--cluster", str(EXAMPLE), "--algorithm", "modnn-sa")
    assert (code, stderr) == (141, "")  # 128 + SIGPIPE, as a shell reports a tool the signal ended
    code, stderr = _closed_stdout("schedule", "--help")  # argparse ignores the failed write itself
    assert stderr == ""


def test_every_bench_flag_says_what_it_does_and_its_default() -> None:
    import argparse

    from deepco_bench import bench_command

    parser = argparse.ArgumentParser()
    bench_command.add_arguments(parser)
    flags = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert len(flags) >= 15
    for action in flags:
        assert action.help and "default" in action.help, action.option_strings


def test_server_and_device_install_under_distinctive_names(tmp_path):
    """Outside the source tree, `server` and `device` are not importable (a user's own modules of those names
    are not shadowed, nor do they shadow ours): the installed packages are deepco_server and deepco_device."""
    probe = ("import importlib.util as u; "
             "print([u.find_spec(n) is not None for n in ('server', 'device', 'deepco_server', 'deepco_device')])")
    (tmp_path / "device.py").write_text("raise SystemExit('a user module called device.py was imported')\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[False, True, True, True]"  # device: the user's own file in cwd, not ours
    ran = subprocess.run([sys.executable, "-m", "deepco", "--version"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert ran.returncode == 0 and ran.stdout.startswith("deepco ")


def test_a_command_imports_only_its_own_module() -> None:
    """`deepco serve` (started for every server) once imported every command: SciPy's optimiser, the planner
    and the benchmark, about 2.5 s of CPU before the server could listen."""
    check = ("import sys; from deepco.cli import build_parser; build_parser(['serve', '--port', '0']); "
             "heavy = sorted(m for m in ('scipy.optimize', 'deepco.planning.calibration', 'deepco_bench.benchmark', "
             "'deepco_device.run_command') if m in sys.modules); print(heavy)")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
