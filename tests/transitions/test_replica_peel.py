"""The replica path's per-call shortcuts (pattern peeling, per-row checks, shape arrays, unchanged
stages, class-level data edges, member durations by intra-node pattern), each against the direct
computation it replaces."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

import transitions.replica_local as replica_local
from bench.transition_dag import CHANGES
from planner.errors import InfeasibleError
from planner.hardware import ClusterSpec
from planner.plan import GlobalPlan, Layout
from transitions.cost import (
    DEFAULT_COMMUNICATOR_SETUP_S,
    FixedCosts,
    _class_seconds,
    _member_seconds,
    _pair_arrays,
    primitive_seconds,
    schedule,
    transition_cost,
)
from transitions.dag_record import class_data_edges, data_edges
from transitions.emu import UnitState
from transitions.global_dag import TransitionDAG, build_transition
from transitions.planning_cache import PlanningCache
from transitions.replica_classes import _build_stage, _relabelled_stage
from transitions.replica_local import PEELS, _distinct, _splits, group_rows, pattern_groups, rows_all
from transitions.replica_plan import ClassShape, ReplicaClass, class_shape
from transitions.scenarios import h200_cluster, ppo_plan, random_scenario, stage_states


def _direct(x: np.ndarray, neg: bool) -> list[tuple[list[int], list[int]]]:
    """group_rows over every row's first-appearance pattern (with ``neg``: and its negative entries)."""
    first = (x[:, :, None] == x[:, None, :]).argmax(axis=2)
    keys = np.concatenate([first, (x < 0).astype(np.int64)], axis=1) if neg else first
    return [(idx.tolist(), first[idx[0]].tolist()) for idx in group_rows(keys)]


def _rows(rng: random.Random, patterns: int, members: int, width: int, neg: bool) -> np.ndarray:
    """Rows following ``patterns`` random first-appearance patterns, shuffled, GPUs drawn afresh per row
    (some shared between rows, so that no value is unique across the array)."""
    shapes = []
    for _ in range(patterns):
        pat: list[int] = []
        for j in range(width):
            pat.append(j if not pat or rng.random() < 0.5 else pat[rng.randrange(j)])
        shapes.append(pat)
    out = []
    for m in range(members):
        pat = shapes[m % patterns] if m < patterns else rng.choice(shapes)
        labels = sorted(set(pat))
        values = rng.sample(range(-1 if neg else 0, 12), len(labels))
        val = dict(zip(labels, values, strict=True))
        out.append([val[p] for p in pat])
    rng.shuffle(out)
    return np.array(out, dtype=np.int64)


@pytest.mark.parametrize("neg", [False, True])
def test_peeled_patterns_are_group_rows_of_every_rows_pattern_in_its_order(neg: bool) -> None:
    rng = random.Random(3)
    for patterns in (1, 2, PEELS, PEELS + 1, 9):  # past PEELS the rest is compared pairwise
        for width in (1, 2, 5, 9):
            for _ in range(6):
                x = _rows(rng, patterns, 24, width, neg)
                got = [(idx.tolist(), pat) for idx, pat in pattern_groups(x, neg)]
                assert got == _direct(x, neg)
    same = np.array([[4, 4, 5], [7, 7, 1]], dtype=np.int64)  # one pattern, no value shared
    assert [(i.tolist(), p) for i, p in pattern_groups(same, False)] == [([0, 1], [0, 0, 2])]
    clash = np.array([[4, 5], [6, 6]], dtype=np.int64)  # row 1 repeats what row 0 keeps apart
    assert sorted(p for _, p in pattern_groups(clash, False)) == [[0, 0], [0, 1]]


def test_peeled_patterns_keep_group_rows_order_when_hashes_collide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replica_local, "_MIX", np.ones(256, dtype=np.int64))  # hash = sum of the pattern
    rng = random.Random(5)
    for _ in range(20):
        x = _rows(rng, 5, 30, 6, False)
        assert [(idx.tolist(), pat) for idx, pat in pattern_groups(x, False)] == _direct(x, False)
    wide = np.arange(300, dtype=np.int64).reshape(1, 300) % 7  # wider than the mixing draws
    wide = np.concatenate([wide, (wide + 1) % 7, np.arange(300, dtype=np.int64).reshape(1, 300)])
    assert [(i.tolist(), p) for i, p in pattern_groups(wide, False)] == _direct(wide, False)


