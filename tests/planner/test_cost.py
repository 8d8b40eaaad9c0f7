"""Cost model invariants: FLOP counts, sharding, bubble, roofline, links, critical path, breakdowns."""

from __future__ import annotations

import pytest
from planner_jobs import h200, job

from planner.cost import (
    PRIORS,
    TIME_CLASSES,
    Efficiencies,
    Links,
    OpClass,
    microbatch_terms,
    stage_cost,
    sync_terms,
)
from planner.models import LLAMA_31_8B, Head
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.prediction import predict
from planner.workflow import ACTOR_GEN, ACTOR_TRAIN, CRITIC_INF, CRITIC_TRAIN, REF_INF, Workload

W = Workload(prompts_per_step=64, prompt_tokens=1024, response_tokens=1024)
CL = h200(16)


def _work(terms, cls: OpClass) -> float:  # type: ignore[no-untyped-def]
    return sum(t.work for t in terms if t.op_class is cls)


def test_training_costs_six_flops_per_param_per_token() -> None:
    """6N per token for the update; the actor adds 2N for the old-log-prob forward PPO/GRPO run first."""
    tokens = W.tokens_per_sequence
    matmul_params = LLAMA_31_8B.num_params() - LLAMA_31_8B.vocab_size * LLAMA_31_8B.hidden_size  # no embedding
    critic = microbatch_terms(LLAMA_31_8B, CRITIC_TRAIN, Layout(1, 1), W, 1, False, CL, Links())
    critic_params = LLAMA_31_8B.num_params(Head.VALUE) - LLAMA_31_8B.vocab_size * LLAMA_31_8B.hidden_size
    assert _work(critic, OpClass.GEMM) == pytest.approx(6 * critic_params * tokens, rel=1e-3)
    terms = microbatch_terms(LLAMA_31_8B, ACTOR_TRAIN, Layout(1, 1), W, 1, False, CL, Links())
    assert _work(terms, OpClass.GEMM) == pytest.approx((6 + 2) * matmul_params * tokens, rel=1e-3)
    recomputed = microbatch_terms(LLAMA_31_8B, ACTOR_TRAIN, Layout(1, 1), W, 1, True, CL, Links())
    assert _work(recomputed, OpClass.GEMM) == pytest.approx((8 + 2) * matmul_params * tokens, rel=1e-3)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_divides_compute_and_adds_all_reduce(tp: int) -> None:
    one = microbatch_terms(LLAMA_31_8B, REF_INF, Layout(1, 1), W, 2, False, CL, Links())
    many = microbatch_terms(LLAMA_31_8B, REF_INF, Layout(tp, 1), W, 2, False, CL, Links())
    assert _work(many, OpClass.GEMM) == pytest.approx(_work(one, OpClass.GEMM) / tp, rel=0.01)
    assert _work(one, OpClass.TP_ALLREDUCE_INTRA) == 0
    # 2 all-reduces per layer of b*s*h bf16 elements, ring: 2(t-1)/t of the buffer per GPU
    expected = 2 * 32 * 2 * W.tokens_per_sequence * 4096 * 2 * 2 * (tp - 1) / tp
    assert _work(many, OpClass.TP_ALLREDUCE_INTRA) == pytest.approx(expected)


def test_pipeline_bubble_fraction_is_p_minus_1_over_m_plus_p_minus_1() -> None:
    for p, m in [(2, 4), (4, 4), (8, 16)]:
        c = stage_cost(LLAMA_31_8B, CRITIC_INF, Layout(1, p), W, micro_batch_size=1, grad_accum=m,
                       recompute=False, dp=1, cluster=CL, links=Links(), eff=PRIORS)
        assert c.bubble_s / c.seconds == pytest.approx((p - 1) / (m + p - 1))


def test_higher_efficiency_means_less_time() -> None:
    kw = dict(micro_batch_size=1, grad_accum=8, recompute=False, dp=2, cluster=CL, links=Links())
    slow = stage_cost(LLAMA_31_8B, ACTOR_TRAIN, Layout(2, 1), W, eff=PRIORS, **kw)  # type: ignore[arg-type]
    fast = stage_cost(LLAMA_31_8B, ACTOR_TRAIN, Layout(2, 1), W,
                      eff=Efficiencies({OpClass.GEMM: 2 * PRIORS[OpClass.GEMM]}), **kw)  # type: ignore[arg-type]
    gemm_slow = slow.by_class(PRIORS)["gemm"]
    assert fast.seconds < slow.seconds
    assert slow.seconds - fast.seconds == pytest.approx(gemm_slow / 2, rel=1e-6)


