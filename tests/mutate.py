"""Mutation testing of the pure packages and the controller: ``make mutate``.

Runs mutmut (configured in pyproject.toml, ``[tool.mutmut]``) and summarises its results per module
and per group as JSON (``runs/mutate/summary.json``), with the issue's targets: >= 90% of mutants
killed in planner/ and transitions/, >= 80% in nereusd/controller.py and its parts. A survivor that cannot be
killed because it does not change behaviour is listed in etc/mutation-equivalents.toml with a
one-line reason; it counts as equivalent, not as survived. Why mutmut (not cosmic-ray): mutmut 3
maps every test to the functions it runs and runs, per mutant, only those tests, in forked
processes with the mutant switched on by a trampoline; cosmic-ray re-runs the whole chosen test
command per mutant from a fresh interpreter (imports, collection and every test each time), which on
2 cores would not finish planner/ in a night. (Not measured side by side; mutmut on planner/admission.py
alone: 467 mutants in 2 min 25 s.)

A run over everything takes hours on 2 cores (planner/ alone is ~5,200 mutants); mutmut keeps its
results in mutants/ by function hash, so an interrupted run resumes where it stopped, and a later
run re-tests only the functions that changed.

One module at a time, with the tests of its package only (what pays on a shared machine): each such
run keeps its own mutants tree (runs/mutate/trees/<module>, linked as mutants/ while it runs, so its
results survive runs of other modules with other test selections: mutmut resets every cached verdict
when the test selection changes), and the summary merges the trees, a module's own tree winning over
the full run's mutants/.

Usage:
    make mutate                            # installs the mutate extra, then this script
    python tests/mutate.py                 # mutmut run, then the summary
    python tests/mutate.py --summary-only  # summarise the last run (mutants/ as mutmut left it)
    python tests/mutate.py --max-children 2
    python tests/mutate.py --module planner/admission.py --tests tests/planner [--label before]
    python tests/mutate.py --module planner/admission.py --tests tests/planner --rerun-survivors

The verdicts outlive the trees: every --module run records its module's verdicts in
etc/mutation-ledger/<module>.json (committed): the test list it ran with and, per function, a hash of
the function's source and the numbers of its mutants by status. The summary counts a recorded
function only while its source is unchanged (a changed function is listed as stale until its module
is run again), so a fresh clone's ``--summary-only`` reproduces the figures without hours of mutmut,
and ``--module M`` without ``--tests`` reuses the recorded test list.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import signal
import subprocess
import sys
import traceback
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENTS = ROOT / "etc" / "mutation-equivalents.toml"
TARGETS = {"planner": 0.90, "transitions": 0.90, "controller": 0.80}
# the controller and its parts (nereusd/controller_parts.py only declares: nothing to mutate)
CONTROLLER = ("nereusd/controller.py", "nereusd/controller_orders.py", "nereusd/controller_drain.py")
TREES = ROOT / "runs" / "mutate" / "trees"
LEDGER = ROOT / "etc" / "mutation-ledger"

# mutmut's exit codes of a mutant's test run (mutmut/stats.py, status_by_exit_code): read here so
# that the summary needs only the JSON meta files mutmut writes, not mutmut's internals.
_STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no_tests", 33: "no_tests", 34: "skipped",
           36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout",
           37: "killed", -11: "segfault", -9: "segfault", None: "not_checked"}


@dataclass(frozen=True)
class Equivalent:
    mutant: str
    reason: str


def group_of(module: str) -> str | None:
    if module.startswith("planner/"):
        return "planner"
    if module.startswith("transitions/"):
        return "transitions"
    if module in CONTROLLER:
        return "controller"
    return None


def load_equivalents(path: Path = EQUIVALENTS) -> dict[str, Equivalent]:
    """The mutants listed as equivalent, each with a one-line reason (a missing reason is an error)."""
    if not path.exists():
        return {}
    data = tomllib.loads(path.read_text())
    out: dict[str, Equivalent] = {}
    for i, row in enumerate(data.get("equivalent", [])):
        mutant, reason = row.get("mutant"), row.get("reason")
        if not isinstance(mutant, str) or not isinstance(reason, str) or not reason.strip():
            raise SystemExit(f"{path}: equivalent[{i}] needs a 'mutant' name and a one-line 'reason'")
        out[mutant] = Equivalent(mutant, reason.strip())
    return out


def statuses(mutants_dir: Path) -> dict[str, dict[str, str]]:
    """Module path -> mutant name -> status, from mutmut's ``*.py.meta`` files."""
    out: dict[str, dict[str, str]] = {}
    for meta in sorted(mutants_dir.rglob("*.py.meta")):
        module = str(meta.relative_to(mutants_dir))[: -len(".meta")]
        codes = json.loads(meta.read_text()).get("exit_code_by_key", {})
        out[module] = {name: _STATUS.get(code, "suspicious") for name, code in codes.items()}
    return out