def test_rows_all_and_distinct_match_the_row_by_row_answers() -> None:
    rng = np.random.default_rng(11)
    for shape in ((0, 3), (5, 0), (7, 1), (9, 4), (40, 12)):
        for p in (0.0, 0.9, 1.0):
            eq = rng.random(shape) < p
            assert rows_all(eq).tolist() == eq.all(axis=1).tolist()
        lab = rng.integers(-1, 30, size=shape)
        if shape[0] and shape[1]:  # (pattern_groups asks only of two labels or more)
            assert _distinct(lab) == all(len(set(r)) == len(r) for r in lab.tolist())
    apart = np.arange(12, dtype=np.int64).reshape(3, 4)  # no value anywhere twice
    assert _distinct(apart) and _distinct(apart - 1)  # ... also with a -1 (row by row then)
    shared = np.array([[0, 1], [1, 0]], dtype=np.int64)  # values shared across rows, not within one
    assert _distinct(shared) and not _distinct(np.array([[0, 1], [2, 2]], dtype=np.int64))


def test_splits_of_equal_and_unequal_part_counts() -> None:
    own = np.array([[0], [0], [1], [1], [2], [2], [2]], dtype=np.int64)
    assert [(u.tolist(), r.tolist()) for u, r in _splits(np.arange(6), own, 3)] == [
        ([0, 1, 2], [[0, 1], [2, 3], [4, 5]])]
    assert [(u.tolist(), r.tolist()) for u, r in _splits(np.array([6, 0, 4, 1, 5]), own, 3)] == [
        ([0], [[0, 1]]), ([2], [[4, 5, 6]])]
    # two units of two parts, one of three: one group per count, each of its units a row
    assert [(u.tolist(), r.tolist()) for u, r in _splits(np.arange(7), own, 3)] == [
        ([0, 1], [[0, 1], [2, 3]]), ([2], [[4, 5, 6]])]


def _cases() -> list[tuple[TransitionDAG, ClusterSpec]]:
    out: list[tuple[TransitionDAG, ClusterSpec]] = []
    cache = PlanningCache()
    for seed in range(40):
        sc = random_scenario(random.Random(seed), loss_probability=0.3)
        try:
            out.append((build_transition(sc.states, sc.cluster, sc.old, sc.new, lost_gpus=sc.lost_gpus,
                                         cache=cache, exact=False), sc.cluster))
        except (InfeasibleError, ValueError):
            continue
    return out


def test_class_data_edges_are_data_edges_of_the_expanded_nodes() -> None:
    seen = 0
    for dag, _ in _cases():
        plan = dag.replicas
        if plan is None:
            continue
        seen += 1
        assert class_data_edges(plan) == data_edges(list(dag.nodes))
    assert seen >= 10


def test_member_durations_memoised_per_shape_are_the_computed_ones() -> None:
    for dag, cluster in _cases()[:25]:
        plan = dag.replicas
        if plan is None:
            continue
        for c in plan.classes:
            first = _class_seconds(c, cluster, DEFAULT_COMMUNICATOR_SETUP_S)
            c.seconds.clear()  # the class's own memo gone: the shape's serves
            again = _class_seconds(c, cluster, DEFAULT_COMMUNICATOR_SETUP_S)
            assert again[0] is first[0] and again[1:] == first[1:]
            fresh = ReplicaClass(kind=c.kind, stage=c.stage, stage_order=c.stage_order, canon=c.canon,
                                 gpus=c.gpus, unit=c.unit, refs=c.refs, touched=c.touched)  # no shape
            sh = _with_pairs(c)
            nodes = c.gpus // cluster.gpus_per_node
            intra = nodes[:, sh.pairs[0]] == nodes[:, sh.pairs[1]]  # type: ignore[index]
            direct = _member_seconds(fresh, sh, intra, cluster, DEFAULT_COMMUNICATOR_SETUP_S, None)
            assert direct[0].tolist() == first[0].tolist() and direct[1:] == first[1:]
            assert _class_seconds(fresh, cluster, DEFAULT_COMMUNICATOR_SETUP_S)[0].tolist() == first[0].tolist()
            fixed = FixedCosts(allocation_bytes_per_s=1e11)
            a, b = _class_seconds(c, cluster, 0.0, fixed), _class_seconds(fresh, cluster, 0.0, fixed)
            assert a[0].tolist() == b[0].tolist() and a[1:] == b[1:]


def _with_pairs(c: ReplicaClass) -> ClassShape:
    """A fresh shape of ``c`` with its pair arrays (what transitions.cost fills on first use)."""
    sh = class_shape(c.canon, c.touched)
    sh.pairs = _pair_arrays(c.canon, c.gpus.shape[1])
    return sh


