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

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from planner.cost import (
    DP_BUCKET_PARAMS,
    DP_OVERLAP,
    Links,
    OpClass,
    RawTerm,
    backward_seconds,
    fixed_raw,
    microbatch_raw,
    raw_seconds,
    sync_raw,
)
from planner.hardware import ClusterSpec
from planner.memory import HEADROOM_FRACTION, WORKSPACE_BYTES, params_per_gpu, resident_bytes, transient_parts
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


def _seconds_line(t1: list[RawTerm], t2: list[RawTerm],
                  eff: Mapping[OpClass, float]) -> tuple[float, float, float, float, float]:
    """(decode GEMM s per sequence and fixed, weight-read s, other s per sequence, other fixed s) of one
    micro-batch.

    Generation keeps max(decode GEMM, weight read) per micro-batch (roofline, as planner.cost.roofline
    does: the first GEMM and the MEMORY_BOUND term); every other term is affine in the micro-batch."""
    gemm_a = gemm_c = mem_c = other_a = other_c = 0.0
    roof = any(a[0] is OpClass.MEMORY_BOUND for a in t1)
    for a, b in zip(t1, t2):  # raw_seconds of each, inline (a replan of a new workload costs ~3,000 pairs)
        s1 = a[1] / (a[2] * eff[a[0]]) + a[3] * a[4]
        s2 = b[1] / (b[2] * eff[b[0]]) + b[3] * b[4]
        if roof and a[0] is OpClass.GEMM:
            gemm_a += s2 - s1
            gemm_c += 2 * s1 - s2
            roof = False  # only the decode GEMM (the first one) is on the roofline
        elif a[0] is OpClass.MEMORY_BOUND:
            mem_c += s1
        else:
            other_a += s2 - s1
            other_c += 2 * s1 - s2
    return gemm_a, gemm_c, mem_c, other_a, other_c


