"""planner/op_classes.py, what its other tests left open (mutation testing, tests/mutate.py --module
planner/op_classes.py: 1 of 48 mutants survived tests/planner): the efficiencies' repr."""

from __future__ import annotations

import re

from planner.op_classes import Efficiencies, OpClass


def test_the_repr_lists_every_class_once_in_parentheses() -> None:
    text = repr(Efficiencies({OpClass.GEMM: 0.5}))
    m = re.fullmatch(r"Efficiencies\((.*)\)", text)
    assert m, text
    pairs = [p.split("=") for p in m.group(1).split(", ")]
    assert [k for k, _ in pairs] == [c.value for c in OpClass]
    assert pairs[0] == ["gemm", "0.5"] and all(re.fullmatch(r"[\d.e+-]+", v) for _, v in pairs)
