"""transitions/replica_order.py's terms: unit-level data edges of a model-stage (``_edges``), their
lift to edges between replica classes with each member's predecessors (``link``), and the greedy
class order checked against capacity on every GPU (``class_order``).

The edges are checked against an independent oracle: transitions.dag_record.data_edges, the
per-unit rules (producer before reader, readers and producer before the node that frees a unit), run
over the members expanded to unit-level primitives; and on small plan changes worked out by hand.
The class order is checked on hand-built classes whose expected order and capacity verdicts follow
from the rules in the docstring (release before acquire, lower stage order first, longest path
first, then index; a class fits when what the GPU holds plus its allocations plus its largest
bucket buffer stays within capacity).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from planner.hardware import CPU, LOOPBACK, NVLINK4, ClusterSpec
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout
from transitions.dag_record import data_edges
from transitions.global_dag import build_transition
from transitions.local_dag import plan_units, target_parts
from transitions.planning_cache import PlanningCache
from transitions.primitives import Footprint, Primitive, PrimitiveKind
from transitions.replica_classes import plan_replicas
from transitions.replica_order import _edges, class_order, link
from transitions.replica_plan import ReplicaClass, ReplicaPlan, ReplicaStage, StageClasses, member
from transitions.scenarios import ACTOR_TRAIN, stage_plan, stage_states

sys.path.insert(0, str(Path(__file__).parent))
from test_replica_classes import _check_order_and_cost, symmetric_case  # noqa: E402

K = PrimitiveKind
TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                 ffn_hidden_size=24, vocab_size=11)
EIGHT = ClusterSpec(device=CPU, num_nodes=2, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)
ROOMY = 1 << 50


# --- edges and predecessors over real stages -------------------------------------------------------

def _one_stage(old: tuple[Layout, list[int]], new: tuple[Layout, list[int]]) -> ReplicaPlan | None:
    """The class-level plan of one actor-train stage moving from ``old`` to ``new`` (layout, GPUs)."""
    name = ACTOR_TRAIN.name
    cur = GlobalPlan(version=1, stages=(stage_plan(name, old[0], old[1], len(old[1]) // old[0].size),))
    tgt = GlobalPlan(version=2, stages=(stage_plan(name, new[0], new[1], len(new[1]) // new[0].size),))
    return plan_replicas(stage_states(TINY, (ACTOR_TRAIN,)), EIGHT, cur, tgt, ROOMY, cache=PlanningCache())


def _members(plan: ReplicaPlan, sc: StageClasses) -> list[Primitive]:
    """The stage's members as unit-level primitives, in stage-local node order."""
    st = sc.stage
    cur = plan_units(st.state, st.current, plan.old_version)
    tgt = plan_units(st.state, st.target, plan.new_version)
    parts = [p for u in tgt for p in target_parts(u, st.sub)]
    return [member(c, m, cur, tgt, parts) for c in sc.classes for m in range(c.size)]


def _edge_set(st: ReplicaStage, classes: list[ReplicaClass]) -> set[tuple[int, int]]:
    src, dst = _edges(st, classes)
    assert src.shape == dst.shape
    return set(zip(src.tolist(), dst.tolist(), strict=True))


def _check_against_unit_rules(plan: ReplicaPlan) -> int:
    """Every stage's array-derived edges, class edges and member predecessors equal what the per-unit
    rules give on its expanded members; returns how many unit-level edges were compared."""
    compared = 0
    for sc in plan.stages:
        nodes = _members(plan, sc)
        oracle = set(data_edges(nodes))
        assert _edge_set(sc.stage, sc.classes) == oracle
        node_class = [k for k, c in enumerate(sc.classes) for _ in range(c.size)]
        assert sc.edges == sorted({(node_class[a], node_class[b]) for a, b in oracle})
        assert link(sc.stage, sc.classes) == sc.edges  # the same again, from the classes alone
        for c in sc.classes:
            want = [sorted({a for a, b in oracle if b == c.first + m}) for m in range(c.size)]
            assert c.preds.shape[0] == c.size
            for m, row in enumerate(c.preds.tolist()):
                real = [p for p in row if p >= 0]
                assert row == real + [-1] * (len(row) - len(real))  # -1 pads the end only
                # ascending: on a tie the class schedule's critical path names the lowest node id, as the
                # per-unit schedule does (its predecessors come from the sorted data edges)
                assert real == sorted(real)
                assert sorted(set(real)) == want[m]
            # as wide as the longest row: some member has no padding (and no column when none has preds)
            width = c.preds.shape[1]
            assert width == 0 if not any(want) else bool((c.preds >= 0).all(axis=1).any())
        _check_renumbered(sc, oracle)
        compared += len(oracle)
    return compared


