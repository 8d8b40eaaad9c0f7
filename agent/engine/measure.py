"""Per-step measurements of each model-stage for the planner's calibration.

A ``StageTimer`` wraps one model-stage's work on one rank: wall time, tokens and sequence lengths,
peak memory, and (when profiling is on) the time and work of each operation class of the cost model
(``planner.cost.OpClass``): GEMM FLOPs, attention FLOPs (prefill) or KV bytes (decode), collective
bytes (TP/DP all-reduce), pipeline send bytes. Classification reads the torch profiler's events by
operator name; the DP all-reduce and the result gather are marked with ``record_function`` ranges.
Records are plain frozen data, one ``StageMeasurement`` per model-stage per step;
``calibration_records`` turns one into ``planner.calibration.OpMeasurement`` records (work in the
cost model's units: collective bytes moved per GPU by a ring, peaks of the device and link).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil
import torch
from torch.profiler import ProfilerActivity, profile

from planner.calibration import OpMeasurement
from planner.cost import OpClass
from planner.hardware import DeviceSpec, LinkSpec
from planner.plan import StagePlan

DP_ALLREDUCE_RANGE = "nereus::dp_allreduce"
GATHER_RANGE = "nereus::gather"  # the engine's result hand-off, not an op the cost model prices
_GEMM = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
_COLLECTIVE = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast",
               "wait_tensor")
_P2P = ("send", "recv")  # c10d::send, gloo:send, nccl:recv ...; only backend events carry shapes


@dataclass(frozen=True, kw_only=True, slots=True)
class OpTiming:
    op_class: OpClass
    seconds: float
    work: float  # FLOPs (GEMM, attention prefill) or bytes (decode attention, collectives, sends)
    calls: int


@dataclass(frozen=True, kw_only=True, slots=True)
class StageMeasurement:
    step: int
    model_stage: str
    tp: int
    pp: int
    dp: int
    rank: int
    seconds: float
    sequences: int
    tokens: int  # real (unpadded) tokens processed
    mean_sequence_tokens: float
    max_sequence_tokens: int
    peak_memory_bytes: int  # CUDA peak allocated, or this process's resident set on CPU
    ops: tuple[OpTiming, ...] = field(default=())

    def op(self, cls: OpClass) -> OpTiming | None:
        return next((o for o in self.ops if o.op_class is cls), None)

    def calibration_records(self, device: DeviceSpec, link: LinkSpec) -> list[OpMeasurement]:
        """What ``planner.calibration.Calibrator.observe`` consumes, one record per measured class."""
        out = []
        for o in self.ops:
            work, peak = o.work, device.peak_flops_bf16
            if o.op_class in (OpClass.ATTENTION_DECODE, OpClass.MEMORY_BOUND):
                peak = device.hbm_bytes_per_s
            elif o.op_class in (OpClass.TP_ALLREDUCE_INTRA, OpClass.TP_ALLREDUCE_INTER):
                work, peak = o.work * _ring(self.tp), link.bytes_per_s
            elif o.op_class in (OpClass.DP_ALLREDUCE_INTRA, OpClass.DP_ALLREDUCE_INTER):
                work, peak = o.work * _ring(self.dp), link.bytes_per_s
            elif o.op_class in (OpClass.PP_SEND_INTRA, OpClass.PP_SEND_INTER):
                peak = link.bytes_per_s
            if work > 0 and o.seconds > 0:
                out.append(OpMeasurement(op_class=o.op_class, work=work, peak_per_s=peak, measured_s=o.seconds,
                                         source=f"{self.model_stage}@step{self.step}"))
        return out


def _ring(n: int) -> float:
    """Bytes a ring all-reduce moves per GPU per byte of buffer (the cost model's convention)."""
    return 2 * (n - 1) / n if n > 1 else 0.0


def _numel(shapes: object) -> int:
    if isinstance(shapes, (list, tuple)):
        if shapes and all(isinstance(s, int) for s in shapes):
            n = 1
            for s in shapes:
                n *= int(s)
            return n
        return sum(_numel(s) for s in shapes)
    return 0


def classify(events: object, elem_bytes: int = 4) -> tuple[OpTiming, ...]:
    """Op-class totals from profiler ``FunctionEvent``s (self time, so nested ranges do not double)."""
    secs: dict[OpClass, float] = defaultdict(float)
    work: dict[OpClass, float] = defaultdict(float)
    calls: dict[OpClass, int] = defaultdict(int)
    def ranges(label: str) -> list[tuple[float, float]]:
        return [(e.time_range.start, e.time_range.end) for e in events  # type: ignore[attr-defined]
                if e.name == label]

    dp_ranges, gather_ranges = ranges(DP_ALLREDUCE_RANGE), ranges(GATHER_RANGE)
    for e in events:  # type: ignore[attr-defined]
        name = e.name
        if any(a <= e.time_range.start <= b for a, b in gather_ranges):
            continue
        cls: OpClass | None = None
        w = 0.0
        if name in _GEMM:
            cls, w = OpClass.GEMM, float(e.flops or 0)
        elif "scaled_dot_product" in name and name != "aten::scaled_dot_product_attention":
            shapes = e.input_shapes or []
            if len(shapes) >= 2 and len(shapes[0]) == 4:
                b, h, tq, d = shapes[0]
                tk = shapes[1][2]
                bwd = 2 if name.endswith("backward") else 1
                if tq == 1:
                    cls, w = OpClass.ATTENTION_DECODE, 2.0 * b * h * tk * d * elem_bytes
                else:
                    cls, w = OpClass.ATTENTION_PREFILL, 4.0 * b * h * tq * tk * d * bwd
        elif any(k in name for k in _P2P):
            cls, w = OpClass.PP_SEND_INTRA, float(_numel(e.input_shapes) * elem_bytes)
        elif any(k in name for k in _COLLECTIVE):
            start = e.time_range.start
            in_dp = any(a <= start <= b for a, b in dp_ranges)
            cls = OpClass.DP_ALLREDUCE_INTRA if in_dp else OpClass.TP_ALLREDUCE_INTRA
            w = float(_numel(e.input_shapes) * elem_bytes) if "wait" not in name else 0.0
        if cls is not None:
            secs[cls] += e.self_cpu_time_total / 1e6
            work[cls] += w
            calls[cls] += 1
    return tuple(OpTiming(op_class=c, seconds=secs[c], work=work[c], calls=calls[c]) for c in secs)


def peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(psutil.Process().memory_info().rss)


class Tally:
    """What a measured block reports about its batch."""

    def __init__(self) -> None:
        self.attention_mask: torch.Tensor | None = None


class StageTimer:
    """Collects one ``StageMeasurement`` per ``stage(...)`` block."""

    def __init__(self, *, rank: int = 0, profile_ops: bool = False) -> None:
        self.rank = rank
        self.profile_ops = profile_ops
        self.records: list[StageMeasurement] = []

    @contextmanager
    def stage(self, step: int, plan: StagePlan | None) -> Iterator[Tally]:
        """Measure the block as model-stage ``plan.model_stage``; the block sets ``tally.attention_mask``
        to the batch it processed. ``plan=None`` runs the block unmeasured."""
        tally = Tally()
        if plan is None:
            yield tally
            return
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        prof = (profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True)
                if self.profile_ops else None)
        t0 = time.perf_counter()
        if prof is not None:
            prof.__enter__()
        try:
            yield tally
        finally:
            if prof is not None:
                prof.__exit__(None, None, None)
            seconds = time.perf_counter() - t0
            mask = tally.attention_mask if tally.attention_mask is not None else torch.zeros(1, 1)
            lengths = mask.sum(-1)
            self.records.append(StageMeasurement(
                step=step, model_stage=plan.model_stage, tp=plan.layout.tp, pp=plan.layout.pp, dp=plan.dp,
                rank=self.rank, seconds=seconds, sequences=int(mask.shape[0]),
                tokens=int(lengths.sum()), mean_sequence_tokens=float(lengths.float().mean()),
                max_sequence_tokens=int(lengths.max()), peak_memory_bytes=peak_memory_bytes(),
                ops=classify(prof.events()) if prof is not None else ()))

    def of_step(self, step: int) -> dict[str, StageMeasurement]:
        return {r.model_stage: r for r in self.records if r.step == step}
