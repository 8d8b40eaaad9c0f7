"""Every benchmark script in bench/ takes ``--quick`` (issue 17: each quick form under 50 s, the 1,024-GPU
sizes kept), and ``make bench`` names only scripts that exist, each given ``--quick`` under QUICK=1.
Read from the sources (ast) and the Makefile: no script is run, no torch imported (the quick forms'
wall times are measured by running them, not here)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _is_script(path: Path) -> bool:
    """A benchmark one runs (it has a ``__main__`` block), not a module the benchmarks import
    (bench/daemon_path.py, bench/fidelity_rl.py)."""
    return 'if __name__ == "__main__"' in path.read_text()


def _options(path: Path) -> set[str]:
    """The option strings of every ``add_argument`` call in the script."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            out |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return out


def test_every_benchmark_takes_quick() -> None:
    scripts = sorted(p for p in (ROOT / "bench").glob("*.py") if _is_script(p))
    assert len(scripts) >= 15 and not {"daemon_path.py", "fidelity_rl.py", "__init__.py"} & {p.name for p in scripts}
    missing = [p.name for p in scripts if "--quick" not in _options(p)]
    assert not missing, f"no --quick in {missing}"


def test_make_bench_runs_existing_scripts_and_quick_reaches_each() -> None:
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^bench:.*?\n((?:\t.*\n)+)", text, re.M)
    assert recipe is not None
    runs = [line for line in recipe.group(1).splitlines() if "bench/" in line and ".py" in line]
    names = [re.search(r"bench/(\w+\.py)", line).group(1) for line in runs]  # type: ignore[union-attr]
    assert len(names) >= 8 and len(set(names)) == len(names)
    for name, line in zip(names, runs, strict=True):
        assert (ROOT / "bench" / name).is_file(), name
        assert "--quick" in line or "$(QUICK_FLAG)" in line or "$(if $(QUICK)" in line, line