def _check_renumbered(sc: StageClasses, oracle: set[tuple[int, int]]) -> None:
    """The same classes listed in reverse, node ids renumbered to match (the freeing classes now come
    first, from node 0): link gives the oracle's edges under that renumbering."""
    new_first, first = {}, 0
    for k in reversed(range(len(sc.classes))):
        new_first[k] = first
        first += sc.classes[k].size
    old_to_new = {c.first + m: new_first[k] + m for k, c in enumerate(sc.classes) for m in range(c.size)}
    moved = [_copy(sc.classes[k], first=new_first[k]) for k in reversed(range(len(sc.classes)))]
    renumbered = {(old_to_new[a], old_to_new[b]) for a, b in oracle}
    assert _edge_set(sc.stage, moved) == renumbered
    node_class = [k for k, c in enumerate(moved) for _ in range(c.size)]
    assert link(sc.stage, moved) == sorted({(node_class[a], node_class[b]) for a, b in renumbered})
    for c in moved:
        for m, row in enumerate(c.preds.tolist()):
            assert sorted({p for p in row if p >= 0}) == sorted({a for a, b in renumbered if b == c.first + m})


# seeds of symmetric_case (each on the fast path) that between them have Split and Extend with
# Destroy (nq == 1), Split and Extend into Merge (nq 2 and 4), a class whose members share a GPU, and
# Destroy classes whose members wait for different numbers of readers (padded rows: 38, 57)
SEEDS = (14, 18, 21, 23, 26, 38, 39, 57, 66)


@pytest.mark.parametrize("seed", SEEDS)
def test_stage_edges_are_the_unit_rules_on_the_members(seed: int) -> None:
    states, cluster, old, new = symmetric_case(seed)
    plan = plan_replicas(states, cluster, old, new, ROOMY, cache=PlanningCache())
    assert plan is not None
    assert _check_against_unit_rules(plan) > 0


@pytest.mark.parametrize("seed", (38, 57))
def test_padded_predecessor_rows_do_not_delay_the_class_schedule(seed: int) -> None:
    """Members of one class with fewer predecessors than the widest have padded rows: the class-level
    schedule must still equal the unit-level schedule of the same order (the padding waits for nothing)."""
    states, cluster, old, new = symmetric_case(seed)
    dag = build_transition(states, cluster, old, new, capacity_bytes=ROOMY, exact=False, cache=PlanningCache())
    assert dag.replicas is not None
    assert any((c.preds < 0).any() for c in dag.replicas.classes if c.preds.shape[1])
    _check_order_and_cost(dag, cluster)


def _node(plan: ReplicaPlan, kind: PrimitiveKind, gpus: Sequence[int]) -> int:
    """Stage-local id of the member of ``kind`` whose target (made or freed unit) lies on ``gpus``."""
    nodes = _members(plan, plan.stages[0])
    hits = [i for i, p in enumerate(nodes) if p.kind is kind
            and tuple(sorted({g for u in (p.frees if kind is K.DESTROY else p.targets) for g in u.gpus})) == tuple(gpus)]
    assert len(hits) == 1, (kind, gpus, nodes)
    return hits[0]


