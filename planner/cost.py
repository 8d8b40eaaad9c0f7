"""Cost model of one model-stage: work by operation class, and time = work / (peak x efficiency).

Work comes from operator shapes and the TP/PP sharding rules (ModelSpec.tensors): FLOPs for GEMMs and
attention prefill, bytes for memory-bound operators (decode weight reads, KV reads, optimizer update)
and for collectives (ring all-reduce moves 2(n-1)/n of the buffer per GPU). Each operation class has ONE
efficiency, learned by planner.calibration and reused across models; unseen classes use conservative
priors. A micro-batch's terms are repeated (m + p - 1) times under 1F1B, so the pipeline bubble is
(p-1)/(m+p-1) of the pipelined time; training adds the DP gradient all-reduce and the optimizer step
once per mini-batch.

Where the device runs operators eagerly from the host (the CPU preset: one gloo worker per core, no
kernel queue to hide behind), every operator also costs a fixed dispatch time that no FLOP or byte
count sees: the launch classes, whose work is the number of operator launches (planner.eager: per
layer per pass, per decode step's sampling, per parameter tensor of the optimizer step, and the host
work of distributed calls, DTensor linears, gloo collectives, pipeline schedule steps, in launch
units) at the device's launch rate, one class per path that issues them (forward passes, the decode
loop, autograd's backward with the optimizer step: their per-launch costs differ by 2-3x on CPU). For
a small model they are most of the time, and they scale with micro-batches and decode steps, not with
FLOPs. GPU presets launch asynchronously (CUDA graphs in decode), so they have no launch terms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from planner.eager import (
    COLLECTIVE_LAUNCHES,
    LAUNCHES_PER_SAMPLE,
    decode_step_collectives,
    distributed_pass_launches,
    launch_overhead_s,
    optimizer_launches,
    pass_launches,
)
from planner.hardware import ClusterSpec, LinkSpec
from planner.memory import (
    BYTES_BF16,
    kv_bytes_per_token_per_gpu,
    params_per_gpu,
    shard_params,
    stage_layer_counts,
    training_bytes_per_param,
)
from planner.models import ModelSpec
from planner.op_classes import PRIOR_EFFICIENCY as PRIOR_EFFICIENCY  # re-exported: callers import them here
from planner.op_classes import PRIORS as PRIORS
from planner.op_classes import TIME_CLASSES as TIME_CLASSES
from planner.op_classes import Efficiencies as Efficiencies
from planner.op_classes import OpClass
from planner.plan import Layout
from planner.workflow import ModelStage, Role, StageKind, Workload

# Inference engines spend CPU time per decode step on scheduling, sampling and output processing,
# growing with the batch: vLLM's multi-step scheduling RFC (vllm-project/vllm issue 6854) measured
# ~4 ms of GPU bubble per decode step at large batch (5-13 ms in the worst traces), and issue 6913
# 3.4 ms of output processing per step at batch 32 (Llama-3-70B, 4 H100). Per live sequence: 4 ms over
# 256 sequences ~ 15 us; at concurrency 1 it vanishes (0.015 ms).
DECODE_SEQUENCE_OVERHEAD_S = 15e-6

# GEMM efficiency falls with the per-GPU shape: see planner.hardware.GEMM_HALF_TOKENS (per device).

# Megatron-core DDP (--overlap-grad-reduce) all-reduces gradient buckets while the last micro-batch's
# backward still runs; only what the backward cannot hide stays exposed, and never less than the
# last bucket. Bucket size: DistributedDataParallelConfig.bucket_size default, 40M parameters.
DP_BUCKET_PARAMS = 40_000_000
DP_OVERLAP = 1.0  # share of the last backward the all-reduce can hide behind

# Weight refit train -> generation: its set-up (communicators / IPC handles, format conversion, the
# engine's weight reload) is ClusterSpec.refit_setup_s, a framework figure like the step overhead:
# planner.hardware.GPU_REFIT_SETUP_S on GPU systems, 0 on the CPU development system.


@dataclass(frozen=True, kw_only=True, slots=True)
class OpTerm:
    """Work of one operation class on one GPU; ``repeat`` counts micro-batches (bubble included)."""

    op_class: OpClass
    work: float  # FLOPs or bytes, per repetition
    peak_per_s: float  # FLOP/s of the device, or bytes/s of HBM or the link
    messages: float = 0.0  # latency-bound hops per repetition
    latency_s: float = 0.0
    repeat: float = 1.0

    def seconds(self, eff: Mapping[OpClass, float]) -> float:
        return self.repeat * (self.work / (self.peak_per_s * eff[self.op_class]) + self.messages * self.latency_s)

    def scaled(self, repeat: float) -> OpTerm:
        return OpTerm(op_class=self.op_class, work=self.work, peak_per_s=self.peak_per_s,
                      messages=self.messages, latency_s=self.latency_s, repeat=repeat)


@dataclass(frozen=True, kw_only=True, slots=True)
class Links:
    """Whether each group of a replica stays inside one node (intra-node link) or not."""

    tp_intra: bool = True
    pp_intra: bool = True
    dp_intra: bool = True


def _ring(n: int) -> float:
    return 2 * (n - 1) / n


def _hops(n: int) -> float:
    # latency of a small all-reduce: a tree/recursive-doubling schedule, 2 log2(n) hops
    return 2 * math.ceil(math.log2(n)) if n > 1 else 0.0


def _matmul_params(model: ModelSpec, ms: ModelStage, layout: Layout) -> int:
    """Parameters a GEMM touches on the slowest PP rank (the embedding is a gather, not a GEMM)."""
    layer, _embed, top = shard_params(model, ms.role.head, layout.tp)
    counts = stage_layer_counts(model.num_layers, layout.pp)
    return max(counts[0] * layer + (top if layout.pp == 1 else 0), counts[-1] * layer + top)


def gemm_peak(cluster: ClusterSpec, model: ModelSpec, layout: Layout, tokens: float) -> float:
    """Attainable GEMM FLOP/s for ``tokens`` rows per GPU (DeviceSpec.gemm_half_tokens): FLOPs stay FLOPs,
    the shape lowers the peak they run at, from the device's matmul ceiling (DeviceSpec.matmul_ceiling)."""
    dev = cluster.device
    width = model.hidden_size / layout.tp
    return dev.peak_flops_bf16 * dev.matmul_ceiling / ((1.0 + dev.gemm_half_tokens / tokens)
                                                      * (1.0 + dev.gemm_half_width / width))


