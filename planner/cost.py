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
count sees: the launch classes, whose work is the number of operator launches (per layer per pass, per
decode step's sampling, per parameter tensor of the optimizer step) at the device's launch rate
(LAUNCH_OVERHEAD_S), one class per path that issues them (forward passes, the decode loop, autograd's
backward with the optimizer step: their per-launch costs differ by 2-3x on CPU). For a small model
they are most of the time, and they scale with micro-batches and decode steps, not with FLOPs: without
them one GEMM efficiency had to explain launch-bound decode, inference and training at once and missed
each by 30-60%. GPU presets launch asynchronously (CUDA graphs in decode), so they have no launch terms.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from planner.errors import SpecError
from planner.hardware import ClusterSpec
from planner.memory import (
    BYTES_BF16,
    TRAINING_BYTES_PER_PARAM,
    kv_bytes_per_token_per_gpu,
    params_per_gpu,
    shard_params,
    stage_layer_counts,
)
from planner.models import ModelSpec
from planner.plan import Layout
from planner.workflow import ModelStage, StageKind, Workload


class OpClass(str, Enum):
    GEMM = "gemm"  # FLOPs at the device's peak
    ATTENTION_PREFILL = "attention_prefill"  # FLOPs (flash attention over whole sequences)
    ATTENTION_DECODE = "attention_decode"  # KV-cache bytes read at HBM bandwidth
    MEMORY_BOUND = "memory_bound"  # weight bytes read per decode step, optimizer update, at HBM bandwidth
    TP_ALLREDUCE_INTRA = "tp_allreduce_intra"  # bytes per GPU over the intra-node link
    TP_ALLREDUCE_INTER = "tp_allreduce_inter"
    PP_SEND_INTRA = "pp_send_intra"
    PP_SEND_INTER = "pp_send_inter"
    DP_ALLREDUCE_INTRA = "dp_allreduce_intra"
    DP_ALLREDUCE_INTER = "dp_allreduce_inter"
    # operator launches at the device's launch rate (eager host dispatch), by the path that issues them:
    LAUNCH_FORWARD = "launch_forward"  # forward passes (inference, training's forward, recompute)
    LAUNCH_DECODE = "launch_decode"  # decode steps: a one-token forward plus sampling, from a Python loop
    LAUNCH_BACKWARD = "launch_backward"  # autograd's backward (its C++ engine) and the optimizer step


# Host time per operator launch that the device's own work does not hide, by device preset name:
# eager PyTorch on a CPU core: ~2 us per dispatched op at best (the prior efficiency, 0.2, makes it 10 us). GPU presets
# queue kernels asynchronously (and decode runs as CUDA graphs), so they have none.
LAUNCH_OVERHEAD_S: Mapping[str, float] = MappingProxyType({"cpu": 2e-6})
# Operator launches of the engine's decoder (agent/engine/model.py), counted once from its forward:
# per layer (2 RMSNorms, q/k/v/o, RoPE on q and k, GQA repeat, attention, SwiGLU, residuals), per
# forward pass outside the layers (embedding, positions, RoPE tables, mask, final norm, head, the
# stage's output function), per decode step's sampling (softmax, top-p sort/cumsum/search, masks), and
# per parameter tensor of an optimizer step (non-foreach AdamW, grad-norm clipping, zeroing, the DP
# bucket's copies). Backward launches about twice the forward's, like its FLOPs.
LAUNCHES_PER_LAYER = 48
LAUNCHES_PER_PASS = 30
LAUNCHES_PER_SAMPLE = 15
LAUNCHES_PER_PARAM_TENSOR = 16


# Conservative priors (below what well-tuned kernels reach), so an uncalibrated plan is not optimistic.
PRIOR_EFFICIENCY: Mapping[OpClass, float] = MappingProxyType({
    OpClass.GEMM: 0.45,
    OpClass.ATTENTION_PREFILL: 0.35,
    OpClass.ATTENTION_DECODE: 0.5,
    OpClass.MEMORY_BOUND: 0.6,
    OpClass.TP_ALLREDUCE_INTRA: 0.6,
    OpClass.TP_ALLREDUCE_INTER: 0.5,
    OpClass.PP_SEND_INTRA: 0.6,
    OpClass.PP_SEND_INTER: 0.5,
    OpClass.DP_ALLREDUCE_INTRA: 0.6,
    OpClass.DP_ALLREDUCE_INTER: 0.5,
    OpClass.LAUNCH_FORWARD: 0.2,
    OpClass.LAUNCH_DECODE: 0.2,
    OpClass.LAUNCH_BACKWARD: 0.2,
})


class Efficiencies(Mapping[OpClass, float]):
    """Immutable op class -> efficiency (0, 1.5]; classes never learned read as their prior."""

    __slots__ = ("_learned",)

    def __init__(self, learned: Mapping[OpClass, float] | None = None) -> None:
        values = dict(learned or {})
        for cls, e in values.items():
            if not isinstance(cls, OpClass):
                raise SpecError("efficiencies", f"unknown op class {cls!r}", ", ".join(c.value for c in OpClass))
            if not (math.isfinite(e) and 0 < e <= 1.5):
                raise SpecError(f"efficiencies.{cls.value}", f"must be in (0, 1.5], got {e}")
        self._learned: Mapping[OpClass, float] = MappingProxyType(values)

    def __getitem__(self, cls: OpClass) -> float:
        return self._learned.get(cls, PRIOR_EFFICIENCY[cls])

    def __iter__(self) -> Iterator[OpClass]:
        return iter(OpClass)

    def __len__(self) -> int:
        return len(OpClass)

    @property
    def learned(self) -> Mapping[OpClass, float]:
        return self._learned

    def updated(self, values: Mapping[OpClass, float]) -> Efficiencies:
        return Efficiencies({**self._learned, **values})

    def __repr__(self) -> str:
        return "Efficiencies(" + ", ".join(f"{c.value}={self[c]:.3g}" for c in OpClass) + ")"

    def __hash__(self) -> int:
        return hash(tuple(sorted((c.value, v) for c, v in self._learned.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Efficiencies) and dict(self._learned) == dict(other._learned)


PRIORS = Efficiencies()


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


def microbatch_raw(model: ModelSpec, ms: ModelStage, layout: Layout, workload: Workload,
                   micro_batch_size: int, recompute: bool, cluster: ClusterSpec,
                   links: Links) -> list[RawTerm]:
    """:func:`microbatch_terms` as raw tuples, in the same order."""
    tp, pp, b = layout.tp, layout.pp, micro_batch_size
    dev = cluster.device
    tp_link = cluster.intra_node_link if links.tp_intra else cluster.inter_node_link
    pp_link = cluster.intra_node_link if links.pp_intra else cluster.inter_node_link
    tp_cls = OpClass.TP_ALLREDUCE_INTRA if links.tp_intra else OpClass.TP_ALLREDUCE_INTER
    pp_cls = OpClass.PP_SEND_INTRA if links.pp_intra else OpClass.PP_SEND_INTER
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
        ctx = p + r / 2  # mean context length over the decode
        decode_flops = 2.0 * w * b * r
        decode_bytes = float(w * model.bytes_per_param * r)
        gemm = (OpClass.GEMM, 2.0 * w * b * p + decode_flops, dev.peak_flops_bf16, 0.0, 0.0)
        weights = (OpClass.MEMORY_BOUND, decode_bytes, dev.hbm_bytes_per_s, 0.0, 0.0)
        terms += [gemm, weights]  # roofline: the search keeps both; stage_cost takes the larger of the two
        terms.append((OpClass.ATTENTION_PREFILL, attention_flops(p), dev.peak_flops_bf16, 0.0, 0.0))
        terms.append((OpClass.ATTENTION_DECODE, float(b * ctx * kv_bytes_per_token_per_gpu(model, layout) * r),
                      dev.hbm_bytes_per_s, 0.0, 0.0))
        if tp > 1:
            terms.append(tp_allreduces(2 * layers, b * p))
            terms.append(tp_allreduces(2 * layers * r, b))
        if pp > 1:
            terms.append(pp_sends(1 + r, b * (p + r)))  # the prompt once, then one token per step
        # r forward passes (the prefill's yields the first token), each followed by sampling
        terms += _launch(cluster, OpClass.LAUNCH_DECODE, r * (_pass_launches(layers) + LAUNCHES_PER_SAMPLE))
        return terms
    s = workload.tokens_per_sequence
    passes = 1 if ms.kind is StageKind.INFERENCE else (4 if recompute else 3)  # fwd (+ bwd 2x, + refwd)
    terms.append((OpClass.GEMM, passes * 2.0 * w * b * s, dev.peak_flops_bf16, 0.0, 0.0))
    terms.append((OpClass.ATTENTION_PREFILL, passes * attention_flops(s), dev.peak_flops_bf16, 0.0, 0.0))
    if tp > 1:
        terms.append(tp_allreduces((2 if passes == 1 else 2 * (passes - 1)) * layers, b * s))
    if pp > 1:
        n_sends = 1 if passes == 1 else 2  # activations forward, gradients backward
        terms.append(pp_sends(n_sends, n_sends * b * s))
    forward = 1 if passes == 1 else passes - 2  # training: fwd (+ refwd); backward launches ~2x the forward's
    terms += _launch(cluster, OpClass.LAUNCH_FORWARD, forward * _pass_launches(layers))
    if passes > 1:
        terms += _launch(cluster, OpClass.LAUNCH_BACKWARD, 2 * _pass_launches(layers))
    return terms


def _pass_launches(layers: int) -> float:
    return float(layers * LAUNCHES_PER_LAYER + LAUNCHES_PER_PASS)


def _launch(cluster: ClusterSpec, cls: OpClass, launches: float) -> list[RawTerm]:
    """The launch term of ``launches`` operator launches; none on a device that hides them."""
    overhead = LAUNCH_OVERHEAD_S.get(cluster.device.name, 0.0)
    return [(cls, launches, 1.0 / overhead, 0.0, 0.0)] if overhead > 0 else []


def _param_tensors(model: ModelSpec, layout: Layout) -> int:
    """Parameter tensors on the most loaded PP rank: its layers' plus embedding, final norm and head."""
    per_layer = sum(1 for t in model.tensors() if t.layer == 0)
    return stage_layer_counts(model.num_layers, layout.pp)[0] * per_layer + 3


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
    terms: list[RawTerm] = [(OpClass.MEMORY_BOUND, 2.0 * n * TRAINING_BYTES_PER_PARAM,
                             cluster.device.hbm_bytes_per_s, 0.0, 0.0)]
    terms += _launch(cluster, OpClass.LAUNCH_BACKWARD, float(_param_tensors(model, layout) * LAUNCHES_PER_PARAM_TENSOR))
    if dp > 1:  # last: the option tables read the DP all-reduce as sync_raw(...)[-1]
        link = cluster.intra_node_link if links.dp_intra else cluster.inter_node_link
        cls = OpClass.DP_ALLREDUCE_INTRA if links.dp_intra else OpClass.DP_ALLREDUCE_INTER
        terms.append((cls, n * BYTES_BF16 * _ring(dp), link.bytes_per_s, _hops(dp), link.latency_s))
    return terms


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
    """One replica's seconds per RL step: (m + p - 1) micro-batches under 1F1B, plus sync per mini-batch."""
    mb = roofline(microbatch_terms(model, ms, layout, workload, micro_batch_size, recompute, cluster, links),
                  eff)
    rep, steps = repeats(ms, layout, grad_accum, workload)
    mb_s = sum(t.seconds(eff) for t in mb)
    terms = tuple(t.scaled(rep) for t in mb) + tuple(
        t.scaled(steps) for t in sync_terms(model, ms, layout, dp, cluster, links))
    seconds = sum(t.seconds(eff) for t in terms)
    bubble = mb_s * (layout.pp - 1) * steps
    return StageCost(seconds=seconds, terms=terms, bubble_s=bubble)
