"""The RL-step rows of bench/fidelity.py: NeMo-RL's GRPO steps and their phases, each priced in its
recipe's setting (cited where defined), with NeMo-RL's colocated refit as it runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from planner.cost import Links, OpClass, OpTerm, stage_cost
from planner.hardware import GPU_DECODE_STEP_OVERHEAD_S, H100, cluster_preset
from planner.memory import params_per_gpu
from planner.models import LLAMA_31_8B, LLAMA_33_70B, QWEN3_32B, Head
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.prediction import predict
from planner.workflow import ModelStage, Role, StageKind, Workload, grpo, same_model_job

Eff = Mapping[OpClass, float]


def _units(n: int, size: int, offset: int = 0) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(range(offset + i * size, offset + (i + 1) * size)) for i in range(n // size))


# --- RL steps: NeMo-RL v0.4 performance summary (docs/about/performance-summary.md, added in commit
# cff17f83b), GRPO on OpenMathInstruct-2, DGX-H100, Megatron training backend, vLLM generation,
# colocated, on-policy. Recipes at tag v0.4.0 (examples/configs/recipes/llm/performance/
# grpo-llama3.1-8b-instruct-2n8g.yaml, grpo-qwen3-32b-4n8g.yaml, both on examples/configs/grpo_math_1B.yaml):
# 64 prompts x 32 generations, train global batch 512 (4 optimizer steps), max 4,096 tokens, sequence
# packing on (grpo_math_1B.yaml: train_mb_tokens = 4,096 x train micro-batch, logprob_mb_tokens = 4,096
# x logprob batch), distributed optimizer; Llama: train micro-batch 1, PP 2, activation_checkpointing:
# true, logprob batch 2; Qwen3-32B: TP 4, PP 4, sequence parallel, micro-batch 1, no activation
# checkpointing (the grpo_math_1B.yaml default), logprob batch 4 (default), generation TP 4.
# Prompt length: tokens/s/GPU x step time x GPUs / samples - mean generated length (132 for Llama).
TRAIN_ONLY = ModelStage("actor-train", Role.ACTOR, StageKind.TRAINING)  # the update without the old-log-prob pass
LLAMA_PROMPT = round(1562 * 97.7 * 16 / 2048 - 1060)
PACK_TOKENS = 4096  # sequence packing's train_mb_tokens at micro-batch 1 (max_total_sequence_length x 1)


# What NeMo-RL's colocated refit does (tag v0.3.0: nemo_rl/algorithms/grpo.py refit_policy_generation,
# the "prepare_for_generation" timer the blog reports as Refit; nemo_rl/models/policy/
# megatron_policy_worker.py): (1) offload_before_refit frees the gradient buffers (Megatron-core
# _ParamAndGradBuffer.offload_to_cpu resizes grad storage to 0: nothing copied) and moves every
# optimizer-state tensor to the host, ``state[k] = v.to("cpu")``: one copy per tensor into fresh
# pageable memory, every step; (2) vLLM wakes its weights; (3) per key group, gather_params
# all-gathers TP shards and broadcasts each tensor across PP, converts to HF names and hands CUDA IPC
# handles to vLLM: every training GPU materialises the whole unsharded model, tensor by tensor, and
# its vLLM worker slices its own shard out (the planner's WEIGHT_SYNC term moves only the generation
# shard over the unit's link: Nereus's refresh DAG does that, NeMo-RL does not); (4)
# offload_after_refit copies the parameter buffers into the pinned host copy offload_to_cpu keeps from
# the first step (``param_data_cpu.copy_(..., non_blocking=True)``).
# The planner's own plans keep training state resident (planner.memory), so (1) and (4) are NeMo-RL's
# plan, not the planner's: the rows price NeMo-RL's refit with the planner's classes (the set-up,
# ClusterSpec.refit_setup_s, as the planner's term has it) and report the planner's term beside it.
# Optimizer state: Megatron's precision-aware optimizer (use_precision_aware_optimizer: true) keeps fp32
# exp_avg and exp_avg_sq plus 16-bit master-weight remainders, 10 B/param, sharded over DP
# (use_distributed_optimizer): NeMo-RL issue 3976's Nsight triage moved 4.94 GB for Qwen2.5-0.5B's
# 0.494B parameters on one GPU. Rate of that copy: ~1.8 GB/s effective "Device -> Pageable" on H100 in
# the same triage (510 copies in offload_before_refit; pinned 55 GB/s on the same host); PyTorch PR
# 120378 measured 1.6 GB/s for 150 x 50 MB tensors GPU -> fresh CPU memory on an H100 PCIe 5 host.
PAGEABLE_D2H_BYTES_PER_S = 1.8e9
PRECISION_AWARE_OPT_BYTES_PER_PARAM = 10


def _nemo_offload(model: Any, train: Layout, train_dp: int, eff: Eff) -> tuple[float, float]:
    """(optimizer state to pageable host memory, parameters to pinned host memory) seconds of NeMo-RL's
    colocated refit on the fullest training GPU: the part of its refit the planner's plans never run."""
    n = params_per_gpu(model, Head.LM, train)
    optimizer = n * PRECISION_AWARE_OPT_BYTES_PER_PARAM / train_dp / PAGEABLE_D2H_BYTES_PER_S
    params = OpTerm(op_class=OpClass.HOST_COPY, work=float(n * model.bytes_per_param),
                    peak_per_s=H100.host_bytes_per_s).seconds(eff)
    return optimizer, params


