"""Predict a whole plan: step latency on the execution-overlap graph, per-GPU peak memory, breakdowns.

Stages run generation -> inference -> training. Inside a stage, model-stages placed on disjoint GPUs
overlap and model-stages sharing a GPU serialise (in plan order); a model-stage takes its slowest
replica. The step latency is the critical path of that graph. Every figure keeps the terms behind it so
a decision can be explained (and calibration can turn measured times back into per-class records).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain
from types import MappingProxyType
from typing import Any

import numpy as np

from planner.cost import PRIORS, Links, OpClass, OpTerm, StageCost, stage_cost
from planner.hardware import ClusterSpec
from planner.memory import MemoryBreakdown, plan_memory
from planner.plan import GlobalPlan, StagePlan
from planner.workflow import JobSpec, StageKind


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    step_latency_s: float
    stage_seconds: Mapping[str, float]  # model-stage -> seconds of its slowest replica
    stage_start_s: Mapping[str, float]  # model-stage -> start time on the critical-path schedule
    kind_seconds: Mapping[str, float]  # generation / inference / training -> span in the step
    breakdown: Mapping[str, Mapping[str, float]]  # model-stage -> op class (or pipeline_bubble) -> s
    terms: Mapping[str, tuple[OpTerm, ...]]  # model-stage -> terms of its slowest replica
    peak_memory_bytes: Mapping[int, int]  # GPU -> peak bytes (headroom included)
    memory: Mapping[str, MemoryBreakdown]  # model-stage -> breakdown on its fullest GPU while it runs
    memory_capacity_bytes: int
    overhead_s: float = 0.0  # fixed per-step overhead (op class STEP_OVERHEAD), part of step_latency_s

    @property
    def max_peak_memory_bytes(self) -> int:
        return max(self.peak_memory_bytes.values(), default=0)

    @property
    def feasible(self) -> bool:
        return self.max_peak_memory_bytes <= self.memory_capacity_bytes

    def memory_over(self) -> dict[str, int]:
        """model-stage -> bytes over capacity on its fullest GPU (only those over)."""
        return {k: m.total_bytes - self.memory_capacity_bytes for k, m in self.memory.items()
                if m.total_bytes > self.memory_capacity_bytes}

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_latency_s": self.step_latency_s,
            "stage_seconds": dict(self.stage_seconds),
            "stage_start_s": dict(self.stage_start_s),
            "kind_seconds": dict(self.kind_seconds),
            "breakdown": {k: dict(v) for k, v in self.breakdown.items()},
            "max_peak_memory_bytes": self.max_peak_memory_bytes,
            "memory_capacity_bytes": self.memory_capacity_bytes,
            "memory": {k: m.as_dict() for k, m in self.memory.items()},
            "feasible": self.feasible,
            "overhead_s": self.overhead_s,
        }


def predict_stage(job: JobSpec, cluster: ClusterSpec, sp: StagePlan, eff: Mapping[OpClass, float],
                  gpus: np.ndarray | None = None) -> StageCost:
    """The slowest replica of one model-stage (replicas differ only in which links their groups use);
    ``gpus``: the stage's GPU ids in rank order, if the caller has them as an array already."""
    ms = job.workflow.stage(sp.model_stage)
    model = job.model_of(ms)
    worst: StageCost | None = None
    for links in _distinct_links(sp, cluster, gpus):
        c = stage_cost(model, ms, sp.layout, job.workload, micro_batch_size=sp.micro_batch_size,
                       grad_accum=sp.grad_accum, recompute=sp.recompute, dp=sp.dp, cluster=cluster,
                       links=links, eff=eff)
        if worst is None or c.seconds > worst.seconds:
            worst = c
    assert worst is not None  # a StagePlan has at least one replica
    return worst


def gpu_array(sp: StagePlan) -> np.ndarray:
    """A model-stage's GPU ids in replica and rank order, flat (faster than np.asarray on the tuples)."""
    return np.fromiter(chain.from_iterable(sp.gpu_sets), dtype=np.int64, count=sp.dp * sp.layout.size)


