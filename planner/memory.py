"""Per-GPU peak memory of a model-stage candidate and of a whole plan, term by term.

A GPU holds the *resident* state of every model-stage placed on it for the whole RL step (weights of
generation/inference model-stages; weights, gradients and mixed-precision Adam state of training ones,
ZeRO-0 inside a DP replica), and, while a model-stage runs, its *transient* memory (activations or KV
cache). Peak = all residents + the largest transient + workspace, plus 10% headroom.

Public figures the tests check: mixed-precision Adam = 16 bytes/param (bf16 weight 2 + bf16 grad 2 +
fp32 master, m, v 12); Llama-3.1-8B KV cache = 2 * 32 layers * 8 kv heads * 128 * 2 B = 128 KiB/token.
Activations follow Korthikanti et al. (2022) with flash attention (no s^2 term), sequence parallelism
(everything divided by TP) and, with recomputation, only each layer's input kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import lru_cache

import numpy as np

from planner.models import Head, ModelSpec, Parallel, TensorSpec
from planner.plan import GlobalPlan, Layout
from planner.workflow import JobSpec, ModelStage, StageKind, Workload

HEADROOM_FRACTION = 0.10  # share of the other terms added on top (allocator fragmentation, spikes)
WORKSPACE_BYTES = 2 * 1024**3  # CUDA context, cuBLAS/NCCL workspaces and buffers per GPU
BYTES_BF16 = 2
BYTES_FP32 = 4
# Adam with bf16 weights: fp32 master copy + first and second moment.
OPTIMIZER_BYTES_PER_PARAM = 3 * BYTES_FP32
TRAINING_BYTES_PER_PARAM = BYTES_BF16 + BYTES_BF16 + OPTIMIZER_BYTES_PER_PARAM  # 16


def training_bytes_per_param(model: ModelSpec) -> int:
    """Model state per parameter of a training replica: 16 with bf16 gradients, 18 with fp32 ones."""
    return model.bytes_per_param + model.grad_bytes_per_param + OPTIMIZER_BYTES_PER_PARAM


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Bytes on one GPU by term; ``total_bytes`` is the peak including headroom."""

    params_bytes: int = 0
    grads_bytes: int = 0
    optimizer_bytes: int = 0
    activations_bytes: int = 0
    kv_cache_bytes: int = 0
    co_resident_bytes: int = 0  # resident state of the other model-stages on this GPU
    workspace_bytes: int = 0
    headroom_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.kv_cache_bytes + self.co_resident_bytes + self.workspace_bytes + self.headroom_bytes)

    def as_dict(self) -> dict[str, int]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["total_bytes"] = self.total_bytes
        return out


@lru_cache(maxsize=1024)
def stage_layer_counts(num_layers: int, pp: int) -> tuple[int, ...]:
    """Decoder layers per PP stage: contiguous, the first ``num_layers % pp`` stages one longer
    (the same split as transitions.geometry.layer_stages)."""
    base, extra = divmod(num_layers, pp)
    return tuple(base + (1 if r < extra else 0) for r in range(pp))


@lru_cache(maxsize=256)
def _shardable_tensors(model: ModelSpec, head: Head) -> tuple[TensorSpec, ...]:
    """Decoder layer 0's tensors and the ones outside the layers: all shard_params needs (every layer
    is alike), listed once per model and head instead of once per TP degree."""
    return tuple(t for t in model.tensors(head) if t.layer is None or t.layer == 0)