def test_split_into_final_units_waits_for_nothing_but_frees_after_its_reads() -> None:
    """TP 2 -> TP 1 on the same GPUs: the target layout is T_sub (one part per unit, no Merge). Each
    current unit is split into the two target units on its GPUs and then destroyed: the only edges are
    Split(u) -> Destroy(u). The class plan is kept (not left to the exact path)."""
    plan = _one_stage((Layout(2, 1), [0, 1, 2, 3]), (Layout(1, 1), [0, 1, 2, 3]))
    assert plan is not None and plan.stages[0].stage.nq == 1
    kinds = sorted(c.kind.value for c in plan.stages[0].classes)
    assert kinds == ["destroy", "split"]
    split01, split23 = _node(plan, K.SPLIT, [0, 1]), _node(plan, K.SPLIT, [2, 3])
    destroy01, destroy23 = _node(plan, K.DESTROY, [0, 1]), _node(plan, K.DESTROY, [2, 3])
    assert _edge_set(plan.stages[0].stage, plan.stages[0].classes) == {(split01, destroy01), (split23, destroy23)}
    assert _check_against_unit_rules(plan) == 2


def test_extends_precede_the_merge_of_their_part_and_the_merge_freeing_their_source() -> None:
    """TP 1 on GPUs 0, 1 -> TP 2 on {0, 1}, {2, 3}: T_sub is TP 1, two parts per target unit. Target
    unit {0, 1} is the two current units kept and merged (the Merge frees them); the parts on 2 and 3
    are on GPUs nobody holds, so each is extended from one current unit (round-robin: GPU 2's from
    the unit on 0, GPU 3's from the unit on 1) and merged into {2, 3}. Edges: each Extend before the
    Merge of its part, and before the Merge that frees the kept unit it reads (4 edges, no Destroy)."""
    plan = _one_stage((Layout(1, 1), [0, 1]), (Layout(2, 1), [0, 1, 2, 3]))
    assert plan is not None and plan.stages[0].stage.nq == 2
    ext2, ext3 = _node(plan, K.EXTEND, [2]), _node(plan, K.EXTEND, [3])
    merge01, merge23 = _node(plan, K.MERGE, [0, 1]), _node(plan, K.MERGE, [2, 3])
    nodes = _members(plan, plan.stages[0])
    assert [u.gpus for u in nodes[ext2].sources] == [(0,)] and [u.gpus for u in nodes[ext3].sources] == [(1,)]
    want = {(ext2, merge23), (ext3, merge23), (ext2, merge01), (ext3, merge01)}
    assert _edge_set(plan.stages[0].stage, plan.stages[0].classes) == want
    assert _check_against_unit_rules(plan) == 4
    merges = [c for c in plan.stages[0].classes if c.kind is K.MERGE]
    for c in merges:  # each Merge waits for both Extends
        assert sorted(c.preds.ravel().tolist()) == sorted([ext2, ext3] * c.size)


def test_wider_fresh_target_has_every_kept_source_read_before_its_merge() -> None:
    """TP 1 on 0..3 -> TP 2 on 0..7: units {0,1}, {2,3} keep and merge the current units; the parts on
    4..7 are extended round-robin from the four current units and merged into {4,5}, {6,7}."""
    plan = _one_stage((Layout(1, 1), [0, 1, 2, 3]), (Layout(2, 1), list(range(8))))
    assert plan is not None
    assert _check_against_unit_rules(plan) == 8


def test_kept_units_and_part_zero_in_the_merges_are_told_apart() -> None:
    """TP 1 on GPUs 2, 3 -> TP 2 on {0, 1}, {2, 3}: now the target unit on fresh GPUs comes first, so its
    Merge reads part 0 (extended), while the Merge into {2, 3} frees the two kept units. Only the kept
    units' readers wait for the second Merge."""
    plan = _one_stage((Layout(1, 1), [2, 3]), (Layout(2, 1), [0, 1, 2, 3]))
    assert plan is not None and plan.stages[0].stage.nq == 2
    ext0, ext1 = _node(plan, K.EXTEND, [0]), _node(plan, K.EXTEND, [1])
    merge01, merge23 = _node(plan, K.MERGE, [0, 1]), _node(plan, K.MERGE, [2, 3])
    want = {(ext0, merge01), (ext1, merge01), (ext0, merge23), (ext1, merge23)}
    assert _edge_set(plan.stages[0].stage, plan.stages[0].classes) == want
    assert _check_against_unit_rules(plan) == 4