def _ring_hops(dp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ring = 2.0 * (dp - 1) / dp
    hops = np.where(dp > 1, 2.0 * np.ceil(np.log2(np.maximum(dp, 1))), 0.0)
    return ring, hops


# Per-layout lines (the Python part of a table) for the last few (model-stage, workload, cluster,
# efficiencies): a replan after a pool change reuses them. The key holds every input of the lines, the
# cluster as one node of it (``_one_node``): nothing a line is made of reads the number of nodes.
_LINES_CACHE: OrderedDict[tuple[object, ...], dict[tuple[int, int, bool], tuple[float, ...] | None]] = OrderedDict()
_LINES_CACHE_SIZE = 64
# ... and their workload-free parts (_unit_part) by (tp, pp), per (model-stage, cluster, efficiencies)
_UNITS_CACHE: OrderedDict[tuple[object, ...], dict[tuple[int, int], tuple[float, ...] | None]] = OrderedDict()


def _lines_for(key: tuple[object, ...], cache: OrderedDict[tuple[object, ...], Any] = _LINES_CACHE) -> Any:
    lines = cache.get(key)
    if lines is None:
        lines = cache[key] = {}
        if len(cache) > _LINES_CACHE_SIZE:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return lines


def _one_node(cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` cut to one node: the same device, links, node size and overheads, which is all that a
    layout's line reads (planner.cost and planner.memory never read ``num_nodes``). Lines are made from
    it and keyed by it, so nodes joining or leaving (the daemon's cluster grows with its highest node)
    find the lines already made instead of re-costing every layout (~4 ms a replan at 1,024 GPUs)."""
    return replace(cluster, num_nodes=1)


def _unit_part(model: ModelSpec, ms: ModelStage, layout: Layout, cluster: ClusterSpec, eff: Mapping[OpClass, float],
               usable: float) -> tuple[float, ...] | None:
    """The scalars of a layout's line that no workload changes (None: its resident state alone does not
    fit): resident bytes, optimizer-update s, DP gradient bytes and per-link (s per byte, latency) for the
    all-reduce, the last bucket's share of it. A replan after a length drift finds them made."""
    resident = resident_bytes(model, ms, layout).total_bytes
    if resident > usable:
        return None
    links = Links()  # sync_raw reads only dp_intra: the all-reduce within a node (across, below)
    sync_mem = sum(raw_seconds(t, eff) for t in sync_raw(model, ms, layout, 1, cluster, links))
    grad_bytes = intra_s = intra_lat = inter_s = inter_lat = 0.0
    if ms.kind is StageKind.TRAINING:
        intra = sync_raw(model, ms, layout, 2, cluster, links)[-1]
        inter = sync_raw(model, ms, layout, 2, cluster, Links(dp_intra=False))[-1]
        grad_bytes = intra[1] / 1.0  # ring factor of dp=2 is 1: work is the bare gradient bytes
        intra_s, intra_lat = intra[2] * eff[intra[0]], intra[4]
        inter_s, inter_lat = inter[2] * eff[inter[0]], inter[4]
    last_bucket = min(1.0, DP_BUCKET_PARAMS / max(params_per_gpu(model, ms.role.head, layout), 1))
    return float(resident), sync_mem, grad_bytes, intra_s, intra_lat, inter_s, inter_lat, last_bucket


def _layout_line(model: ModelSpec, ms: ModelStage, layout: Layout, workload: Workload, recompute: bool,
                 cluster: ClusterSpec, eff: Mapping[OpClass, float], usable: float,
                 units: dict[tuple[int, int], tuple[float, ...] | None] | None = None) -> tuple[float, ...] | None:
    """One layout's scalars, from exact evaluations of the cost and memory models (None: its resident
    state alone does not fit): resident bytes; decode GEMM s per sequence and fixed, weight-read s, other s
    per sequence and fixed, of one micro-batch; optimizer-update s, DP gradient bytes and per-link (s per byte,
    latency) for the all-reduce; transient bytes c0, c1, c2 (c0 + b * (c1 + (min(pp, g) - 1) * c2));
    backward s per sequence and fixed (what the all-reduce hides behind), the last bucket's share of
    the all-reduce, and the once-per-step seconds (generation tail, weight refit). ``units``: the
    workload-free parts (:func:`_unit_part`) by (tp, pp), made where missing."""
    key = (layout.tp, layout.pp)
    if units is None or key not in units:
        part = _unit_part(model, ms, layout, cluster, eff, usable)
        if units is not None:
            units[key] = part
    else:
        part = units[key]
    if part is None:
        return None
    resident, sync_mem, grad_bytes, intra_s, intra_lat, inter_s, inter_lat, last_bucket = part
    gpn = cluster.gpus_per_node
    links = Links(tp_intra=layout.tp <= gpn, pp_intra=layout.size <= gpn, dp_intra=True)
    t1 = microbatch_raw(model, ms, layout, workload, 1, recompute, cluster, links)
    t2 = microbatch_raw(model, ms, layout, workload, 2, recompute, cluster, links)
    c0, c1, c2 = _transient_coeffs(model, ms, layout, workload, recompute)
    bwd1 = backward_seconds(model, ms, layout, workload, 1, recompute, cluster, eff)
    bwd2 = backward_seconds(model, ms, layout, workload, 2, recompute, cluster, eff)
    fixed = sum(raw_seconds(t, eff) for t in fixed_raw(model, ms, layout, workload, cluster, links))
    return (resident, *_seconds_line(t1, t2, eff), sync_mem, grad_bytes, intra_s, intra_lat, inter_s,
            inter_lat, float(c0), float(c1), float(c2), bwd2 - bwd1, 2 * bwd1 - bwd2, last_bucket, fixed)


_COLUMNS = ("tp", "pp", "dp", "b", "g", "recompute", "seconds", "gpus", "resident", "transient")


def option_table(job: JobSpec, ms: ModelStage, cluster: ClusterSpec, num_gpus: int,
                 eff: Mapping[OpClass, float], rules: OptionRules = DEFAULT_RULES) -> OptionTable:
    """Every candidate of one model-stage on ``num_gpus`` GPUs whose own footprint fits in memory.

    Each layout's lines come from the cost and memory models (Python, cached across calls); every
    (layout, DP, micro-batch) row is then read off them at once, as (layout x grid) arrays."""
    model = job.model_of(ms)
    workload = job.workload
    gpn = cluster.gpus_per_node
    usable = cluster.device.memory_bytes / (1 + HEADROOM_FRACTION) - WORKSPACE_BYTES
    sequences = batch_sequences(job, ms)
    mini = workload.train_mini_batches_per_step if ms.kind is StageKind.TRAINING else 1
    grid_dp, grid_b, grid_g = _grid(sequences, num_gpus)
    max_tp = num_gpus if rules.allow_cross_node_tp else min(num_gpus, gpn)
    recompute_opts = (False, True) if rules.allow_recompute and ms.kind is StageKind.TRAINING else (False,)
    eff = {c: eff[c] for c in OpClass}  # a plain dict: the cost terms look classes up many times
    node = _one_node(cluster)
    lines = _lines_for((model, ms, workload, node, tuple(eff.values())))
    units = _lines_for((model, ms, node, tuple(eff.values())), _UNITS_CACHE)
    layouts: list[tuple[int, int, bool]] = []
    rows: list[tuple[float, ...]] = []
    for tp in power_of_two_upto(max_tp):
        if not model.valid_tp(tp):
            continue
        for pp in power_of_two_upto(min(model.num_layers, num_gpus // tp)):
            for recompute in recompute_opts:
                key = (tp, pp, recompute)
                if key not in lines:
                    lines[key] = _layout_line(model, ms, Layout(tp, pp), workload, recompute, node, eff, usable,
                                              units)
                line = lines[key]
                if line is not None:
                    layouts.append(key)
                    rows.append(line)
    if not layouts:
        empty = {k: np.zeros(0, dtype=bool if k == "recompute" else float if k == "seconds" else np.int64)
                 for k in _COLUMNS}
        return OptionTable(model_stage=ms.name, **empty)
    lay = np.array(layouts, dtype=np.int64)
    tp_l, pp_l, rec_l = lay[:, 0:1], lay[:, 1:2], lay[:, 2:3].astype(bool)
    size_l = tp_l * pp_l
    (resident, gemm_a, gemm_c, mem_c, other_a, other_c, sync_mem, grad_bytes, intra_s, intra_lat, inter_s, inter_lat,
     c0, c1, c2, bwd_a, bwd_c, last_bucket, fixed) = (col[:, None] for col in np.array(rows, dtype=float).T)
    dp, b, g = grid_dp[None, :], grid_b[None, :], grid_g[None, :]
    if ms.kind is StageKind.TRAINING:
        ring, hops = _ring_hops(dp)
        # sync: the optimizer update, plus the exposed part of the DP all-reduce (its link depends on
        # dp): what the last micro-batch's backward cannot hide, at least the last bucket
        all_reduce = np.where(dp * size_l <= gpn, grad_bytes * ring / intra_s + hops * intra_lat,
                              grad_bytes * ring / inter_s + hops * inter_lat)
        sync = sync_mem + np.maximum(all_reduce * last_bucket, all_reduce - DP_OVERLAP * (bwd_a * b + bwd_c))
    else:
        sync = np.zeros((1, 1))
    mb_s = np.maximum(gemm_a * b + gemm_c, mem_c) + other_a * b + other_c
    seconds = mb_s * (g + pp_l - 1) * mini + sync * mini + fixed
    # + slack: the affine read-off may sit a few bytes under transient_bytes' own rounding
    in_flight = np.minimum(pp_l, g) - 1
    trans = (c0 + b * (c1 + in_flight * c2)).astype(np.int64) + TRANSIENT_SLACK_BYTES
    li, gi = np.nonzero((dp * size_l <= num_gpus) & (resident + trans <= usable))
    return OptionTable(model_stage=ms.name, tp=lay[li, 0], pp=lay[li, 1], dp=grid_dp[gi], b=grid_b[gi],
                       g=grid_g[gi], recompute=rec_l[li, 0], seconds=np.broadcast_to(seconds, trans.shape)[li, gi],
                       gpus=grid_dp[gi] * size_l[li, 0], resident=resident[li, 0].astype(np.int64),
                       transient=trans[li, gi])


def _transient_coeffs(model: ModelSpec, ms: ModelStage, layout: Layout, workload: Workload,
                      recompute: bool) -> tuple[int, int, int]:
    """Transient bytes of every row are c0 + b * (c1 + (min(pp, g) - 1) * c2): three exact evaluations."""
    def at(bb: int, gg: int) -> int:
        return sum(transient_parts(model, ms, layout, workload, bb, gg, recompute))

    t11, t21 = at(1, 1), at(2, 1)
    c1 = t21 - t11
    c0 = t11 - c1
    c2 = at(1, 2) - t11 if ms.kind is StageKind.TRAINING and layout.pp > 1 else 0
    return c0, c1, c2


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
