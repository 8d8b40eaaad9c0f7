"""The shadowed-package guard (planner/shadow.py) and the planner's typed errors (planner/errors.py),
read word for word: what a user sees when PyPI's ``transitions`` shadows ours, or a spec is refused."""

from __future__ import annotations

import sys
import types

import pytest

import transitions
from planner.errors import InfeasibleError, NereusError, SpecError, unknown_preset
from planner.shadow import ShadowedPackageError, require_nereus_transitions


def test_our_transitions_package_passes_the_guard() -> None:
    assert require_nereus_transitions() is transitions


def test_a_foreign_transitions_package_is_named_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    foreign = types.ModuleType("transitions")
    foreign.__file__ = "/site-packages/transitions/__init__.py"
    monkeypatch.setitem(sys.modules, "transitions", foreign)
    with pytest.raises(ShadowedPackageError) as info:
        require_nereus_transitions()
    assert str(info.value) == (
        "'import transitions' loaded /site-packages/transitions/__init__.py, which is not Nereus's transitions "
        "package. The PyPI state-machine library 'transitions' shadows it in this environment: uninstall it "
        "(pip uninstall transitions) or run Nereus in its own virtual environment.")
    assert isinstance(info.value, ImportError)
    spaceless = types.ModuleType("transitions")  # a namespace package has no __file__
    monkeypatch.setitem(sys.modules, "transitions", spaceless)
    with pytest.raises(ShadowedPackageError, match=r"^'import transitions' loaded <namespace package>, "):
        require_nereus_transitions()


def test_the_guard_imports_transitions_when_it_is_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "transitions")
    mod = require_nereus_transitions()
    assert getattr(mod, "__nereus__", False) is True


def test_typed_errors_say_the_field_the_problem_and_what_is_allowed() -> None:
    e = SpecError("model.tp", "3 is odd", "1, 2, 4")
    assert (str(e), e.field, e.allowed) == ("model.tp: 3 is odd (allowed: 1, 2, 4)", "model.tp", "1, 2, 4")
    assert isinstance(e, ValueError) and isinstance(e, NereusError)
    plain = SpecError("x", "bad")
    assert (str(plain), plain.allowed) == ("x: bad", None)
    assert str(SpecError("x", "bad", "")) == "x: bad"
    inf = InfeasibleError("no plan fits", ("a over by 1 GB", "b over by 2 GB"))
    assert str(inf) == "no plan fits\n  - a over by 1 GB\n  - b over by 2 GB"
    assert inf.reasons == ("a over by 1 GB", "b over by 2 GB")
    assert str(InfeasibleError("none")) == "none" and InfeasibleError("none").reasons == ()
    u = unknown_preset("device", "tpu", ["b", "a"])
    assert (str(u), u.field, u.allowed) == ("device: unknown preset 'tpu' (allowed: a, b)", "device", "a, b")
