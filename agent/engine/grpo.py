"""GRPO: several samples per prompt, group-normalised sequence advantages, no critic.

The KL to the reference enters the loss (k3 estimator, ``losses.ActorLoss(kl_coef=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from planner.errors import SpecError


@dataclass(frozen=True, kw_only=True, slots=True)
class GRPOConfig:
    samples_per_prompt: int = 4
    clip: float = 0.2
    kl_coef: float = 0.01
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.samples_per_prompt < 2:
            raise SpecError("grpo.samples_per_prompt", f"needs >= 2 samples to normalise, got "
                            f"{self.samples_per_prompt}")


def grpo_advantages(scores: torch.Tensor, action_mask: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """Rows are grouped by prompt: rows ``[k*g, (k+1)*g)`` share prompt ``k`` (g = samples per prompt)."""
    g = cfg.samples_per_prompt
    if scores.shape[0] % g:
        raise SpecError("grpo.samples_per_prompt", f"{g} does not divide the batch of {scores.shape[0]}")
    grouped = scores.view(-1, g)
    norm = (grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + cfg.eps)
    return norm.reshape(-1)[:, None] * action_mask
