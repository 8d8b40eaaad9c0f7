"""The same executor over NCCL on GPUs (backend chosen by device): skipped without 2 CUDA devices."""

from __future__ import annotations

import pytest
import torch
from executor_helpers import assert_same_state, init_placements, logical_state, move, placement

from agent.coordinator import LocalCoordinator

pytestmark = [pytest.mark.gpus(2), pytest.mark.multiprocess]  # NCCL p2p: one device per rank


def test_tp_change_and_extend_over_nccl_are_bit_exact() -> None:
    n = min(4, torch.cuda.device_count())
    with LocalCoordinator(n, timeout_s=60, device="cuda") as pool:
        pool.form_generation()
        old = [placement("a", 1, 1, [[0], [1]])]
        new = [placement("a", 2, 1, [[0, 1]])] if n < 4 else [placement("a", 2, 1, [[0, 1], [2, 3]])]
        init_placements(pool, old, seed=3)
        before = logical_state(pool.dump())
        outcome = move(pool, old, new)
        assert outcome.committed, outcome.errors
        assert_same_state(before, logical_state(pool.dump()))


@pytest.mark.gpus(3)  # a fan-out to two copies
def test_dag_with_fan_out_broadcast_over_nccl_is_bit_exact() -> None:
    """DP1 -> DP3 over NCCL: the two Extends of GPU 0's replica run as one broadcast (forced: the unit
    is below the default size), bit-exactly; then the same over point-to-point."""
    from executor_helpers import MICRO

    from planner.hardware import cluster_preset
    from planner.plan import GlobalPlan, Layout, StagePlan
    from planner.workflow import ACTOR_TRAIN
    from transitions.global_dag import build_transition
    from transitions.local_dag import plan_units
    from transitions.scenarios import stage_states

    states = stage_states(MICRO, (ACTOR_TRAIN,))
    cluster = cluster_preset("cpu", 3)

    def plan(version: int, sets: list[list[int]]) -> GlobalPlan:
        return GlobalPlan(version=version, stages=(StagePlan(model_stage="actor-train", layout=Layout(1, 1),
                                                             gpu_sets=tuple(tuple(g) for g in sets),
                                                             micro_batch_size=1),))

    old, new = plan(1, [[0]]), plan(2, [[0], [1], [2]])
    dag = build_transition(states, cluster, old, new)
    with LocalCoordinator(3, timeout_s=60, device="cuda") as pool:
        pool.form_generation()
        pool.init_units([u for sp in old for u in plan_units(states[sp.model_stage], sp, 1)], seed=4)
        before = logical_state(pool.dump())
        outcome = pool.run_dag(dag, cluster, fan_out=True)
        assert outcome.committed, outcome.errors
        assert_same_state(before, logical_state(pool.dump()))
        assert all(r.alongside == "broadcast" for w in (1, 2) for r in outcome.reports[w])
        pool.init_units([u for sp in old for u in plan_units(states[sp.model_stage], sp, 1)], seed=4)
        again = pool.run_dag(dag, cluster, fan_out=False)
        assert again.committed, again.errors
        assert_same_state(before, logical_state(pool.dump()))