@lru_cache(maxsize=4096)
def shard_params(model: ModelSpec, head: Head, tp: int) -> tuple[int, int, int]:
    """(params of one decoder layer, of the embedding, of final norm + head) held by one TP rank."""
    layer = embed = top = 0
    for t in _shardable_tensors(model, head):
        if t.parallel is Parallel.REPLICATED:
            n = t.numel
        else:
            # k/v with fewer heads than TP ranks are replicated in groups (GQA): each rank holds one head
            ways = tp if t.num_heads is None else min(tp, t.num_heads)
            n = -(-t.numel // ways)
        if t.layer == 0:
            layer += n
        elif t.layer is None and t.parallel is Parallel.VOCAB:
            embed += n
        elif t.layer is None:
            top += n
    return layer, embed, top


@lru_cache(maxsize=4096)
def params_per_gpu(model: ModelSpec, head: Head, layout: Layout) -> int:
    """Parameters on the most loaded GPU of a unit (worst PP rank, one TP rank)."""
    layer, embed, top = shard_params(model, head, layout.tp)
    counts = stage_layer_counts(model.num_layers, layout.pp)
    worst = 0
    for r, n in enumerate(counts):
        p = n * layer + (embed if r == 0 else 0) + (top if r == layout.pp - 1 else 0)
        if model.tie_word_embeddings and layout.pp > 1 and r == layout.pp - 1:
            p += embed
        worst = max(worst, p)
    return worst


def resident_bytes(model: ModelSpec, ms: ModelStage, layout: Layout) -> MemoryBreakdown:
    """State a model-stage keeps on each of its GPUs for the whole step (worst GPU of a unit)."""
    n = params_per_gpu(model, ms.role.head, layout)
    if ms.sleeps:  # its weights are on the GPU only while it runs (transient_parts counts them)
        return MemoryBreakdown()
    if ms.kind is StageKind.TRAINING:
        return MemoryBreakdown(params_bytes=n * model.bytes_per_param, grads_bytes=n * model.grad_bytes_per_param,
                               optimizer_bytes=n * OPTIMIZER_BYTES_PER_PARAM)
    return MemoryBreakdown(params_bytes=n * model.bytes_per_param)


@lru_cache(maxsize=4096)
def kv_bytes_per_token_per_gpu(model: ModelSpec, layout: Layout) -> int:
    """KV cache per token on one GPU: kv heads split by TP (replicated when TP > kv heads), layers by PP."""
    kv_heads = -(-model.num_kv_heads // min(layout.tp, model.num_kv_heads))
    layers = stage_layer_counts(model.num_layers, layout.pp)[0]
    return 2 * layers * kv_heads * model.head_dim * model.bytes_per_param


def _layer_activation_bytes_per_token(model: ModelSpec, tp: int) -> float:
    """Bytes kept for backward per token per decoder layer (bf16, flash attention, SP: all / tp).

    Attention: norm input, q/k/v input, q, k, v, attention output (= o_proj input), fp32 softmax
    statistics per head. MLP: norm input, gate/up input, gate and up outputs, activation output
    (= down_proj input). For a GPT with a 4h GELU MLP the same count gives 32h bytes, Korthikanti's
    34h less the dropout masks Llama does not have.
    """
    h, f = model.hidden_size, model.ffn_hidden_size
    q, kv = model.num_attention_heads * model.head_dim, model.num_kv_heads * model.head_dim
    attn = BYTES_BF16 * (2 * h + 2 * q + 2 * kv) + BYTES_FP32 * model.num_attention_heads
    mlp = BYTES_BF16 * (2 * h + 3 * f)
    return (attn + mlp) / tp


def transient_bytes(model: ModelSpec, ms: ModelStage, layout: Layout, workload: Workload,
                    micro_batch_size: int, grad_accum: int, recompute: bool) -> MemoryBreakdown:
    """Memory a model-stage needs only while it runs (worst GPU of a unit)."""
    kv, act, woken = transient_parts(model, ms, layout, workload, micro_batch_size, grad_accum, recompute)
    return MemoryBreakdown(params_bytes=woken, kv_cache_bytes=kv, activations_bytes=act)


def transient_parts(model: ModelSpec, ms: ModelStage, layout: Layout, workload: Workload,
                    micro_batch_size: int, grad_accum: int, recompute: bool) -> tuple[int, int, int]:
    """(KV-cache bytes, activation bytes, woken weight bytes) of :func:`transient_bytes`, without building
    the breakdown (the option tables evaluate it thousands of times per replan). Woken weights: a
    sleeping model-stage's weights, on the GPU only while it runs."""
    woken = params_per_gpu(model, ms.role.head, layout) * model.bytes_per_param if ms.sleeps else 0
    kv, act = _transient_kv_act(model, ms, layout, workload, micro_batch_size, grad_accum, recompute)
    return kv, act, woken


def _transient_kv_act(model: ModelSpec, ms: ModelStage, layout: Layout, workload: Workload,
                      micro_batch_size: int, grad_accum: int, recompute: bool) -> tuple[int, int]:
    tp, pp = layout.tp, layout.pp
    layers = stage_layer_counts(model.num_layers, pp)[0]
    b = micro_batch_size
    if ms.kind is StageKind.GENERATION:
        # paged KV (vLLM's PagedAttention): blocks are taken as tokens are generated, so a budget for b
        # concurrent sequences holds b sequences at prompt + mean response, plus the one that runs on to
        # the longest response (no reservation at the maximum length for every sequence)
        tokens = b * workload.tokens_per_sequence + workload.tail_response_tokens
        kv = tokens * kv_bytes_per_token_per_gpu(model, layout)
        # logits of the batch being sampled (fp32) and one layer's prefill activations of one sequence
        logits = b * model.vocab_size // tp * BYTES_FP32
        prefill = int(workload.prompt_tokens * _layer_activation_bytes_per_token(model, tp))
        return kv, logits + prefill
    s = workload.max_tokens_per_sequence
    per_layer = b * s * _layer_activation_bytes_per_token(model, tp)
    # log-probs / loss over the vocabulary: bf16 logits plus an fp32 copy for the softmax
    logits = b * s * (model.vocab_size // tp) * (BYTES_BF16 + BYTES_FP32) if ms.role.head is Head.LM else 0
    if ms.kind is StageKind.INFERENCE:
        return 0, int(per_layer + logits)
    # 1F1B: the first PP stage keeps min(pp, micro-batches) micro-batches in flight
    in_flight = min(pp, grad_accum)
    if recompute:
        kept = in_flight * layers * b * s * model.hidden_size * BYTES_BF16 / tp
        act = kept + per_layer  # one layer rematerialised at a time
    else:
        act = in_flight * layers * per_layer
    return 0, int(act + logits)


def with_headroom(m: MemoryBreakdown, workspace_bytes: int = WORKSPACE_BYTES) -> MemoryBreakdown:
    """Add the workspace and 10% headroom on top of the state terms."""
    base = m.total_bytes - m.workspace_bytes - m.headroom_bytes + workspace_bytes
    return MemoryBreakdown(
        params_bytes=m.params_bytes, grads_bytes=m.grads_bytes, optimizer_bytes=m.optimizer_bytes,
        activations_bytes=m.activations_bytes, kv_cache_bytes=m.kv_cache_bytes,
        co_resident_bytes=m.co_resident_bytes, workspace_bytes=workspace_bytes,
        headroom_bytes=int(base * HEADROOM_FRACTION))


def combine(resident: MemoryBreakdown, transient: MemoryBreakdown, co_resident_bytes: int) -> MemoryBreakdown:
    """A running model-stage's own terms plus the other model-stages' resident state, with headroom."""
    return with_headroom(MemoryBreakdown(
        params_bytes=resident.params_bytes + transient.params_bytes, grads_bytes=resident.grads_bytes,
        optimizer_bytes=resident.optimizer_bytes, activations_bytes=transient.activations_bytes,
        kv_cache_bytes=transient.kv_cache_bytes, co_resident_bytes=co_resident_bytes))


def peak_total(resident_sum: int, transient_max: int) -> int:
    """Peak with workspace and headroom, from the sums the search works with."""
    return int((resident_sum + transient_max + WORKSPACE_BYTES) * (1 + HEADROOM_FRACTION))


def plan_memory(job: JobSpec, plan: GlobalPlan, gpu_arrays: Mapping[str, np.ndarray] | None = None
                ) -> tuple[dict[int, int], dict[str, MemoryBreakdown]]:
    """(GPU -> peak bytes, model-stage -> breakdown on its fullest GPU while it runs); ``gpu_arrays``:
    each model-stage's GPU ids as an array, if the caller has them already.

    Every model-stage placed on a GPU keeps its resident state there all step long; a GPU peaks while
    the model-stage with the largest transient memory on it runs. GPUs are handled as arrays, and
    each distinct co-resident amount of a model-stage is combined once (a 1,024-GPU plan has few).
    """
    workload = job.workload
    stages = list(plan)
    if not stages:
        return {}, {}
    res: dict[str, MemoryBreakdown] = {}
    trans: dict[str, MemoryBreakdown] = {}
    gpus: dict[str, np.ndarray] = {}
    for sp in stages:
        ms = job.workflow.stage(sp.model_stage)
        model = job.model_of(ms)
        res[sp.model_stage] = resident_bytes(model, ms, sp.layout)
        trans[sp.model_stage] = transient_bytes(model, ms, sp.layout, workload, sp.micro_batch_size,
                                                sp.grad_accum, sp.recompute)
        gpus[sp.model_stage] = (np.asarray(sp.gpu_sets, dtype=np.int64).ravel() if gpu_arrays is None
                                else gpu_arrays[sp.model_stage])
    # dense arrays over the id range (ids are small integers); a stage's own GPUs are distinct, so plain
    # fancy indexing accumulates correctly
    lo = min(int(g.min()) for g in gpus.values())
    gpus = {k: g - lo for k, g in gpus.items()}
    size = 1 + max(int(g.max()) for g in gpus.values())
    resident_on = np.zeros(size, dtype=np.int64)
    present = np.zeros(size, dtype=bool)
    for sp in stages:
        resident_on[gpus[sp.model_stage]] += res[sp.model_stage].total_bytes
        present[gpus[sp.model_stage]] = True
    peak = np.zeros(size, dtype=np.int64)
    per_stage: dict[str, MemoryBreakdown] = {}
    for sp in stages:
        own = res[sp.model_stage]
        on = gpus[sp.model_stage]
        co, inverse = np.unique(resident_on[on] - own.total_bytes, return_inverse=True)
        by_co = [combine(own, trans[sp.model_stage], int(c)) for c in co.tolist()]
        totals = np.array([m.total_bytes for m in by_co], dtype=np.int64)
        peak[on] = np.maximum(peak[on], totals[inverse.ravel()])
        per_stage[sp.model_stage] = by_co[int(np.argmax(totals))]
    ids = np.flatnonzero(present)
    return dict(zip((ids + lo).tolist(), peak[ids].tolist())), per_stage
