"""The planner binding of a simulated job: the daemon's own, plus what a job learns from its OOMs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from nereusd.planning import PlannerBinding, cluster_for, job_spec
from nereusd.sim.truth import OutOfMemory
from nereusd.wire import protocol
from planner import admission
from planner.errors import InfeasibleError
from planner.hardware import ClusterSpec
from planner.plan import GlobalPlan


class SimPort(PlannerBinding):
    """The daemon's planner binding plus what a job learns from its OOMs (a worker's OOM report says which
    model-stage failed, the bytes it needed and the longest sequence in the failing batch):

    - the planner is asked to size memory for the tail: ``max_response_tokens`` of the spec it plans is
      the mean times the worst longest/mean ratio an OOM has shown (the cost model plans for mean lengths
      and the tail is what overflows; as a ratio it follows lengths that grow);
    - if the plan still looks feasible with that, the usable memory is derated by predicted/needed.

    The planner's memory model itself is left as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.memory_derate = 1.0
        self.tail_ratio = 0.0  # longest / mean response of the worst OOM seen, with 10% margin

    def _job(self, job: dict[str, Any]) -> dict[str, Any]:
        w = job.get("workload") or {}
        tail = math.ceil(self.tail_ratio * float(w.get("response_tokens") or 0))
        if tail <= int(w.get("max_response_tokens") or 0):
            return job
        return {**job, "workload": {**w, "max_response_tokens": tail}}

    def _cluster(self, job: dict[str, Any], pool: frozenset[int]) -> ClusterSpec:
        c = cluster_for(job, pool)
        if self.memory_derate >= 1.0:
            return c
        dev = dataclasses.replace(c.device, memory_bytes=int(c.device.memory_bytes * self.memory_derate))
        return dataclasses.replace(c, device=dev)

    def search(self, job: dict[str, Any], pool: frozenset[int], version: int) -> admission.Candidate:
        from planner.search import search

        job = self._job(job)
        res = search(job_spec(job), self._cluster(job, pool), pool=sorted(pool), eff=self._eff(job), version=version)
        return admission.Candidate(plan=res.plan, prediction=res.prediction)

    def alternatives(self, job: dict[str, Any], pool: frozenset[int], version: int, best: GlobalPlan,
                     error: InfeasibleError | None) -> Iterator[admission.Candidate]:
        job = self._job(job)
        return self._alternatives(job_spec(job), self._cluster(job, pool), pool, self._eff(job), version, best, error)

    def predict(self, job: dict[str, Any], pool: frozenset[int], plan: GlobalPlan) -> Any | None:
        from planner.prediction import predict

        job = self._job(job)
        pred = predict(job_spec(job), self._cluster(job, pool), plan, self._eff(job))
        return pred if pred.feasible else None

    def calibrate(self, job: dict[str, Any], measurement: protocol.Measurement, plan: GlobalPlan) -> None:
        """Calibrate against the workload the predictions use (the tail an OOM taught included): fitted
        without it, the tail's decode time is learned into the generation classes and then counted twice."""
        super().calibrate(self._job(job), measurement, plan)

    def predict_seconds(self, job: dict[str, Any], pool: frozenset[int], plan: GlobalPlan) -> float:
        """The predicted step latency of ``plan`` whether or not the planner thinks it fits (time is what
        the calibration figures compare; memory is judged by the truth's OOMs)."""
        from planner.prediction import predict

        job = self._job(job)
        return float(predict(job_spec(job), cluster_for(job, pool), plan, self._eff(job)).step_latency_s)

    def learn_oom(self, job: dict[str, Any], pool: frozenset[int], plan: GlobalPlan, oom: OutOfMemory) -> None:
        from planner.prediction import predict

        mean = float((job.get("workload") or {}).get("response_tokens") or 1)
        self.tail_ratio = max(self.tail_ratio, 1.1 * oom.longest_response_tokens / mean)
        job = self._job(job)
        pred = predict(job_spec(job), cluster_for(job, pool), plan, self._eff(job))
        predicted = pred.memory[oom.model_stage].total_bytes
        if predicted < oom.need_bytes:
            self.memory_derate = min(self.memory_derate, 0.95 * predicted / oom.need_bytes)
