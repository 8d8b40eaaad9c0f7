"""The efficiencies record (planner/op_classes.Efficiencies): what it refuses, naming the class and
value; learned values over priors; equality, hashing and updates by value. Found by mutation testing
(tests/mutate.py --module planner/op_classes.py: 21 of 48 mutants killed before)."""

from __future__ import annotations

import math

import pytest

from planner.errors import SpecError
from planner.op_classes import PRIOR_EFFICIENCY, PRIORS, Efficiencies, OpClass


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5000001, math.inf, math.nan])
def test_an_efficiency_outside_its_range_is_refused_naming_the_class(value: float) -> None:
    with pytest.raises(SpecError) as err:
        Efficiencies({OpClass.GEMM: value})
    assert (err.value.field, str(err.value)) == ("efficiencies.gemm", f"efficiencies.gemm: must be in (0, 1.5], got {value}")


def test_an_unknown_op_class_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(SpecError) as err:
        Efficiencies({"gemm": 0.5})  # type: ignore[dict-item]
    assert err.value.field == "efficiencies" and err.value.allowed == ", ".join(c.value for c in OpClass)
    assert str(err.value).startswith("efficiencies: unknown op class 'gemm' (allowed: gemm, ")


def test_learned_values_read_over_the_priors_and_updates_keep_the_rest() -> None:
    assert Efficiencies({OpClass.GEMM: 1.5})[OpClass.GEMM] == 1.5  # the top of the range is allowed
    e = Efficiencies({OpClass.GEMM: 0.7})
    assert e[OpClass.GEMM] == 0.7 and e[OpClass.WEIGHT_SYNC] == PRIOR_EFFICIENCY[OpClass.WEIGHT_SYNC]
    assert list(e) == list(OpClass) and len(e) == len(OpClass) and dict(e.learned) == {OpClass.GEMM: 0.7}
    u = e.updated({OpClass.HOST_COPY: 0.3})
    assert dict(u.learned) == {OpClass.GEMM: 0.7, OpClass.HOST_COPY: 0.3} and dict(e.learned) == {OpClass.GEMM: 0.7}
    assert u.updated({OpClass.GEMM: 0.9})[OpClass.GEMM] == 0.9
    with pytest.raises(TypeError):
        e.learned[OpClass.GEMM] = 0.1  # type: ignore[index]  # read-only: a shared prior cannot be changed
    assert dict(PRIORS.learned) == {}


def test_equal_learned_values_are_equal_and_hash_alike() -> None:
    a = Efficiencies({OpClass.GEMM: 0.7, OpClass.HOST_COPY: 0.3})
    b = Efficiencies({OpClass.HOST_COPY: 0.3, OpClass.GEMM: 0.7})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != Efficiencies({OpClass.GEMM: 0.7}) and a != dict(a)
    assert hash(a) != hash(Efficiencies({OpClass.GEMM: 0.7, OpClass.HOST_COPY: 0.31}))
    # a prior written out is not "learned": the record keeps what was fitted, not what it reads as
    assert Efficiencies({OpClass.GEMM: PRIOR_EFFICIENCY[OpClass.GEMM]}) != PRIORS
    assert repr(a).startswith("Efficiencies(gemm=0.7, ") and "host_copy=0.3" in repr(a)
