"""Stand-ins for a prediction and a plan where admission only reads a latency and a version."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pred:
    step_latency_s: float


@dataclass(frozen=True)
class Plan:
    name: str
    version: int = 2
