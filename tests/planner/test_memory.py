"""Memory model against public figures (16 B/param, 128 KiB/token) and its structural invariants."""

from __future__ import annotations

import pytest
from planner_jobs import job

from planner.memory import (
    HEADROOM_FRACTION,
    TRAINING_BYTES_PER_PARAM,
    WORKSPACE_BYTES,
    MemoryBreakdown,
    kv_bytes_per_token_per_gpu,
    plan_memory,
    resident_bytes,
    transient_bytes,
    with_headroom,
)
from planner.models import LLAMA_31_8B, LLAMA_33_70B, Head
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.workflow import ACTOR_GEN, ACTOR_TRAIN, CRITIC_INF, REF_INF, Workload

KiB = 1024


def test_mixed_precision_adam_is_16_bytes_per_param() -> None:
    assert TRAINING_BYTES_PER_PARAM == 16
    res = resident_bytes(LLAMA_31_8B, ACTOR_TRAIN, Layout(1, 1))
    assert res.total_bytes == 16 * LLAMA_31_8B.num_params(Head.LM)
    assert res.params_bytes == res.grads_bytes == 2 * LLAMA_31_8B.num_params()
    assert res.optimizer_bytes == 12 * LLAMA_31_8B.num_params()


@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (8, 1), (1, 4), (4, 4)])
def test_training_state_is_sharded_by_tp_and_pp(tp: int, pp: int) -> None:
    whole = 16 * LLAMA_33_70B.num_params()
    per_gpu = resident_bytes(LLAMA_33_70B, ACTOR_TRAIN, Layout(tp, pp)).total_bytes
    # the worst PP rank also holds the embedding or the head, and norms are replicated over TP
    assert whole / (tp * pp) <= per_gpu < whole / (tp * pp) * 1.12


def test_inference_holds_bf16_weights_only() -> None:
    res = resident_bytes(LLAMA_31_8B, REF_INF, Layout(1, 1))
    assert res.total_bytes == res.params_bytes == 2 * LLAMA_31_8B.num_params()
    assert res.optimizer_bytes == res.grads_bytes == 0


def test_llama_31_8b_kv_cache_is_128_kib_per_token() -> None:
    assert LLAMA_31_8B.kv_bytes_per_token == 128 * KiB
    assert kv_bytes_per_token_per_gpu(LLAMA_31_8B, Layout(1, 1)) == 128 * KiB
    assert kv_bytes_per_token_per_gpu(LLAMA_31_8B, Layout(2, 1)) == 64 * KiB
    assert kv_bytes_per_token_per_gpu(LLAMA_31_8B, Layout(8, 1)) == 16 * KiB
    assert kv_bytes_per_token_per_gpu(LLAMA_31_8B, Layout(1, 2)) == 64 * KiB


def test_kv_heads_are_replicated_beyond_tp_eight() -> None:
    # 8 kv heads: TP16 cannot split them further, each rank keeps one head (GQA replication)
    assert kv_bytes_per_token_per_gpu(LLAMA_33_70B, Layout(16, 1)) == \
        kv_bytes_per_token_per_gpu(LLAMA_33_70B, Layout(8, 1))


def test_generation_kv_cache_is_sequences_times_tokens() -> None:
    w = Workload(prompts_per_step=64, prompt_tokens=1000, response_tokens=3000)
    t = transient_bytes(LLAMA_31_8B, ACTOR_GEN, Layout(1, 1), w, micro_batch_size=16, grad_accum=4,
                        recompute=False)
    assert t.kv_cache_bytes == 16 * 4000 * 128 * KiB


