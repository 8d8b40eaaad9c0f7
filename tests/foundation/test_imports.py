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
        import nereusd, nereusd.ctl, nereusd.settings, nereusd.wire.logs, planner.plan, planner.models
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
    assert proc.stdout.strip() == "[]", proc.stdout


def test_planner_does_no_io_while_it_plans() -> None:
    """A search, a prediction and an admission decision open no file, socket or process: every way
    to reach the outside is made to raise before the planner runs (imports are done first)."""
    proc = _run("""
        import builtins, io, os, socket, subprocess
        from planner.admission import Trigger, TriggerKind, decide
        from planner.hardware import cluster_preset
        from planner.models import model_preset
        from planner.prediction import predict
        from planner.search import search
        from planner.workflow import Workload, same_model_job, workflow_preset
        calls = []
        def refuse(name):
            def f(*a, **k):
                calls.append(name)
                raise OSError('planner did I/O: ' + name)
            return f
        builtins.open = io.open = refuse('open')
        os.open = refuse('os.open')
        socket.socket = refuse('socket')
        subprocess.Popen = refuse('Popen')
        cluster = cluster_preset('h200', 32)
        jobs = [same_model_job(workflow_preset(w), model_preset('llama-3.1-8b'),
                               Workload(prompts_per_step=1024, prompt_tokens=1024, response_tokens=n))
                for w, n in (('ppo', 1024), ('grpo', 4096))]
        results = [search(j, cluster) for j in jobs]
        preds = [predict(j, cluster, r.plan) for j, r in zip(jobs, results)]
        trigger = Trigger(kind=TriggerKind.OPPORTUNISTIC, step=3, reasons=('drift',), h_steps=50)
        dec = decide(trigger=trigger, current_plan=results[0].plan, current_prediction=preds[0],
                     replan=lambda: search(jobs[1], cluster), transition_s=lambda old, new: 1.0)
        print('CALLS', calls, 'FEASIBLE', [p.feasible for p in preds], 'RULE', dec.verdict.rule.value)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "CALLS [] FEASIBLE [True, True] RULE " in proc.stdout, proc.stdout


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


# --- the import direction of every package, as DESIGN.md's table states it -------------------------
# Read from each module's syntax tree (imports inside functions count too), so a rule breaks here
# the moment a forbidden import is written, whether or not a test happens to execute it.

PACKAGES = ("planner", "transitions", "agent", "nereusd")
# transitions: torch only in the data channel, the executor and the checkpoint fallback
TORCH_IN_TRANSITIONS = ("transitions.channel", "transitions.checkpoint", "transitions.executor")
# the torch-free wire layer agent/ may use from nereusd (protocol, client, keys, logging)
WIRE = ("nereusd.wire",)
NO_IO = ("zmq", "sqlite3", "subprocess", "socket", "fsspec", "requests", "urllib")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    """Per module of the four packages, every module it imports (absolute names)."""
    import ast

    out: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = _module_name(path)
            found: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found |= {alias.name for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    found.add(node.module)
                    found |= {f"{node.module}.{alias.name}" for alias in node.names}
            out[name] = found
    return out


def _under(name: str, prefixes: tuple[str, ...] | str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in ((prefixes,) if isinstance(prefixes, str) else prefixes))


def _violations(imports: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, imported in imports.items():
        package = module.split(".")[0]
        for name in sorted(imported):
            top = name.split(".")[0]
            if package == "planner" and (top in ("transitions", "agent", "nereusd", "torch") or top in NO_IO):
                bad.append(f"{module} imports {name}: the planner is pure (stdlib, numpy, pydantic)")
            if package == "transitions":
                if top in ("agent", "nereusd"):
                    bad.append(f"{module} imports {name}: transitions never imports agent or nereusd")
                if top == "torch" and not _under(module, TORCH_IN_TRANSITIONS):
                    bad.append(f"{module} imports torch outside the channel, executor and checkpoint")
            if package == "nereusd" and top in ("torch", "agent"):
                bad.append(f"{module} imports {name}: the daemon never imports torch or agent")
            if package == "agent" and top == "nereusd" and name != "nereusd" and not _under(name, WIRE):
                bad.append(f"{module} imports {name}: agent uses only nereusd's wire layer {WIRE}")
    return bad


def test_every_package_imports_only_in_the_direction_the_design_states() -> None:
    imports = _imports()
    assert len(imports) > 60  # the walk saw the packages (a wrong ROOT would pass vacuously)
    assert _violations(imports) == []


def test_the_direction_check_catches_each_forbidden_import() -> None:
    bad = _violations({
        "planner.cost": {"torch", "sqlite3"},
        "transitions.layout": {"torch"},
        "transitions.executor.runner": {"torch", "agent.worker"},
        "nereusd.admin": {"agent.node"},
        "agent.node": {"nereusd.wire.protocol", "nereusd.store"},
    })
    assert len(bad) == 6, bad
    assert not _violations({"transitions.executor.runner": {"torch"}, "agent.node": {"nereusd.wire.keys"}})
