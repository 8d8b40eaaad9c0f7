"""planner/plan.py, what its other tests left open (mutation testing, tests/mutate.py --module
planner/plan.py: 9 of 116 mutants survived tests/planner): batch splits of one replica and of one
sequence, in whole numbers; replicas of the wrong sizes whose GPUs are all distinct are refused."""

from __future__ import annotations

import pytest

from planner.errors import SpecError
from planner.plan import Layout, StagePlan, batch_splits


def test_batch_splits_of_one_replica_and_of_one_sequence() -> None:
    assert batch_splits(4, 1) == [(1, 4), (2, 2), (4, 1)]
    assert batch_splits(1, 1) == [(1, 1)]
    assert batch_splits(12, 2, max_micro_batch=3) == [(1, 6), (2, 3), (3, 2)]
    assert all(type(b) is int and type(g) is int for b, g in batch_splits(12, 2))


def test_replicas_of_the_wrong_sizes_are_refused_even_with_distinct_gpus() -> None:
    # 3 + 1 distinct GPUs, as many as two replicas of TP2 hold: the sizes are still wrong
    with pytest.raises(SpecError) as err:
        StagePlan(model_stage="actor-gen", layout=Layout(2, 1), gpu_sets=((0, 1, 2), (3,)), micro_batch_size=1)
    assert str(err.value) == "actor-gen.gpu_sets[0]: has 3 GPUs, layout TP2xPP1 needs 2"
