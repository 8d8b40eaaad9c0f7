"""Cost-model shapes against published behaviour: the paper's 16-GPU example, the RL step's structure
(old-log-prob pass, weight refit, fixed overhead), generation under continuous batching (length tail,
time per output token vs concurrency, paged KV), exposed DP all-reduce, GEMM shapes, fp32 gradients."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from planner_jobs import h200

from planner.cost import (
    DP_BUCKET_PARAMS,
    PRIORS,
    Links,
    OpClass,
    dp_exposed_fraction,
    microbatch_terms,
    stage_cost,
)
from planner.hardware import cluster_preset
from planner.memory import params_per_gpu, resident_bytes, transient_bytes
from planner.models import LLAMA_31_8B, LLAMA_33_70B, Head
from planner.options import option_table
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.prediction import predict
from planner.workflow import (
    ACTOR_GEN,
    ACTOR_TRAIN,
    CRITIC_TRAIN,
    REF_INF,
    Workload,
    grpo,
    same_model_job,
)

MEGATRON_8B = dataclasses.replace(LLAMA_31_8B, grad_bytes_per_param=4)  # fp32 main grads, Megatron's default


def _train_only(total_tokens: int, micro_batch: int, tp: int, pp: int):  # type: ignore[no-untyped-def]
    """The paper's example: Llama-3.1-8B actor training on 16 A100-64GB (4 per node), layout (DP,TP,PP)."""
    cl = cluster_preset("a100", 16)
    w = Workload(prompts_per_step=256, prompt_tokens=512, response_tokens=total_tokens - 512)
    job = same_model_job(grpo(learned_reward=False), MEGATRON_8B, w)
    size = tp * pp
    dp = 16 // size
    plan = GlobalPlan(version=1, stages=(StagePlan(
        model_stage="actor-train", layout=Layout(tp, pp),
        gpu_sets=tuple(tuple(range(i * size, (i + 1) * size)) for i in range(dp)),
        micro_batch_size=micro_batch, grad_accum=256 // dp // micro_batch),))
    return predict(job, cl, plan)


def test_paper_16_a100_example_422_ooms_at_4k_and_wins_at_2k() -> None:
    """PAPER.md: at 16 GPUs (4,2,2) is fastest at 2K tokens and runs out of memory at 4K, where (4,4,1)
    fits (Megatron-style fp32 main gradients, micro-batch 2)."""
    at_2k = {lay: _train_only(2048, 2, *lay) for lay in ((2, 2), (4, 1))}
    at_4k = {lay: _train_only(4096, 2, *lay) for lay in ((2, 2), (4, 1))}
    assert at_2k[(2, 2)].feasible and at_2k[(4, 1)].feasible
    assert at_2k[(2, 2)].step_latency_s < at_2k[(4, 1)].step_latency_s  # not a tie: the bubble costs less
    assert at_2k[(4, 1)].step_latency_s / at_2k[(2, 2)].step_latency_s > 1.01  # than TP4's all-reduces
    assert not at_4k[(2, 2)].feasible
    assert at_4k[(4, 1)].feasible
    # (4,2,2) keeps pp = 2 micro-batches of 16 layers in flight on its first stage, at TP 2: twice the
    # activations of (4,4,1); the OOM is activations, not state
    m22, m41 = at_4k[(2, 2)].memory["actor-train"], at_4k[(4, 1)].memory["actor-train"]
    assert m22.activations_bytes > 1.5 * m41.activations_bytes
    assert m22.params_bytes + m22.grads_bytes + m22.optimizer_bytes == pytest.approx(
        m41.params_bytes + m41.grads_bytes + m41.optimizer_bytes, rel=0.1)


def test_fp32_gradients_are_18_bytes_per_param() -> None:
    res = resident_bytes(MEGATRON_8B, ACTOR_TRAIN, Layout(1, 1))
    assert res.total_bytes == 18 * MEGATRON_8B.num_params(Head.LM)
    assert res.grads_bytes == 4 * MEGATRON_8B.num_params(Head.LM)
    with pytest.raises(ValueError, match="grad_bytes_per_param"):
        dataclasses.replace(LLAMA_31_8B, grad_bytes_per_param=3)


W = Workload(prompts_per_step=256, prompt_tokens=1024, response_tokens=1024)


INTER = Links(dp_intra=False)
ONE = Layout(1, 1)


def _train(ms, layout: Layout, dp: int, b: int, g: int, links: Links = INTER,  # type: ignore[no-untyped-def]
           workload: Workload = W):
    return stage_cost(LLAMA_31_8B, ms, layout, workload, micro_batch_size=b, grad_accum=g, recompute=False,
                      dp=dp, cluster=h200(64), links=links, eff=PRIORS)


def _dp_seconds(c) -> float:  # type: ignore[no-untyped-def]
    return sum(t.seconds(PRIORS) for t in c.terms if t.op_class in (OpClass.DP_ALLREDUCE_INTER,
                                                                    OpClass.DP_ALLREDUCE_INTRA))


def test_dp_all_reduce_exposed_part_shrinks_with_overlap() -> None:
    """Bucketed all-reduce overlapped with the last backward: a larger last micro-batch hides more, the
    exposed part never exceeds the whole all-reduce and never drops below the last bucket."""
    small = _train(ACTOR_TRAIN, Layout(2, 1), 8, 1, 16)
    big = _train(ACTOR_TRAIN, Layout(2, 1), 8, 4, 4)
    full = [t for t in microbatch_terms(LLAMA_31_8B, ACTOR_TRAIN, Layout(2, 1), W, 1, False, h200(64),
                                        Links(dp_intra=False))]
    assert full  # the micro-batch terms exist; the all-reduce is priced apart
    assert 0 < _dp_seconds(big) < _dp_seconds(small)
    n = params_per_gpu(LLAMA_31_8B, Head.LM, Layout(2, 1))
    assert dp_exposed_fraction(10.0, 0.0, n) == 1.0  # nothing to hide behind
    assert dp_exposed_fraction(10.0, 100.0, n) == pytest.approx(DP_BUCKET_PARAMS / n)  # the last bucket
    assert dp_exposed_fraction(10.0, 4.0, n) == pytest.approx(0.6)


def test_large_dp_is_not_penalised_by_a_serial_all_reduce() -> None:
    """Per-replica work falls as 1/dp while the ring all-reduce tends to 2x the gradients; with overlap
    the step time keeps falling with DP, as Megatron's weak-scaling tables show."""
    seqs = 256
    costs = [_train(ACTOR_TRAIN, Layout(2, 1), dp, 1, seqs // dp) for dp in (2, 4, 8, 16, 32)]
    times = [c.seconds for c in costs]
    assert all(a > b for a, b in zip(times, times[1:]))
    assert times[0] / times[-1] > 10  # 16x the GPUs
    serial = [t for t in costs[-1].terms if t.op_class is OpClass.DP_ALLREDUCE_INTER][0]
    assert _dp_seconds(costs[-1]) < serial.seconds(PRIORS) / serial.repeat  # exposed < the whole all-reduce


def test_old_logprob_pass_adds_one_forward_to_the_actor_only() -> None:
    actor = _train(ACTOR_TRAIN, Layout(1, 1), 1, 1, 8, Links())
    critic = _train(CRITIC_TRAIN, Layout(1, 1), 1, 1, 8, Links())
    gemm = {k: sum(t.work * t.repeat for t in c.terms if t.op_class is OpClass.GEMM)
            for k, c in (("actor", actor), ("critic", critic))}
    embed = LLAMA_31_8B.vocab_size * LLAMA_31_8B.hidden_size  # a gather, not a GEMM
    lm, value = LLAMA_31_8B.num_params(Head.LM) - embed, LLAMA_31_8B.num_params(Head.VALUE) - embed
    assert gemm["actor"] / gemm["critic"] == pytest.approx((8 * lm) / (6 * value), rel=1e-3)
    assert ACTOR_TRAIN.old_logprob_pass and not CRITIC_TRAIN.old_logprob_pass


def _gen(b: int, g: int, workload: Workload, layout: Layout = ONE):  # type: ignore[no-untyped-def]
    return stage_cost(LLAMA_31_8B, ACTOR_GEN, layout, workload, micro_batch_size=b, grad_accum=g,
                      recompute=False, dp=1, cluster=h200(8), links=Links(), eff=PRIORS)


def test_time_per_output_token_rises_with_concurrency_and_throughput_too() -> None:
    """vLLM's decode: each step reads the weights once and every live sequence's KV, so TPOT grows
    with concurrency while tokens/s grows much faster (NIM/vLLM benchmark tables show both)."""
    w = Workload(prompts_per_step=512, prompt_tokens=1000, response_tokens=1000)
    tpot, tput = [], []
    for b in (1, 8, 64, 256):
        c = _gen(b, 1, w)
        decode = sum(t.seconds(PRIORS) for t in c.terms if t.op_class in (
            OpClass.MEMORY_BOUND, OpClass.ATTENTION_DECODE) or (t.op_class is OpClass.GEMM and t.work <= 2.1 *
                                                                LLAMA_31_8B.num_params() * b * 1000))
        tpot.append(decode / 1000)
        tput.append(b * 1000 / c.seconds)
    assert all(a < b for a, b in zip(tpot, tpot[1:]))
    assert all(a < b for a, b in zip(tput, tput[1:]))
    assert tpot[-1] / tpot[0] > 2 and tput[-1] / tput[0] > 20


def test_long_tail_adds_low_concurrency_decode_steps_once_per_step() -> None:
    mean = Workload(prompts_per_step=256, prompt_tokens=512, response_tokens=1000)
    tail = dataclasses.replace(mean, max_response_tokens=4000)
    for b, g in ((64, 4), (256, 1)):
        extra = _gen(b, g, tail).seconds - _gen(b, g, mean).seconds
        weight_read = 3000 * 2 * LLAMA_31_8B.num_params() / (h200(8).device.hbm_bytes_per_s * PRIORS[OpClass.MEMORY_BOUND])
        assert weight_read * 0.9 < extra < weight_read * 1.3  # 3,000 extra steps of weight reads
    # the spread of lengths adds KV reads (E[n^2] > mean^2) without a longer tail
    spread = dataclasses.replace(mean, response_tokens_std=800.0)
    assert _gen(64, 4, spread).seconds > _gen(64, 4, mean).seconds


def test_kv_cache_is_a_paged_budget_not_a_reservation_at_the_maximum() -> None:
    w = Workload(prompts_per_step=256, prompt_tokens=512, response_tokens=1000, max_response_tokens=8000)
    kv = transient_bytes(LLAMA_31_8B, ACTOR_GEN, Layout(1, 1), w, 64, 4, False).kv_cache_bytes
    per_token = LLAMA_31_8B.kv_bytes_per_token
    assert kv == per_token * (64 * 1512 + 7000)
    assert kv < per_token * 64 * 8512 / 4  # a quarter of the old reservation


def test_gemm_efficiency_falls_with_few_tokens_per_micro_batch() -> None:
    short = Workload(prompts_per_step=256, prompt_tokens=128, response_tokens=128)
    long_ = Workload(prompts_per_step=256, prompt_tokens=2048, response_tokens=2048)

    def gemm_s_per_token(w: Workload) -> float:
        terms = microbatch_terms(LLAMA_31_8B, REF_INF, Layout(1, 1), w, 1, False, h200(8), Links())
        return sum(t.seconds(PRIORS) for t in terms if t.op_class is OpClass.GEMM) / w.tokens_per_sequence

    assert gemm_s_per_token(short) > 1.2 * gemm_s_per_token(long_)
    wide = microbatch_terms(LLAMA_31_8B, REF_INF, Layout(1, 1), long_, 1, False, h200(8), Links())
    narrow = microbatch_terms(LLAMA_31_8B, REF_INF, Layout(8, 1), long_, 1, False, h200(8), Links())
    peak = {k: next(t.peak_per_s for t in ts if t.op_class is OpClass.GEMM) for k, ts in (("1", wide), ("8", narrow))}
    assert peak["8"] < peak["1"]  # 512 columns per GPU at TP 8 run below 4,096 at TP 1


def test_weight_refit_is_priced_once_per_step_for_actor_generation() -> None:
    w = Workload(prompts_per_step=64, prompt_tokens=512, response_tokens=512)
    for layout in (Layout(1, 1), Layout(4, 1)):
        c = _gen(16, 4, w, layout)
        sync = [t for t in c.terms if t.op_class is OpClass.WEIGHT_SYNC]
        assert len(sync) == 1 and sync[0].repeat == 1
        assert sync[0].work == params_per_gpu(LLAMA_31_8B, Head.LM, layout) * 2
    ref = stage_cost(LLAMA_31_8B, REF_INF, Layout(1, 1), w, micro_batch_size=4, grad_accum=16, recompute=False,
                     dp=1, cluster=h200(8), links=Links(), eff=PRIORS)
    assert not [t for t in ref.terms if t.op_class is OpClass.WEIGHT_SYNC]


def test_refit_time_is_its_set_up_once_plus_the_bytes_that_cross_over_the_units_link() -> None:
    """What crosses is the generation GPU's shard: a TP-4 unit's GPU receives a quarter of what a TP-1
    GPU does, a 70B model ~8.8x an 8B one, while the set-up (communicators, IPC handles, the engine's
    reload) is paid once per step whatever the size; a unit across nodes receives over the NICs."""
    w = Workload(prompts_per_step=64, prompt_tokens=512, response_tokens=512)
    cl = h200(16)

    def refit(model, layout: Layout, links: Links | None = None) -> float:  # type: ignore[no-untyped-def]
        c = stage_cost(model, ACTOR_GEN, layout, w, micro_batch_size=16, grad_accum=4, recompute=False, dp=1,
                       cluster=cl, links=links or Links(), eff=PRIORS)
        return sum(t.seconds(PRIORS) for t in c.terms if t.op_class is OpClass.WEIGHT_SYNC)

    setup = cl.refit_setup_s
    assert setup > 0
    one, four = refit(LLAMA_31_8B, Layout(1, 1)) - setup, refit(LLAMA_31_8B, Layout(4, 1)) - setup
    ratio = params_per_gpu(LLAMA_31_8B, Head.LM, Layout(1, 1)) / params_per_gpu(LLAMA_31_8B, Head.LM, Layout(4, 1))
    assert one / four == pytest.approx(ratio) and 3.5 < ratio < 4.0  # the embedding and head shard too
    big = refit(LLAMA_33_70B, Layout(1, 1)) - setup
    assert big / one == pytest.approx(LLAMA_33_70B.num_params() / LLAMA_31_8B.num_params(), rel=1e-6)
    across = refit(LLAMA_31_8B, Layout(1, 1), Links(tp_intra=False)) - setup
    assert across / one == pytest.approx(cl.intra_node_link.bytes_per_s / cl.inter_node_link.bytes_per_s)


def test_step_overhead_is_part_of_the_step() -> None:
    cl = dataclasses.replace(h200(8), step_overhead_s=3.0)
    job = same_model_job(grpo(learned_reward=False), LLAMA_31_8B, Workload(prompts_per_step=64, prompt_tokens=256,
                                                                          response_tokens=256))
    plan = GlobalPlan(version=1, stages=(
        StagePlan(model_stage="actor-gen", layout=Layout(2, 1), gpu_sets=((0, 1), (2, 3), (4, 5), (6, 7)),
                  micro_batch_size=16),
        StagePlan(model_stage="ref-inf", layout=Layout(2, 1), gpu_sets=((0, 1), (2, 3), (4, 5), (6, 7)),
                  micro_batch_size=4, grad_accum=4),
        StagePlan(model_stage="actor-train", layout=Layout(4, 1), gpu_sets=((0, 1, 2, 3), (4, 5, 6, 7)),
                  micro_batch_size=1, grad_accum=32)))
    plain = predict(job, dataclasses.replace(h200(8), step_overhead_s=0.0), plan)
    loaded = predict(job, cl, plan)
    assert loaded.step_latency_s == pytest.approx(plain.step_latency_s + 3.0)
    assert loaded.kind_seconds["overhead"] == 3.0 and sum(loaded.kind_seconds.values()) == pytest.approx(
        loaded.step_latency_s)
    with pytest.raises(ValueError, match="step_overhead_s"):
        dataclasses.replace(h200(8), step_overhead_s=-1.0)
    # GPU systems carry NeMo-RL's published per-step overhead by default; the CPU development system none
    assert h200(8).step_overhead_s == 4.0 and cluster_preset("cpu", 2).step_overhead_s == 0.0


@pytest.mark.parametrize("stage", ["actor-gen", "actor-train", "ref-inf"])
def test_option_rows_match_the_cost_model_with_a_tail_and_overlap(stage: str) -> None:
    w = Workload(prompts_per_step=64, samples_per_prompt=2, prompt_tokens=512, response_tokens=1500,
                 max_response_tokens=6000, response_tokens_std=900.0, train_mini_batches_per_step=2)
    job = same_model_job(grpo(learned_reward=False), MEGATRON_8B, w)
    cl = h200(32)
    ms = job.workflow.stage(stage)
    table = option_table(job, ms, cl, 32, PRIORS)
    rng = np.random.default_rng(1)
    for i in rng.choice(len(table), size=min(30, len(table)), replace=False):
        o = table.option(int(i))
        gpn = cl.gpus_per_node
        links = Links(tp_intra=o.layout.tp <= gpn, pp_intra=o.layout.size <= gpn, dp_intra=o.num_gpus <= gpn)
        exact = stage_cost(MEGATRON_8B, ms, o.layout, w, micro_batch_size=o.micro_batch_size,
                           grad_accum=o.grad_accum, recompute=o.recompute, dp=o.dp, cluster=cl, links=links, eff=PRIORS)
        assert o.seconds == pytest.approx(exact.seconds, rel=1e-9)


def test_sleeping_generation_frees_its_weights_for_training_and_pays_the_host_copies() -> None:
    """vLLM sleep mode as colocated RL systems run it: the generation weights leave the GPU while
    training runs (its peak drops by them) and each step copies them out and back over PCIe."""
    asleep = dataclasses.replace(ACTOR_GEN, sleeps=True)
    w = Workload(prompts_per_step=64, prompt_tokens=512, response_tokens=512)
    gpus = tuple(range(8))
    stages = (StagePlan(model_stage="actor-gen", layout=Layout(1, 1), gpu_sets=tuple((g,) for g in gpus),
                        micro_batch_size=8),
              StagePlan(model_stage="actor-train", layout=Layout(4, 1), gpu_sets=(gpus[:4], gpus[4:]),
                        micro_batch_size=1, grad_accum=32))
    plan = GlobalPlan(version=1, stages=stages)
    cl = h200(8)
    awake_job = same_model_job(grpo(learned_reward=False), LLAMA_31_8B, w)
    flows = {"awake": awake_job, "asleep": dataclasses.replace(awake_job, workflow=dataclasses.replace(
        awake_job.workflow, model_stages=tuple(asleep if m.name == "actor-gen" else m
                                               for m in awake_job.workflow.model_stages if m.name != "ref-inf")))}
    flows["awake"] = dataclasses.replace(awake_job, workflow=dataclasses.replace(
        awake_job.workflow, model_stages=tuple(m for m in awake_job.workflow.model_stages if m.name != "ref-inf")))
    preds = {k: predict(j, cl, plan) for k, j in flows.items()}
    weights = params_per_gpu(LLAMA_31_8B, Head.LM, Layout(1, 1)) * 2
    train = {k: p.memory["actor-train"] for k, p in preds.items()}
    assert train["awake"].co_resident_bytes - train["asleep"].co_resident_bytes == weights
    copy = preds["asleep"].stage_seconds["actor-gen"] - preds["awake"].stage_seconds["actor-gen"]
    assert copy == pytest.approx(2 * weights / (cl.device.host_bytes_per_s * PRIORS[OpClass.HOST_COPY]))
    # while it runs, the woken weights are on the GPU like any others
    assert preds["asleep"].memory["actor-gen"].params_bytes == weights
    with pytest.raises(ValueError, match="sleeps"):
        dataclasses.replace(ACTOR_TRAIN, sleeps=True)
