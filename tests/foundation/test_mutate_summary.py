"""make mutate's summary (tests/mutate.py) reads mutmut's meta files: statuses per module and group,
listed equivalents taken out of the share, timeouts counted as kills, the targets judged."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _mutate():  # tests/ is not a package: load the script by path
    spec = importlib.util.spec_from_file_location("nereus_mutate", ROOT / "tests" / "mutate.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _meta(root: Path, module: str, codes: dict[str, int | None]) -> None:
    path = root / (module + ".meta")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"exit_code_by_key": codes}))


def test_summary_counts_statuses_equivalents_and_targets(tmp_path: Path) -> None:
    m = _mutate()
    mutants = tmp_path / "mutants"
    _meta(mutants, "planner/a.py", {"planner.a.x_f__mutmut_1": 1, "planner.a.x_f__mutmut_2": 0,
                                    "planner.a.x_f__mutmut_3": 36, "planner.a.x_f__mutmut_4": 0})
    _meta(mutants, "nereusd/controller.py", {"nereusd.controller.x_g__mutmut_1": 1,
                                             "nereusd.controller.x_g__mutmut_2": None})
    eq_file = tmp_path / "eq.toml"
    eq_file.write_text('[[equivalent]]\nmutant = "planner.a.x_f__mutmut_4"\nreason = "same value either way"\n'
                       '[[equivalent]]\nmutant = "planner.gone.x__mutmut_1"\nreason = "function rewritten"\n')
    summary = m.summarise(m.statuses(mutants), m.load_equivalents(eq_file))
    a = summary["modules"]["planner/a.py"]
    assert (a["mutants"], a["killed"], a["survived"], a["timeout"], a["equivalent"]) == (4, 1, 1, 1, 1)
    planner = summary["groups"]["planner"]
    assert planner["killed_share"] == pytest.approx(2 / 3) and not planner["met"]  # 1 kill + 1 timeout of 3
    controller = summary["groups"]["controller"]
    assert controller["killed_share"] == 1.0 and controller["met"]  # the unchecked one is not judged
    assert summary["groups"]["transitions"]["killed_share"] is None
    assert summary["survivors"] == [{"module": "planner/a.py", "mutant": "planner.a.x_f__mutmut_2"}]
    assert summary["equivalents_not_found"] == ["planner.gone.x__mutmut_1"]


def test_an_equivalent_without_a_reason_is_refused(tmp_path: Path) -> None:
    m = _mutate()
    bad = tmp_path / "eq.toml"
    bad.write_text('[[equivalent]]\nmutant = "planner.a.x_f__mutmut_4"\nreason = " "\n')
    with pytest.raises(SystemExit, match="one-line 'reason'"):
        m.load_equivalents(bad)


def test_a_modules_own_tree_wins_over_the_full_run(tmp_path: Path) -> None:
    """--module runs keep a tree per module (runs/mutate/trees/<module>): the summary takes the
    module's statuses from there, and everything else from the full run's mutants/."""
    m = _mutate()
    _meta(tmp_path / "mutants", "planner/a.py", {"planner.a.x_f__mutmut_1": 0, "planner.a.x_f__mutmut_2": 0})
    _meta(tmp_path / "mutants", "planner/b.py", {"planner.b.x_g__mutmut_1": 1})
    tree = tmp_path / "runs" / "mutate" / "trees" / m.slug("planner/a.py")
    _meta(tree, "planner/a.py", {"planner.a.x_f__mutmut_1": 1, "planner.a.x_f__mutmut_2": 0})
    _meta(tree, "planner/b.py", {"planner.b.x_g__mutmut_1": None})  # copied unmutated there: not its module
    merged = m.merged_statuses(tmp_path)
    assert merged == {"planner/a.py": {"planner.a.x_f__mutmut_1": "killed", "planner.a.x_f__mutmut_2": "survived"},
                      "planner/b.py": {"planner.b.x_g__mutmut_1": "killed"}}
    eq = {"planner.a.x_f__mutmut_2": m.Equivalent("planner.a.x_f__mutmut_2", "same either way")}
    row = m.module_row("planner/a.py", trees=tree.parent, equivalents=eq)
    assert (row["mutants"], row["killed"], row["equivalent"], row["killed_share"], row["survivors"]) == (2, 1, 1, 1.0, [])


def test_a_rerun_picks_the_named_statuses_of_the_named_functions_only() -> None:
    m = _mutate()
    status_of = {"planner.a.x_f__mutmut_1": "survived", "planner.a.x_f__mutmut_2": "timeout",
                 "planner.a.x_f__mutmut_3": "killed", "planner.a.x_g__mutmut_1": "timeout",
                 "planner.a.x_fg__mutmut_1": "survived"}
    assert m.rerun_names(status_of, "planner.a.", {"timeout"}) == [
        "planner.a.x_f__mutmut_2", "planner.a.x_g__mutmut_1"]
    assert m.rerun_names(status_of, "planner.a.", {"survived", "timeout"}, ["x_f"]) == [
        "planner.a.x_f__mutmut_1", "planner.a.x_f__mutmut_2"]  # x_fg is another function
    assert m.rerun_names(status_of, "planner.a.", {"survived"}, ["x_g"]) == []


SOURCE = '''import functools


def f(a):
    return a + 1


class C:
    @functools.cache
    def m(self, b):
        def inner():
            return b * 2
        return inner()
'''


def test_the_ledger_counts_a_recorded_function_only_while_its_source_is_unchanged(tmp_path: Path) -> None:
    """A module's verdicts are recorded per function with a hash of its source; the summary of a
    checkout with no trees reads them back, and drops (as stale) a function edited since."""
    m = _mutate()
    (tmp_path / "planner").mkdir()
    (tmp_path / "planner" / "a.py").write_text(SOURCE)
    status_of = {"planner.a.x_f__mutmut_2": "killed", "planner.a.x_f__mutmut_1": "survived",
                 "planner.a.xǁCǁm__mutmut_1": "timeout", "planner.a.xǁCǁm__mutmut_3": "no_tests"}
    entry = m.ledger_entry("planner/a.py", status_of, ["tests/planner/test_a.py"], root=tmp_path)
    assert entry["functions"]["x_f"]["killed"] == [2] and entry["functions"]["x_f"]["survived"] == [1]
    path = m.write_ledger(entry, tmp_path / "etc" / "mutation-ledger")
    assert path.name == "planner.a.json"
    assert json.loads(path.read_text()) == entry  # the hand-formatted file is plain JSON
    assert m.read_ledger("planner/a.py", tmp_path / "etc" / "mutation-ledger")["tests"] == ["tests/planner/test_a.py"]

    stale: list[str] = []
    assert m.merged_statuses(tmp_path, stale) == {"planner/a.py": status_of} and stale == []

    # an edit inside the nested function changes the method's hash, not f's
    (tmp_path / "planner" / "a.py").write_text(SOURCE.replace("b * 2", "b * 3"))
    assert m.merged_statuses(tmp_path, stale) == {
        "planner/a.py": {"planner.a.x_f__mutmut_2": "killed", "planner.a.x_f__mutmut_1": "survived"}}
    assert stale == ["planner/a.py:xǁCǁm"]

    # a module's own tree still wins over the ledger
    _meta(tmp_path / "runs" / "mutate" / "trees" / "planner.a", "planner/a.py", {"planner.a.x_f__mutmut_1": 1})
    assert m.merged_statuses(tmp_path) == {"planner/a.py": {"planner.a.x_f__mutmut_1": "killed"}}


def test_recording_a_tree_older_than_the_source_is_refused(tmp_path: Path) -> None:
    m = _mutate()
    (tmp_path / "planner").mkdir()
    (tmp_path / "planner" / "a.py").write_text(SOURCE)
    with pytest.raises(SystemExit, match="no function x_gone in planner/a.py"):
        m.ledger_entry("planner/a.py", {"planner.a.x_gone__mutmut_1": "killed"}, [], root=tmp_path)


def test_function_hashes_name_functions_and_methods_as_mutmut_does() -> None:
    m = _mutate()
    hashes = m.function_hashes(SOURCE)
    assert sorted(hashes) == ["x_f", "xǁCǁm"]  # the nested function belongs to its method
    assert m.function_hashes(SOURCE.replace("a + 1", "a + 2"))["x_f"] != hashes["x_f"]
    assert m.function_hashes(SOURCE.replace("a + 1", "a + 2"))["xǁCǁm"] == hashes["xǁCǁm"]


def test_a_group_tree_counts_the_modules_it_lists() -> None:
    """Several --module files run together share one tree (one mapping pass of the tests): the
    summary takes from it the modules its modules.json lists, not the others copied into it."""
    m = _mutate()
    assert m.tree_name(["planner/a.py"]) == "planner.a"
    assert m.tree_name(["planner/b.py", "planner/a.py"]) == m.tree_name(["planner/a.py", "planner/b.py"])
    assert m.tree_name(["planner/a.py", "planner/b.py"]).startswith("group.")


def test_the_summary_merges_a_group_tree(tmp_path: Path) -> None:
    m = _mutate()
    tree = tmp_path / "runs" / "mutate" / "trees" / m.tree_name(["planner/a.py", "planner/b.py"])
    _meta(tree, "planner/a.py", {"planner.a.x_f__mutmut_1": 1})
    _meta(tree, "planner/b.py", {"planner.b.x_g__mutmut_1": 0})
    _meta(tree, "planner/c.py", {"planner.c.x_h__mutmut_1": None})  # copied there, not run
    (tree / "modules.json").write_text(json.dumps(["planner/a.py", "planner/b.py"]))
    assert m.merged_statuses(tmp_path) == {"planner/a.py": {"planner.a.x_f__mutmut_1": "killed"},
                                           "planner/b.py": {"planner.b.x_g__mutmut_1": "survived"}}
    row = m.module_row("planner/b.py", tree=tree, equivalents={})
    assert (row["mutants"], row["survived"], row["survivors"]) == (1, 1, ["planner.b.x_g__mutmut_1"])