def test_a_shrink_that_only_keeps_and_destroys_has_no_edges() -> None:
    """DP 4 -> DP 2 on the same layout: two units are kept (renamed), two destroyed; nothing reads."""
    plan = _one_stage((Layout(1, 1), [0, 1, 2, 3]), (Layout(1, 1), [0, 1]))
    assert plan is not None
    sc = plan.stages[0]
    assert [c.kind for c in sc.classes] == [K.DESTROY] and sc.edges == []
    assert sc.classes[0].preds.shape == (2, 0)
    assert _edge_set(sc.stage, sc.classes) == set()
    assert link(sc.stage, []) == []  # no classes at all: no edges either


# --- link's refusals on classes that are not blocks ------------------------------------------------

def _copy(c: ReplicaClass, **changes: object) -> ReplicaClass:
    fields = {f: getattr(c, f) for f in ("kind", "stage", "stage_order", "canon", "gpus", "unit", "refs",
                                         "touched", "first")}
    fields.update(changes)
    return ReplicaClass(**fields)  # type: ignore[arg-type]


def _split_case() -> tuple[ReplicaStage, ReplicaClass, ReplicaClass]:
    plan = _one_stage((Layout(2, 1), [0, 1, 2, 3]), (Layout(1, 1), [0, 1, 2, 3]))
    assert plan is not None
    sc = plan.stages[0]
    split, destroy = sorted(sc.classes, key=lambda c: c.kind is K.DESTROY)
    return sc.stage, split, destroy


def test_classes_numbered_into_each_other_are_refused() -> None:
    """A Destroy class numbered over the Split class's node ids: each Split member would wait for
    itself, a class depending on itself, so link refuses (None) instead of giving a self-edge."""
    st, split, destroy = _split_case()
    good = [_copy(split, first=0), _copy(destroy, first=split.size)]
    assert link(st, good) == [(0, 1)]
    # the numbering is free as long as it matches the list: the Destroy class first, at node 0
    first_destroy = [_copy(destroy, first=0), _copy(split, first=destroy.size)]
    assert link(st, first_destroy) == [(1, 0)]
    assert first_destroy[0].preds.tolist() == [[destroy.size + k] for k in range(split.size)]
    assert link(st, [_copy(split, first=0), _copy(destroy, first=0)]) is None


def test_a_unit_nobody_frees_waits_for_nothing() -> None:
    """Without the Destroy class, the split units are freed by no class: no edges, no predecessors."""
    st, split, _ = _split_case()
    alone = [_copy(split, first=0)]
    assert link(st, alone) == []
    assert alone[0].preds.shape == (split.size, 0)


def test_an_edge_to_a_node_outside_the_classes_is_refused() -> None:
    """Node ids past the last class (the Destroy numbered one too far) or a Merge missing for a part
    (its node id -1) are not a block of these classes: None."""
    st, split, destroy = _split_case()
    num = split.size + destroy.size
    assert link(st, [_copy(split, first=0), _copy(destroy, first=num - destroy.size + 1)]) is None
    plan = _one_stage((Layout(1, 1), [0, 1]), (Layout(2, 1), [0, 1, 2, 3]))
    assert plan is not None
    sc = plan.stages[0]
    without_merges = []
    first = 0
    for c in sc.classes:
        if c.kind is not K.MERGE:
            without_merges.append(_copy(c, first=first))
            first += c.size
    assert link(sc.stage, without_merges) is None
    # one Extend and the Merge freeing its (kept) source, without the Merge of its own part: still None
    ext3, merge01 = _node(plan, K.EXTEND, [3]), _node(plan, K.MERGE, [0, 1])
    by_node = {c.first + m: c for c in sc.classes for m in range(c.size)}
    assert by_node[ext3].size == by_node[merge01].size == 1
    pair = [_copy(by_node[ext3], first=0), _copy(by_node[merge01], first=1)]
    assert link(sc.stage, pair) is None


# --- class_order -----------------------------------------------------------------------------------

