"""StagePlan's GPU-set validation (planner.plan), which the replica-class shape cache relies on (no GPU
twice in a stage plan): its fast check must reject exactly what the per-replica checks reject, with
the same error (the first fault in replica order)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import SpecError
from planner.plan import Layout, StagePlan


def _reference_error(layout: Layout, gpu_sets: tuple[tuple[int, ...], ...]) -> str | None:
    """The per-replica rules, one after another (the validation as first written)."""
    for i, gpus in enumerate(gpu_sets):
        if len(gpus) != layout.size:
            return f"x.gpu_sets[{i}]: has {len(gpus)} GPUs, layout {layout} needs {layout.size}"
        if len(set(gpus)) != len(gpus):
            return f"x.gpu_sets[{i}]: repeats a GPU: {gpus}"
    flat = [g for s in gpu_sets for g in s]
    if len(set(flat)) != len(flat):
        return "x.gpu_sets: two replicas share a GPU"
    return None


@settings(max_examples=300, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2]),
       sets=st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=8).map(tuple), min_size=1, max_size=5))
def test_gpu_set_errors_match_the_per_replica_rules(tp: int, pp: int, sets: list[tuple[int, ...]]) -> None:
    layout = Layout(tp, pp)
    gpu_sets = tuple(sets)
    expected = _reference_error(layout, gpu_sets)
    if expected is None:
        plan = StagePlan(model_stage="x", layout=layout, gpu_sets=gpu_sets, micro_batch_size=1)
        assert plan.dp == len(gpu_sets)
        return
    with pytest.raises(SpecError) as err:
        StagePlan(model_stage="x", layout=layout, gpu_sets=gpu_sets, micro_batch_size=1)
    assert str(err.value).startswith(expected)


def test_valid_large_plan_and_batch_error() -> None:
    sets = tuple((2 * i, 2 * i + 1) for i in range(2048))
    assert StagePlan(model_stage="x", layout=Layout(2, 1), gpu_sets=sets, micro_batch_size=1).dp == 2048
    with pytest.raises(SpecError, match="micro_batch_size"):
        StagePlan(model_stage="x", layout=Layout(2, 1), gpu_sets=sets, micro_batch_size=0)
    with pytest.raises(SpecError, match="two replicas share a GPU"):
        StagePlan(model_stage="x", layout=Layout(2, 1), gpu_sets=(*sets, (0, 9999)), micro_batch_size=1)
