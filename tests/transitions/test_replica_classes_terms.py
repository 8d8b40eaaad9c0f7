"""transitions.replica_classes: terms pinned one by one (mutation survivors of the replica-class fast path).

The oracles: the exact per-unit path (``build_transition(..., exact=True)``), a build of the same stage
pair with a cold PlanningCache (``_build_stage`` on a fresh cache: what a warm cache must equal), and
byte counts worked out by hand from ``rank_bytes``.
"""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
from test_replica_classes import _renamed, _same_as_exact, symmetric_case

import transitions.replica_classes as rc
from planner.hardware import CPU, LOOPBACK, NVLINK4, ClusterSpec
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout, StagePlan
from transitions.cost import transition_cost
from transitions.emu import rank_bytes
from transitions.global_dag import build_transition
from transitions.planning_cache import PlanningCache
from transitions.replica_classes import plan_replicas
from transitions.replica_plan import ReplicaPlan, StageClasses
from transitions.scenarios import PPO_STAGES, stage_plan, stage_states

ROOMY = 1 << 50
MODEL = ModelSpec(name="tiny", num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                  ffn_hidden_size=24, vocab_size=11)
STATES = stage_states(MODEL, PPO_STAGES)
GEN, TRAIN = "actor-gen", "actor-train"
CLUSTER = ClusterSpec(device=CPU, num_nodes=2, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)


def _plan(version: int, *stages: StagePlan) -> GlobalPlan:
    return GlobalPlan(version=version, stages=stages)