def _train_act(layout: Layout, s: int, b: int = 1, g: int = 8, recompute: bool = False) -> int:
    w = Workload(prompts_per_step=64, prompt_tokens=s // 2, response_tokens=s // 2)
    return transient_bytes(LLAMA_31_8B, ACTOR_TRAIN, layout, w, b, g, recompute).activations_bytes


def test_flash_attention_has_no_quadratic_term() -> None:
    w1 = Workload(prompts_per_step=8, prompt_tokens=1024, response_tokens=1024)
    w2 = Workload(prompts_per_step=8, prompt_tokens=4096, response_tokens=4096)
    # critic: a value head, so no vocabulary-sized logits; inference keeps one layer's activations
    a1 = transient_bytes(LLAMA_31_8B, CRITIC_INF, Layout(1, 1), w1, 1, 1, False).activations_bytes
    a2 = transient_bytes(LLAMA_31_8B, CRITIC_INF, Layout(1, 1), w2, 1, 1, False).activations_bytes
    assert a2 == pytest.approx(4 * a1, rel=1e-6)


def test_recomputation_and_tp_cut_activations() -> None:
    full = _train_act(Layout(1, 1), 4096)
    assert _train_act(Layout(1, 1), 4096, recompute=True) < full / 4
    assert _train_act(Layout(4, 1), 4096) == pytest.approx(full / 4, rel=0.01)


def test_1f1b_keeps_up_to_pp_micro_batches_in_flight() -> None:
    one = _train_act(Layout(1, 4), 2048, g=1)
    two = _train_act(Layout(1, 4), 2048, g=2)
    four = _train_act(Layout(1, 4), 2048, g=4)
    many = _train_act(Layout(1, 4), 2048, g=16)
    assert one < two < four == many


def test_headroom_is_ten_percent_on_top_of_state_and_workspace() -> None:
    m = with_headroom(MemoryBreakdown(params_bytes=10 * 1024**3, activations_bytes=5 * 1024**3))
    state = 15 * 1024**3 + WORKSPACE_BYTES
    assert m.workspace_bytes == WORKSPACE_BYTES
    assert m.headroom_bytes == int(state * HEADROOM_FRACTION)
    assert m.total_bytes == state + m.headroom_bytes


def test_idle_training_state_stays_resident_during_generation() -> None:
    j = job("grpo", prompts=16, samples=1)
    gpus = ((0, 1),)
    plan = GlobalPlan(version=1, stages=(
        StagePlan(model_stage="actor-gen", layout=Layout(2, 1), gpu_sets=gpus, micro_batch_size=16),
        StagePlan(model_stage="ref-inf", layout=Layout(2, 1), gpu_sets=gpus, micro_batch_size=1, grad_accum=16),
        StagePlan(model_stage="reward-inf", layout=Layout(2, 1), gpu_sets=gpus, micro_batch_size=1,
                  grad_accum=16),
        StagePlan(model_stage="actor-train", layout=Layout(2, 1), gpu_sets=gpus, micro_batch_size=1,
                  grad_accum=16),
    ))
    per_gpu, per_stage = plan_memory(j, plan)
    train_res = resident_bytes(LLAMA_31_8B, ACTOR_TRAIN, Layout(2, 1)).total_bytes
    gen = per_stage["actor-gen"]
    assert gen.kv_cache_bytes > 0
    assert gen.co_resident_bytes >= train_res  # actor-train's weights, grads and Adam state
    assert set(per_gpu) == {0, 1}
    assert per_gpu[0] == max(m.total_bytes for m in per_stage.values())


def test_plan_memory_matches_a_per_gpu_sum_on_a_fragmented_plan() -> None:
    """Stages on overlapping, uneven GPU sets: every GPU's peak is its residents plus the largest
    transient among the stages on it (with workspace and headroom), summed GPU by GPU here."""
    from planner.memory import combine

    j = job("ppo", prompts=16)
    w = j.workload
    sets = {"actor-gen": ((0, 1), (2, 3)), "ref-inf": ((1,), (5,)), "critic-inf": ((0,), (6,)),
            "reward-inf": ((7,),), "actor-train": ((0, 1, 2, 3),), "critic-train": ((4, 5), (6, 7))}
    layouts = {k: Layout(len(v[0]), 1) for k, v in sets.items()}
    plan = GlobalPlan(version=1, stages=tuple(
        StagePlan(model_stage=k, layout=layouts[k], gpu_sets=v, micro_batch_size=16 // len(v)) for k, v in sets.items()))
    per_gpu, per_stage = plan_memory(j, plan)
    res = {sp.model_stage: resident_bytes(j.model_of(j.workflow.stage(sp.model_stage)),
                                          j.workflow.stage(sp.model_stage), sp.layout) for sp in plan}
    expected: dict[int, int] = {}
    for g in range(8):
        on = [sp for sp in plan if g in sp.gpus]
        total_res = sum(res[sp.model_stage].total_bytes for sp in on)
        peaks = []
        for sp in on:
            ms = j.workflow.stage(sp.model_stage)
            t = transient_bytes(j.model_of(ms), ms, sp.layout, w, sp.micro_batch_size, sp.grad_accum, sp.recompute)
            own = res[sp.model_stage]
            peaks.append(combine(own, t, total_res - own.total_bytes).total_bytes)
        expected[g] = max(peaks)
    assert per_gpu == expected
    for sp in plan:  # each stage's breakdown is the one on its fullest GPU
        assert per_stage[sp.model_stage].total_bytes == max(
            combine(res[sp.model_stage], transient_bytes(j.model_of(j.workflow.stage(sp.model_stage)),
                                                         j.workflow.stage(sp.model_stage), sp.layout, w,
                                                         sp.micro_batch_size, sp.grad_accum, sp.recompute),
                    sum(res[o.model_stage].total_bytes for o in plan if g in o.gpus)
                    - res[sp.model_stage].total_bytes).total_bytes for g in sp.gpus)
