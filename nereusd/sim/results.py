"""What a simulated run records: one row per RL step, and the run's result with its summary."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.plan import GlobalPlan


@dataclass(kw_only=True, slots=True)
class StepRecord:
    step: int
    gpus: int
    step_s: float  # the RL step itself (0 when it failed every attempt)
    transition_s: float  # transitions executed at this step's safe point (ground truth)
    lost_s: float  # time lost to OOMs, node losses and restarts at this step
    response_tokens: float
    plan_version: int
    ooms: int = 0


@dataclass(kw_only=True)
class RunResult:
    policy: str
    gamma: float | None
    trace: str
    steps: list[StepRecord]
    transitions: list[dict[str, Any]] = field(default_factory=list)  # executed (not the initial placement)
    restarts: list[dict[str, Any]] = field(default_factory=list)  # checkpoint/restarts the controller fell back to
    decisions: int = 0
    decision_ms: list[float] = field(default_factory=list)
    controller_passes: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0  # process CPU time of the run (the fairer figure on a shared machine)
    prediction_errors: list[dict[str, float]] = field(default_factory=list)
    passed_over: list[dict[str, Any]] = field(default_factory=list)  # decisions that took a later plan, or none
    plans_run: dict[int, GlobalPlan] = field(default_factory=dict, repr=False)  # version -> plan stepped on
    port: Any = field(default=None, repr=False)  # the planner binding as the run left it (not serialised)
    truth: Any = field(default=None, repr=False)  # the ground truth of the run (not serialised)

    @property
    def run_s(self) -> float:
        return sum(r.step_s + r.transition_s + r.lost_s for r in self.steps)

    @property
    def transition_time_s(self) -> float:
        return sum(r.transition_s for r in self.steps)

    @property
    def ooms(self) -> int:
        return sum(r.ooms for r in self.steps)

    def summary(self) -> dict[str, Any]:
        done = [r for r in self.steps if r.step_s > 0]
        tokens = sum(r.response_tokens for r in done)
        n = max(1, len(self.steps))
        return {
            "policy": self.policy, "gamma": self.gamma, "trace": self.trace, "steps": len(self.steps),
            "mean_step_s": self.run_s / n,  # transitions and lost time included: what a user waits for
            "mean_step_compute_s": sum(r.step_s for r in done) / max(1, len(done)),
            "run_s": self.run_s, "transitions": len(self.transitions),
            "transition_s": self.transition_time_s,
            "transition_share": self.transition_time_s / self.run_s if self.run_s else 0.0,
            "ooms": self.ooms, "lost_s": sum(r.lost_s for r in self.steps), "restarts": len(self.restarts),
            "response_tokens_per_s": tokens / self.run_s if self.run_s else 0.0,
            "decisions": self.decisions, "controller_passes": self.controller_passes,
            "decision_ms_mean": sum(self.decision_ms) / len(self.decision_ms) if self.decision_ms else None,
            "decision_ms_max": max(self.decision_ms) if self.decision_ms else None,
            "wall_s": self.wall_s, "cpu_s": self.cpu_s,
            "controller_passes_per_s": self.controller_passes / self.wall_s if self.wall_s else None,
            "controller_passes_per_cpu_s": self.controller_passes / self.cpu_s if self.cpu_s else None,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "steps": [dataclasses.asdict(r) for r in self.steps],
                "transitions": self.transitions, "restarts": self.restarts, "prediction_errors": self.prediction_errors,
                "passed_over": self.passed_over}


def save_json(path: str | Path, data: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(p)
