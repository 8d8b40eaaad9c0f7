"""The executor runs transition DAGs (transitions.global_dag) on real workers, bit-exactly.

Each worker runs only the nodes that touch it, in the DAG's order, deriving its own transfers; T_sub
parts, relabelling Merges, Extends from several replicas and Destroys all happen on real tensors.
Measured time per node is reported next to the cost model's prediction.
"""

from __future__ import annotations

import pytest
from executor_helpers import MICRO, assert_same_state, logical_state

from agent.coordinator import LocalCoordinator
from planner.hardware import cluster_preset
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.workflow import ACTOR_GEN, ACTOR_TRAIN, REF_INF
from transitions.global_dag import build_transition
from transitions.local_dag import plan_units
from transitions.scenarios import stage_states

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("executor-pool")]

STATES = stage_states(MICRO, (ACTOR_GEN, REF_INF, ACTOR_TRAIN))
CLUSTER = cluster_preset("cpu", 4)


def _plan(version: int, **stages: tuple[int, int, list[list[int]]]) -> GlobalPlan:
    return GlobalPlan(version=version, stages=tuple(
        StagePlan(model_stage=name.replace("_", "-"), layout=Layout(tp, pp),
                  gpu_sets=tuple(tuple(g) for g in sets), micro_batch_size=1)
        for name, (tp, pp, sets) in stages.items()))


def _units(plan: GlobalPlan) -> list:
    return [u for sp in plan for u in plan_units(STATES[sp.model_stage], sp, plan.version)]