def slug(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


def merged_statuses(root: Path = ROOT, stale: list[str] | None = None) -> dict[str, dict[str, str]]:
    """The ledger's verdicts of unchanged functions, replaced per module by the full run's
    (``mutants/``), each module replaced in turn by its own tree's where it has one. Functions the
    ledger records whose source changed are appended to ``stale``."""
    out, stale_now = ledger_statuses(root)
    if stale is not None:
        stale.extend(stale_now)
    mutants = root / "mutants"
    out.update(statuses(mutants) if mutants.is_dir() and not mutants.is_symlink() else {})
    trees = root / "runs" / "mutate" / "trees"
    for tree in sorted(trees.iterdir()) if trees.is_dir() else ():
        mine = tree_modules(tree)
        for module, mutants_of in statuses(tree).items():
            if module in mine:
                out[module] = mutants_of
    return dict(sorted(out.items()))


def tree_name(modules: Sequence[str]) -> str:
    """A module's tree is named by its slug; several modules run together share a ``group.`` tree."""
    if len(modules) == 1:
        return slug(modules[0])
    return "group." + hashlib.sha256("\n".join(sorted(modules)).encode()).hexdigest()[:10]


def tree_modules(tree: Path) -> set[str]:
    """The modules a tree was made for (the others in it are copied unmutated)."""
    listed = tree / "modules.json"
    if listed.is_file():
        return set(json.loads(listed.read_text()))
    return {m for m in statuses(tree) if slug(m) == tree.name}


def function_hashes(source: str) -> dict[str, str]:
    """mutmut's name of each function and method mutmut mutates (``x_f``, ``xǁClassǁm``) -> a hash of
    its source (decorators and nested functions included, so any edit inside it changes the hash)."""
    out: dict[str, str] = {}

    def put(name: str, node: ast.AST) -> None:
        text = ast.get_source_segment(source, node) or ""
        out[name] = hashlib.sha256(text.encode()).hexdigest()[:16]

    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            put(f"x_{node.name}", node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    put(f"xǁ{node.name}ǁ{item.name}", item)
    return out


def _function_of(mutant: str, prefix: str) -> str:
    return mutant[len(prefix):].rsplit("__mutmut_", 1)[0]


def ledger_entry(module: str, status_of: dict[str, str], tests: Sequence[str], root: Path = ROOT) -> dict[str, Any]:
    """What the ledger keeps of one module's run: its tests and, per function, the source hash and
    the mutant numbers by status."""
    hashes = function_hashes((root / module).read_text())
    prefix = slug(module) + "."
    functions: dict[str, dict[str, Any]] = {}
    for name, status in status_of.items():
        fn = _function_of(name, prefix)
        if fn not in hashes:
            raise SystemExit(f"mutate: {name}: no function {fn} in {module} (the tree is older than the source?)")
        row = functions.setdefault(fn, {"source": hashes[fn]})
        row.setdefault(status, []).append(int(name.rsplit("__mutmut_", 1)[1]))
    for fn, row in functions.items():  # stable files: statuses in name order, numbers ascending
        functions[fn] = {"source": row["source"], **{k: sorted(row[k]) for k in sorted(row) if k != "source"}}
    return {"module": module, "tests": list(tests), "functions": dict(sorted(functions.items()))}


def write_ledger(entry: dict[str, Any], ledger: Path = LEDGER) -> Path:
    """One file per module (no merge conflicts between modules), one line per function."""
    ledger.mkdir(parents=True, exist_ok=True)
    path = ledger / f"{slug(entry['module'])}.json"
    rows = [f"  {json.dumps(fn)}: {json.dumps(row, separators=(',', ':'))}" for fn, row in entry["functions"].items()]
    path.write_text('{"module": ' + json.dumps(entry["module"]) + ', "tests": ' + json.dumps(entry["tests"])
                    + ',\n "functions": {\n' + ",\n".join(rows) + "\n }}\n")
    return path


def read_ledger(module: str, ledger: Path = LEDGER) -> dict[str, Any] | None:
    path = ledger / f"{slug(module)}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def ledger_statuses(root: Path = ROOT) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Module -> mutant -> status for every recorded function whose source is unchanged, and the
    recorded functions that changed (``module:function``) or are gone."""
    out: dict[str, dict[str, str]] = {}
    stale: list[str] = []
    folder = root / "etc" / "mutation-ledger"
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        entry = json.loads(path.read_text())
        module = entry["module"]
        source = root / module
        hashes = function_hashes(source.read_text()) if source.is_file() else {}
        prefix = slug(module) + "."
        mine = out.setdefault(module, {})
        for fn, row in entry["functions"].items():
            if hashes.get(fn) != row["source"]:
                stale.append(f"{module}:{fn}")
                continue
            for status, numbers in row.items():
                if status != "source":
                    mine.update({f"{prefix}{fn}__mutmut_{n}": status for n in numbers})
        if not mine:
            del out[module]
    return out, stale


@contextmanager
def module_tree(modules: Sequence[str]) -> Iterator[Path]:
    """Link ``mutants/`` to the modules' own tree for one run (a full run's folder is parked meanwhile)."""
    link, tree, parked = ROOT / "mutants", TREES / tree_name(modules), TREES / "_full-run"
    tree.mkdir(parents=True, exist_ok=True)
    if len(modules) > 1:
        (tree / "modules.json").write_text(json.dumps(sorted(modules)) + "\n")
    if link.is_symlink():
        link.unlink()
    elif link.exists():
        if parked.exists():
            raise SystemExit(f"mutate: {parked} exists: move it back to mutants/ or remove it")
        link.rename(parked)
    link.symlink_to(tree, target_is_directory=True)
    try:
        yield tree
    finally:
        link.unlink(missing_ok=True)
        if parked.exists():
            parked.rename(link)


def _child(modules: list[str], tests: list[str], max_children: int, names: list[str]) -> int:
    """In a child process: mutmut run with the configuration narrowed to the modules and their tests."""
    import mutmut.configuration as mc
    from mutmut.__main__ import cli

    mc._config = dataclasses.replace(mc._load_config(), only_mutate=list(modules),
                                     pytest_add_cli_args_test_selection=tests)
    try:
        cli(["run", "--max-children", str(max_children), *names], standalone_mode=False)
    except SystemExit as e:
        return int(e.code or 0)
    except Exception:  # mutmut crashed: say so with a code of our own, so that nothing is recorded
        traceback.print_exc()
        return 3
    return 0


def rerun_names(status_of: dict[str, str], prefix: str, again: set[str],
                functions: Sequence[str] = ()) -> list[str]:
    """The mutants to re-test: those whose status is in ``again``, of ``functions`` only if named."""
    return sorted(n for n, st in status_of.items() if st in again
                  and (not functions or any(n.startswith(f"{prefix}{f}__mutmut_") for f in functions)))


def run_module(modules: Sequence[str], tests: list[str], max_children: int, rerun_survivors: bool,
               functions: Sequence[str] = (), rerun_timeouts: bool = False) -> int:
    """mutmut on ``modules`` (one tree for them all, one mapping pass of ``tests``); only the
    survivors and/or the timeouts (re-tested: a timeout under load may hide a survivor), or only the
    mutants of ``functions`` (mutmut's names without the module and ``__mutmut_N``, e.g.
    ``xǁJobControllerǁstep``)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unlink mutants/ on the way out
    with module_tree(modules) as tree:
        names = [f"{slug(m)}.{f}__mutmut_*" for m in modules for f in functions]
        again = {"survived"} if rerun_survivors else set()
        again |= {"timeout"} if rerun_timeouts else set()
        if again:
            found = statuses(tree)
            names = [n for m in modules for n in rerun_names(found.get(m, {}), slug(m) + ".", again, functions)]
            if not names:  # mutmut still runs, to test what has no verdict yet, and the run is recorded
                print(f"mutate: no {' or '.join(sorted(again))} mutants of {', '.join(modules)} to rerun")
        cmd = [sys.executable, __file__, "--child", *(f"--module={m}" for m in modules),
               "--max-children", str(max_children)]
        cmd += [f"--tests={t}" for t in tests] + ["--", *names]
        rc = subprocess.run(cmd, cwd=ROOT, check=False).returncode
        if rc in (0, 1):  # mutmut has just brought the tree up to the source: record its verdicts
            found = statuses(tree)
            for module in modules:
                if found.get(module):
                    path = write_ledger(ledger_entry(module, found[module], tests))
                    print(f"mutate: verdicts recorded in {path.relative_to(ROOT)}")
        return rc


def module_row(module: str, trees: Path = TREES, equivalents: dict[str, Equivalent] | None = None,
               functions: Sequence[str] = (), tree: Path | None = None) -> dict[str, Any]:
    """One module's counts from its own tree (only ``functions``' mutants, if named), with the killed
    share (timeouts count as killed)."""
    found = statuses(trees / slug(module) if tree is None else tree).get(module, {})
    if functions:
        found = {n: st for n, st in found.items()
                 if any(n.startswith(f"{slug(module)}.{f}__mutmut_") for f in functions)}
    equivalents = load_equivalents() if equivalents is None else equivalents
    counts = Counter("equivalent" if st == "survived" and n in equivalents else st for n, st in found.items())
    judged = len(found) - counts["equivalent"] - counts["not_checked"] - counts["skipped"]
    share = (counts["killed"] + counts["timeout"]) / judged if judged else None
    return {"module": module, "mutants": len(found), **dict(sorted(counts.items())), "killed_share": share,
            "survivors": sorted(n for n, st in found.items() if st == "survived" and n not in equivalents)}


def summarise(by_module: dict[str, dict[str, str]], equivalents: dict[str, Equivalent]) -> dict[str, Any]:
    modules: dict[str, dict[str, int]] = {}
    groups: dict[str, Counter[str]] = {g: Counter() for g in TARGETS}
    survivors: list[dict[str, str]] = []
    seen: set[str] = set()
    for module, mutants in by_module.items():
        counts: Counter[str] = Counter()
        for name, status in mutants.items():
            seen.add(name)
            if status == "survived" and name in equivalents:
                status = "equivalent"
            counts[status] += 1
            if status == "survived":
                survivors.append({"module": module, "mutant": name})
        counts["mutants"] = len(mutants)
        modules[module] = dict(sorted(counts.items()))
        group = group_of(module)
        if group is not None:
            groups[group].update(counts)
    group_rows: dict[str, Any] = {}
    for group, c in groups.items():
        # a timeout is a kill (the mutant made the tests run away); no_tests counts against the share
        judged = c["mutants"] - c["equivalent"] - c["not_checked"] - c["skipped"]
        share = (c["killed"] + c["timeout"]) / judged if judged else None
        group_rows[group] = {**dict(sorted(c.items())), "killed_share": share, "target": TARGETS[group],
                             "met": share is not None and share >= TARGETS[group]}
    stale = sorted(set(equivalents) - seen)
    return {"groups": group_rows, "modules": modules, "survivors": survivors,
            "equivalents_listed": len(equivalents), "equivalents_not_found": stale}


def _table(summary: dict[str, Any]) -> str:
    cols = ("killed", "survived", "timeout", "no_tests", "not_checked", "equivalent")
    lines = [f"{'module':40} {'mutants':>7} " + " ".join(f"{c:>11}" for c in cols)]
    for module, c in summary["modules"].items():
        lines.append(f"{module:40} {c['mutants']:7d} " + " ".join(f"{c.get(k, 0):11d}" for k in cols))
    for group, g in summary["groups"].items():
        share = "n/a" if g["killed_share"] is None else f"{100 * g['killed_share']:.1f}%"
        lines.append(f"{group}: {share} killed (target {100 * g['target']:.0f}%): "
                     f"{'met' if g['met'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--summary-only", action="store_true", help="summarise the last mutmut run")
    ap.add_argument("--max-children", type=int, default=2, help="mutants tested at once (default 2)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "mutate" / "summary.json")
    ap.add_argument("--module", action="append", default=[], dest="modules",
                    help="mutate this file only (e.g. planner/admission.py), in its own tree; repeated: "
                         "these files, in one tree with one mapping pass of the tests")
    ap.add_argument("--tests", action="append", default=[],
                    help="with --module: the tests mutmut may run (repeatable; default: the list its "
                         "ledger file records, else its package)")
    ap.add_argument("--label", help="with --module: also write runs/mutate/<module>.<label>.json")
    ap.add_argument("--rerun-survivors", action="store_true", help="with --module: re-test its survivors only")
    ap.add_argument("--rerun-timeouts", action="store_true",
                    help="with --module: re-test its timeouts only (with --rerun-survivors: both)")
    ap.add_argument("--function", action="append", default=[], dest="functions",
                    help="with --module: only this function's mutants (mutmut's name, e.g. xǁJobControllerǁstep)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("names", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.max_children < 1:
        ap.error("--max-children must be >= 1")
    if args.child:
        return _child(args.modules, args.tests, args.max_children, args.names)
    if args.modules:
        for module in args.modules:
            if not (ROOT / module).is_file():
                ap.error(f"--module {module}: no such file")
        recorded = read_ledger(args.modules[0])
        tests = args.tests or (recorded["tests"] if recorded else
                               [f"tests/{args.modules[0].split('/')[0].replace('nereusd', 'daemon')}"])
        if not args.summary_only:
            rc = run_module(args.modules, tests, args.max_children, args.rerun_survivors, args.functions,
                            args.rerun_timeouts)
            if rc not in (0, 1):
                print(f"mutate: mutmut run failed with exit code {rc}", file=sys.stderr)
                return rc
        tree = TREES / tree_name(args.modules)
        for module in args.modules:
            row = {**module_row(module, functions=args.functions, tree=tree), "tests": tests,
                   "functions": args.functions}
            if args.label:
                out = ROOT / "runs" / "mutate" / f"{slug(module)}.{args.label}.json"
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(row, indent=1) + "\n")
            print(json.dumps({k: v for k, v in row.items() if k != "survivors"}))
            print(f"survivors: {len(row['survivors'])}")
        return 0
    equivalents = load_equivalents()
    if not args.summary_only:
        run = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children)],
                             cwd=ROOT, check=False)
        if run.returncode not in (0, 1):
            print(f"mutate: mutmut run failed with exit code {run.returncode}", file=sys.stderr)
            return run.returncode
    stale: list[str] = []
    by_module = merged_statuses(stale=stale)
    if not by_module:
        print("mutate: no ledger, mutants/ folder nor module trees: run without --summary-only first",
              file=sys.stderr)
        return 2
    summary = {**summarise(by_module, equivalents), "stale_functions": stale}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(_table(summary))
    print(f"JSON: {args.out}")
    if summary["equivalents_not_found"]:
        print(f"note: {len(summary['equivalents_not_found'])} listed equivalents no longer exist "
              f"(their function changed): review etc/mutation-equivalents.toml")
    if stale:
        print(f"note: {len(stale)} recorded functions changed since their module's last run (not counted): "
              f"{', '.join(stale[:8])}{' ...' if len(stale) > 8 else ''}; run those modules again")
    return 0 if all(g["met"] for g in summary["groups"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
