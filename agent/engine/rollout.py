"""Torch rollout backend: batched sampling with a KV cache, stop tokens, temperature and top-p.

Works on any ``LMRunner``: a whole model in one process, a tensor-parallel model (every rank gets the
full logits), or a pipeline (``agent.engine.parallel.PipelineRunner``). Sampling draws one uniform per
(sequence, position) from a generator seeded by the sequence's own seed, so a sequence's tokens do not
depend on which DP replica or micro-batch produced it.

Batch layout (shared by all stages): prompts left-padded to ``prompt_tokens``, responses right-padded
to ``max_new_tokens``; ``T = prompt_tokens + max_new_tokens`` is fixed, so pipeline shapes are fixed.
Per-token tensors are aligned to logits positions: column ``t`` scores token ``t + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from agent.engine.model import Decoder, KVCache
from planner.errors import SpecError


class LMRunner(Protocol):
    def begin(self, batch: int, max_tokens: int) -> None: ...

    def last_logits(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` of the last new position, on every rank that drives sampling."""
        ...

    def end(self) -> None: ...


class LocalRunner:
    """A whole (possibly tensor-parallel) decoder in this process, on CPU or a GPU: sampling state
    stays on the CPU, the model's inputs go to its device and the last logits come back."""

    def __init__(self, model: Decoder) -> None:
        self.model = model
        self.device = next(model.parameters()).device

    def begin(self, batch: int, max_tokens: int) -> None:
        self.model.cache = KVCache(batch, max_tokens)

    def last_logits(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(ids.to(self.device), attention_mask.to(self.device))[:, -1]
        return out.float().cpu()

    def end(self) -> None:
        self.model.cache = None


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise SpecError("sampling.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise SpecError("sampling.temperature", f"must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecError("sampling.top_p", f"must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Rollout:
    tokens: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] 1 = real token
    action_mask: torch.Tensor  # [B, T] float, 1 where column t scores a generated token t + 1
    logprobs: torch.Tensor  # [B, T] float, behaviour log-probs (temperature applied), aligned like action_mask
    prompt_tokens: int

    @property
    def next_tokens(self) -> torch.Tensor:
        return torch.cat([self.tokens[:, 1:], torch.zeros_like(self.tokens[:, :1])], dim=1)

    def responses(self) -> list[list[int]]:
        keep = self.attention_mask[:, self.prompt_tokens:].bool()
        return [row[m].tolist() for row, m in zip(self.tokens[:, self.prompt_tokens:], keep)]

    def select(self, rows: slice) -> Rollout:
        return Rollout(tokens=self.tokens[rows], attention_mask=self.attention_mask[rows],
                       action_mask=self.action_mask[rows], logprobs=self.logprobs[rows],
                       prompt_tokens=self.prompt_tokens)


def left_pad(prompts: list[list[int]], prompt_tokens: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(prompts), prompt_tokens), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), prompt_tokens), dtype=torch.long)
    for i, p in enumerate(prompts):
        if len(p) > prompt_tokens:
            raise SpecError("prompt_tokens", f"prompt {i} has {len(p)} tokens > prompt_tokens={prompt_tokens}")
        ids[i, prompt_tokens - len(p):] = torch.tensor(p)
        mask[i, prompt_tokens - len(p):] = 1
    return ids, mask


def sample_top_p(probs: torch.Tensor, u: torch.Tensor, top_p: float) -> torch.Tensor:
    """Inverse-CDF sampling from the top-p nucleus of ``probs`` [B, V] with uniforms ``u`` [B]."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(-1)
    keep = (cum - sorted_p) < top_p  # the first token is always kept
    sorted_p = sorted_p * keep
    cum = sorted_p.cumsum(-1)
    target = (u * cum[:, -1])[:, None]
    idx = torch.searchsorted(cum, target).clamp(max=probs.shape[-1] - 1)
    return order.gather(-1, idx).squeeze(-1)


@torch.no_grad()
def generate(runner: LMRunner, prompts: list[list[int]], seeds: list[int], params: SamplingParams, *,
             prompt_tokens: int, pad_id: int) -> Rollout:
    """Generate up to ``max_new_tokens`` per prompt; a row stops after any of ``stop_ids``."""
    b, r = len(prompts), params.max_new_tokens
    ids, mask = left_pad(prompts, prompt_tokens, pad_id)
    uniforms = torch.stack([torch.rand(r, generator=torch.Generator().manual_seed(s)) for s in seeds])
    tokens = torch.cat([ids, torch.full((b, r), pad_id, dtype=torch.long)], dim=1)
    attn = torch.cat([mask, torch.zeros((b, r), dtype=torch.long)], dim=1)
    logprobs = torch.zeros((b, prompt_tokens + r))
    done = torch.zeros(b, dtype=torch.bool)
    stops = torch.tensor(params.stop_ids, dtype=torch.long)
    runner.begin(b, prompt_tokens + r)
    try:
        step_ids = ids
        for i in range(r):
            pos = prompt_tokens + i
            logits = runner.last_logits(step_ids, attn[:, :pos]).float() / params.temperature
            logp = torch.log_softmax(logits, dim=-1)
            if params.greedy:
                nxt = logits.argmax(-1)
            else:
                nxt = sample_top_p(logp.exp(), uniforms[:, i], params.top_p)
            live = ~done
            tokens[:, pos] = torch.where(live, nxt, torch.full_like(nxt, pad_id))
            attn[:, pos] = live.long()
            logprobs[:, pos - 1] = torch.where(live, logp.gather(-1, nxt[:, None]).squeeze(-1), 0.0)
            done = done | (live & torch.isin(nxt, stops))
            step_ids = tokens[:, pos:pos + 1]
            if bool(done.all()):
                break
    finally:
        runner.end()
    action = torch.zeros((b, prompt_tokens + r))
    action[:, prompt_tokens - 1:-1] = attn[:, prompt_tokens:].float()
    return Rollout(tokens=tokens, attention_mask=attn, action_mask=action, logprobs=logprobs,
                   prompt_tokens=prompt_tokens)