# (op class, work, peak per s, messages, latency s) of one term: what OpTerm holds, without building one
# (the option tables evaluate thousands of terms per replan).
RawTerm = tuple[OpClass, float, float, float, float]


def raw_seconds(t: RawTerm, eff: Mapping[OpClass, float]) -> float:
    """OpTerm.seconds of a raw term (repeat 1)."""
    return t[1] / (t[2] * eff[t[0]]) + t[3] * t[4]


def microbatch_terms(model: ModelSpec, ms: ModelStage, layout: Layout, workload: Workload,
                     micro_batch_size: int, recompute: bool, cluster: ClusterSpec,
                     links: Links) -> tuple[OpTerm, ...]:
    """Work of one micro-batch (generation: one wave of concurrent sequences) on the slowest GPU."""
    return tuple(OpTerm(op_class=c, work=w, peak_per_s=p, messages=m, latency_s=lat) for c, w, p, m, lat in
                 microbatch_raw(model, ms, layout, workload, micro_batch_size, recompute, cluster, links))


def _links_of(cluster: ClusterSpec, links: Links) -> tuple[LinkSpec, LinkSpec, OpClass, OpClass]:
    tp_link = cluster.intra_node_link if links.tp_intra else cluster.inter_node_link
    pp_link = cluster.intra_node_link if links.pp_intra else cluster.inter_node_link
    tp_cls = OpClass.TP_ALLREDUCE_INTRA if links.tp_intra else OpClass.TP_ALLREDUCE_INTER
    pp_cls = OpClass.PP_SEND_INTRA if links.pp_intra else OpClass.PP_SEND_INTER
    return tp_link, pp_link, tp_cls, pp_cls


