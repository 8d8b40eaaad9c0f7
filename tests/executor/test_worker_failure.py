"""A worker SIGKILLed in the middle of a DAG run: the others stop within a bounded time, the group
is re-formed without it, and no logical state is lost unless its last copy died (then the stage is
reported as needing the checkpoint path). Every worker runs its DAG nodes in the DAG's order and a
node frees the sources it is done with, so what survives is what the units held at the failure
cover (transitions.survival). Real processes, real kill, real gloo."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from executor_helpers import MICRO, assert_same_state, init_placements, logical_state, move, placement

from agent.commands import WorkerState
from agent.coordinator import LocalCoordinator
from transitions.placement_dag import placement_cluster, placement_dag, placement_units

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("executor-kill")]

TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def kill_pool() -> Iterator[LocalCoordinator]:
    """Its own pool: these tests kill workers. The second test runs on whichever 3 are left."""
    with LocalCoordinator(4, timeout_s=TIMEOUT_S) as coord:
        coord.form_generation()
        yield coord


def _subset(state: dict, stages: set[str]) -> dict:
    return {k: v for k, v in state.items() if k[0] in stages}


def test_killed_destination_loses_nothing_and_group_reforms(kill_pool: LocalCoordinator) -> None:
    pool = kill_pool
    old = [placement("a", 1, 1, [[0], [1]]), placement("b", 2, 1, [[0, 1]], training=False)]
    new = [placement("a", 2, 1, [[1, 2], [0, 3]]), placement("b", 1, 1, [[2], [3]], training=False)]
    init_placements(pool, old, seed=21)
    before = logical_state(pool.dump())
    # worker 2 dies just before the first round of its first node (stage "b": Extend to it): the
    # transfers to it never happen, and no node frees anything before they would have
    dag = placement_dag(old, new)
    assert all(dag.nodes_on(w)[0] == dag.nodes_on(2)[0] for w in (0, 1))  # every sender's first node
    outcome = pool.run_dag(dag, placement_cluster(old, new), max_bucket_bytes=8192, kill_at={2: ("b", 0)})
    assert not outcome.committed
    assert outcome.dead_workers == (2,)
    assert outcome.seconds < 3 * TIMEOUT_S  # bounded: nobody waits for ever on the dead peer
    assert pool.alive == (0, 1, 3) and pool.spec is not None and pool.spec.members == (0, 1, 3)
    assert outcome.lost == {} and not outcome.needs_checkpoint
    # survivors still hold the old units, bit for bit, and are READY in the new generation
    assert set(pool.held[0]) | set(pool.held[1]) | set(pool.held[3]) == {u.uid for u in placement_units(old)}
    assert {pool.state[w] for w in pool.alive} == {WorkerState.READY}
    assert_same_state(before, logical_state(pool.dump()))
    # the re-formed generation works: move to a layout that avoids the dead worker
    retry = [placement("a", 2, 1, [[1, 0]]), placement("b", 1, 1, [[3], [0]], training=False)]
    outcome = move(pool, old, retry)
    assert outcome.committed, outcome.errors
    assert_same_state(before, logical_state(pool.dump()))


def test_killed_last_copy_is_reported_for_checkpoint(kill_pool: LocalCoordinator) -> None:
    pool = kill_pool
    a, b, c = pool.alive[:3]
    # stage "solo" has one copy, on worker a; stage "dup" has two replicas (a and b). The DAG
    # destroys b's replica at once (one source suffices) and extends a's to c, then splits solo.
    old = [placement("solo", 1, 1, [[a]]), placement("dup", 1, 1, [[a], [b]], training=False)]
    new = [placement("solo", 2, 1, [[b, c]]), placement("dup", 1, 1, [[c]], training=False)]
    init_placements(pool, old, seed=4)
    before = logical_state(pool.dump())
    outcome = move(pool, old, new, kill_at={a: ("solo", 0)})  # a dies once dup reached c, before solo moves
    assert not outcome.committed and outcome.dead_workers == (a,)
    assert outcome.seconds < 3 * TIMEOUT_S
    assert set(outcome.lost) == {"solo"} and outcome.needs_checkpoint
    assert "model.embed_tokens.weight/master" in outcome.lost["solo"]
    # "dup" survived (on worker c), bit-identical
    assert_same_state(_subset(before, {"dup"}), _subset(logical_state(pool.dump()), {"dup"}))


def test_killed_worker_during_a_dag_run(kill_pool: LocalCoordinator) -> None:
    """DAG mode: the survivors report which units they still hold; coverage decides what is lost."""
    from planner.hardware import cluster_preset
    from planner.plan import GlobalPlan, Layout, StagePlan
    from planner.workflow import ACTOR_TRAIN, REF_INF
    from transitions.global_dag import build_transition
    from transitions.local_dag import plan_units
    from transitions.scenarios import stage_states

    pool = kill_pool
    a, b = pool.alive[-2:]
    states = stage_states(MICRO, (REF_INF, ACTOR_TRAIN))

    def plan(version: int, train: list[list[int]], ref: list[list[int]]) -> GlobalPlan:
        return GlobalPlan(version=version, stages=(
            StagePlan(model_stage="actor-train", layout=Layout(len(train[0]), 1), gpu_sets=tuple(map(tuple, train)),
                      micro_batch_size=1),
            StagePlan(model_stage="ref-inf", layout=Layout(1, 1), gpu_sets=tuple(map(tuple, ref)),
                      micro_batch_size=1)))

    # actor-train: one copy on a, extended to b; ref-inf: its only copy moves from b to a
    old, new = plan(1, [[a]], [[b]]), plan(2, [[a], [b]], [[a]])
    cluster = cluster_preset("cpu", 4)
    dag = build_transition(states, cluster, old, new)
    pool.init_units([u for sp in old for u in plan_units(states[sp.model_stage], sp, 1)], seed=8)
    before = logical_state(pool.dump())
    outcome = pool.run_dag(dag, cluster, kill_at={b: ("ref-inf", 0)})  # b dies before it sends ref-inf
    assert not outcome.committed and outcome.dead_workers == (b,)
    assert outcome.seconds < 3 * TIMEOUT_S
    assert pool.spec is not None and b not in pool.spec.members
    # actor-train's copy on a survived, bit for bit; ref-inf's only copy died with b: checkpoint path
    assert set(outcome.lost) == {"ref-inf"} and outcome.needs_checkpoint
    assert "model.norm.weight/param" in outcome.lost["ref-inf"]
    assert_same_state(_subset(before, {"actor-train"}), _subset(logical_state(pool.dump()), {"actor-train"}))


@pytest.mark.parametrize("in_place", [False, True])
def test_in_place_building_keeps_what_survives_a_failure(in_place: bool) -> None:
    """TP1 x DP2 -> TP2 x DP2 with worker 0 killed before it sends: worker 1 still finishes its own
    nodes (its Merge frees its old replica, as the DAG says), so the half of the state only worker 0
    held is lost either way. Building in place consumes the old replica exactly where the DAG frees
    it: the survivors hold the same units and the same lost set with and without it."""
    from agent.worker import held_units
    from planner.hardware import cluster_preset
    from planner.plan import GlobalPlan, Layout, StagePlan
    from planner.workflow import ACTOR_TRAIN
    from transitions.global_dag import build_transition
    from transitions.local_dag import plan_units
    from transitions.scenarios import stage_states

    states = stage_states(MICRO, (ACTOR_TRAIN,))

    def plan(version: int, tp: int, sets: list[list[int]]) -> GlobalPlan:
        return GlobalPlan(version=version, stages=(StagePlan(model_stage="actor-train", layout=Layout(tp, 1),
                                                             gpu_sets=tuple(map(tuple, sets)), micro_batch_size=1),))

    old, new = plan(1, 1, [[0], [1]]), plan(2, 2, [[0, 1], [2, 3]])
    cluster = cluster_preset("cpu", 4)
    dag = build_transition(states, cluster, old, new)
    with LocalCoordinator(4, timeout_s=TIMEOUT_S) as pool:
        pool.form_generation()
        pool.init_units([u for sp in old for u in plan_units(states[sp.model_stage], sp, 1)], seed=5)
        outcome = pool.run_dag(dag, cluster, kill_at={0: ("actor-train", 0)}, in_place=in_place)
        assert not outcome.committed and outcome.dead_workers == (0,)
        held = pool.call(held_units)
    # worker 1 built its rank of the new unit (in its old buffer, or beside it) and freed the old one
    assert held[1] == ["actor-train@v2#0"]
    assert "actor-train" in outcome.lost and "model.embed_tokens.weight/param" in outcome.lost["actor-train"]
