"""A decision's stored record (Decision.to_dict) is the same plain data as the deep-copying form it
replaced (``dataclasses.asdict`` then plain), for a real search result on 8 H200s."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from enum import Enum
from typing import Any

from planner import admission
from planner.hardware import cluster_preset
from planner.models import model_preset
from planner.search import search
from planner.workflow import Workload, same_model_job, workflow_preset


def _reference(obj: Any) -> Any:
    """The record as it was made before: asdict for dataclasses without to_dict, then plain."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return _reference(obj.to_dict()) if hasattr(obj, "to_dict") else _reference(asdict(obj))
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, Mapping):
        return {(_reference(k) if isinstance(k, Enum) else str(k)): _reference(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [_reference(v) for v in obj]
        return sorted(items) if isinstance(obj, (set, frozenset)) else items
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def test_decision_record_matches_the_asdict_form() -> None:
    job = same_model_job(workflow_preset("ppo"), model_preset("llama-3.1-8b"),
                         Workload(prompts_per_step=64, prompt_tokens=1024, response_tokens=2048))
    cluster = cluster_preset("h200", 8)
    current = search(job, cluster)
    trigger = admission.Trigger(kind=admission.TriggerKind.URGENT, step=3, reasons=("test",))
    dec = admission.decide(trigger=trigger, current_plan=None, current_prediction=None,
                           replan=lambda: current, transition_s=lambda old, new: 4.0)
    record = dec.to_dict()
    assert record == _reference({
        "step": dec.step, "trigger": dec.trigger, "current_plan_version": dec.current_plan_version,
        "candidate_plan_version": dec.candidate_plan_version, "current_prediction": dec.current_prediction,
        "candidate_prediction": dec.candidate_prediction, "verdict": dec.verdict,
        "payback_ratio": dec.verdict.payback_ratio, "candidate_plan": dec.candidate_plan,
        "infeasible_reasons": dec.infeasible_reasons, "passed_over": dec.passed_over})
    assert record["candidate_prediction"]["step_latency_s"] == current.prediction.step_latency_s
    assert json.loads(json.dumps(record)) == record  # plain: stores as JSON and reads back the same
