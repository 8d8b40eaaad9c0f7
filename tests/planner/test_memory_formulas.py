"""The memory model's formulas on a small model whose sizes all differ (h=64, q=128, kv=32, f=96, 8 heads,
vocab 1000), worked out by hand (planner/memory.py): activations per token and layer, the generation,
inference and training transients with and without recomputation, the peak with workspace and
headroom, and the plan's per-GPU map. Found by mutation testing (tests/mutate.py --module
planner/memory.py: 50 of 325 mutants survived tests that compared plans, not bytes)."""

from __future__ import annotations

import pytest
from planner_jobs import SMALL

from planner.memory import (
    HEADROOM_FRACTION,
    WORKSPACE_BYTES,
    MemoryBreakdown,
    _layer_activation_bytes_per_token,
    peak_total,
    plan_memory,
    training_bytes_per_param,
    transient_bytes,
    transient_parts,
    with_headroom,
)
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.workflow import (
    ACTOR_GEN,
    ACTOR_TRAIN,
    CRITIC_INF,
    REF_INF,
    ModelStage,
    Role,
    StageKind,
    Workload,
    same_model_job,
    workflow_preset,
)

M = SMALL
W = Workload(prompts_per_step=4, prompt_tokens=10, response_tokens=20, max_response_tokens=50)


def test_activation_bytes_per_token_and_layer() -> None:
    # attention: 2 B x (2h + 2q + 2kv) + 4 B per head = 2 x 448 + 32; MLP: 2 B x (2h + 3f) = 832
    assert _layer_activation_bytes_per_token(M, 1) == 928 + 832
    assert _layer_activation_bytes_per_token(M, 2) == (928 + 832) / 2


def test_generation_holds_paged_kv_sampling_logits_and_one_prefill() -> None:
    # b = 3: 3 x 30 tokens + the 30-token tail; KV per token on a GPU of TP2 x PP2: 2 x 2 layers x 1 kv head x 16 x 2 B
    kv, act, woken = transient_parts(M, ACTOR_GEN, Layout(2, 2), W, 3, 1, False)
    assert (kv, act, woken) == (120 * 128, 3 * 1000 // 2 * 4 + 10 * 880, 0)


def test_inference_holds_one_layer_and_the_lm_heads_logits() -> None:
    _, act, _ = transient_parts(M, REF_INF, Layout(2, 1), W, 3, 1, False)
    assert act == 3 * 60 * 880 + 3 * 60 * 500 * (2 + 4)  # 60 tokens per sequence, bf16 + fp32 logits
    assert transient_parts(M, CRITIC_INF, Layout(2, 1), W, 3, 1, False)[1] == 3 * 60 * 880  # a value head


def test_training_keeps_in_flight_micro_batches_or_their_layer_inputs_when_recomputing() -> None:
    per_layer, logits = 2 * 60 * 1760, 2 * 60 * 1000 * 6
    # 1F1B on PP2 with 3 micro-batches: 2 in flight, over the stage's 2 layers
    assert transient_parts(M, ACTOR_TRAIN, Layout(1, 2), W, 2, 3, False)[1] == 2 * 2 * per_layer + logits
    kept = 2 * 2 * 2 * 60 * 64 * 2  # in flight x layers x b x s x h x 2 B: each layer's input only
    assert transient_parts(M, ACTOR_TRAIN, Layout(1, 2), W, 2, 3, True)[1] == kept + per_layer + logits
    assert transient_parts(M, ACTOR_TRAIN, Layout(2, 2), W, 2, 3, True)[1] == kept // 2 + per_layer // 2 + logits // 2
    assert transient_parts(M, ACTOR_TRAIN, Layout(1, 2), W, 2, 1, False)[1] == 2 * per_layer + logits  # 1 in flight, 2 layers


def test_a_sleeping_stage_wakes_its_weights_and_the_breakdown_says_where() -> None:
    sleeper = ModelStage("ref-inf", Role.REFERENCE, StageKind.INFERENCE, sleeps=True)
    awake = transient_parts(M, REF_INF, Layout(1, 1), W, 1, 1, False)
    slept = transient_parts(M, sleeper, Layout(1, 1), W, 1, 1, False)
    assert awake[2] == 0 and slept[2] > 0 and slept[:2] == awake[:2]
    b = transient_bytes(M, sleeper, Layout(1, 1), W, 1, 1, False)
    assert (b.params_bytes, b.kv_cache_bytes, b.activations_bytes) == (slept[2], slept[0], slept[1])


def test_state_per_parameter_peak_and_headroom() -> None:
    assert training_bytes_per_param(M) == 2 + 2 + 12
    import dataclasses
    assert training_bytes_per_param(dataclasses.replace(M, grad_bytes_per_param=4)) == 2 + 4 + 12
    assert peak_total(100, 50) == int((150 + WORKSPACE_BYTES) * (1 + HEADROOM_FRACTION))
    m = MemoryBreakdown(params_bytes=1000, activations_bytes=500, workspace_bytes=7, headroom_bytes=3)
    h = with_headroom(m)
    assert (h.workspace_bytes, h.headroom_bytes) == (WORKSPACE_BYTES, int((1500 + WORKSPACE_BYTES) * 0.1))
    assert (h.params_bytes, h.activations_bytes) == (1000, 500)
    assert m.as_dict() == {"params_bytes": 1000, "grads_bytes": 0, "optimizer_bytes": 0, "activations_bytes": 500,
                           "kv_cache_bytes": 0, "co_resident_bytes": 0, "workspace_bytes": 7, "headroom_bytes": 3,
                           "total_bytes": 1510}


def test_the_plans_peak_map_names_its_own_gpus() -> None:
    job = same_model_job(workflow_preset("grpo", learned_reward=False), M, W)
    plan = GlobalPlan(version=1, stages=tuple(
        StagePlan(model_stage=ms.name, layout=Layout(1, 1), gpu_sets=((8,), (9,)), micro_batch_size=2)
        for ms in job.workflow.model_stages))
    per_gpu, per_stage = plan_memory(job, plan)
    assert sorted(per_gpu) == [8, 9] and all(type(v) is int and v > 0 for v in per_gpu.values())
    assert per_gpu[8] == per_gpu[9] == max(m.total_bytes for m in per_stage.values())
    assert set(per_stage) == {"actor-gen", "ref-inf", "actor-train"}
    with pytest.raises(KeyError):
        per_gpu[0]  # noqa: B018
