"""ReMax: REINFORCE with the reward of a greedy rollout of the same prompt as the baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class ReMaxConfig:
    clip: float = 0.2
    kl_coef: float = 0.01


def remax_advantages(scores: torch.Tensor, greedy_scores: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    return (scores - greedy_scores)[:, None] * action_mask