def _nemo_gather(model: Any, train: Layout, cl: Any, eff: Eff) -> float:
    """Seconds of gather_params on one training GPU: TP all-gathers of its own stage's tensors (NVLink),
    then a PP broadcast of every other stage's full tensors over the PP group's slowest link (the NICs
    when the TP x PP group spans nodes), one broadcast per tensor."""
    stage = params_per_gpu(model, Head.LM, Layout(1, train.pp)) * model.bytes_per_param
    full = model.num_params() * model.bytes_per_param
    intra = train.size <= cl.gpus_per_node
    pp_link = cl.intra_node_link if intra else cl.inter_node_link
    terms = [OpTerm(op_class=OpClass.TP_ALLREDUCE_INTRA, work=stage * (train.tp - 1) / train.tp,
                    peak_per_s=cl.intra_node_link.bytes_per_s),
             OpTerm(op_class=OpClass.PP_SEND_INTRA if intra else OpClass.PP_SEND_INTER, work=float(full - stage),
                    peak_per_s=pp_link.bytes_per_s, messages=float(len(model.tensors(Head.LM))),
                    latency_s=pp_link.latency_s)]
    return sum(t.seconds(eff) for t in terms) if train.pp > 1 or train.tp > 1 else 0.0


def _packed(mb_tokens: int, seq_tokens: int, samples: int) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches) of sequence packing: bins of ``mb_tokens`` filled with
    mean-length sequences (varlen attention stays per sequence, which b x s^2 already prices)."""
    b = max(1, mb_tokens // seq_tokens)
    return b, -(-samples // b)


def _nemo_rl(model: Any, gpus: int, mean_gen: int, prompt: int, gen_tp: int, train: Layout, recompute: bool,
             logprob_b: int, eff: Eff) -> dict[str, float]:
    """Predicted step and phases (generation, refit, log-probs, training) of a NeMo-RL GRPO step."""
    # lengths: capped at 4,096 in all; spread assumed exponential-like (std = mean), not published
    w = Workload(prompts_per_step=2048, prompt_tokens=prompt, response_tokens=mean_gen,
                 max_response_tokens=4096 - prompt, response_tokens_std=float(mean_gen), train_mini_batches_per_step=4)
    job = same_model_job(grpo(learned_reward=False), model, w)  # math: rule-based reward
    # NeMo-RL's pinned engine (vllm 0.9.0 at v0.3.0, 0.10.0 at v0.4.0; pyproject.toml at those tags)
    # schedules each decode step in series with the GPU: planner.hardware.GPU_DECODE_STEP_OVERHEAD_S
    cl = dataclasses.replace(cluster_preset("h100", gpus), decode_step_overhead_s=GPU_DECODE_STEP_OVERHEAD_S)
    gen_dp, train_dp = gpus // gen_tp, gpus // train.size
    seq = w.tokens_per_sequence
    lp_b, lp_m = _packed(PACK_TOKENS * logprob_b, seq, 2048 // train_dp)
    tr_b, tr_m = _packed(PACK_TOKENS, seq, 512 // train_dp)
    plan = GlobalPlan(version=1, stages=(
        StagePlan(model_stage="actor-gen", layout=Layout(gen_tp, 1), gpu_sets=_units(gpus, gen_tp),
                  micro_batch_size=2048 // gen_dp),  # every sequence of a replica in flight (continuous batching)
        StagePlan(model_stage="ref-inf", layout=train, gpu_sets=_units(gpus, train.size),
                  micro_batch_size=lp_b, grad_accum=lp_m),
        StagePlan(model_stage="actor-train", layout=train, gpu_sets=_units(gpus, train.size),
                  micro_batch_size=tr_b, grad_accum=tr_m, recompute=recompute),
    ))
    p = predict(job, cl, plan, eff)
    gpn = cl.gpus_per_node
    links = Links(tp_intra=True, pp_intra=train.size <= gpn, dp_intra=gpus <= gpn)
    update = stage_cost(model, TRAIN_ONLY, train, w, micro_batch_size=tr_b, grad_accum=tr_m,
                        recompute=recompute, dp=train_dp, cluster=cl, links=links, eff=eff).seconds
    weight_sync = sum(t.seconds(eff) for t in p.terms["actor-gen"] if t.op_class is OpClass.WEIGHT_SYNC)
    optimizer_out, params_out = _nemo_offload(model, train, train_dp, eff)
    gather = _nemo_gather(model, train, cl, eff)
    # NeMo-RL's refit window (the measured step holds it, in place of the planner's WEIGHT_SYNC term)
    refit = cl.refit_setup_s + gather + optimizer_out + params_out
    return {"step": p.step_latency_s - weight_sync + refit,
            "generation": p.stage_seconds["actor-gen"] - weight_sync, "refit": refit,
            "planner_weight_sync": weight_sync, "gather_full_model": gather,
            "optimizer_offload_pageable": optimizer_out, "params_offload_pinned": params_out,
            "logprobs": p.stage_seconds["ref-inf"] + p.stage_seconds["actor-train"] - update, "training": update,
            "planner_peak_gb": p.max_peak_memory_bytes / 1e9}


def _phase(result: dict[str, float], name: str) -> tuple[float, dict[str, Any]]:
    return result[name], {k: round(v, 1) for k, v in result.items() if k != name}


def rl_llama8b(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _phase(_nemo_rl(LLAMA_31_8B, 16, 1060, LLAMA_PROMPT, 1, Layout(1, 2), True, 2, eff), "step")


def rl_qwen32b(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _phase(_nemo_rl(QWEN3_32B, 32, 3206, round(540 * 393 * 32 / 2048 - 3206), 4, Layout(4, 4), False, 4, eff),
                  "step")


# NeMo-RL issue 959 (the v0.3 blog's Llama-3.1-8B Instruct, Megatron, 1 node x 8 H100):
# step 112 s = policy training 28 + refit 5 + generation 58 + log-probs 18, 795 generated tokens on average
# (the issue's own rerun: 116 = 27 + 8 + 56 + 18). The blog's recipe at tag v0.3.0,
# examples/configs/grpo_math_8B_megatron.yaml on grpo_math_1B_megatron.yaml: TP 1, PP 2, train
# micro-batch 1, logprob batch 4, megatron_cfg.activation_checkpointing: false (the distributed
# optimizer, use_distributed_optimizer: true, is what makes 8B fit without recomputation), sequence
# packing on (train_mb_tokens 4,096), bf16 gradients (grad_reduce_in_fp32: false), overlapped grad
# reduce. So the update is priced WITHOUT recomputation: the planner itself would recompute (ZeRO-0
# does not fit 8B on 8 GPUs), but the row compares time, in the measured setting.
def _v03(eff: Eff) -> dict[str, float]:
    return _nemo_rl(LLAMA_31_8B, 8, 795, LLAMA_PROMPT, 1, Layout(1, 2), False, 4, eff)


def v03_step(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _phase(_v03(eff), "step")


def v03_generation(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _phase(_v03(eff), "generation")


def v03_training(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _phase(_v03(eff), "training")


def v03_logprobs(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _phase(_v03(eff), "logprobs")


def v03_refit(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _phase(_v03(eff), "refit")


# The same issue's Llama-3.1-70B row (blog figures; Megatron, 8 nodes x 8 H100): step 147 s = training 28 +
# refit 14 + generation 84 + log-probs 18, 398 generated tokens on average (the reporter's rerun: 178 =
# 31 + 26 + 87 + 20). Recipe at tag v0.3.0, examples/configs/grpo_math_70B_megatron.yaml on
# grpo_math_1B_megatron.yaml: Llama-3.3-70B-Instruct (the 3.1 architecture), TP 4, PP 4 (DP 4), train
# micro-batch 1, logprob batch 4, no activation checkpointing, sequence packing, generation TP 4 (DP 16),
# the same dataset and prompt (so the same prompt length as the 8B rows). Out of sample for both
# calibrations: another model size, 64 GPUs, a training group (TP x PP = 16) across two nodes.
def _v03_70b(eff: Eff) -> dict[str, float]:
    return _nemo_rl(LLAMA_33_70B, 64, 398, LLAMA_PROMPT, 4, Layout(4, 4), False, 4, eff)


def v03_70b_step(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _phase(_v03_70b(eff), "step")


def v03_70b_generation(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _phase(_v03_70b(eff), "generation")


def v03_70b_training(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _phase(_v03_70b(eff), "training")


def v03_70b_logprobs(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _phase(_v03_70b(eff), "logprobs")


def v03_70b_refit(eff: Eff) -> tuple[float, dict[str, Any]]:
    return _phase(_v03_70b(eff), "refit")
