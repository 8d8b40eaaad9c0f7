"""Candidate layouts of one model-stage: enumeration, estimated cost and memory, frontier pruning.

A candidate is (TP, PP, DP, micro-batch, accumulation, recomputation) with its estimated seconds per
RL step, GPU count, resident bytes (kept all step) and transient bytes (while it runs), per GPU.
TP and PP are powers of two (ModelSpec.valid_tp, ModelStage layers), DP is any degree for which the
model-stage's batch splits into micro-batches (planner.plan.batch_splits), so the global batch never
changes. For a fixed layout, seconds and transient bytes are affine in the micro-batch size (given the
1F1B depth), so each layout is costed at b = 1 and 2 and every (DP, b) row is read off those lines
with numpy: a 1,024-GPU replan stays in milliseconds. Rows are columns of an :class:`OptionTable`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from planner.cost import Links, OpClass, OpTerm, microbatch_terms, sync_terms
from planner.hardware import ClusterSpec
from planner.memory import HEADROOM_FRACTION, WORKSPACE_BYTES, resident_bytes, transient_bytes
from planner.models import ModelSpec
from planner.plan import Layout, power_of_two_upto
from planner.workflow import JobSpec, ModelStage, StageKind, Workload


@dataclass(frozen=True, kw_only=True, slots=True)
class StageOption:
    """One candidate of one model-stage (a row of an OptionTable)."""

    model_stage: str
    layout: Layout
    dp: int
    micro_batch_size: int
    grad_accum: int
    recompute: bool
    seconds: float  # estimated, slowest replica, per RL step
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


DEFAULT_RULES = OptionRules()
TRANSIENT_SLACK_BYTES = 1 << 16


@dataclass(frozen=True, kw_only=True, slots=True)
class OptionTable:
    """All candidates of one model-stage as numpy columns (one row per candidate)."""

    model_stage: str
    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    b: np.ndarray
    g: np.ndarray
    recompute: np.ndarray
    seconds: np.ndarray
    gpus: np.ndarray
    resident: np.ndarray
    transient: np.ndarray

    def __len__(self) -> int:
        return int(self.seconds.shape[0])

    def take(self, idx: np.ndarray) -> OptionTable:
        return OptionTable(model_stage=self.model_stage, **{
            k: getattr(self, k)[idx] for k in ("tp", "pp", "dp", "b", "g", "recompute", "seconds", "gpus",
                                               "resident", "transient")})

    def option(self, i: int) -> StageOption:
        return StageOption(model_stage=self.model_stage, layout=Layout(int(self.tp[i]), int(self.pp[i])),
                           dp=int(self.dp[i]), micro_batch_size=int(self.b[i]), grad_accum=int(self.g[i]),
                           recompute=bool(self.recompute[i]), seconds=float(self.seconds[i]),
                           resident_bytes=int(self.resident[i]), transient_bytes=int(self.transient[i]))

    def options(self) -> list[StageOption]:
        return [self.option(i) for i in range(len(self))]


def batch_sequences(job: JobSpec, ms: ModelStage) -> int:
    """Sequences in the batch a model-stage splits over its replicas (a mini-batch for training)."""
    w = job.workload
    if ms.kind is StageKind.TRAINING:
        return w.sequences_per_mini_batch
    if ms.greedy:  # ReMax's greedy baseline: one rollout per prompt
        return w.prompts_per_step
    return w.sequences_per_step


@lru_cache(maxsize=256)
def _grid(sequences: int, max_dp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (dp, b, g) with dp * b * g == sequences and dp <= max_dp (planner.plan.batch_splits)."""
    rows = [(dp, b, per // b) for dp in range(1, min(sequences, max_dp) + 1) if sequences % dp == 0
            for per in (sequences // dp,) for b in range(1, per + 1) if per % b == 0]
    arr = np.array(rows, dtype=np.int64).reshape(-1, 3)
    return arr[:, 0], arr[:, 1], arr[:, 2]


def _seconds_line(t1: tuple[OpTerm, ...], t2: tuple[OpTerm, ...],
                  eff: Mapping[OpClass, float]) -> tuple[float, float, float, float]:
    """(GEMM s per sequence, weight-read s, other s per sequence, other fixed s) of one micro-batch.

    Generation keeps max(GEMM, weight read) per micro-batch (roofline, as planner.cost.roofline does)."""
    gemm_a = mem_c = other_a = other_c = 0.0
    for a, b in zip(t1, t2):
        s1, s2 = a.seconds(eff), b.seconds(eff)
        if a.op_class is OpClass.GEMM:
            gemm_a += s2 - s1
        elif a.op_class is OpClass.MEMORY_BOUND:
            mem_c += s1
        else:
            other_a += s2 - s1
            other_c += 2 * s1 - s2
    return gemm_a, mem_c, other_a, other_c


def _ring_hops(dp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ring = 2.0 * (dp - 1) / dp
    hops = np.where(dp > 1, 2.0 * np.ceil(np.log2(np.maximum(dp, 1))), 0.0)
    return ring, hops


def option_table(job: JobSpec, ms: ModelStage, cluster: ClusterSpec, num_gpus: int,
                 eff: Mapping[OpClass, float], rules: OptionRules = DEFAULT_RULES) -> OptionTable:
    """Every candidate of one model-stage on ``num_gpus`` GPUs whose own footprint fits in memory."""
    model = job.model_of(ms)
    workload = job.workload
    gpn = cluster.gpus_per_node
    usable = cluster.device.memory_bytes / (1 + HEADROOM_FRACTION) - WORKSPACE_BYTES
    sequences = batch_sequences(job, ms)
    mini = workload.train_mini_batches_per_step if ms.kind is StageKind.TRAINING else 1
    grid_dp, grid_b, grid_g = _grid(sequences, num_gpus)
    max_tp = num_gpus if rules.allow_cross_node_tp else min(num_gpus, gpn)
    recompute_opts = (False, True) if rules.allow_recompute and ms.kind is StageKind.TRAINING else (False,)
    parts: list[dict[str, np.ndarray]] = []
    for tp in power_of_two_upto(max_tp):
        if not model.valid_tp(tp):
            continue
        for pp in power_of_two_upto(min(model.num_layers, num_gpus // tp)):
            layout = Layout(tp, pp)
            size = layout.size
            resident = resident_bytes(model, ms, layout).total_bytes
            if resident > usable:
                continue
            rows = grid_dp * size <= num_gpus
            dp, b, g = grid_dp[rows], grid_b[rows], grid_g[rows]
            links = Links(tp_intra=tp <= gpn, pp_intra=size <= gpn, dp_intra=True)
            # sync (training): the optimizer update, plus the DP all-reduce whose link depends on dp
            sync_mem = sum(t.seconds(eff) for t in sync_terms(model, ms, layout, 1, cluster, links))
            if ms.kind is StageKind.TRAINING:
                intra = sync_terms(model, ms, layout, 2, cluster, links)[-1]
                inter = sync_terms(model, ms, layout, 2, cluster, Links(dp_intra=False))[-1]
                ring, hops = _ring_hops(dp)
                in_node = dp * size <= gpn
                bytes_ = intra.work / 1.0  # ring factor of dp=2 is 1: work is the bare gradient bytes
                sync = sync_mem + np.where(
                    in_node, bytes_ * ring / (intra.peak_per_s * eff[intra.op_class]) + hops * intra.latency_s,
                    bytes_ * ring / (inter.peak_per_s * eff[inter.op_class]) + hops * inter.latency_s)
            else:
                sync = np.zeros(dp.shape)
            for recompute in recompute_opts:
                t1 = microbatch_terms(model, ms, layout, workload, 1, recompute, cluster, links)
                t2 = microbatch_terms(model, ms, layout, workload, 2, recompute, cluster, links)
                gemm_a, mem_c, other_a, other_c = _seconds_line(t1, t2, eff)
                mb_s = np.maximum(gemm_a * b, mem_c) + other_a * b + other_c
                seconds = mb_s * (g + pp - 1) * mini + sync * mini
                # + slack: the affine read-off may sit a few bytes under transient_bytes' own rounding
                trans = _transient_line(model, ms, layout, workload, recompute, b, g) + TRANSIENT_SLACK_BYTES
                ok = resident + trans <= usable
                if not ok.any():
                    continue
                parts.append({"tp": np.full(int(ok.sum()), tp), "pp": np.full(int(ok.sum()), pp),
                              "dp": dp[ok], "b": b[ok], "g": g[ok],
                              "recompute": np.full(int(ok.sum()), recompute),
                              "seconds": seconds[ok], "gpus": dp[ok] * size,
                              "resident": np.full(int(ok.sum()), resident, dtype=np.int64),
                              "transient": trans[ok]})
    keys = ("tp", "pp", "dp", "b", "g", "recompute", "seconds", "gpus", "resident", "transient")
    if not parts:
        empty = {k: np.zeros(0, dtype=bool if k == "recompute" else float if k == "seconds" else np.int64)
                 for k in keys}
        return OptionTable(model_stage=ms.name, **empty)
    return OptionTable(model_stage=ms.name, **{k: np.concatenate([p[k] for p in parts]) for k in keys})


def _transient_line(model: ModelSpec, ms: ModelStage, layout: Layout, workload: Workload, recompute: bool,
                    b: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Transient bytes of every row: c0 + b * (c1 + min(pp, g) * c2), from three exact evaluations."""
    def at(bb: int, gg: int) -> int:
        return transient_bytes(model, ms, layout, workload, bb, gg, recompute).total_bytes

    t11, t21 = at(1, 1), at(2, 1)
    c1 = t21 - t11
    c0 = t11 - c1
    if ms.kind is StageKind.TRAINING and layout.pp > 1:
        c2 = at(1, 2) - t11
        return np.asarray(c0 + b * (c1 + (np.minimum(layout.pp, g) - 1) * c2))
    return np.asarray(c0 + b * c1)


# Seconds closer than this factor count as equal on the frontier, so a row survives only by needing
# clearly less memory: each model-stage loses at most this much, and far fewer memory levels remain.
FRONTIER_TOLERANCE = 0.002


def frontier(table: OptionTable, tolerance: float = FRONTIER_TOLERANCE) -> OptionTable:
    """Drop dominated candidates: among rows with the same GPU count and resident bytes, keep only
    those that need less transient memory than every faster row (a latency/memory frontier).

    With ``tolerance`` 0 nothing optimal is lost (a plan using a dropped row stays feasible and no slower
    with its dominator); otherwise seconds are compared on a geometric grid of that ratio, so the plan
    found may be up to that fraction slower than the optimum."""
    if len(table) == 0:
        return table
    if tolerance > 0:
        step = np.log1p(tolerance)
        secs = np.exp(np.ceil(np.log(np.maximum(table.seconds, 1e-300)) / step) * step)
    else:
        secs = table.seconds
    order = np.lexsort((table.seconds, table.transient, secs, table.resident, table.gpus))
    gpus, res, trans = table.gpus[order], table.resident[order], table.transient[order]
    new_group = np.ones(len(order), dtype=bool)
    new_group[1:] = (gpus[1:] != gpus[:-1]) | (res[1:] != res[:-1])
    group = np.cumsum(new_group)
    big = float(trans.max()) + 1.0
    shifted = trans.astype(float) + (group.max() - group) * big  # later groups sit lower: cummin resets
    running = np.minimum.accumulate(shifted)
    keep = new_group.copy()
    keep[1:] |= shifted[1:] < running[:-1]
    return table.take(order[keep])
