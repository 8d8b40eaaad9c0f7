"""What the controller keeps and reaches: plans and trigger state as stored data (JSON-safe dicts the
store and the wire carry), the sketch of a transition the planner prices, and the ports through which
the controller reaches the planner (``PlannerPort``, bound by nereusd/planning.py) and the transition
calibration. Pure: no torch, no I/O."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from nereusd.wire import protocol
from planner import admission
from planner.plan import GlobalPlan, Layout, StagePlan


@dataclass(frozen=True, kw_only=True, slots=True)
class TransitionSketch:
    """What the transition layer says about moving from one plan to another."""

    predicted_s: float  # L_tran: critical path of the DAG
    bytes_moved: int
    dag: dict[str, Any]  # the record's head: kind, cost, L_tran, primitives per kind, bytes
    parts: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> that node's part
    # the record's unit-level body (primitives, edges, order, units, peaks), derived on demand: the
    # controller stores it after the orders are sent, so that an order waits for none of it
    detail: Callable[[], dict[str, Any]] | None = None


class PlannerPort(Protocol):
    """The numerical side of a decision (bound to planner/ and transitions/ in nereusd/planning.py).
    A port may also be a TransitionObserver (below): the controller then feeds it completed transitions."""

    def search(self, job: dict[str, Any], pool: frozenset[int], version: int) -> admission.Candidate:
        """Best plan for the job spec on ``pool``; raises InfeasibleError when nothing fits."""

    def predict(self, job: dict[str, Any], pool: frozenset[int], plan: GlobalPlan) -> Any | None:
        """Prediction of ``plan`` on ``pool``; None when it does not fit (memory, GPUs gone)."""

    def calibrate(self, job: dict[str, Any], measurement: protocol.Measurement, plan: GlobalPlan) -> None:
        """Feed one step's measured stage times into the efficiency fit."""

    def transition(self, job: dict[str, Any], old: GlobalPlan | None, new: GlobalPlan, pool: frozenset[int],
                   node_of_gpu: Callable[[int], str]) -> TransitionSketch:
        """Build the global DAG old -> new (old None: initial placement), its cost and per-node parts."""


@runtime_checkable
class TransitionObserver(Protocol):
    """Optional part of a PlannerPort: learns L_tran from completed transitions (a port without it, such
    as a test's fake, simply never corrects its transition cost)."""

    def observe_transition(self, job: dict[str, Any], transition: dict[str, Any]) -> None:
        """Feed one completed transition (its store row: id, dag, predicted_s, measured_s, bytes_moved)."""


# --- plans as stored data -------------------------------------------------------------------------


def plan_to_dict(plan: GlobalPlan) -> dict[str, Any]:
    return {"version": plan.version, "stages": [
        {"model_stage": s.model_stage, "tp": s.layout.tp, "pp": s.layout.pp,
         "gpu_sets": [list(g) for g in s.gpu_sets], "micro_batch_size": s.micro_batch_size,
         "grad_accum": s.grad_accum, "recompute": s.recompute} for s in plan.stages]}


def plan_from_dict(data: dict[str, Any]) -> GlobalPlan:
    return GlobalPlan(version=int(data["version"]), stages=tuple(
        StagePlan(model_stage=s["model_stage"], layout=Layout(int(s["tp"]), int(s["pp"])),
                  gpu_sets=tuple(tuple(int(g) for g in gs) for gs in s["gpu_sets"]),
                  micro_batch_size=int(s["micro_batch_size"]), grad_accum=int(s["grad_accum"]),
                  recompute=bool(s.get("recompute", False))) for s in data["stages"]))


def trigger_state_to_dict(ts: admission.TriggerState) -> dict[str, Any]:
    return {"gpu_pool": sorted(ts.gpu_pool), "references": {k.value: v for k, v in ts.references.items()},
            "thresholds": {k.value: v for k, v in ts.thresholds.items()},
            "last_crossing_step": {k.value: v for k, v in ts.last_crossing_step.items()},
            "h_steps": {k.value: v for k, v in ts.h_steps.items()}, "start_step": ts.start_step}


def trigger_state_from_dict(d: dict[str, Any]) -> admission.TriggerState:
    sig = admission.Signal
    return admission.TriggerState(
        gpu_pool=frozenset(int(g) for g in d["gpu_pool"]),
        references={sig(k): float(v) for k, v in d["references"].items()},
        thresholds={sig(k): float(v) for k, v in d["thresholds"].items()},
        last_crossing_step={sig(k): int(v) for k, v in d["last_crossing_step"].items()},
        h_steps={sig(k): float(v) for k, v in d["h_steps"].items()}, start_step=int(d["start_step"]))


def _latency(prediction: Any) -> float | None:
    return None if prediction is None else float(prediction.step_latency_s)