def microbatch_raw(model: ModelSpec, ms: ModelStage, layout: Layout, workload: Workload,
                   micro_batch_size: int, recompute: bool, cluster: ClusterSpec,
                   links: Links) -> list[RawTerm]:
    """:func:`microbatch_terms` as raw tuples, in the same order.

    Generation: a wave of b concurrent sequences (continuous batching: b is the concurrency) that
    prefills its prompts (compute bound, its own GEMM term) and decodes the mean response length;
    each decode step reads the weights once and the KV cache of every live sequence, so time per
    output token rises with concurrency. The first two terms are the decode roofline pair (GEMM,
    weight read). Training: forward + backward (x2) (+ a recomputed forward), plus the old-log-prob
    forward of PPO/GRPO actors (ModelStage.old_logprob_pass)."""
    tp, pp, b = layout.tp, layout.pp, micro_batch_size
    dev = cluster.device
    tp_link, pp_link, tp_cls, pp_cls = _links_of(cluster, links)
    w = _matmul_params(model, ms, layout)
    layers = stage_layer_counts(model.num_layers, pp)[0]
    h = model.hidden_size
    q_dim_per_gpu = model.num_attention_heads // tp * model.head_dim
    act = BYTES_BF16 * h  # bytes of one token's hidden state

    def attention_flops(tokens_per_seq: int) -> float:
        # QK^T and AV over a causal mask: 2 GEMMs * 2 FLOPs * s^2/2 * q_dim, per layer
        return 2.0 * b * tokens_per_seq**2 * q_dim_per_gpu * layers

    def tp_allreduces(count: float, tokens: float) -> RawTerm:
        return (tp_cls, count * tokens * act * _ring(tp), tp_link.bytes_per_s, count * _hops(tp),
                tp_link.latency_s)

    def pp_sends(count: float, tokens_total: float) -> RawTerm:
        return (pp_cls, tokens_total * act, pp_link.bytes_per_s, count, pp_link.latency_s)

    terms: list[RawTerm] = []
    if ms.kind is StageKind.GENERATION:
        p, r = workload.prompt_tokens, workload.response_tokens
        decode_flops = 2.0 * w * b * r
        decode_bytes = float(w * model.bytes_per_param * r)
        # roofline pair: the search keeps both; stage_cost takes the larger of the two
        # decode GEMMs at the plain peak: their small-M regime is the weight read the roofline keeps
        terms.append((OpClass.GEMM, decode_flops, dev.peak_flops_bf16 * dev.matmul_ceiling, 0.0, 0.0))
        terms.append((OpClass.MEMORY_BOUND, decode_bytes, dev.hbm_bytes_per_s, 0.0, 0.0))
        terms.append((OpClass.GEMM, 2.0 * w * b * p, gemm_peak(cluster, model, layout, b * p), 0.0, 0.0))
        terms.append((OpClass.ATTENTION_PREFILL, attention_flops(p), dev.peak_flops_bf16, 0.0, 0.0))
        # KV read: every decode step reads each live sequence's context, sum over a response of
        # length n is p*n + n^2/2, and E[n^2] = mean^2 + std^2 (long responses read more)
        kv_tokens = p * r + workload.response_tokens_second_moment / 2
        terms.append((OpClass.ATTENTION_DECODE, float(b * kv_tokens * kv_bytes_per_token_per_gpu(model, layout)),
                      dev.hbm_bytes_per_s, 0.0, 0.0))
        # the engine's CPU time per decode step: per live sequence, and per step (ClusterSpec)
        terms.append((OpClass.DECODE_OVERHEAD, r * (b * DECODE_SEQUENCE_OVERHEAD_S + cluster.decode_step_overhead_s),
                      1.0, 0.0, 0.0))
        if tp > 1:
            terms.append(tp_allreduces(2 * layers, b * p))
            terms.append(tp_allreduces(2 * layers * r, b))
        if pp > 1:
            terms.append(pp_sends(1 + r, b * (p + r)))  # the prompt once, then one token per step
        # r forward passes (the prefill's yields the first token), each followed by sampling
        terms += _decode_launches(cluster, layout, layers, float(r))
        return terms
    s = workload.tokens_per_sequence
    # forward-pass equivalents: fwd + bwd (2x) (+ recomputed fwd) (+ the old-log-prob fwd)
    extra = 1 if ms.old_logprob_pass else 0
    passes = 1 if ms.kind is StageKind.INFERENCE else (4 if recompute else 3) + extra
    terms.append((OpClass.GEMM, passes * 2.0 * w * b * s, gemm_peak(cluster, model, layout, b * s), 0.0, 0.0))
    terms.append((OpClass.ATTENTION_PREFILL, passes * attention_flops(s), dev.peak_flops_bf16, 0.0, 0.0))
    if tp > 1:
        count = 2 if ms.kind is StageKind.INFERENCE else 2 * ((3 if recompute else 2) + extra)
        terms.append(tp_allreduces(count * layers, b * s))
    if pp > 1:
        n_sends = 1 if ms.kind is StageKind.INFERENCE else 2 + extra  # activations fwd, gradients bwd
        terms.append(pp_sends(n_sends, n_sends * b * s))
    forward = 1 if passes == 1 else passes - 2  # training: fwd (+ refwd); backward launches ~2x the forward's
    # distributed calls (DTensor dispatch, collectives, schedule steps) are Python host work in either
    # direction: the backward's count as two more forward passes'
    if launch_overhead_s(cluster) > 0:  # GPU presets hide launches: nothing to count
        dist = (forward + (2 if passes > 1 else 0)) * distributed_pass_launches(layout, layers)
        terms += _launch(cluster, OpClass.LAUNCH_FORWARD, forward * pass_launches(layers))
        if dist > 0:
            terms += _launch(cluster, OpClass.LAUNCH_DISTRIBUTED, dist)
    if passes > 1:
        terms += _launch(cluster, OpClass.LAUNCH_BACKWARD, 2 * pass_launches(layers))
    return terms


