"""transitions.replica_local: terms pinned one by one (mutation survivors of the replica-class fast path)."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from itertools import chain

import numpy as np

from planner.models import ModelSpec
from planner.plan import Layout, StagePlan
from transitions.emu import UnitState, part_gpus, part_indices, t_sub
from transitions.footprints import canonical_footprint, footprint
from transitions.local_dag import plan_stage, plan_units, target_parts
from transitions.planning_cache import PlanningCache
from transitions.primitives import Extend, Primitive, relabels
from transitions.replica_classes import replica_stage
from transitions.replica_local import (
    _MIX,
    classes_of,
    gpu_array,
    group_rows,
    local_plan,
    part_columns,
    stage_owners,
)
from transitions.replica_plan import ReplicaClass, member
from transitions.scenarios import PPO_STAGES, random_model, stage_states


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


# --- the class-level local plan against transitions.local_dag's unit-by-unit plan -----------------
#
# Oracle: local_dag.plan_stage applies the same rules one unit at a time (dicts of GPU tuples, no
# numpy). Expanding every class member back to a primitive must give exactly its primitives, and each
# member's own canonical footprint must be its class's (so a class never mixes two shapes).


def _layouts(model: ModelSpec) -> list[Layout]:
    return [Layout(t, p) for t in (1, 2, 4) for p in (1, 2) if model.valid_tp(t) and p <= model.num_layers]


def _positions(lt: Layout, sub: Layout) -> list[list[int]]:
    """Per T_sub part of an ``lt`` unit: the unit ranks its GPUs sit on, in part rank order."""
    ident = tuple(range(lt.size))
    return [list(part_gpus(lt, ident, sub, a, b)) for a, b in part_indices(lt, sub)]


def _stage_case(rng: random.Random, nesting: str = "any") -> tuple[UnitState, StagePlan, StagePlan, int]:
    """A random pair of stage plans of one model-stage whose target parts are, by a per-part draw,
    a current unit (reuse), a current unit's part (split), a mix of current and free GPUs (extend
    from overlaps), free GPUs only (extend round-robin) or a permutation of a current unit's GPUs.
    ``nesting``: "reuse" (the current layout is T_sub: units are reused whole), "split" (the target
    layout is T_sub and the current one larger), "any"."""
    pairs: list[tuple[Layout, Layout]] = []
    while not pairs:
        model = random_model(rng)
        model = dataclasses.replace(model, num_layers=min(model.num_layers, 2))  # small: cheap footprints
        pairs = [(a, b) for a in _layouts(model) for b in _layouts(model)
                 if nesting == "any" or (a != b and t_sub(a, b) == (a if nesting == "reuse" else b))]
    ms = rng.choice(PPO_STAGES)
    state = stage_states(model, (ms,))[ms.name]
    lc, lt = rng.choice(pairs)
    sub = t_sub(lc, lt)
    n = 32
    gpus = list(range(n))
    rng.shuffle(gpus)
    dc = rng.randint(1, min(5, n // (2 * lc.size)))
    cur_sets = [tuple(gpus[i * lc.size:(i + 1) * lc.size]) for i in range(dc)]
    held = {g for s in cur_sets for g in s}
    free_pool = [g for g in range(n) if g not in held]
    rng.shuffle(free_pool)
    candidates: list[tuple[int, ...]] = []  # GPU tuples in T_sub rank order a target part may take
    for s in cur_sets:
        if lc == sub:
            candidates.append(s)
        else:
            candidates += [part_gpus(lc, s, sub, a, b) for a, b in part_indices(lc, sub)]
    positions = _positions(lt, sub) if lt != sub else [list(range(lt.size))]
    recipe = [rng.randrange(5) for _ in positions] if rng.random() < 0.5 else None  # None: a draw per part
    used: set[int] = set()
    tgt_sets: list[tuple[int, ...]] = []
    dt = rng.randint(1, min(4, n // lt.size))
    for j in range(dt):
        unit = [-1] * lt.size
        for q, pos in enumerate(positions):
            how = recipe[q] if recipe is not None else rng.randrange(5)
            take: list[int] = []
            if how == 0 and candidates:  # exactly a current unit / a current part
                take = list(candidates[(j * len(positions) + q) % len(candidates)])
            elif how == 1:  # some current GPUs, the rest free
                mixed = [g for g in rng.choice(cur_sets)]
                take = mixed[: rng.randint(1, len(mixed))]
            elif how == 2:  # free GPUs only
                take = []
            elif how == 3:  # a current part's GPUs in another order
                take = list(rng.choice(candidates))
                rng.shuffle(take)
            else:  # random GPUs
                take = rng.sample(range(n), sub.size)
            take = [g for g in take if g not in used][: sub.size]
            for g in chain(free_pool, gpus):
                if len(take) == sub.size:
                    break
                if g not in used and g not in take:
                    take.append(g)
            used.update(take)
            for p, g in zip(pos, take):
                unit[p] = g
        tgt_sets.append(tuple(unit))
    cp = StagePlan(model_stage=ms.name, layout=lc, gpu_sets=tuple(cur_sets), micro_batch_size=1)
    tp = StagePlan(model_stage=ms.name, layout=lt, gpu_sets=tuple(tgt_sets), micro_batch_size=1)
    return state, cp, tp, n


def _describe(p: Primitive) -> tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Kind and unit names, an Extend's sources in order: the first is the main source (it sends
    what the others do not hold), so both paths must agree on it, ties in shared GPUs included
    (first appearance in the part)."""
    return p.kind.value, tuple(u.uid for u in p.sources), tuple(u.uid for u in p.targets), \
        tuple(u.uid for u in p.frees)


