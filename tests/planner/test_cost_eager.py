"""Host work of distributed calls on eager devices (planner.eager): what TP and PP cost a CPU worker
beyond FLOPs and bytes, counted against the engine's own modules."""

from __future__ import annotations

import pytest
from planner_jobs import h200

from planner.cost import Links, OpClass, microbatch_terms, sync_terms
from planner.eager import (
    COLLECTIVE_LAUNCHES,
    DTENSOR_OP_LAUNCHES,
    LAUNCHES_PER_PARAM_TENSOR,
    PIPELINE_HOP_LAUNCHES,
    TP_LINEAR_LAUNCHES,
    TP_LINEARS_AT_ENDS,
    TP_LINEARS_PER_LAYER,
)
from planner.hardware import cluster_preset
from planner.models import TINY_3M, Head
from planner.plan import Layout
from planner.workflow import ACTOR_GEN, CRITIC_TRAIN, REF_INF, Workload

W = Workload(prompts_per_step=16, prompt_tokens=14, response_tokens=13)
CPU = cluster_preset("cpu", 2)


def _launches(terms, cls: OpClass) -> float:  # type: ignore[no-untyped-def]
    return sum(t.work for t in terms if t.op_class is cls)


def test_tp_linear_count_is_the_engines_tensor_parallel_plan() -> None:
    """The per-layer and end counts are those of agent.engine.parallel.tp_plan on a whole decoder."""
    from agent.engine.model import build_decoder
    from agent.engine.parallel import tp_plan

    plan = tp_plan(build_decoder(TINY_3M, Head.LM))
    assert len(plan) == TP_LINEARS_PER_LAYER * TINY_3M.num_layers + TP_LINEARS_AT_ENDS


def test_tp_on_cpu_charges_dtensor_linears_and_collectives_per_pass() -> None:
    """One inference pass at TP2 launches every DTensor linear and the two collectives per layer (plus
    the vocab-parallel ends) in plain-launch units, in their own class; its plain launches stay TP1's."""
    one = microbatch_terms(TINY_3M, REF_INF, Layout(1, 1), W, 16, False, CPU, Links())
    two = microbatch_terms(TINY_3M, REF_INF, Layout(2, 1), W, 16, False, CPU, Links())
    layers = TINY_3M.num_layers
    expected = ((TP_LINEARS_PER_LAYER * layers + TP_LINEARS_AT_ENDS) * TP_LINEAR_LAUNCHES
                + (2 * layers + TP_LINEARS_AT_ENDS) * COLLECTIVE_LAUNCHES)
    assert _launches(two, OpClass.LAUNCH_DISTRIBUTED) == pytest.approx(expected)
    assert _launches(one, OpClass.LAUNCH_DISTRIBUTED) == 0
    assert _launches(two, OpClass.LAUNCH_FORWARD) == _launches(one, OpClass.LAUNCH_FORWARD)


def test_pp_decode_pays_a_schedule_step_per_stage_and_a_logits_broadcast_per_token() -> None:
    one = microbatch_terms(TINY_3M, ACTOR_GEN, Layout(1, 1), W, 16, False, CPU, Links())
    two = microbatch_terms(TINY_3M, ACTOR_GEN, Layout(1, 2), W, 16, False, CPU, Links())
    # the pipeline repeats a stage's term pp times: per token, 2 schedule-step shares and 1 broadcast
    assert 2 * _launches(two, OpClass.LAUNCH_DISTRIBUTED) / W.response_tokens == pytest.approx(
        2 * PIPELINE_HOP_LAUNCHES + COLLECTIVE_LAUNCHES)
    # and each stage's pass its own per-pass launches: the layers split, the rest once per stage
    per_token_one = _launches(one, OpClass.LAUNCH_DECODE) / W.response_tokens
    per_token_two = 2 * _launches(two, OpClass.LAUNCH_DECODE) / W.response_tokens
    assert per_token_two - per_token_one == pytest.approx(per_token_one - 48 * TINY_3M.num_layers)


def test_tp_optimizer_step_runs_dtensor_ops_on_sharded_parameters() -> None:
    one = sync_terms(TINY_3M, CRITIC_TRAIN, Layout(1, 1), 1, CPU, Links())
    two = sync_terms(TINY_3M, CRITIC_TRAIN, Layout(2, 1), 1, CPU, Links())
    sharded = TP_LINEARS_PER_LAYER * TINY_3M.num_layers + TP_LINEARS_AT_ENDS
    assert _launches(two, OpClass.LAUNCH_DISTRIBUTED) == pytest.approx(
        sharded * LAUNCHES_PER_PARAM_TENSOR * (DTENSOR_OP_LAUNCHES - 1) + COLLECTIVE_LAUNCHES)
    assert _launches(two, OpClass.LAUNCH_BACKWARD) == _launches(one, OpClass.LAUNCH_BACKWARD)


@pytest.mark.parametrize("layout", [Layout(2, 1), Layout(1, 2), Layout(2, 2)])
def test_gpu_presets_have_no_host_launch_terms(layout: Layout) -> None:
    gpu = h200(8)
    for ms in (ACTOR_GEN, REF_INF, CRITIC_TRAIN):
        terms = microbatch_terms(TINY_3M, ms, layout, W, 4, False, gpu, Links())
        assert not {t.op_class for t in terms} & {OpClass.LAUNCH_FORWARD, OpClass.LAUNCH_DECODE,
                                                  OpClass.LAUNCH_BACKWARD, OpClass.LAUNCH_DISTRIBUTED}