def _decode_launches(cluster: ClusterSpec, layout: Layout, layers: int, steps: float) -> list[RawTerm]:
    """Launches of ``steps`` decode steps on one rank: the pass and its sampling in the decode loop's
    class; the distributed calls' host work (DTensor dispatch, collectives, schedule steps, the logits
    broadcast) in their own class, whose unit is one plain dispatched op as bench/cpu_call_costs.py
    counts them (the decode class's unit also carries the loop's own Python per step)."""
    if launch_overhead_s(cluster) <= 0:
        return []
    dist = distributed_pass_launches(layout, layers) + decode_step_collectives(layout) * COLLECTIVE_LAUNCHES
    terms = _launch(cluster, OpClass.LAUNCH_DECODE, steps * (pass_launches(layers) + LAUNCHES_PER_SAMPLE))
    return terms + (_launch(cluster, OpClass.LAUNCH_DISTRIBUTED, steps * dist) if dist > 0 else [])


def _launch(cluster: ClusterSpec, cls: OpClass, launches: float) -> list[RawTerm]:
    """The launch term of ``launches`` operator launches; none on a device that hides them."""
    overhead = launch_overhead_s(cluster)
    return [(cls, launches, 1.0 / overhead, 0.0, 0.0)] if overhead > 0 else []


def backward_seconds(model: ModelSpec, ms: ModelStage, layout: Layout, workload: Workload,
                     micro_batch_size: int, recompute: bool, cluster: ClusterSpec,
                     eff: Mapping[OpClass, float]) -> float:
    """Compute seconds of one micro-batch's backward (2 forward-equivalents, 3 with recomputation):
    what the DP gradient all-reduce can hide behind. Affine in the micro-batch size."""
    if ms.kind is not StageKind.TRAINING:
        return 0.0
    b, s = micro_batch_size, workload.tokens_per_sequence
    w = _matmul_params(model, ms, layout)
    layers = stage_layer_counts(model.num_layers, layout.pp)[0]
    q_dim = model.num_attention_heads // layout.tp * model.head_dim
    passes = 3 if recompute else 2
    gemm = passes * 2.0 * w * b * s / (gemm_peak(cluster, model, layout, b * s) * eff[OpClass.GEMM])
    attn = passes * 2.0 * b * s**2 * q_dim * layers / (cluster.device.peak_flops_bf16 * eff[OpClass.ATTENTION_PREFILL])
    return gemm + attn