def _cls(gpus: list[list[int]], *, alloc: dict[int, int] | None = None, free: dict[int, int] | None = None,
         buf: dict[int, int] | None = None, moved: int = 0, stage_order: int = 0,
         touched: list[int] | None = None) -> ReplicaClass:
    """A class of len(gpus) members; its footprint over labels 0.. (alloc/free/buffer bytes per label)."""
    g = np.array(gpus, dtype=np.int64)
    canon = Footprint(alloc_bytes=alloc or {}, free_bytes=free or {}, buffer_bytes=buf or {}, local_bytes={},
                      pair_bytes={(0, 1): moved} if moved else {})
    labels = list(range(g.shape[1])) if touched is None else touched
    c = ReplicaClass(kind=K.EXTEND, stage="s", stage_order=stage_order, canon=canon, gpus=g,
                     unit=np.zeros(len(g), dtype=np.int64), refs=np.zeros((len(g), 0), dtype=np.int64),
                     touched=np.array(labels, dtype=np.int64))
    c._finish()
    return c


def _order(classes: list[ReplicaClass], edges: list[tuple[int, int]] = (), initial: Sequence[int] = (0,) * 4,  # type: ignore[assignment]
           capacity: int = 100) -> list[int] | None:
    return class_order(classes, list(edges), np.array(initial, dtype=np.int64), capacity)


def test_releases_go_before_acquires_when_both_are_ready() -> None:
    acquire = _cls([[0]], alloc={0: 10})
    release = _cls([[1]], free={0: 10})
    assert _order([acquire, release]) == [1, 0]
    assert _order([release, acquire]) == [0, 1]


def test_lower_stage_order_goes_first_among_releases_and_among_acquires() -> None:
    late, early = _cls([[0]], free={0: 1}, stage_order=2), _cls([[1]], free={0: 1}, stage_order=1)
    assert _order([late, early]) == [1, 0]
    late_a, early_a = _cls([[0]], alloc={0: 1}, stage_order=5), _cls([[1]], alloc={0: 1}, stage_order=3)
    assert _order([late_a, early_a]) == [1, 0]
    # acquire vs release comes before the stage order: a later-stage release still goes first
    assert _order([early_a, _cls([[2]], free={0: 1}, stage_order=9)]) == [1, 0]


def test_longest_path_to_a_sink_goes_first_then_the_index() -> None:
    """Alike classes 0 (a sink), 1 -> 2 (a chain): 1 heads a path of two classes so it goes first; then
    0 and 2 both head a path of one (0 by index). With 2 -> 0 instead, 2 heads the longest path; then 0
    and 1 both head a path of one (0 by index)."""
    alike = [_cls([[k]], free={0: 1}) for k in range(3)]
    assert _order(alike, [(1, 2)]) == [1, 0, 2]
    assert _order(alike, []) == [0, 1, 2]
    assert _order(alike, [(2, 0)]) == [2, 0, 1]


def test_path_length_weighs_each_class_by_its_bytes_moved_plus_one() -> None:
    """Each class weighs moved_bytes + 1. Class 0 heads a chain 0 -> 1 of two classes moving nothing
    (2); class 2 alone weighs 1 (moving nothing), 2 (1 byte: a tie, the lower index first) or 3 (2 bytes)."""
    def case(moved: int) -> list[int] | None:
        return _order([_cls([[0]], free={0: 1}), _cls([[1]], free={0: 1}), _cls([[2]], free={0: 1}, moved=moved)],
                      [(0, 1)])
    assert case(0) == [0, 1, 2]  # 2 > 1; then 1 and 2 both weigh 1: by index
    assert case(1) == [0, 2, 1]  # 2 == 2: 0 by index; then 2 (2) before 1 (1)
    assert case(2) == [2, 0, 1]  # 3 > 2


def test_a_successor_waits_for_its_predecessor_whatever_its_priority() -> None:
    acquire, release = _cls([[0]], alloc={0: 1}), _cls([[1]], free={0: 1})
    assert _order([acquire, release], [(0, 1)]) == [0, 1]
    chain = [_cls([[k]], free={0: 1}, stage_order=3 - k) for k in range(3)]
    assert _order(chain, [(0, 1), (1, 2)]) == [0, 1, 2]
    assert _order(chain, [(0, 2), (1, 2)]) == [1, 0, 2]  # 1 (stage 2) before 0 (stage 3), 2 last


