"""What one RL step measured beside its times: reward and response-length statistics of the rollout,
and the token-weighted sums the losses tallied while training (``agent.engine.losses.LossStats``).

Every rank builds one (picklable floats, no tensors); the rollout part is the same on every rank (the
batch is gathered), the loss sums are each rank's own. ``combine`` merges the ranks' into the step's
figures: clip fractions, entropy and KL as token means over the whole batch, whatever the layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class StepStats:
    reward_mean: float
    reward_std: float
    response_len_mean: float
    response_len_p95: float
    response_len_max: float
    response_tokens: float  # generated tokens of the whole step (every sequence)
    actor: dict[str, float] = field(default_factory=dict)  # LossStats sums of this rank (empty: none computed)
    critic: dict[str, float] = field(default_factory=dict)


def rollout_stats(scores: torch.Tensor, action_mask: torch.Tensor, *, actor: dict[str, float] | None = None,
                  critic: dict[str, float] | None = None) -> StepStats:
    lengths = action_mask.sum(1).double()
    s = scores.double()
    return StepStats(reward_mean=float(s.mean()), reward_std=float(s.std(correction=0)) if s.numel() else 0.0,
                     response_len_mean=float(lengths.mean()),
                     response_len_p95=float(torch.quantile(lengths, 0.95)) if lengths.numel() else 0.0,
                     response_len_max=float(lengths.max()) if lengths.numel() else 0.0,
                     response_tokens=float(lengths.sum()), actor=dict(actor or {}), critic=dict(critic or {}))


def _ratio(parts: Iterable[dict[str, float]], name: str) -> float | None:
    num = den = 0.0
    for p in parts:
        if p.get("weight", 0.0) > 0:
            num, den = num + p[name], den + p["weight"]
    return num / den if den > 0 else None


def combine(ranks: Iterable[StepStats]) -> dict[str, float | None]:
    """The step's figures from every rank's stats (None where no rank computed that loss)."""
    all_ = list(ranks)
    first = all_[0]
    out: dict[str, float | None] = {
        "reward_mean": first.reward_mean, "reward_std": first.reward_std,
        "response_len_mean": first.response_len_mean, "response_len_p95": first.response_len_p95,
        "response_len_max": first.response_len_max, "response_tokens": first.response_tokens,
        "clip_fraction": _ratio((r.actor for r in all_), "clipped"),
        "entropy": _ratio((r.actor for r in all_), "entropy"),
        "kl_ref": _ratio((r.actor for r in all_), "kl"),
        "value_clip_fraction": _ratio((r.critic for r in all_), "clipped"),
    }
    return {k: (None if v is not None and not math.isfinite(v) else v) for k, v in out.items()}
