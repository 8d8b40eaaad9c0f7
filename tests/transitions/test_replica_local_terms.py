"""transitions.replica_local: terms pinned one by one (mutation survivors of the replica-class fast path)."""

from __future__ import annotations

import numpy as np

from planner.plan import Layout, StagePlan
from transitions.planning_cache import PlanningCache
from transitions.replica_local import _MIX, gpu_array, group_rows, part_columns, stage_owners


def _as_groups(groups: list[np.ndarray]) -> set[tuple[int, ...]]:
    out = [tuple(int(i) for i in g) for g in groups]
    assert all(list(g) == sorted(g) for g in out) and len(set(out)) == len(out)
    return set(out)


def _oracle(keys: np.ndarray) -> set[tuple[int, ...]]:
    rows: dict[tuple[int, ...], list[int]] = {}
    for i, row in enumerate(keys.tolist()):
        rows.setdefault(tuple(row), []).append(i)
    return {tuple(v) for v in rows.values()}


def test_rows_are_grouped_exactly_as_a_dictionary_of_rows_groups_them() -> None:
    rng = np.random.default_rng(7)
    for width in (1, 3, 256, 300):  # 300: wider than the mixing draws
        for _ in range(5):
            keys = rng.integers(0, 3, size=(9, width), dtype=np.int64)
            keys[4] = keys[1]
            assert _as_groups(group_rows(keys)) == _oracle(keys)
    assert group_rows(np.zeros((0, 4), dtype=np.int64)) == []
    same = np.tile(np.arange(4, dtype=np.int64), (3, 1))
    assert _as_groups(group_rows(same)) == {(0, 1, 2)}
    apart = np.array([[0, 0], [1, 1]], dtype=np.int64)  # rows that differ in every column
    assert _as_groups(group_rows(apart)) == {(0,), (1,)}


def test_rows_whose_hashes_collide_are_still_told_apart() -> None:
    m0, m1 = int(_MIX[0]), int(_MIX[1])
    # row @ mix is m1*m0 for both (mod 2**64): one hash, two different rows
    pair = np.array([[m1, 0], [0, m0]], dtype=np.int64)
    assert int((pair @ _MIX[:2])[0]) == int((pair @ _MIX[:2])[1])
    assert _as_groups(group_rows(pair)) == {(0,), (1,)}
    keys = np.array([[m1, 0], [0, m0], [m1, 0], [5, 5], [0, m0]], dtype=np.int64)
    assert _as_groups(group_rows(keys)) == {(0, 2), (1, 4), (3,)}
    # colliding rows that share a column: told apart by whole-row equality, not by any column
    shared = np.array([[m1, 0, 7], [0, m0, 7], [m1, 0, 7]], dtype=np.int64)
    assert _as_groups(group_rows(shared)) == {(0, 2), (1,)}


def test_gpu_arrays_owners_and_part_columns_are_int_arrays_of_the_plan() -> None:
    cache = PlanningCache()
    plan = StagePlan(model_stage="s", layout=Layout(2, 1), gpu_sets=((3, 1), (0, 5)), micro_batch_size=1)
    arr = gpu_array(plan.gpu_sets, cache)
    assert arr.dtype == np.int64 and arr.tolist() == [[3, 1], [0, 5]]
    assert gpu_array(plan.gpu_sets, cache) is arr  # memoised per tuple
    owner, rank = stage_owners(plan, 7, cache)
    assert owner.dtype == np.int64 and rank.dtype == np.int64
    assert owner.tolist() == [1, 0, -1, 0, -1, 1, -1] and rank.tolist() == [0, 1, -1, 0, -1, 1, -1]
    assert stage_owners(plan, 7, cache)[0] is owner
    cols = part_columns(Layout(2, 2), Layout(1, 1))  # ranks pp*tp + tp: one column per part
    assert cols.dtype == np.int64 and sorted(cols.ravel().tolist()) == [0, 1, 2, 3]
    assert part_columns(Layout(2, 1), Layout(2, 1)).tolist() == [[0, 1]]


def test_memoised_arrays_pin_their_plans_so_a_new_plan_never_reads_an_old_ones_entry() -> None:
    # the memos key by id(): each entry keeps its plan alive, or a new plan could reuse a freed id
    cache = PlanningCache()
    for i in range(40):
        gpus = ((i % 8, (i + 3) % 8),)
        plan = StagePlan(model_stage="s", layout=Layout(2, 1), gpu_sets=tuple(tuple(g) for g in gpus),
                         micro_batch_size=1)
        assert gpu_array(plan.gpu_sets, cache).tolist() == [list(gpus[0])]
        owner, rank = stage_owners(plan, 8, cache)
        assert [g for g in range(8) if owner[g] == 0] == sorted(gpus[0])
        assert rank[gpus[0][0]] == 0 and rank[gpus[0][1]] == 1
        del plan