def _sp(name: str, tp: int, gpus: list[int]) -> StagePlan:
    return stage_plan(name, Layout(tp, 1), gpus, len(gpus) // tp)


def _fast(old: GlobalPlan, new: GlobalPlan, cache: PlanningCache, capacity: int = ROOMY) -> ReplicaPlan | None:
    return plan_replicas(STATES, CLUSTER, old, new, capacity, cache=cache)


def _matches_exact(old: GlobalPlan, new: GlobalPlan, cache: PlanningCache) -> None:
    """The class plan built with ``cache`` (warm or cold) expands to exactly the exact path's DAG."""
    fast = build_transition(STATES, CLUSTER, old, new, capacity_bytes=ROOMY, exact=False, cache=cache)
    assert fast.replicas is not None
    exact = build_transition(STATES, CLUSTER, old, new, capacity_bytes=ROOMY, exact=True, cache=PlanningCache())
    _same_as_exact(fast, exact)


# --- what plan_replicas declines, and where exactly the thresholds lie --------------------------------


def test_min_units_counts_old_and_new_replicas_and_is_inclusive() -> None:
    # 8 replicas of TP 1 -> 4 of TP 2: 12 units in all; the fast path needs at least min_units of them
    old, new = _plan(1, _sp(GEN, 1, list(range(8)))), _plan(2, _sp(GEN, 2, list(range(8))))
    assert plan_replicas(STATES, CLUSTER, old, new, ROOMY, 12, cache=PlanningCache()) is not None
    assert plan_replicas(STATES, CLUSTER, old, new, ROOMY, 13, cache=PlanningCache()) is None


def test_two_empty_plans_make_an_empty_class_plan_by_default() -> None:
    """min_units defaults to no threshold at all: even a change with no units gets a (trivial) plan."""
    plan = plan_replicas(STATES, CLUSTER, _plan(1), _plan(2), ROOMY, cache=PlanningCache())
    assert plan is not None
    assert (plan.num_nodes, plan.classes, plan.class_order) == (0, [], [])
    assert plan.initial.tolist() == [0] * CLUSTER.num_gpus


def test_a_gpu_outside_the_cluster_is_left_to_the_exact_path() -> None:
    """GPU ids -1 or num_gpus anywhere (current or target) make the fast path decline (no IndexError,
    no wrap-around to the last GPU): the exact path names the offending GPU."""
    n = CLUSTER.num_gpus
    good = list(range(n))
    for cur, tgt in ((good[:-1] + [n], good), (good, good[:-1] + [n]),
                     ([-1] + good[1:], good), (good, [-1] + good[1:])):
        old, new = _plan(1, _sp(GEN, 1, cur)), _plan(2, _sp(GEN, 2, tgt))
        assert _fast(old, new, PlanningCache()) is None


def test_a_gpu_outside_the_cluster_is_declined_even_when_its_wrapped_twin_was_planned() -> None:
    """GPU -1 would alias GPU n-1 in numpy indexing, so a pair naming -1 has the relative shape of the
    pair naming n-1: the range check must come before the shape cache is consulted."""
    n = CLUSTER.num_gpus
    good = list(range(n))
    for cur, tgt, bad_cur, bad_tgt in ((good, good, good, good[:-1] + [-1]),
                                        (good, good, good[:-1] + [-1], good)):
        cache = PlanningCache()
        assert _fast(_plan(1, _sp(GEN, 1, cur)), _plan(2, _sp(GEN, 2, tgt)), cache) is not None
        assert _fast(_plan(1, _sp(GEN, 1, bad_cur)), _plan(2, _sp(GEN, 2, bad_tgt)), cache) is None


def test_capacity_is_what_a_gpu_may_hold_inclusive() -> None:
    # nothing changes (same layout, same GPUs): no primitive, so the peak is what each GPU holds already
    held = rank_bytes(STATES[GEN], Layout(1, 1))[0]  # one TP-1 replica per GPU: its whole state
    old, new = _plan(1, _sp(GEN, 1, list(range(8)))), _plan(2, _sp(GEN, 1, list(range(8))))
    plan = _fast(old, new, PlanningCache(), capacity=held)
    assert plan is not None and plan.num_nodes == 0
    assert _fast(old, new, PlanningCache(), capacity=held - 1) is None


# --- the plan's record ---------------------------------------------------------------------------------


def _two_stage_case() -> tuple[GlobalPlan, GlobalPlan]:
    # actor-gen TP 1 on all 8 GPUs -> TP 2; actor-train TP 2 on GPUs 0-3 -> TP 1 on GPUs 0-3
    old = _plan(1, _sp(GEN, 1, list(range(8))), _sp(TRAIN, 2, [0, 1, 2, 3]))
    new = _plan(2, _sp(GEN, 2, list(range(8))), _sp(TRAIN, 1, [0, 1, 2, 3]))
    return old, new


def test_initial_bytes_are_every_stage_units_bytes_summed_per_gpu() -> None:
    old, new = _two_stage_case()
    cache = PlanningCache()
    plan = _fast(old, new, cache)
    assert plan is not None
    # by hand: every GPU holds one whole actor-gen replica (TP 1); GPUs 0-3 also hold the rank of
    # their actor-train TP-2 replica (ranks 0, 1, 0, 1)
    gen = rank_bytes(STATES[GEN], Layout(1, 1))[0]
    train = rank_bytes(STATES[TRAIN], Layout(2, 1))
    want = [gen + train[0], gen + train[1], gen + train[0], gen + train[1]] + [gen] * 4
    assert plan.initial.tolist() == want
    assert np.issubdtype(plan.initial.dtype, np.integer)  # bytes are counted exactly
    assert plan.cache is cache  # the builder's memos serve the expansion


def test_initial_bytes_of_another_current_plan_of_the_same_stage_are_its_own() -> None:
    """The held-bytes memo tells plans apart (one cache, two current plans of one model-stage)."""
    cache = PlanningCache()
    gen = rank_bytes(STATES[GEN], Layout(1, 1))[0]
    first = _fast(_plan(1, _sp(GEN, 1, [0, 1, 2, 3])), _plan(2, _sp(GEN, 2, [0, 1, 2, 3])), cache)
    second = _fast(_plan(1, _sp(GEN, 1, [4, 5, 6, 7])), _plan(2, _sp(GEN, 2, [4, 5, 6, 7])), cache)
    assert first is not None and second is not None
    assert first.initial.tolist() == [gen] * 4 + [0] * 4
    assert second.initial.tolist() == [0] * 4 + [gen] * 4


def test_node_ids_run_stage_after_stage_and_class_after_class() -> None:
    old, new = _two_stage_case()
    plan = _fast(old, new, PlanningCache())
    assert plan is not None
    exact = build_transition(STATES, CLUSTER, old, new, capacity_bytes=ROOMY, exact=True)
    assert plan.num_nodes == len(exact.nodes) == sum(c.size for c in plan.classes)
    assert [sc.stage.name for sc in plan.stages] == [GEN, TRAIN]  # the old plan's order
    base, k = 0, 0
    for s, sc in enumerate(plan.stages):
        assert plan.stage_base[s] == base
        local = 0
        for c in sc.classes:
            assert plan.classes[k] is c and plan.class_stage[k] == s
            assert plan.first[k] == base + local
            local += c.size
            k += 1
        assert local == sc.num_nodes
        base += local
    assert sorted(plan.order()) == list(range(plan.num_nodes))
    # every stage-local edge between classes holds in the global class order
    pos = {cls: i for i, cls in enumerate(plan.class_order)}
    offset = 0
    for sc in plan.stages:
        assert all(pos[x + offset] < pos[y + offset] for x, y in sc.edges)
        offset += len(sc.classes)


def test_every_class_and_stage_record_names_its_model_stage_and_its_order() -> None:
    old, new = _two_stage_case()
    plan = _fast(old, new, PlanningCache())
    assert plan is not None
    for sc in plan.stages:
        assert sc.classes
        for c in sc.classes:
            assert (c.stage, c.stage_order) == (sc.stage.name, STATES[sc.stage.name].stage_order)
        assert sc.stage.name == sc.stage.state.model_stage


# --- the memos: a warm cache gives what a cold one gives -----------------------------------------------


def _same_stage(got: StageClasses, want: StageClasses) -> None:
    """Every field of a stage's class-level plan, against ``want`` built with a cold cache."""
    a, b = got.stage, want.stage
    assert (a.name, a.state, a.sub, a.nq, a.renamed) == (b.name, b.state, b.sub, b.nq, b.renamed)
    assert a.current is b.current and a.target is b.target
    for f in ("cur", "tgt", "parts"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert (got.edges, got.num_nodes) == (want.edges, want.num_nodes)
    assert len(got.classes) == len(want.classes)
    for x, y in zip(got.classes, want.classes):
        assert (x.kind, x.stage, x.stage_order, x.canon, x.first, x.single, x.acquire) == (
            y.kind, y.stage, y.stage_order, y.canon, y.first, y.single, y.acquire)
        for f in ("gpus", "unit", "refs", "touched", "g", "alloc", "buf", "delta", "preds"):
            assert np.array_equal(getattr(x, f), getattr(y, f)), f


def _symmetric_fast_cases(*seeds: int) -> list[tuple[dict, ClusterSpec, GlobalPlan, GlobalPlan]]:
    """symmetric_case of ``seeds``, each of which the fast path carries (checked here)."""
    out = []
    for seed in seeds:
        states, cluster, old, new = case = symmetric_case(seed)
        assert plan_replicas(states, cluster, old, new, ROOMY, cache=PlanningCache()) is not None, seed
        out.append(case)
    return out


def test_a_pair_of_a_seen_shape_gets_the_record_a_cold_build_gives() -> None:
    """Served from the shape cache (the same plans as new objects; every GPU renamed), each stage's
    record is field for field what building that pair afresh gives, and nothing is rebuilt."""
    for states, cluster, old, new in _symmetric_fast_cases(3, 7, 9):
        n = cluster.num_gpus
        cache = PlanningCache()
        assert plan_replicas(states, cluster, old, new, ROOMY, cache=cache) is not None
        shapes = len(cache.shape_stages)
        perm = list(range(n))
        random.Random(n).shuffle(perm)
        for cur, cand in ((old, _renamed(new, 3, list(range(n)))), (_renamed(old, 1, perm), _renamed(new, 2, perm))):
            plan = plan_replicas(states, cluster, cur, cand, ROOMY, cache=cache)
            assert plan is not None and len(cache.shape_stages) == shapes
            for sc in plan.stages:
                name = sc.stage.name
                cold = rc._build_stage(states[name], cur.stage(name), cand.stage(name), n, PlanningCache(), False)
                assert cold is not None
                _same_stage(sc, cold)


def test_a_pair_of_a_seen_shape_is_not_rebuilt(monkeypatch: pytest.MonkeyPatch) -> None:
    states, cluster, old, new = _symmetric_fast_cases(0)[0]
    cache = PlanningCache()
    first = plan_replicas(states, cluster, old, new, ROOMY, cache=cache)
    assert first is not None

    def no_build(*_args: object) -> None:
        raise AssertionError("a pair of a seen shape was built again")

    monkeypatch.setattr(rc, "_build_stage", no_build)
    perm = list(range(cluster.num_gpus))[::-1]
    for cur, cand in ((old, _renamed(new, 3, list(range(cluster.num_gpus)))),
                      (_renamed(old, 1, perm), _renamed(new, 2, perm))):
        assert plan_replicas(states, cluster, cur, cand, ROOMY, cache=cache) is not None


def test_on_the_same_gpus_a_seen_shape_keeps_its_durations_and_on_others_starts_afresh() -> None:
    """transition_cost's per-class durations depend on the GPUs only: a candidate on the very same
    GPUs starts with the first's durations, a renamed one with none (they may differ there)."""
    states, cluster, old, new = _symmetric_fast_cases(0)[0]
    cache = PlanningCache()
    first = build_transition(states, cluster, old, new, capacity_bytes=ROOMY, exact=False, cache=cache)
    assert first.replicas is not None
    transition_cost(first, cluster)
    assert any(c.seconds for c in first.replicas.classes)
    same = plan_replicas(states, cluster, old, _renamed(new, 3, list(range(cluster.num_gpus))), ROOMY, cache=cache)
    assert same is not None
    assert [c.seconds for c in same.classes] == [c.seconds for c in first.replicas.classes]
    perm = list(range(cluster.num_gpus))[::-1]
    other = plan_replicas(states, cluster, _renamed(old, 1, perm), _renamed(new, 2, perm), ROOMY, cache=cache)
    assert other is not None and all(not c.seconds for c in other.classes)


def test_pairs_sharing_one_plan_object_are_told_apart() -> None:
    """The per-pair memo keys on both plans: one target with two current plans, and one current plan
    with two targets, each expand to their own exact DAG through one cache."""
    cache = PlanningCache()
    tgt = _plan(2, _sp(GEN, 2, list(range(8))))
    _matches_exact(_plan(1, _sp(GEN, 1, list(range(8)))), tgt, cache)
    _matches_exact(_plan(1, _sp(GEN, 4, list(range(8)))), tgt, cache)
    cur = _plan(1, _sp(GEN, 1, list(range(8))))
    _matches_exact(cur, _plan(2, _sp(GEN, 4, list(range(8)))), cache)
    _matches_exact(cur, _plan(2, _sp(GEN, 2, [1, 0, 3, 2, 5, 4, 7, 6])), cache)


@pytest.mark.parametrize("targets", [
    [[4], [1]],  # GPU 4 is rank 0 of replica 2, GPU 1 rank 1 of replica 0
    [[0], [1]],  # both ranks of replica 0
    [[6, 7], [6, 5]],  # two GPUs no current replica holds, against one that and rank 1 of replica 2
    [[1, 0], [0, 1], [4, 5], [7, 6], [6, 7]],
])
def test_targets_on_different_gpus_of_the_current_replicas_are_different_shapes(targets: list[list[int]]) -> None:
    """A target GPU's place in the current plan (replica, rank) or, if no replica holds it, its order of
    appearance, is its label: targets on different places never share a cached plan."""
    cache = PlanningCache()
    cur = _plan(1, _sp(GEN, 2, [0, 1, 2, 3, 4, 5]))  # three TP-2 replicas: (0, 1), (2, 3), (4, 5)
    for gpus in targets:
        _matches_exact(cur, _plan(2, _sp(GEN, 1, gpus)), cache)


# --- the identity memos keep their plans alive (so no other plan can take over their ids) ------------


def test_the_memos_keyed_by_plan_identity_hold_their_plans() -> None:
    n = CLUSTER.num_gpus
    cp, tp = _sp(GEN, 1, list(range(n))), _sp(GEN, 2, list(range(n - 1)) + [n])  # GPU n: declined
    cache = PlanningCache()
    before = sys.getrefcount(tp)
    assert rc._stage_classes(STATES[GEN], cp, tp, n, cache, False) is None
    assert sys.getrefcount(tp) > before  # the None it memoised holds nothing: the memo pins tp
    cache.clear()
    assert sys.getrefcount(tp) == before
    cp = _sp(GEN, 1, list(range(n)))
    before = sys.getrefcount(cp)
    rc._initial(STATES[GEN], cp, n, cache)
    assert sys.getrefcount(cp) > before  # an array of bytes holds no plan: the memo pins cp
    cache.clear()
    assert sys.getrefcount(cp) == before