def _shared_first(p: Extend) -> bool:
    """Sources that share more GPUs with the target part come first."""
    shared = [len(set(s.gpus) & set(p.target.gpus)) for s in p.sources]
    return shared == sorted(shared, reverse=True)


def _check_stage(state: UnitState, cp: StagePlan, tp: StagePlan, n: int,
                 cache: PlanningCache | None = None) -> list[ReplicaClass]:
    cache = PlanningCache() if cache is None else cache
    st = replica_stage(state, cp, tp, cache)
    local = local_plan(st, n, cache)
    assert local is not None
    classes = classes_of(st, local, state.stage_order, cache)
    cur, tgt = plan_units(state, cp, 1), plan_units(state, tp, 2)
    parts = [p for u in tgt for p in target_parts(u, st.sub)]
    exact = plan_stage(state, cur, tgt)
    assert sorted((cur[i].uid, tgt[j].uid) for i, j in st.renamed) == sorted(exact.renamed)
    if not classes:  # nothing to do, or a primitive that touches no GPU at all (the exact path takes it)
        assert not exact.primitives or any(not footprint(p, PlanningCache()).gpus and not relabels(p) for p in exact.primitives)
        return classes
    nodes = []
    first = 0
    oracle = cache  # each member's footprint by its own relative shape (memoised per shape)
    for c in classes:
        assert c.first == first and c.stage == state.model_stage and c.stage_order == state.stage_order
        first += c.size
        for m in range(c.size):
            node = member(c, m, cur, tgt, parts)
            assert node.kind is c.kind
            fp, gpus = canonical_footprint(node, oracle)
            assert fp == c.canon, (c.kind, m)
            assert gpus == c.gpus[m].tolist()
            assert c.touched.tolist() == sorted(fp.gpus)
            assert not isinstance(node, Extend) or _shared_first(node)
            nodes.append(node)
    assert sorted(map(_describe, nodes)) == sorted(map(_describe, exact.primitives))
    return classes


def _kinds(classes: list[ReplicaClass]) -> Counter[str]:
    return Counter(c.kind.value for c in classes for _ in range(c.size))


def test_class_members_expand_to_the_unit_by_unit_plan_with_their_class_footprint() -> None:
    rng = random.Random(2026)
    kinds: Counter[str] = Counter()
    for _ in range(20):
        kinds += _kinds(_check_stage(*_stage_case(rng)))
    assert all(kinds[k] > 0 for k in ("split", "merge", "extend", "destroy")), kinds


def test_current_units_kept_whole_are_renamed_or_merged_as_the_unit_by_unit_plan_keeps_them() -> None:
    """The current layout is T_sub: parts on a current unit's GPUs in its rank order reuse it (renamed
    where the target layout is T_sub too, else merged in, or only relabelled when every part is)."""
    rng = random.Random(18)
    kinds: Counter[str] = Counter()
    relabelled = 0
    for _ in range(20):
        classes = _check_stage(*_stage_case(rng, "reuse"))
        kinds += _kinds(classes)
        relabelled += sum(c.size for c in classes if c.kind.value == "merge" and not len(c.touched))
    assert relabelled > 0 and kinds["merge"] > relabelled and kinds["extend"] > 0, (kinds, relabelled)


def test_parts_cut_from_one_current_unit_are_split_as_the_unit_by_unit_plan_splits_them() -> None:
    """The target layout is T_sub and the current one larger: a part on a current unit's part GPUs
    in rank order is split from it; the rest is extended."""
    rng = random.Random(81)
    kinds: Counter[str] = Counter()
    for _ in range(20):
        kinds += _kinds(_check_stage(*_stage_case(rng, "split")))
    assert kinds["split"] > 0 and kinds["extend"] > 0 and kinds["destroy"] > 0, kinds


def test_one_cache_shared_by_many_stage_pairs_serves_each_its_own_class_shapes() -> None:
    """A planner keeps one PlanningCache over many candidates: a class shape memoised for one pair of
    stage plans (other state, layouts, kind or inputs) is never served to another."""
    rng = random.Random(5)
    cache = PlanningCache()
    kinds: Counter[str] = Counter()
    for k in range(24):
        kinds += _kinds(_check_stage(*_stage_case(rng, ("any", "reuse", "split")[k % 3]), cache=cache))
    assert all(kinds[k] > 0 for k in ("split", "merge", "extend", "destroy")), kinds


# --- hand-built stage pairs: each pins one rule on a case worked out by hand ----------------------

_TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                  ffn_hidden_size=24, vocab_size=11)