def _distinct_links(sp: StagePlan, cluster: ClusterSpec, gpus: np.ndarray | None = None) -> set[Links]:
    """The link patterns among a model-stage's replicas (vectorised: 1,024 replicas in microseconds)."""
    tp, pp = sp.layout.tp, sp.layout.pp
    flat = gpu_array(sp) if gpus is None else gpus
    nodes = flat.reshape(sp.dp, pp, tp) // cluster.gpus_per_node
    tp_intra = (nodes.min(axis=2) == nodes.max(axis=2)).all(axis=1)
    pp_intra = (nodes[:, 1:, 0] == nodes[:, :-1, 0]).all(axis=1)
    dp_intra = bool(nodes.min() == nodes.max())
    return {Links(tp_intra=bool(t), pp_intra=bool(p), dp_intra=dp_intra)
            for t, p in set(zip(tp_intra.tolist(), pp_intra.tolist()))}


def predict(job: JobSpec, cluster: ClusterSpec, plan: GlobalPlan,
            eff: Mapping[OpClass, float] = PRIORS) -> Prediction:
    arrays = {sp.model_stage: gpu_array(sp) for sp in plan}
    costs = {sp.model_stage: predict_stage(job, cluster, sp, eff, arrays[sp.model_stage]) for sp in plan}
    t, starts, kind_seconds = schedule(job, plan, {k: c.seconds for k, c in costs.items()}, arrays)
    overhead = step_overhead_seconds(cluster, eff)
    kind_seconds["overhead"] = overhead
    t += overhead

    per_gpu, stage_mem = plan_memory(job, plan, arrays)
    return Prediction(
        step_latency_s=t,
        stage_seconds=MappingProxyType({k: c.seconds for k, c in costs.items()}),
        stage_start_s=MappingProxyType(starts),
        kind_seconds=MappingProxyType(kind_seconds),
        breakdown=MappingProxyType({k: MappingProxyType(c.by_class(eff)) for k, c in costs.items()}),
        terms=MappingProxyType({k: c.terms for k, c in costs.items()}),
        peak_memory_bytes=MappingProxyType(per_gpu),
        memory=MappingProxyType(stage_mem),
        memory_capacity_bytes=cluster.device.memory_bytes,
        overhead_s=overhead,
    )


def schedule(job: JobSpec, plan: GlobalPlan, seconds: Mapping[str, float],
             arrays: Mapping[str, np.ndarray] | None = None) -> tuple[float, dict[str, float], dict[str, float]]:
    """(critical path, model-stage -> start, kind -> seconds) of model-stages taking ``seconds`` each:
    kinds in order, model-stages of one kind sharing a GPU serialise (the step without its overhead)."""
    arrays = arrays if arrays is not None else {sp.model_stage: gpu_array(sp) for sp in plan}
    starts: dict[str, float] = {}
    kind_seconds: dict[str, float] = {}
    t = 0.0
    for kind in sorted(StageKind, key=lambda k: k.order):
        members = [sp for sp in plan if job.workflow.stage(sp.model_stage).kind is kind]
        ends: list[tuple[frozenset[int], float]] = []
        kind_end = t
        for sp in members:
            gpus = frozenset(arrays[sp.model_stage].tolist())
            start = max([t] + [end for other, end in ends if not other.isdisjoint(gpus)])
            end = start + seconds[sp.model_stage]
            starts[sp.model_stage] = start
            ends.append((gpus, end))
            kind_end = max(kind_end, end)
        kind_seconds[kind.value] = kind_end - t
        t = kind_end
    return t, starts, kind_seconds


def step_overhead_seconds(cluster: ClusterSpec, eff: Mapping[OpClass, float] = PRIORS) -> float:
    """The fixed per-step overhead (scheduling, data movement between stages, rewards, logging) the
    cluster names, under the STEP_OVERHEAD class (learned like any other; prior: taken as it is)."""
    if cluster.step_overhead_s <= 0:
        return 0.0
    return OpTerm(op_class=OpClass.STEP_OVERHEAD, work=cluster.step_overhead_s, peak_per_s=1.0).seconds(eff)