def test_inter_node_links_are_slower() -> None:
    intra = microbatch_terms(LLAMA_31_8B, REF_INF, Layout(8, 1), W, 1, False, CL, Links(tp_intra=True))
    inter = microbatch_terms(LLAMA_31_8B, REF_INF, Layout(8, 1), W, 1, False, CL, Links(tp_intra=False))
    t_intra = sum(t.seconds(PRIORS) for t in intra)
    t_inter = sum(t.seconds(PRIORS) for t in inter)
    assert {t.op_class for t in inter} >= {OpClass.TP_ALLREDUCE_INTER}
    assert t_inter > t_intra


def test_dp_all_reduce_moves_2_d_minus_1_over_d_of_the_gradients() -> None:
    n = LLAMA_31_8B.num_params()
    for d in (2, 8):
        terms = sync_terms(LLAMA_31_8B, ACTOR_TRAIN, Layout(1, 1), d, CL, Links(dp_intra=False))
        assert _work(terms, OpClass.DP_ALLREDUCE_INTER) == pytest.approx(2 * n * 2 * (d - 1) / d)


def test_decode_is_memory_bound_at_small_batch_and_compute_bound_at_large() -> None:
    small = stage_cost(LLAMA_31_8B, ACTOR_GEN, Layout(1, 1), W, micro_batch_size=1, grad_accum=64,
                       recompute=False, dp=1, cluster=CL, links=Links(), eff=PRIORS)
    big = stage_cost(LLAMA_31_8B, ACTOR_GEN, Layout(1, 1), W, micro_batch_size=512, grad_accum=1,
                     recompute=False, dp=1, cluster=CL, links=Links(), eff=PRIORS)
    # prefill is compute bound (its own GEMM term); decode keeps the larger of weight reads and GEMMs
    assert OpClass.MEMORY_BOUND in {t.op_class for t in small.terms}
    assert [t.op_class for t in small.terms].count(OpClass.GEMM) == 1
    assert [t.op_class for t in big.terms].count(OpClass.GEMM) == 2
    assert big.seconds / 512 < small.seconds / 64 / 10  # batching amortises the weight reads (per sequence)


def _inference_plan(shared: bool) -> GlobalPlan:
    ref_gpus = ((0,), (1,))
    other = ((0,), (1,)) if shared else ((2,), (3,))
    return GlobalPlan(version=1, stages=(
        StagePlan(model_stage="actor-gen", layout=Layout(1, 1), gpu_sets=((0,), (1,), (2,), (3,)),
                  micro_batch_size=16),
        StagePlan(model_stage="ref-inf", layout=Layout(1, 1), gpu_sets=ref_gpus, micro_batch_size=32),
        StagePlan(model_stage="reward-inf", layout=Layout(1, 1), gpu_sets=other, micro_batch_size=32),
        StagePlan(model_stage="actor-train", layout=Layout(1, 1), gpu_sets=((0,), (1,), (2,), (3,)),
                  micro_batch_size=1, grad_accum=16),
    ))


def test_step_latency_is_the_critical_path() -> None:
    j = job("grpo", model="tiny-25m", prompts=64)
    cl = h200(4)
    apart = predict(j, cl, _inference_plan(shared=False))
    together = predict(j, cl, _inference_plan(shared=True))
    ref, rm = apart.stage_seconds["ref-inf"], apart.stage_seconds["reward-inf"]
    assert apart.kind_seconds["inference"] == pytest.approx(max(ref, rm))  # disjoint GPUs overlap
    assert together.kind_seconds["inference"] == pytest.approx(ref + rm)  # shared GPUs serialise
    assert together.stage_start_s["reward-inf"] == pytest.approx(together.stage_start_s["ref-inf"] + ref)
    for p in (apart, together):
        assert p.step_latency_s == pytest.approx(sum(p.kind_seconds.values()))
        assert p.stage_start_s["ref-inf"] == pytest.approx(p.stage_seconds["actor-gen"])  # gen -> inf -> train


def test_breakdown_explains_every_second() -> None:
    j = job("grpo", model="tiny-25m", prompts=64)
    p = predict(j, h200(4), _inference_plan(shared=False))
    for name, secs in p.stage_seconds.items():
        assert sum(p.breakdown[name].values()) == pytest.approx(secs)
    d = p.to_dict()
    assert d["feasible"] and d["step_latency_s"] == p.step_latency_s


def test_efficiencies_default_to_conservative_priors() -> None:
    e = Efficiencies({OpClass.GEMM: 0.8})
    assert e[OpClass.GEMM] == 0.8 and e[OpClass.PP_SEND_INTER] == PRIORS[OpClass.PP_SEND_INTER]
    # rates start conservative; the per-step overhead is a time in seconds, taken as configured
    assert all(0 < PRIORS[c] <= 0.6 for c in OpClass if c not in TIME_CLASSES)
    assert len(e) == len(OpClass) and set(e) == set(OpClass)
    with pytest.raises(ValueError, match="efficiencies.gemm"):
        Efficiencies({OpClass.GEMM: 0.0})