def test_successors_made_ready_together_follow_the_same_priorities() -> None:
    """Classes that become ready when the same class runs are ordered like those ready at the start:
    a release before an acquire, then the lower stage order, then the longer path to a sink."""
    head = _cls([[0]], free={0: 1})
    acquire, release = _cls([[1]], alloc={0: 1}), _cls([[2]], free={0: 1})
    assert _order([head, acquire, release], [(0, 1), (0, 2)]) == [0, 2, 1]
    late, early = _cls([[1]], free={0: 1}, stage_order=4), _cls([[2]], free={0: 1}, stage_order=1)
    assert _order([head, late, early], [(0, 1), (0, 2)]) == [0, 2, 1]
    # 0 -> {1, 2}, 2 -> 3: 2 heads a path of two, 1 of one; then 1 and 3 (one each) by index
    alike = [_cls([[k]], free={0: 1}) for k in range(4)]
    assert _order(alike, [(0, 1), (0, 2), (2, 3)]) == [0, 2, 1, 3]
    assert _order(alike, [(0, 1), (0, 2), (1, 3)]) == [0, 1, 2, 3]


def test_a_class_fits_when_held_plus_alloc_plus_buffer_is_within_capacity() -> None:
    """GPU 0 holds 90 of 100: allocating 6 with a 4-byte buffer reaches exactly 100 (fits), with a
    5-byte buffer 101 (blocked). Afterwards it holds 96 (the buffer is gone, the allocation stays):
    a second class allocating 4 fits, one allocating 5 does not."""
    held = [90, 0, 0, 0]
    assert _order([_cls([[0]], alloc={0: 6}, buf={0: 4})], initial=held) == [0]
    assert _order([_cls([[0]], alloc={0: 6}, buf={0: 5})], initial=held) is None
    assert _order([_cls([[0]], alloc={0: 6}, buf={0: 4}), _cls([[0]], alloc={0: 4})], [(0, 1)], held) == [0, 1]
    assert _order([_cls([[0]], alloc={0: 6}, buf={0: 4}), _cls([[0]], alloc={0: 5})], [(0, 1)], held) is None
    # what it frees is subtracted: allocating 6 and freeing 6 leaves 90, so 10 more still fit
    assert _order([_cls([[0]], alloc={0: 6}, free={0: 6}), _cls([[0]], alloc={0: 10})], [(0, 1)], held) == [0, 1]
    assert _order([_cls([[0]], alloc={0: 6}, free={0: 6}), _cls([[0]], alloc={0: 11})], [(0, 1)], held) is None


def test_every_member_on_every_gpu_is_checked() -> None:
    """Two members on GPUs (0, 1) and (2, 3); label 1 allocates 10. Only GPU 3 is too full (95): blocked;
    with GPU 1 at 95 instead, also blocked; with every GPU at 90, it fits."""
    two = _cls([[0, 1], [2, 3]], alloc={1: 10})
    assert two.single
    assert _order([two], initial=[0, 0, 0, 95]) is None
    assert _order([two], initial=[0, 95, 0, 0]) is None
    assert _order([two], initial=[90, 90, 90, 90]) == [0]
    assert _order([two], initial=[0, 0, 95, 0]) == [0]  # label 0 allocates nothing


def test_releases_are_never_blocked_even_on_an_overfull_gpu() -> None:
    """A class that only frees is not checked (it can only lower what a GPU holds)."""
    release = _cls([[0]], free={0: 30})
    assert not release.acquire
    assert _order([release], initial=[120, 0, 0, 0]) == [0]
    # and it lowers GPU 0 to 90, so a class allocating 10 after it fits, 11 does not
    assert _order([release, _cls([[0]], alloc={0: 10})], [(0, 1)], [120, 0, 0, 0]) == [0, 1]
    assert _order([release, _cls([[0]], alloc={0: 11})], [(0, 1)], [120, 0, 0, 0]) is None


