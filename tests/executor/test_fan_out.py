"""Extend fan-outs as broadcasts: which DAG nodes qualify (pure), and the broadcast run (real workers).

NCCL pipelines a broadcast along a ring, so one source feeding several copies sends the unit once;
by default the executor broadcasts fan-outs of at least FAN_OUT_MIN_BYTES per rank. The tiny units
here are below it, so the test forces it on (and off, to compare).
"""

from __future__ import annotations

import pytest
from executor_helpers import MICRO, assert_same_state, logical_state

from agent.coordinator import LocalCoordinator
from planner.hardware import cluster_preset
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.workflow import ACTOR_TRAIN
from transitions.global_dag import build_transition
from transitions.local_dag import plan_units
from transitions.scenarios import stage_states

STATES = stage_states(MICRO, (ACTOR_TRAIN,))


def _plan(version: int, tp: int, sets: list[list[int]]) -> GlobalPlan:
    return GlobalPlan(version=version, stages=(StagePlan(model_stage="actor-train", layout=Layout(tp, 1),
                                                         gpu_sets=tuple(tuple(g) for g in sets),
                                                         micro_batch_size=1),))


def test_fan_outs_group_each_rank_with_its_copies() -> None:
    from transitions.fan_outs import fan_outs

    dag = build_transition(STATES, cluster_preset("cpu", 8), _plan(1, 2, [[0, 1]]),
                           _plan(2, 2, [[0, 1], [2, 3], [4, 5], [6, 7]]))
    (fan,) = fan_outs(dag)
    assert len(fan.nodes) == 3 and fan.source.gpus == (0, 1)
    assert fan.ranks == ((0, (2, 4, 6)), (1, (3, 5, 7)))
    # one copy only: nothing to fan out
    single = build_transition(STATES, cluster_preset("cpu", 4), _plan(1, 2, [[0, 1]]), _plan(2, 2, [[0, 1], [2, 3]]))
    assert fan_outs(single) == []
    # a layout change is not a whole copy
    reshard = build_transition(STATES, cluster_preset("cpu", 8), _plan(1, 1, [[0]]),
                               _plan(2, 2, [[0, 1], [2, 3], [4, 5]]))
    assert all(f.targets[0].layout == f.source.layout for f in fan_outs(reshard))


@pytest.mark.multiprocess
@pytest.mark.xdist_group("executor-pool")
def test_fan_out_by_broadcast_is_bit_exact(pool: LocalCoordinator) -> None:
    """DP1 -> DP4: worker 0's replica reaches workers 1-3 by one broadcast over a group formed for it
    (forced on: the unit is below the default size), bit-exactly, and the groups are gone afterwards
    (a later DAG runs)."""
    cluster = cluster_preset("cpu", 4)
    old, new = _plan(1, 1, [[0]]), _plan(2, 1, [[0], [1], [2], [3]])
    dag = build_transition(STATES, cluster, old, new)
    pool.init_units([u for sp in old for u in plan_units(STATES[sp.model_stage], sp, 1)], seed=9)
    before = logical_state(pool.dump())
    outcome = pool.run_dag(dag, cluster, fan_out=True)
    assert outcome.committed, outcome.errors
    assert_same_state(before, logical_state(pool.dump()))
    for worker in (1, 2, 3):
        (report,) = outcome.reports[worker]
        assert report.alongside == "broadcast" and report.bytes_received > 0
    source = outcome.reports[0]
    assert len(source) == 3 and sum(r.bytes_sent for r in source) == \
        sum(r.bytes_received for w in (1, 2, 3) for r in outcome.reports[w])
    # the same DAG over point-to-point moves the same logical state: the two paths agree
    pool.init_units([u for sp in old for u in plan_units(STATES[sp.model_stage], sp, 1)], seed=9)
    again = pool.run_dag(dag, cluster, fan_out=False)
    assert again.committed and not any(r.alongside == "broadcast" for reps in again.reports.values() for r in reps)
    assert_same_state(before, logical_state(pool.dump()))
