"""Typed errors of the pure transitions modules: a cyclic DAG, an uncovered shard and a failed replay
each raise their own NereusError (never an AssertionError), and the replica-class fast path falls
back to the per-unit path on exactly the error it means."""

from __future__ import annotations

import pytest

from planner.errors import NereusError
from planner.hardware import CPU, LOOPBACK, NVLINK4, ClusterSpec
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout
from planner.workflow import ACTOR_TRAIN
from transitions import replica_order
from transitions.errors import CoverageError, DagCycleError
from transitions.feasibility import bottom_levels, order_by_memory
from transitions.footprints import footprint
from transitions.global_dag import build_transition
from transitions.local_dag import plan_units, target_parts
from transitions.pieces import pieces
from transitions.planning_cache import PlanningCache
from transitions.primitives import Extend, Footprint
from transitions.replay import ReplayError, replay
from transitions.scenarios import PPO_STAGES, ppo_plan, stage_plan, stage_states

TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                 ffn_hidden_size=24, vocab_size=11)


def _typed(err: BaseException) -> None:
    assert isinstance(err, NereusError) and not isinstance(err, AssertionError)


def test_a_cyclic_dag_raises_dag_cycle_error() -> None:
    with pytest.raises(DagCycleError) as caught:
        bottom_levels(4, [(0, 1), (1, 2), (2, 1), (2, 3)], [1.0] * 4)
    _typed(caught.value)
    assert caught.value.unordered == (1, 2, 3)  # 1 and 2 close the cycle, 3 waits behind it
    empty = Footprint(alloc_bytes={}, free_bytes={}, buffer_bytes={}, local_bytes={}, pair_bytes={})
    with pytest.raises(DagCycleError):
        order_by_memory([empty, empty], [(0, 1), (1, 0)], [0, 0], {}, 1 << 30)
    assert bottom_levels(3, [(0, 1), (1, 2)], [1.0, 2.0, 3.0]) == [6.0, 5.0, 3.0]  # acyclic: unchanged


def test_an_uncovered_shard_raises_coverage_error() -> None:
    state = stage_states(TINY, (ACTOR_TRAIN,))["actor-train"]
    target = plan_units(state, stage_plan("actor-train", Layout(2, 1), [2, 3], 1), 1)[0]
    wide = plan_units(state, stage_plan("actor-train", Layout(4, 1), [4, 5, 6, 7], 1), 0)[0]
    half = target_parts(wide, Layout(2, 1))[0]  # a TP2 part of a TP4 unit: every other quarter of a shard
    for sources in ((), (half,)):
        prim = Extend(sources=sources, target=target)
        with pytest.raises(CoverageError) as caught:
            pieces(prim)
        _typed(caught.value)
        assert caught.value.target == target.uid and caught.value.rows
        with pytest.raises(CoverageError):
            footprint(prim, PlanningCache())


def test_a_failed_replay_raises_replay_error() -> None:
    states = stage_states(TINY, (ACTOR_TRAIN,))
    cluster = ClusterSpec(device=CPU, num_nodes=1, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)
    old = GlobalPlan(version=1, stages=(stage_plan("actor-train", Layout(2, 1), [0, 1], 1),))
    new = GlobalPlan(version=2, stages=(stage_plan("actor-train", Layout(2, 1), [2, 3], 1),))
    dag = build_transition(states, cluster, old, new)
    replay(dag)
    backwards = dag.with_order(tuple(reversed(dag.order)))  # the Destroy before the Extend that reads it
    with pytest.raises(ReplayError) as caught:
        replay(backwards)
    _typed(caught.value)


def _big_case() -> tuple[dict, ClusterSpec, GlobalPlan, GlobalPlan]:
    cluster = ClusterSpec(device=CPU, num_nodes=8, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)
    old = ppo_plan(1, cluster.num_gpus, {ms.name: Layout(1, 1) for ms in PPO_STAGES})
    new = ppo_plan(2, cluster.num_gpus, {ms.name: Layout(2, 1) for ms in PPO_STAGES})
    return stage_states(TINY, PPO_STAGES), cluster, old, new


def test_the_fast_path_falls_back_on_a_class_cycle_and_on_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    states, cluster, old, new = _big_case()
    assert build_transition(states, cluster, old, new, exact=False, cache=PlanningCache()).replicas is not None
    exact = build_transition(states, cluster, old, new, exact=True, cache=PlanningCache())

    def cyclic(num_nodes: int, edges: list[tuple[int, int]], weight: list[float]) -> list[float]:
        raise DagCycleError(tuple(range(num_nodes)))

    monkeypatch.setattr(replica_order, "bottom_levels", cyclic)
    dag = build_transition(states, cluster, old, new, exact=False, cache=PlanningCache())
    assert dag.replicas is None  # the per-unit path took it
    assert dag.nodes == exact.nodes and dag.order == exact.order and dag.peak_bytes == exact.peak_bytes

    def broken(num_nodes: int, edges: list[tuple[int, int]], weight: list[float]) -> list[float]:
        raise AssertionError("a bug")

    monkeypatch.setattr(replica_order, "bottom_levels", broken)
    with pytest.raises(AssertionError, match="a bug"):  # a bug is not taken for a reason to fall back
        build_transition(states, cluster, old, new, exact=False, cache=PlanningCache())