def _hand_case(lc: Layout, cur: list[tuple[int, ...]], lt: Layout, tgt: list[tuple[int, ...]]
               ) -> tuple[list[ReplicaClass], dict[str, tuple[str, ...]], list[tuple[str, str]]]:
    """The classes of a hand-built pair (checked against local_dag as above), the sources of each
    extended part (unit indices in order) by the part's index, and the renames (by index)."""
    state = stage_states(_TINY, (PPO_STAGES[1],))[PPO_STAGES[1].name]
    cp = StagePlan(model_stage=state.model_stage, layout=lc, gpu_sets=tuple(cur), micro_batch_size=1)
    tp = StagePlan(model_stage=state.model_stage, layout=lt, gpu_sets=tuple(tgt), micro_batch_size=1)
    classes = _check_stage(state, cp, tp, 16)
    st = replica_stage(state, cp, tp, PlanningCache())
    cur_u, tgt_u = plan_units(state, cp, 1), plan_units(state, tp, 2)
    parts = [p for u in tgt_u for p in target_parts(u, st.sub)]
    sources: dict[str, tuple[str, ...]] = {}
    for c in classes:
        for m in range(c.size):
            node = member(c, m, cur_u, tgt_u, parts)
            if isinstance(node, Extend):
                sources[node.target.uid.split("#")[1]] = tuple(u.uid.split("#")[1] for u in node.sources)
    exact = plan_stage(state, cur_u, tgt_u)
    return classes, sources, [(a.split("#")[1], b.split("#")[1]) for a, b in exact.renamed]


def test_a_part_on_several_units_gpus_in_rank_order_is_neither_reused_nor_split() -> None:
    """A part whose GPUs hold ranks 0, 1 in order, but of two different current units, is no current
    unit (nor a current unit's part): it is extended from both."""
    two = Layout(2, 1)
    # current units 0: (0, 1), 1: (2, 3); target (0, 3) = rank 0 of unit 0, rank 1 of unit 1
    _, sources, renamed = _hand_case(two, [(0, 1), (2, 3)], two, [(0, 3), (2, 1)])
    assert renamed == [] and {k: sorted(v) for k, v in sources.items()} == {"0": ["0", "1"], "1": ["0", "1"]}
    # the same with the current layout larger: (0, 3) is no pipeline stage of one current unit
    _, sources, _ = _hand_case(Layout(2, 2), [(0, 1, 2, 3), (4, 5, 6, 7)], two, [(0, 5), (4, 1)])
    assert {k: sorted(v) for k, v in sources.items()} == {"0": ["0", "1"], "1": ["0", "1"]}
    # control: (2, 3) is unit 1 in rank order, so it is renamed, and (0, 1) too
    _, sources, renamed = _hand_case(two, [(0, 1), (2, 3)], two, [(2, 3), (0, 1)])
    assert sorted(renamed) == [("0", "1"), ("1", "0")] and sources == {}


def test_extend_sources_sharing_more_gpus_with_the_part_come_first() -> None:
    """Part (0, 4, 5, 8): unit 1 = (4, 5, 6, 7) holds two of its GPUs, unit 0 = (0, 1, 2, 3) one, GPU 8
    is nobody's: the sources are unit 1, then unit 0."""
    lay = Layout(2, 2)
    _, sources, _ = _hand_case(lay, [(0, 1, 2, 3), (4, 5, 6, 7)], lay, [(0, 4, 5, 8)])
    assert sources == {"0": ("1", "0")}


def test_parts_with_a_gpu_nobody_holds_and_parts_held_by_unit_zero_are_told_apart() -> None:
    """Target (6, 2): GPU 6 is nobody's, 2 is unit 1's; target (0, 4): unit 0's and unit 2's GPUs. Both
    parts have two GPUs of two different holders, but only the second has two sources."""
    two = Layout(2, 1)
    _, sources, _ = _hand_case(two, [(0, 1), (2, 3), (4, 5)], two, [(6, 2), (0, 4)])
    assert {k: sorted(v) for k, v in sources.items()} == {"0": ["1"], "1": ["0", "2"]}


def test_members_whose_gpus_repeat_beyond_the_first_members_pattern_get_their_own_class() -> None:
    """Current (2, 1) units 0: (0, 1), 1: (2, 3), 2: (4, 5); target (2, 2) units T0 = (0, 9, 10, 11) and
    T1 = (2, 12, 3, 5), parts = their pipeline stages. T0's first part (0, 9) and T1's (2, 12) are
    both extended from the unit holding their first GPU, but unit 1's other GPU 3 is also on T1 while
    unit 0's GPU 1 is not on T0: two shapes, so two classes (checked by each member's footprint)."""
    _, sources, _ = _hand_case(Layout(2, 1), [(0, 1), (2, 3), (4, 5)], Layout(2, 2),
                               [(0, 9, 10, 11), (2, 12, 3, 5)])
    # every part extended: T0's second part (10, 11) from unit 0 round-robin, T1's (3, 5) from units 1, 2
    assert {k: sorted(v) for k, v in sources.items()} == {"0.p0.0": ["0"], "0.p0.1": ["0"], "1.p0.0": ["1"],
                                                          "1.p0.1": ["1", "2"]}
