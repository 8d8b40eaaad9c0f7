"""The plan records every part of Nereus reads (planner/plan.py): what they refuse, naming the field and
the fault, and what they answer. Found by mutation testing (tests/mutate.py --module planner/plan.py:
24% of its mutants killed before; the checks were reached only through plans that were valid)."""

from __future__ import annotations

import pytest

from planner.errors import SpecError
from planner.plan import GlobalPlan, Layout, StagePlan, batch_splits, power_of_two_upto


def _refused(make, field: str, text: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SpecError) as err:
        make()
    assert (err.value.field, str(err.value)) == (field, f"{field}: {text}")


@pytest.mark.parametrize(("tp", "pp"), [(0, 1), (1, 0), (-2, 4), (0, 0)])
def test_a_layout_needs_tp_and_pp_of_at_least_one(tp: int, pp: int) -> None:
    _refused(lambda: Layout(tp, pp), "layout", f"tp and pp must be >= 1, got tp={tp} pp={pp}")


def test_unit_ranks_put_tp_innermost_and_coords_invert_them() -> None:
    layout = Layout(4, 2)
    assert (layout.size, str(layout)) == (8, "TP4xPP2")
    assert [layout.rank_of(t, p) for p in range(2) for t in range(4)] == list(range(8))
    assert [layout.coords(r) for r in range(8)] == [(t, p) for p in range(2) for t in range(4)]
    assert Layout(1, 1).coords(0) == (0, 0) and Layout(2, 3).coords(5) == (1, 2)


def _stage(**kw) -> StagePlan:  # type: ignore[no-untyped-def]
    args = dict(model_stage="actor-train", layout=Layout(2, 1), gpu_sets=((0, 1), (2, 3)), micro_batch_size=2)
    args.update(kw)
    return StagePlan(**args)


def test_a_stage_plan_names_the_first_fault_of_its_gpu_sets() -> None:
    _refused(lambda: _stage(gpu_sets=()), "actor-train.gpu_sets", "a model-stage needs at least one replica")
    _refused(lambda: _stage(gpu_sets=((0, 1), (2,))), "actor-train.gpu_sets[1]", "has 1 GPUs, layout TP2xPP1 needs 2")
    _refused(lambda: _stage(gpu_sets=((0, 1, 4), (2, 3))), "actor-train.gpu_sets[0]",
             "has 3 GPUs, layout TP2xPP1 needs 2")
    _refused(lambda: _stage(gpu_sets=((0, 1), (3, 3))), "actor-train.gpu_sets[1]", "repeats a GPU: (3, 3)")
    _refused(lambda: _stage(gpu_sets=((0, 1), (1, 2))), "actor-train.gpu_sets", "two replicas share a GPU")
    for kw in ({"micro_batch_size": 0}, {"grad_accum": 0}, {"micro_batch_size": -1, "grad_accum": 3}):
        _refused(lambda kw=kw: _stage(**kw), "actor-train.micro_batch_size", "micro_batch_size and grad_accum must be >= 1")


def test_a_stage_plan_answers_its_degree_gpus_and_batch() -> None:
    s = _stage(gpu_sets=((4, 5), (0, 1), (2, 3)), micro_batch_size=2, grad_accum=3)
    assert (s.dp, s.gpus, s.sequences_per_batch) == (3, frozenset(range(6)), 18)
    one = _stage(layout=Layout(1, 1), gpu_sets=((7,),), micro_batch_size=1)
    assert (one.dp, one.gpus, one.sequences_per_batch, one.grad_accum, one.recompute) == (1, frozenset({7}), 1, 1, False)


def test_a_global_plan_refuses_a_stage_twice_and_finds_each_stage_by_name() -> None:
    gen = _stage(model_stage="actor-gen", layout=Layout(1, 1), gpu_sets=((0,), (1,)))
    ref = _stage(model_stage="ref-inf", layout=Layout(1, 1), gpu_sets=((2,),))
    train = _stage(gpu_sets=((0, 1), (4, 5)))
    _refused(lambda: GlobalPlan(version=1, stages=(gen, train, gen)), "plan.stages",
             "a model-stage appears twice: ['actor-gen', 'actor-train', 'actor-gen']")
    plan = GlobalPlan(version=4, stages=(gen, ref, train))
    assert [plan.stage(n) for n in ("ref-inf", "actor-train", "actor-gen")] == [ref, train, gen]
    assert list(plan) == [gen, ref, train] and plan.gpus == frozenset({0, 1, 2, 4, 5})
    with pytest.raises(SpecError) as err:
        plan.stage("critic-train")
    assert (err.value.field, err.value.allowed) == ("model_stage", "actor-gen, ref-inf, actor-train")
    assert str(err.value) == "model_stage: 'critic-train' not in plan (allowed: actor-gen, ref-inf, actor-train)"


def test_powers_of_two_and_batch_splits() -> None:
    assert [power_of_two_upto(n) for n in (0, 1, 2, 6, 8)] == [[], [1], [1, 2], [1, 2, 4], [1, 2, 4, 8]]
    assert batch_splits(12, 2) == [(1, 6), (2, 3), (3, 2), (6, 1)]
    assert batch_splits(12, 2, max_micro_batch=3) == [(1, 6), (2, 3), (3, 2)]
    assert batch_splits(12, 5) == [] and batch_splits(12, 0) == [] and batch_splits(0, 1) == []
    assert batch_splits(7, 7) == [(1, 1)]