CASES = {
    "tp4 -> tp2 x dp2 (split)": (_plan(1, actor_train=(4, 1, [[0, 1, 2, 3]])),
                                 _plan(2, actor_train=(2, 1, [[0, 1], [2, 3]]))),
    "tp1 x dp2 -> tp2 x dp2": (_plan(1, actor_train=(1, 1, [[0], [1]])),
                               _plan(2, actor_train=(2, 1, [[0, 1], [2, 3]]))),
    "dp2 -> dp4 (extend)": (_plan(1, actor_train=(1, 1, [[0], [1]])),
                            _plan(2, actor_train=(1, 1, [[0], [1], [2], [3]]))),
    "pp2 x dp2 -> tp2 x pp2 (merge)": (_plan(1, actor_train=(1, 2, [[0, 1], [2, 3]])),
                                       _plan(2, actor_train=(2, 2, [[0, 2, 1, 3]]))),
    # new ranks 0 and 2 stay on GPUs 0 and 1 (each keeps part of its old shard), 1 and 3 go to 2 and 3
    "tp2 -> tp4 (split, same gpus)": (_plan(1, actor_train=(2, 1, [[0, 1]])),
                                      _plan(2, actor_train=(4, 1, [[0, 2, 1, 3]]))),
    "pp2 -> pp4 (split, same gpus)": (_plan(1, actor_train=(1, 2, [[0, 1]])),
                                      _plan(2, actor_train=(1, 4, [[0, 2, 1, 3]]))),
    "three stages, shared gpus": (
        _plan(1, actor_gen=(2, 1, [[0, 1], [2, 3]]), ref_inf=(1, 1, [[3], [2]]), actor_train=(1, 2, [[0, 1]])),
        _plan(2, actor_gen=(4, 1, [[3, 2, 1, 0]]), ref_inf=(2, 1, [[0, 1]]), actor_train=(2, 1, [[2, 3]]))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dag_run_is_bit_exact(pool: LocalCoordinator, name: str) -> None:
    old, new = CASES[name]
    dag = build_transition(STATES, CLUSTER, old, new)
    pool.init_units(_units(old), seed=len(name))
    before = logical_state(pool.dump())
    outcome = pool.run_dag(dag, CLUSTER, max_bucket_bytes=64 << 10)
    assert outcome.committed, outcome.errors
    assert_same_state(before, logical_state(pool.dump()))
    # every worker ends up holding exactly the new plan's units (old ones and parts were freed)
    from agent.worker import held_units

    expected = {w: sorted(u.uid for u in _units(new) if u.holds(w)) for w in pool.alive}
    assert pool.call(held_units) == expected
    nodes = [r for reps in outcome.reports.values() for r in reps]
    assert nodes and all(r.measured_s > 0 for r in nodes)
    moving = [r for r in nodes if r.bytes_sent]
    assert all(r.predicted_s > 0 for r in moving)
    sent = sum(r.bytes_sent for r in nodes)
    # what the DAG planned, plus the units' 32-byte counters and 16-byte alignment inside buckets
    assert sent == sum(r.bytes_received for r in nodes)
    assert dag.bytes_moved <= sent <= 1.01 * dag.bytes_moved + 4096


def test_local_merge_runs_alongside_the_extends(pool: LocalCoordinator) -> None:
    """TP1 x DP2 -> TP2 x DP2 with in-place building off: workers 0 and 1 send their halves to the new
    replica (Extend) and build their own new rank locally (Merge) in fresh memory; the local Merge
    runs while the Extend's transfers are in flight, and the state stays exact."""
    old, new = CASES["tp1 x dp2 -> tp2 x dp2"]
    dag = build_transition(STATES, CLUSTER, old, new)
    pool.init_units(_units(old), seed=3)
    before = logical_state(pool.dump())
    outcome = pool.run_dag(dag, CLUSTER, max_bucket_bytes=16 << 10, in_place=False)
    assert outcome.committed, outcome.errors
    assert_same_state(before, logical_state(pool.dump()))
    for worker in (0, 1):
        reps = outcome.reports[worker]
        (merge,) = [r for r in reps if r.primitive.startswith("merge")]
        (extend,) = [r for r in reps if r.primitive.startswith("extend")]
        assert merge.alongside == extend.primitive and merge.bytes_copied_locally > 0
        assert not merge.in_place
        assert extend.bytes_sent > 0 and extend.pack_s > 0
    assert all(not r.alongside for w in (2, 3) for r in outcome.reports[w])


def test_local_merge_compacts_in_place_after_the_extend(pool: LocalCoordinator) -> None:
    """The same change with in-place building (the CPU default): once the Extend has sent the half
    the new replica needs, the local Merge compacts each worker's old replica into its new rank inside
    the same buffer, where the DAG frees the old one (so a failure finds the same copies alive).
    Exact state, the same bytes on the wire, and no new buffer on the workers that merge."""
    old, new = CASES["tp1 x dp2 -> tp2 x dp2"]
    dag = build_transition(STATES, CLUSTER, old, new)
    pool.init_units(_units(old), seed=3)
    before = logical_state(pool.dump())
    reference = pool.run_dag(dag, CLUSTER, max_bucket_bytes=16 << 10, in_place=False)
    pool.init_units(_units(old), seed=3)
    outcome = pool.run_dag(dag, CLUSTER, max_bucket_bytes=16 << 10, in_place=True)
    assert outcome.committed, outcome.errors
    assert_same_state(before, logical_state(pool.dump()))
    from agent.worker import held_units

    assert pool.call(held_units) == {w: sorted(u.uid for u in _units(new) if u.holds(w)) for w in pool.alive}
    for worker in (0, 1):
        reps = outcome.reports[worker]
        assert [r.primitive.split("#")[0] for r in reps] == ["extend", "merge"]  # the DAG's order
        extend, merge = reps
        assert merge.in_place and merge.bytes_copied_locally > 0 and not merge.alongside
        assert extend.bytes_sent == sum(r.bytes_sent for r in reference.reports[worker])
    assert all(not r.in_place for w in (2, 3) for r in outcome.reports[w])


@pytest.mark.parametrize("name", ["tp2 -> tp4 (split, same gpus)", "pp2 -> pp4 (split, same gpus)"])
def test_splits_on_the_same_gpus_compact_in_place(pool: LocalCoordinator, name: str) -> None:
    """GPUs 0 and 1 keep part of their old shard: they send the rest, then compact what they keep
    inside the old buffer (a later Destroy frees the old unit); the state stays exact and the bytes on
    the wire are those of the fresh-memory run."""
    old, new = CASES[name]
    dag = build_transition(STATES, CLUSTER, old, new)
    pool.init_units(_units(old), seed=11)
    before = logical_state(pool.dump())
    reference = pool.run_dag(dag, CLUSTER, in_place=False)
    pool.init_units(_units(old), seed=11)
    outcome = pool.run_dag(dag, CLUSTER, in_place=True)
    assert outcome.committed, outcome.errors
    assert_same_state(before, logical_state(pool.dump()))
    for worker in (0, 1):
        built = [r for r in outcome.reports[worker] if r.in_place]
        assert len(built) == 1 and built[0].bytes_copied_locally > 0, outcome.reports[worker]
    assert not any(r.in_place for w in (2, 3) for r in outcome.reports[w])
    for worker in pool.alive:
        assert sum(r.bytes_sent for r in outcome.reports[worker]) == \
            sum(r.bytes_sent for r in reference.reports[worker])