def test_members_sharing_a_gpu_are_bound_by_all_their_allocations_and_the_largest_buffer() -> None:
    """Members (0, 1) and (0, 2) share GPU 0; label 0 allocates 10 with a 5-byte buffer, label 1
    allocates 3 with a 7-byte buffer. GPU 0 gets 10 + 10 allocated and at most 5 of buffer: 25; GPUs
    1 and 2 each 3 + 7 = 10. Afterwards GPU 0 holds 20, GPUs 1 and 2 hold 3 each."""
    shared = _cls([[0, 1], [0, 2]], alloc={0: 10, 1: 3}, buf={0: 5, 1: 7})
    assert not shared.single
    assert _order([shared], capacity=25) == [0]
    assert _order([shared], capacity=24) is None
    assert _order([shared], initial=[0, 16, 0, 0], capacity=25) is None  # GPU 1: 16 + 10 > 25
    assert _order([shared], initial=[0, 15, 15, 0], capacity=25) == [0]
    after = [_cls([[0]], alloc={0: 5}), _cls([[1]], alloc={0: 22}), _cls([[2]], alloc={0: 22})]
    assert _order([shared, *after], [(0, 1), (0, 2), (0, 3)], capacity=25) == [0, 1, 2, 3]
    for k, too_much in ((1, 6), (2, 23), (3, 23)):  # 20 + 6, 3 + 23, 3 + 23 > 25
        more = list(after)
        more[k - 1] = _cls([[k - 1]], alloc={0: too_much})
        assert _order([shared, *more], [(0, 1), (0, 2), (0, 3)], capacity=25) is None


def test_members_sharing_a_gpu_release_what_they_all_free() -> None:
    """Two members on GPU 0 each freeing 30 of 100 held (not checked: they acquire nothing): 40 left, so
    60 more fit afterwards and 61 do not. Each allocating 1 and freeing 30 from 80 held: 80 + 1 + 1 fits,
    then 80 + 2 - 60 = 22 are held, so 78 more fit and 79 do not."""
    shared = _cls([[0], [0]], free={0: 30})
    assert not shared.single and not shared.acquire
    held = [100, 0, 0, 0]
    assert _order([shared, _cls([[0]], alloc={0: 60})], [(0, 1)], held) == [0, 1]
    assert _order([shared, _cls([[0]], alloc={0: 61})], [(0, 1)], held) is None
    both = _cls([[0], [0]], free={0: 30}, alloc={0: 1})
    assert both.acquire and not both.single
    assert _order([both, _cls([[0]], alloc={0: 78})], [(0, 1)], [80, 0, 0, 0]) == [0, 1]
    assert _order([both, _cls([[0]], alloc={0: 79})], [(0, 1)], [80, 0, 0, 0]) is None


def test_a_class_on_no_gpu_is_ordered_without_a_check() -> None:
    """A class touching no GPU (a Merge that only relabels) takes no room and is never blocked."""
    nothing = _cls([[0]], touched=[])
    assert _order([nothing], initial=[500, 0, 0, 0]) == [0]
    assert _order([nothing, _cls([[1]], alloc={0: 100})], [(0, 1)]) == [0, 1]


def test_a_cycle_the_levels_miss_still_leaves_classes_unordered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Classes on a cycle never become ready; if the longest-path levels did not refuse the cycle
    (they raise DagCycleError), the order would miss them and is refused (None)."""
    import transitions.replica_order as ro

    monkeypatch.setattr(ro, "bottom_levels", lambda n, edges, weight: [1.0] * n)
    alike = [_cls([[k]], free={0: 1}) for k in range(3)]
    assert _order(alike, [(1, 2), (2, 1)]) is None
    assert _order(alike, [(1, 2)]) == [0, 1, 2]


def test_the_callers_initial_bytes_are_left_as_they_were() -> None:
    initial = np.array([10, 20, 30, 40], dtype=np.int64)
    classes = [_cls([[0, 1]], alloc={0: 5, 1: 5}), _cls([[2], [2]], alloc={0: 7})]
    assert class_order(classes, [], initial, 100) == [0, 1]
    assert initial.tolist() == [10, 20, 30, 40]
