"""PPO: KL-shaped token rewards, GAE advantages from critic values, whitened advantages.

The actor trains with the clipped surrogate (``losses.ActorLoss``, no KL term: the KL is in the
reward), the critic with the clipped value loss on the GAE returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent.engine.losses import gae, kl_shaped_rewards, masked_whiten
from planner.errors import SpecError


@dataclass(frozen=True, kw_only=True, slots=True)
class PPOConfig:
    gamma: float = 1.0
    lam: float = 0.95
    clip: float = 0.2
    value_clip: float = 0.2
    kl_beta: float = 0.01
    whiten_advantages: bool = True

    def __post_init__(self) -> None:
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise SpecError(f"ppo.{name}", f"must be in [0, 1], got {getattr(self, name)}")
        if self.clip <= 0 or self.value_clip <= 0:
            raise SpecError("ppo.clip", "clip and value_clip must be > 0")


def ppo_advantages(scores: torch.Tensor, action_mask: torch.Tensor, old_logp: torch.Tensor,
                   ref_logp: torch.Tensor, values: torch.Tensor,
                   cfg: PPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, T] aligned to action columns."""
    rewards = kl_shaped_rewards(scores, old_logp, ref_logp, action_mask, cfg.kl_beta)
    adv, returns = gae(rewards, values * action_mask, action_mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        adv = masked_whiten(adv, action_mask)
    return adv, returns
