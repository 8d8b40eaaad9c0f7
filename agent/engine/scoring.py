"""A step's scores, one per sequence: from the reward model's last-token value, or from a reward
function (``agent.engine.rewards``), evaluated once and shared with every rank where it may not be
deterministic. Collective where the function is a user's: every rank calls it in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from agent.engine.rewards import RewardError, RewardFn
from agent.engine.rollout import Rollout
from agent.engine.tasks import Problem


def model_scores(engine: Any, roll: Rollout) -> torch.Tensor:
    """The reward model's value at each sequence's last real token (``engine``: reward-inf's
    StageEngine; a forward over the whole rollout, collective over its ranks)."""
    vals = engine.forward(roll.tokens, roll.attention_mask, roll.next_tokens, lambda y, e: y)
    last = roll.attention_mask.shape[1] - 1 - roll.attention_mask.flip(1).argmax(1)
    return vals.gather(1, last[:, None]).squeeze(1)


def function_scores(roll: Rollout, problems: list[Problem], reward: RewardFn, tok: Any,
                    rollout: str) -> tuple[torch.Tensor, list[tuple[int, str]]]:
    """(scores, failures) from the reward function. A user's function runs once, on rank 0, and its
    scores are broadcast (it may not be deterministic); the built-ins run on every rank. Failures are
    scored ``error_score`` and returned as (sequence, reason), the reason naming the ``rollout`` unless
    it is the sampled one; only rank 0 (or every rank of an inline function) sees them."""
    responses = roll.responses()
    scores = torch.zeros(len(problems), dtype=torch.float64)
    errors: list[tuple[int, str]] = []
    failed = torch.zeros(1)
    shared = not reward.cfg.inline and dist.is_initialized() and dist.get_world_size() > 1
    if not shared or dist.get_rank() == 0:
        try:
            report = reward(prompts=[pr.prompt for pr in problems],
                            responses=[tok.decode(r) for r in responses],
                            ground_truths=[pr.answer for pr in problems],
                            finished=[tok.terminated(r) for r in responses])
            scores = torch.tensor(report.scores, dtype=torch.float64)
            errors = [(i, reason if rollout == "sampled" else f"{rollout} rollout: {reason}")
                      for i, reason in report.errors]
        except Exception:
            if not shared:
                raise
            failed.fill_(1.0)
            dist.broadcast(failed, 0)  # the other ranks stop with it instead of waiting
            raise
    if shared:
        dist.broadcast(failed, 0)
        if failed.item():
            raise RewardError(reward.cfg.function, None, "failed on rank 0 (see its error)")
        dist.broadcast(scores, 0)
    return scores.float(), errors
