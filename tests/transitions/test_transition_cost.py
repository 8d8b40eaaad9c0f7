"""Transition fixed costs (communicators per peer, allocation, generation re-forming) and the planner's
per-step refit price held against the transition DAG's own weight-sync cost."""

from __future__ import annotations

import pytest

from planner.cost import PRIORS, Links, OpClass, stage_cost
from planner.hardware import CPU, H200, IB_NDR, NVLINK4, ClusterSpec
from planner.models import LLAMA_31_8B
from planner.plan import GlobalPlan, Layout
from planner.workflow import ACTOR_GEN, ACTOR_TRAIN, REF_INF, Workload, grpo, same_model_job
from transitions.cost import DEFAULT_FIXED_COSTS, FixedCosts, primitive_seconds, transition_cost
from transitions.global_dag import build_transition, build_weight_sync
from transitions.scenarios import stage_plan, stage_states

CLUSTER = ClusterSpec(device=CPU, num_nodes=2, gpus_per_node=4, intra_node_link=NVLINK4, inter_node_link=IB_NDR)


def _grow() -> object:
    from planner.models import TINY_3M

    states = stage_states(TINY_3M, (ACTOR_GEN, REF_INF, ACTOR_TRAIN))
    old = GlobalPlan(version=1, stages=(stage_plan("actor-train", Layout(2, 1), [0, 1], 1),))
    new = GlobalPlan(version=2, stages=(stage_plan("actor-train", Layout(2, 1), [0, 1, 4, 5, 2, 3], 3),))
    return build_transition(states, CLUSTER, old, new)


def test_without_fixed_costs_nothing_changes() -> None:
    dag = _grow()
    assert transition_cost(dag, CLUSTER).seconds == transition_cost(dag, CLUSTER, fixed=None).seconds


def test_fixed_costs_add_reform_once_and_communicators_per_peer() -> None:
    dag = _grow()
    base = transition_cost(dag, CLUSTER, communicator_setup_s=0.0)
    reform_only = transition_cost(dag, CLUSTER, fixed=FixedCosts(communicator_per_peer_s=0.0, generation_reform_s=5.0))
    assert reform_only.seconds == pytest.approx(base.seconds + 5.0)
    per_peer = FixedCosts(communicator_per_peer_s=0.1)
    fp = next(f for f in dag.footprints if f.pair_bytes)
    peers: dict[int, int] = {}
    for s, d in fp.pair_bytes:
        peers[s] = peers.get(s, 0) + 1
        peers[d] = peers.get(d, 0) + 1
    assert primitive_seconds(fp, CLUSTER, 0.0, per_peer) == pytest.approx(
        primitive_seconds(fp, CLUSTER, 0.0) + 0.1 * max(peers.values()))
    slow_alloc = FixedCosts(communicator_per_peer_s=0.0, allocation_bytes_per_s=1e6)
    assert primitive_seconds(fp, CLUSTER, 0.0, slow_alloc) > primitive_seconds(fp, CLUSTER, 0.0)
    assert transition_cost(dag, CLUSTER, fixed=DEFAULT_FIXED_COSTS).seconds > base.seconds + 4.9
    with pytest.raises(ValueError):
        FixedCosts(generation_reform_s=-1.0)


def test_planner_refit_price_matches_the_weight_sync_dag() -> None:
    """The planner prices each step's train -> gen refit as its generation unit's bf16 shard over its
    link (WEIGHT_SYNC class), every generation replica receiving at once; the transition DAG of the same
    refit (build_weight_sync) runs one Extend per generation replica, one after another on the training
    GPUs they share. Per replica the two agree (full link speed, no set-up costs) within 25%."""
    h200 = ClusterSpec(device=H200, num_nodes=1, gpus_per_node=8, intra_node_link=NVLINK4, inter_node_link=IB_NDR)
    job = same_model_job(grpo(learned_reward=False), LLAMA_31_8B,
                         Workload(prompts_per_step=8, prompt_tokens=16, response_tokens=16))
    plan = GlobalPlan(version=3, stages=(stage_plan("actor-gen", Layout(4, 1), list(range(8)), 2),
                                         stage_plan("actor-train", Layout(8, 1), list(range(8)), 1)))
    dag = build_weight_sync(job, h200, plan)
    dag_s = transition_cost(dag, h200, communicator_setup_s=0.0).seconds
    c = stage_cost(LLAMA_31_8B, ACTOR_GEN, Layout(4, 1), job.workload, micro_batch_size=4, grad_accum=1,
                   recompute=False, dp=2, cluster=h200, links=Links(), eff={**PRIORS, OpClass.WEIGHT_SYNC: 1.0})
    refit = [t for t in c.terms if t.op_class is OpClass.WEIGHT_SYNC][0]
    planner_s = refit.seconds({**PRIORS, OpClass.WEIGHT_SYNC: 1.0}) - h200.refit_setup_s
    gen_dp = 2
    assert planner_s == pytest.approx(dag_s / gen_dp, rel=0.25)
