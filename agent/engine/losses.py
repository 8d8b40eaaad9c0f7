"""Shared RL losses: token log-probs, GAE, clipped policy loss, clipped value loss, KL terms.

All per-token losses take a ``weight`` tensor (response mask divided by the number of response tokens
in the whole mini-batch): summing micro-batch losses then gives the token mean over the global batch,
whatever the DP degree, micro-batch size or pipeline schedule.
"""

from __future__ import annotations

import torch


def vocab_logprobs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p over the vocabulary, in fp32 whatever the logits' dtype: [B, T, V]."""
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def pick(logp: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """``logp[b, t, next_tokens[b, t]]``: [B, T]."""
    return logp.gather(-1, next_tokens.long().unsqueeze(-1)).squeeze(-1)


def token_logprobs(logits: torch.Tensor, next_tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(next_tokens[b, t] | prefix up to t) from ``logits[b, t]``; shapes [B, T, V], [B, T]."""
    return pick(vocab_logprobs(logits, temperature), next_tokens)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    n = mask.sum().clamp(min=1)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / n
    return (x - mean) * torch.rsqrt(var + eps) * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens; returns (advantages, returns).

    ``rewards``, ``values``, ``mask``: [B, T] aligned to action tokens; masked positions are skipped
    (their value and reward are treated as absent, so trailing padding does not leak into the return).
    """
    b, t = rewards.shape
    adv = torch.zeros_like(rewards)
    last = torch.zeros(b, dtype=rewards.dtype)
    next_value = torch.zeros(b, dtype=rewards.dtype)
    for i in reversed(range(t)):
        m = mask[:, i]
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        last_new = delta + gamma * lam * last
        adv[:, i] = last_new * m
        last = torch.where(m > 0, last_new, last)
        next_value = torch.where(m > 0, values[:, i], next_value)
    return adv, adv + values * mask


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, weight: torch.Tensor,
                clip: float) -> torch.Tensor:
    """PPO clipped surrogate, summed with ``weight``."""
    ratio = torch.exp(logp - old_logp)
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    return -(surr * weight).sum()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Unbiased, non-negative estimator of KL(pi || ref) per token (Schulman's k3)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, weight: torch.Tensor,
               clip: float) -> torch.Tensor:
    """Clipped value loss (0.5 * max of squared errors), summed with ``weight``."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    err = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * (err * weight).sum()


def kl_shaped_rewards(scores: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor,
                      mask: torch.Tensor, beta: float) -> torch.Tensor:
    """PPO's KL reward: -beta * (log pi - log ref) per token, the sequence score on the last token."""
    r = -beta * (old_logp - ref_logp) * mask
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)
    return r + scores[:, None] * last


# --- packed per-token targets --------------------------------------------------------------------
# A pipeline schedule hands the loss function one target tensor per micro-batch, so every per-token
# input of a loss travels packed as float columns [B, T, k]; token ids stay exact in float32 up to 2**24.
ACTOR_COLUMNS = ("next_token", "old_logp", "advantage", "ref_logp", "weight")
CRITIC_COLUMNS = ("old_value", "return", "weight")


def pack(*columns: torch.Tensor) -> torch.Tensor:
    return torch.stack([c.float() for c in columns], dim=-1)


# what a loss tallies while it trains (``LossStats``): token-weighted sums over the calls of one step
ACTOR_STATS = ("weight", "clipped", "entropy", "kl")
CRITIC_STATS = ("weight", "clipped")


class LossStats:
    """Token-weighted sums a loss adds up over its micro-batches (no gradient, a few ops per call).

    Each rank holds the sums of the rows it computed the loss on; since ``weight`` is normalised over
    the whole mini-batch, the sums of every rank that computed a loss, divided by the summed weight,
    give the step's token mean whatever the layout (TP ranks of a replica repeat the same sums, and
    every replica has as many of them)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.sums = torch.zeros(len(names), dtype=torch.float64)

    def add(self, weight: torch.Tensor, **terms: torch.Tensor) -> None:
        vals = [weight.sum()] + [(terms[n] * weight).sum() for n in self.names[1:]]
        self.sums += torch.stack([v.double() for v in vals])

    def as_dict(self) -> dict[str, float]:
        return dict(zip(self.names, self.sums.tolist()))


class ActorLoss:
    """Clipped policy loss plus an optional k3 KL-to-reference term (GRPO), on packed targets.

    ``stats`` tallies, per token, whether the clip was active (the ratio outside ``1 +- clip`` on the
    side the advantage pushes), the policy's entropy and its k3 KL to the reference."""

    def __init__(self, *, clip: float, kl_coef: float = 0.0, temperature: float = 1.0) -> None:
        self.clip, self.kl_coef, self.temperature = clip, kl_coef, temperature
        self.stats = LossStats(ACTOR_STATS)

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        next_token, old_logp, adv, ref_logp, weight = target.unbind(-1)
        logp_all = vocab_logprobs(logits, self.temperature)  # kept for the entropy below
        logp = pick(logp_all, next_token)
        loss = policy_loss(logp, old_logp, adv, weight, self.clip)
        kl = kl_k3(logp, ref_logp)
        if self.kl_coef:
            loss = loss + self.kl_coef * (kl * weight).sum()
        with torch.no_grad():
            ratio = torch.exp(logp - old_logp)
            clipped = ((ratio > 1 + self.clip) & (adv > 0)) | ((ratio < 1 - self.clip) & (adv < 0))
            # the entropy of the tokens that count (weight != 0: responses, not prompts or padding), so the
            # [N, V] temporary is as small as the step allows; the zero-weight rows add nothing to the sums
            counted = weight != 0
            lp = logp_all.detach()[counted]
            entropy = torch.zeros_like(weight)
            entropy[counted] = lp.exp().mul_(lp).sum(-1).neg_()
            self.stats.add(weight, clipped=clipped.float(), entropy=entropy, kl=kl.detach())
        return loss


class CriticLoss:
    """``stats`` tallies the tokens whose value the clip held back (the clipped error was the larger)."""

    def __init__(self, *, clip: float) -> None:
        self.clip = clip
        self.stats = LossStats(CRITIC_STATS)

    def __call__(self, values: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        old_values, returns, weight = target.unbind(-1)
        with torch.no_grad():
            v = values.float()
            clipped = ((old_values + (v - old_values).clamp(-self.clip, self.clip) - returns) ** 2 > (v - returns) ** 2)
            self.stats.add(weight, clipped=clipped.float())
        return value_loss(values.float(), old_values, returns, weight, self.clip)
