"""etc/submit_elastic.py before anything reaches Slurm: under the system python from a clean environment,
every mistake is one line naming what to pass (the lab test runs the README's command to the end)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


def _run(tmp_path: Path, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", **env}
    if not (ROOT / ".venv" / "bin" / "python").exists():  # a worktree without its own venv: name the project's
        clean.setdefault("NEREUS_PYTHON", sys.executable)
    return subprocess.run([SYSTEM_PYTHON or sys.executable, "etc/submit_elastic.py", *argv], capture_output=True,
                          text=True, timeout=120, env=clean, cwd=ROOT)


@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no python3 in /usr/bin or /bin")
def test_submit_script_says_in_one_line_what_to_pass(tmp_path: Path) -> None:
    cases = [
        ((), "pass --job-file FILE"),  # no job file: the job would have no model, algorithm or workload
        (("--job-file", "etc/jobs/live.toml"), "cannot find nereusd's control endpoint"),
        (("--job-file", "etc/jobs/live.toml", "--endpoint", "tcp://head:7501"), "pass --keys DIR"),
        (("--job-file", str(tmp_path / "none.toml")), "does not exist"),
    ]
    for extra, expected in cases:
        proc = _run(tmp_path, "live", *extra, NEREUS_STATE_DIR=str(tmp_path / "state"))
        assert proc.returncode == 2, (extra, proc.stderr)
        assert expected in proc.stderr and len(proc.stderr.splitlines()) == 1, (extra, proc.stderr)
        assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no python3 in /usr/bin or /bin")
def test_submit_script_without_the_projects_environment_says_how_to_get_it(tmp_path: Path) -> None:
    if (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("the checkout has its .venv: the script re-executes itself with it")
    proc = subprocess.run([str(SYSTEM_PYTHON), "etc/submit_elastic.py", "live"], capture_output=True, text=True,
                          timeout=60, env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    if proc.returncode != 2 or "cannot import Nereus" not in proc.stderr:
        assert "pass --job-file" in proc.stderr, proc.stderr  # this system python has every dependency itself
    else:
        assert "make venv" in proc.stderr and "NEREUS_PYTHON" in proc.stderr and len(proc.stderr.splitlines()) == 1
