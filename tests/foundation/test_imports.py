"""The daemon and its CLIs never import torch; a foreign 'transitions' package is detected."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, *flags: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(code)], cwd=cwd, text=True,
                          capture_output=True, env={**os.environ, **env}, timeout=120)


def test_daemon_and_cli_never_import_torch() -> None:
    proc = _run("""
        import sys
        import nereusd, nereusd.ctl, nereusd.settings, nereusd.logs, planner.plan, planner.models
        nereusd.ctl.build_parser()
        import importlib, pkgutil
        for m in pkgutil.iter_modules(nereusd.__path__):
            importlib.import_module('nereusd.' + m.name)
        bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))
        print('TORCH' if bad else 'CLEAN', bad[:3])
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("CLEAN"), proc.stdout


def test_planner_is_pure() -> None:
    proc = _run("""
        import sys, importlib, pkgutil, planner
        for m in pkgutil.iter_modules(planner.__path__):
            importlib.import_module('planner.' + m.name)
        print(sorted(m for m in ('torch', 'zmq', 'sqlite3', 'subprocess') if m in sys.modules))
    """)
    assert proc.returncode == 0, proc.stderr
    assert "torch" not in proc.stdout


def test_shadowing_transitions_package_fails_clearly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "transitions").mkdir(parents=True)
    (site / "transitions" / "__init__.py").write_text("class Machine: pass\n")
    # The foreign package comes first on sys.path, as when pip installs it into site-packages
    # (-S keeps the editable-install finder of the development venv out of the way).
    proc = _run("import nereusd", "-S", cwd=tmp_path, PYTHONPATH=f"{site}{os.pathsep}{ROOT}")
    assert proc.returncode != 0
    assert "not Nereus's transitions package" in proc.stderr
    assert "pip uninstall transitions" in proc.stderr


def test_real_transitions_package_passes() -> None:
    proc = _run("import nereusd, agent, transitions; print(transitions.__nereus__)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"