def test_a_shape_memo_tells_members_on_one_node_from_members_across_nodes() -> None:
    dag = build_transition(*_bench_args("ppo-70b", 64), cache=PlanningCache(), exact=False)
    cluster = h200_cluster(64)
    c = next(c for c in dag.replicas.classes if c.canon.pair_bytes)
    one = _class_seconds(c, cluster, DEFAULT_COMMUNICATOR_SETUP_S)
    spread = np.array([(np.arange(c.gpus.shape[1]) * 8 + m) % 64 for m in range(c.size)], dtype=np.int64)
    other = ReplicaClass(kind=c.kind, stage=c.stage, stage_order=c.stage_order, canon=c.canon, gpus=spread,
                         unit=c.unit, refs=c.refs, touched=c.touched, shape=c.shape)  # same shape, other nodes
    other._finish()
    across = _class_seconds(other, cluster, DEFAULT_COMMUNICATOR_SETUP_S)
    assert across[2] > 0 == one[2] and (across[0] > one[0]).all()
    assert len(c.shape.durations) == 2  # type: ignore[union-attr]


def _bench_args(name: str, n: int) -> tuple[dict[str, UnitState], ClusterSpec, GlobalPlan, GlobalPlan]:
    model, old_layouts, new_layouts = CHANGES[name]
    return stage_states(model), h200_cluster(n), ppo_plan(1, n, old_layouts), ppo_plan(2, n, new_layouts)


def test_an_unchanged_stage_is_the_built_plan_of_every_unit_kept() -> None:
    states, cluster, old, _ = _bench_args("ppo-70b", 128)
    for sp in old:
        again = replace(sp, gpu_sets=tuple(sp.gpu_sets))  # equal, not the same object
        short = _relabelled_stage(states[sp.model_stage], sp, again, 128, PlanningCache(), False)
        built = _build_stage(states[sp.model_stage], sp, again, 128, PlanningCache(), False)
        assert short is not None and built is not None
        assert short.classes == built.classes == [] and short.edges == built.edges == []
        assert short.num_nodes == built.num_nodes == 0 and short.stage.renamed == built.stage.renamed
        assert short.stage.nq == built.stage.nq == 1 and short.stage.sub == built.stage.sub
        assert (short.stage.parts == built.stage.parts).all()
    sp = next(iter(old))
    moved = replace(sp, gpu_sets=tuple(tuple(g + 1 for g in s) for s in sp.gpu_sets))  # GPU 128: outside
    assert _relabelled_stage(states[sp.model_stage], sp, moved, 128, PlanningCache(), False) is None
    other = replace(sp, layout=Layout(4, 2))  # the same GPUs, another layout: not unchanged
    changed = _relabelled_stage(states[sp.model_stage], sp, other, 128, PlanningCache(), False)
    assert changed is not None and changed.classes


def test_a_reused_shape_entry_labels_its_classes_and_parts_as_built() -> None:
    states, cluster, old, new = _bench_args("ppo-8b", 128)
    cache = PlanningCache()
    for sp in old:
        tp = new.stage(sp.model_stage)
        built = _relabelled_stage(states[sp.model_stage], sp, tp, 128, cache, False)
        again = replace(tp, gpu_sets=tuple(tp.gpu_sets))  # a new object of the same shape: the entry's
        hit = _relabelled_stage(states[sp.model_stage], sp, again, 128, cache, False)
        assert built is not None and hit is not None
        assert [c.gpus.tolist() for c in hit.classes] == [c.gpus.tolist() for c in built.classes]
        assert [c.g.tolist() for c in hit.classes] == [c.g.tolist() for c in built.classes]
        assert hit.stage.parts.tolist() == built.stage.parts.tolist()


@pytest.mark.parametrize("seed", [14, 42, 56])  # classes with one data predecessor per member among them
def test_the_class_schedule_is_the_unit_schedule_of_its_order(seed: int) -> None:
    sc = random_scenario(random.Random(seed), loss_probability=0.3)
    dag = build_transition(sc.states, sc.cluster, sc.old, sc.new, lost_gpus=sc.lost_gpus, cache=PlanningCache(),
                           exact=False)
    assert dag.replicas is not None and any(c.preds.shape[1] == 1 for c in dag.replicas.classes)
    cost = transition_cost(dag, sc.cluster)
    durations = [primitive_seconds(fp, sc.cluster, DEFAULT_COMMUNICATOR_SETUP_S) for fp in dag.footprints]
    start, end, _ = schedule(dag, durations)
    assert list(cost.start_s) == pytest.approx(start, rel=1e-12, abs=1e-15)
    assert list(cost.end_s) == pytest.approx(end, rel=1e-12, abs=1e-15)