def fixed_raw(model: ModelSpec, ms: ModelStage, layout: Layout, workload: Workload, cluster: ClusterSpec,
              links: Links) -> list[RawTerm]:
    """Once per RL step per replica, whatever the batch split: the generation tail, the weight refit, and
    a sleeping model-stage's two host copies of its weights.

    Tail: under continuous batching a replica's last sequences decode alone; the longest response
    runs ``tail_response_tokens`` steps past the mean at concurrency ~1, each step reading the
    weights (and the tail sequence's KV, TP all-reduce latencies, PP hops). Refit: a generation
    model-stage of the actor receives its weight shard from training every step (bf16 bytes per GPU
    over its unit's link, plus ClusterSpec.refit_setup_s)."""
    terms: list[RawTerm] = []
    if ms.sleeps:  # weights out to the host after running, back before the next step's run
        n = params_per_gpu(model, ms.role.head, layout)
        terms.append((OpClass.HOST_COPY, 2.0 * n * model.bytes_per_param, cluster.device.host_bytes_per_s, 0.0, 0.0))
    if ms.kind is not StageKind.GENERATION:
        return terms
    tp_link, pp_link, tp_cls, pp_cls = _links_of(cluster, links)
    w = _matmul_params(model, ms, layout)
    layers = stage_layer_counts(model.num_layers, layout.pp)[0]
    tail = workload.tail_response_tokens
    if tail > 0:
        dev = cluster.device
        terms.append((OpClass.MEMORY_BOUND, float(w * model.bytes_per_param * tail), dev.hbm_bytes_per_s, 0.0, 0.0))
        ctx = workload.prompt_tokens + (workload.response_tokens + workload.max_tokens_per_sequence
                                        - workload.prompt_tokens) / 2
        terms.append((OpClass.ATTENTION_DECODE, float(ctx * tail * kv_bytes_per_token_per_gpu(model, layout)),
                      dev.hbm_bytes_per_s, 0.0, 0.0))
        terms.append((OpClass.DECODE_OVERHEAD, tail * (DECODE_SEQUENCE_OVERHEAD_S + cluster.decode_step_overhead_s),
                      1.0, 0.0, 0.0))
        if layout.tp > 1:
            terms.append((tp_cls, 2 * layers * tail * BYTES_BF16 * model.hidden_size * _ring(layout.tp),
                          tp_link.bytes_per_s, 2 * layers * tail * _hops(layout.tp), tp_link.latency_s))
        if layout.pp > 1:
            terms.append((pp_cls, float(tail * BYTES_BF16 * model.hidden_size), pp_link.bytes_per_s,
                          float(tail * (layout.pp - 1)), pp_link.latency_s))
        # each tail step is a decode forward with its sampling (eager devices launch every operator)
        terms += _decode_launches(cluster, layout, layers, float(tail))
    if ms.role is Role.ACTOR:
        link = cluster.intra_node_link if links.tp_intra and links.pp_intra else cluster.inter_node_link
        n = params_per_gpu(model, ms.role.head, layout)
        terms.append((OpClass.WEIGHT_SYNC, float(n * model.bytes_per_param), link.bytes_per_s, 1.0,
                      cluster.refit_setup_s))
    return terms


def dp_exposed_fraction(all_reduce_s: float, backward_s: float, params_per_gpu_: int) -> float:
    """Share of the DP gradient all-reduce left exposed: what the last backward cannot hide, at least
    the last bucket (DP_BUCKET_PARAMS of the GPU's parameters)."""
    if all_reduce_s <= 0:
        return 0.0
    last_bucket = min(1.0, DP_BUCKET_PARAMS / max(params_per_gpu_, 1))
    return max(last_bucket, (all_reduce_s - DP_OVERLAP * backward_s) / all_reduce_s)


def sync_terms(model: ModelSpec, ms: ModelStage, layout: Layout, dp: int, cluster: ClusterSpec,
               links: Links) -> tuple[OpTerm, ...]:
    """Once per optimizer step of a training model-stage: DP gradient all-reduce and the Adam update."""
    return tuple(OpTerm(op_class=c, work=w, peak_per_s=p, messages=m, latency_s=lat)
                 for c, w, p, m, lat in sync_raw(model, ms, layout, dp, cluster, links))


def sync_raw(model: ModelSpec, ms: ModelStage, layout: Layout, dp: int, cluster: ClusterSpec,
             links: Links) -> list[RawTerm]:
    """:func:`sync_terms` as raw tuples, in the same order."""
    if ms.kind is not StageKind.TRAINING:
        return []
    n = params_per_gpu(model, ms.role.head, layout)
    terms: list[RawTerm] = [(OpClass.MEMORY_BOUND, 2.0 * n * training_bytes_per_param(model),
                             cluster.device.hbm_bytes_per_s, 0.0, 0.0)]
    if launch_overhead_s(cluster) > 0:  # counting tensors is not free: only where launches cost
        plain, dist = optimizer_launches(model, layout)
        terms += _launch(cluster, OpClass.LAUNCH_BACKWARD, plain)
        if dist > 0:
            terms += _launch(cluster, OpClass.LAUNCH_DISTRIBUTED, dist)
    if dp > 1:  # last: the option tables read the DP all-reduce as sync_raw(...)[-1]
        link = cluster.intra_node_link if links.dp_intra else cluster.inter_node_link
        cls = OpClass.DP_ALLREDUCE_INTRA if links.dp_intra else OpClass.DP_ALLREDUCE_INTER
        rails = 1 if links.dp_intra else dp_rails(cluster, layout)
        terms.append((cls, n * model.grad_bytes_per_param * _ring(dp), link.bytes_per_s * rails, _hops(dp),
                      link.latency_s))
    return terms


