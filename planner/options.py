"""Candidate layouts of one model-stage: enumeration, estimated cost and memory, frontier pruning.

A candidate is (TP, PP, DP, micro-batch, accumulation, recomputation) with its estimated seconds per
RL step, GPU count, resident bytes (kept all step) and transient bytes (while it runs), per GPU.
TP and PP are powers of two (ModelSpec.check_tp/check_pp), DP is any degree for which the model-stage's
batch splits into micro-batches (planner.plan.batch_splits), so the global batch never changes.
Seconds are affine in the micro-batch size for a fixed layout, so each layout is costed twice (b = 1, 2)
and every micro-batch size is read off the line; that keeps a 1,024-GPU replan in milliseconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from planner.cost import Links, OpClass, OpTerm, microbatch_terms, repeats, sync_terms
from planner.hardware import ClusterSpec
from planner.memory import resident_bytes, transient_bytes
from planner.models import ModelSpec
from planner.plan import Layout, batch_splits, power_of_two_upto
from planner.workflow import JobSpec, ModelStage, StageKind


@dataclass(frozen=True, kw_only=True, slots=True)
class StageOption:
    model_stage: str
    layout: Layout
    dp: int
    micro_batch_size: int
    grad_accum: int
    recompute: bool
    seconds: float  # estimated, one replica, per RL step
    resident_bytes: int  # per GPU, all step
    transient_bytes: int  # per GPU, while running

    @property
    def num_gpus(self) -> int:
        return self.dp * self.layout.size


@dataclass(frozen=True, kw_only=True, slots=True)
class OptionRules:
    """Which candidates to enumerate: the urgent path widens them step by step."""

    allow_recompute: bool = False
    allow_cross_node_tp: bool = False
    max_micro_batch: int | None = None


DEFAULT_RULES = OptionRules()


def batch_sequences(job: JobSpec, ms: ModelStage) -> int:
    """Sequences in the batch a model-stage splits over its replicas (a mini-batch for training)."""
    w = job.workload
    if ms.kind is StageKind.TRAINING:
        return w.sequences_per_mini_batch
    if ms.greedy:  # ReMax's greedy baseline: one rollout per prompt
        return w.prompts_per_step
    return w.sequences_per_step


def _affine(terms1: tuple[OpTerm, ...], terms2: tuple[OpTerm, ...],
            eff: Mapping[OpClass, float]) -> tuple[float, float, float, float]:
    """(gemm s/seq, weight-read s, other s/seq, other fixed s) of a micro-batch from b=1 and b=2 terms."""
    gemm_a = mem_c = other_a = other_c = 0.0
    for t1, t2 in zip(terms1, terms2):
        s1, s2 = t1.seconds(eff), t2.seconds(eff)
        if t1.op_class is OpClass.GEMM:
            gemm_a += s2 - s1
        elif t1.op_class is OpClass.MEMORY_BOUND:
            mem_c += s1
        else:
            other_a += s2 - s1
            other_c += 2 * s1 - s2
    return gemm_a, mem_c, other_a, other_c


def stage_options(job: JobSpec, ms: ModelStage, cluster: ClusterSpec, num_gpus: int,
                  eff: Mapping[OpClass, float], rules: OptionRules = DEFAULT_RULES) -> list[StageOption]:
    """Every candidate of one model-stage on ``num_gpus`` GPUs whose own footprint fits in memory."""
    from planner.memory import peak_total  # local: keeps the import list short

    model: ModelSpec = job.model_of(ms)
    workload = job.workload
    gpn = cluster.gpus_per_node
    capacity = cluster.device.memory_bytes
    sequences = batch_sequences(job, ms)
    max_tp = num_gpus if rules.allow_cross_node_tp else min(num_gpus, gpn)
    recompute_opts = (False, True) if rules.allow_recompute and ms.kind is StageKind.TRAINING else (False,)
    out: list[StageOption] = []
    for tp in power_of_two_upto(max_tp):
        if not model.valid_tp(tp):
            continue
        for pp in power_of_two_upto(min(model.num_layers, num_gpus // tp)):
            layout = Layout(tp, pp)
            size = layout.size
            resident = resident_bytes(model, ms, layout).total_bytes
            if peak_total(resident, 0) > capacity:
                continue
            links = Links(tp_intra=tp <= gpn, pp_intra=size <= gpn, dp_intra=True)
            for recompute in recompute_opts:
                t1 = microbatch_terms(model, ms, layout, workload, 1, recompute, cluster, links)
                t2 = microbatch_terms(model, ms, layout, workload, 2, recompute, cluster, links)
                gemm_a, mem_c, other_a, other_c = _affine(t1, t2, eff)
                for dp in range(1, num_gpus // size + 1):
                    splits = batch_splits(sequences, dp, rules.max_micro_batch)
                    if not splits:
                        continue
                    sync_links = Links(tp_intra=links.tp_intra, pp_intra=links.pp_intra,
                                       dp_intra=dp * size <= gpn)
                    rep1, steps = repeats(ms, layout, 1, workload)
                    sync_s = steps * sum(t.seconds(eff) for t in sync_terms(model, ms, layout, dp, cluster,
                                                                             sync_links))
                    for b, g in splits:
                        mb_s = max(gemm_a * b, mem_c) + other_a * b + other_c
                        trans = transient_bytes(model, ms, layout, workload, b, g, recompute).total_bytes
                        if peak_total(resident, trans) > capacity:
                            continue
                        seconds = mb_s * (rep1 + (g - 1) * steps) + sync_s
                        out.append(StageOption(model_stage=ms.name, layout=layout, dp=dp, micro_batch_size=b,
                                               grad_accum=g, recompute=recompute, seconds=seconds,
                                               resident_bytes=resident, transient_bytes=trans))
    return out


def frontier(options: list[StageOption]) -> list[StageOption]:
    """Drop dominated candidates: another is no slower, uses no more GPUs and no more memory of either kind.

    Dropping them loses no optimum (any plan using one stays feasible and no slower with its dominator)."""
    kept: list[StageOption] = []
    for o in sorted(options, key=lambda o: (o.seconds, o.num_gpus, o.resident_bytes, o.transient_bytes)):
        if any(k.num_gpus <= o.num_gpus and k.resident_bytes <= o.resident_bytes
               and k.transient_bytes <= o.transient_bytes for k in kept):
            continue
        kept.append(o)
    return kept
