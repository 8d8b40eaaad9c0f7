"""`nereusctl plan` has two forms: a what-if (flags) and a running job's plan (JOB, from the daemon)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CTL = Path(sys.executable).parent / "nereusctl"


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(CTL)] if CTL.exists() else [sys.executable, "-m", "nereusd.ctl"]
    return subprocess.run(cmd + ["plan", *args], cwd=ROOT, text=True, capture_output=True, timeout=120)


def test_what_if_without_its_flags_says_which_are_missing() -> None:
    p = ctl("--model", "llama-3.1-8b", "--gpus", "8")
    assert p.returncode == 2
    assert "--response-tokens" in p.stderr and "nereusctl plan JOB" in p.stderr


def test_job_form_goes_to_the_daemon_client(tmp_path: Path) -> None:
    """With JOB the command is the daemon's job-plan: without admin keys it says which keys it needs
    (the what-if flags are not asked for); the running-daemon case is in tests/daemon/test_cli.py."""
    p = ctl("some-job", "--state-dir", str(tmp_path), "--keys", str(tmp_path / "keys"), "--timeout", "0.5")
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "key bundle" in p.stderr and "--response-tokens" not in p.stderr