def dp_rails(cluster: ClusterSpec, layout: Layout) -> int:
    """NICs one DP group's all-reduce drives at once when it spans nodes: its members on one node
    (replicas packed node by node, as the search places them), each on its own NIC's share.

    NCCL splits a collective over several rings (channels), each leaving the node through a different
    NIC, so a group with m members per node moves its ring bytes over m NICs at once: bus bandwidth
    (nccl-tests doc/PERFORMANCE.md: ``busbw = S/t * 2(n-1)/n``, "should reflect the speed of the
    hardware bottleneck") is the node's NIC bandwidth, not one GPU's share, when every GPU of the node
    is in the group (DP-only layouts), and one GPU's share when only one is (a TP or PP group filling
    the node). Within a node the same group's NVLink part runs beside it and is faster."""
    return max(1, cluster.gpus_per_node // layout.size)


def roofline(terms: tuple[OpTerm, ...], eff: Mapping[OpClass, float]) -> tuple[OpTerm, ...]:
    """Decode GEMMs and weight reads overlap: keep whichever of GEMM / MEMORY_BOUND takes longer.

    Only generation terms carry both a GEMM and a MEMORY_BOUND term."""
    gemm = next((t for t in terms if t.op_class is OpClass.GEMM), None)
    mem = next((t for t in terms if t.op_class is OpClass.MEMORY_BOUND), None)
    if gemm is None or mem is None:
        return terms
    drop = mem if gemm.seconds(eff) >= mem.seconds(eff) else gemm
    return tuple(t for t in terms if t is not drop)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCost:
    """Time of one replica of a model-stage for one RL step, and the terms behind it."""

    seconds: float
    terms: tuple[OpTerm, ...]  # with their repeat counts (bubble included)
    bubble_s: float  # part of ``seconds`` spent in the pipeline bubble

    def by_class(self, eff: Mapping[OpClass, float]) -> dict[str, float]:
        """op class -> seconds without the bubble, plus ``pipeline_bubble``."""
        out: dict[str, float] = {}
        for t in self.terms:
            out[t.op_class.value] = out.get(t.op_class.value, 0.0) + t.seconds(eff)
        total = sum(out.values())
        if self.bubble_s > 0 and total > 0:
            scale = (total - self.bubble_s) / total
            out = {k: v * scale for k, v in out.items()}
            out["pipeline_bubble"] = self.bubble_s
        return out


def repeats(ms: ModelStage, layout: Layout, grad_accum: int, workload: Workload) -> tuple[float, float]:
    """(micro-batch repetitions including the bubble, optimizer steps) per RL step."""
    mini = workload.train_mini_batches_per_step if ms.kind is StageKind.TRAINING else 1
    return float((grad_accum + layout.pp - 1) * mini), float(mini)


def stage_cost(model: ModelSpec, ms: ModelStage, layout: Layout, workload: Workload, *,
               micro_batch_size: int, grad_accum: int, recompute: bool, dp: int, cluster: ClusterSpec,
               links: Links, eff: Mapping[OpClass, float]) -> StageCost:
    """One replica's seconds per RL step: (m + p - 1) micro-batches under 1F1B, plus per mini-batch the
    optimizer update and the exposed part of the DP all-reduce, plus once per step the fixed terms
    (generation tail, weight refit)."""
    mb = roofline(microbatch_terms(model, ms, layout, workload, micro_batch_size, recompute, cluster, links),
                  eff)
    rep, steps = repeats(ms, layout, grad_accum, workload)
    mb_s = sum(t.seconds(eff) for t in mb)
    sync = sync_terms(model, ms, layout, dp, cluster, links)
    if dp > 1 and sync:  # the all-reduce (last) overlaps the last micro-batch's backward: only what shows counts
        ar = sync[-1]
        bwd = backward_seconds(model, ms, layout, workload, micro_batch_size, recompute, cluster, eff)
        exposed = dp_exposed_fraction(ar.seconds(eff), bwd, params_per_gpu(model, ms.role.head, layout))
        sync = (*sync[:-1], ar.scaled(exposed))
    fixed = tuple(OpTerm(op_class=c, work=w, peak_per_s=p, messages=m, latency_s=lat)
                  for c, w, p, m, lat in fixed_raw(model, ms, layout, workload, cluster, links))
    terms = tuple(t.scaled(rep) for t in mb) + tuple(t.scaled(t.repeat * steps) for t in sync) + fixed
    seconds = sum(t.seconds(eff) for t in terms)
    bubble = mb_s * (layout.pp - 1) * steps
    return StageCost(seconds=seconds, terms=terms, bubble_s=bubble)
