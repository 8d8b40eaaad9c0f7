"""RL losses against hand-computed values: GAE, clipped surrogate, value clipping, KL shaping, GRPO
group normalisation, ReMax baseline."""

from __future__ import annotations

import math

import pytest
import torch

from agent.engine.grpo import GRPOConfig, grpo_advantages
from agent.engine.losses import gae, kl_k3, kl_shaped_rewards, policy_loss, token_logprobs, value_loss
from agent.engine.remax import remax_advantages
from agent.engine.tasks import ByteTokenizer, Problem, SortDigits, problems_for_step, rule_reward


def test_gae_matches_the_recursion_by_hand() -> None:
    r = torch.tensor([[0.0, 1.0, 2.0, 0.0]])
    v = torch.tensor([[0.5, 0.25, 1.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    g, lam = 0.9, 0.8
    d2 = 2.0 - 1.0
    d1 = 1.0 + g * 1.0 - 0.25
    d0 = 0.0 + g * 0.25 - 0.5
    a2, a1 = d2, d1 + g * lam * d2
    a0 = d0 + g * lam * a1
    adv, ret = gae(r, v, m, g, lam)
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a1 + 0.25, a2 + 1.0, 0.0]]))


def test_policy_loss_clips_the_ratio() -> None:
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    w = torch.ones(1, 3) / 3
    # ratios 1.5 (clipped to 1.2 for A>0), 0.5 (clipped to 0.8 for A<0: min(-0.5, -0.8) = -0.8), 1.1
    assert float(policy_loss(logp, old, adv, w, 0.2)) == pytest.approx(-(1.2 - 0.8 + 1.1) / 3, rel=1e-5)


def test_value_loss_takes_the_worse_of_clipped_and_unclipped() -> None:
    v = torch.tensor([[2.0]])
    old = torch.tensor([[0.0]])
    ret = torch.tensor([[1.0]])
    # unclipped error (2-1)^2 = 1; clipped value 0.2 -> (0.2-1)^2 = 0.64; max = 1
    assert float(value_loss(v, old, ret, torch.ones(1, 1), 0.2)) == pytest.approx(0.5)


def test_kl_terms() -> None:
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.0, -1.0]])
    assert float(kl_k3(logp, ref)[0, 0]) == 0.0
    assert float(kl_k3(logp, ref)[0, 1]) == pytest.approx(math.exp(1.0) - 1.0 - 1.0)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    r = kl_shaped_rewards(torch.tensor([3.0]), torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-1.0, -1.0, 0.0]]),
                          mask, beta=0.5)
    torch.testing.assert_close(r, torch.tensor([[0.0, 0.5 + 3.0, 0.0]]))


def test_grpo_and_remax_advantages() -> None:
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    mask = torch.ones(8, 2)
    adv = grpo_advantages(scores, mask, GRPOConfig(samples_per_prompt=4))
    assert float(adv[0, 0]) > 0 > float(adv[1, 0])
    assert float(adv[:4].sum()) == pytest.approx(0.0, abs=1e-5)
    assert torch.equal(adv[4:], torch.zeros(4, 2))  # a group with one score carries no signal
    torch.testing.assert_close(remax_advantages(torch.tensor([1.0, 0.5]), torch.tensor([0.5, 0.5]), torch.ones(2, 3)),
                               torch.tensor([[0.5] * 3, [0.0] * 3]))


def test_rule_reward_and_prompts() -> None:
    tok = ByteTokenizer()
    p = Problem("312>", "123")
    assert rule_reward(p, tok.encode("123", bos=False) + [tok.eos_id], tok) == pytest.approx(1.0)
    assert rule_reward(p, tok.encode("123", bos=False), tok) == pytest.approx(0.9)  # not stopped
    assert rule_reward(p, tok.encode("abc", bos=False), tok) == 0.0
    assert 0 < rule_reward(p, tok.encode("999", bos=False), tok) < 0.3
    a = problems_for_step(SortDigits(), seed=1, step=5, count=6)
    assert a == problems_for_step(SortDigits(), seed=1, step=5, count=6)
    assert a != problems_for_step(SortDigits(), seed=1, step=6, count=6)
    assert all(pr.answer == "".join(sorted(pr.prompt[:-1])) for pr in a)


def test_token_logprobs_are_computed_in_fp32_from_low_precision_logits() -> None:
    """bf16 logits (as a bf16 model returns them) are upcast before the softmax: the log-probs equal the
    fp32 computation on the same values, where a bf16 log_softmax would be off by ~1e-2."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 300, generator=g) * 4).to(torch.bfloat16)
    nxt = torch.randint(0, 300, (2, 5), generator=g)
    got = token_logprobs(logits, nxt, temperature=0.7)
    want = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(-1, nxt[..., None]).squeeze(-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    in_bf16 = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, nxt[..., None]).squeeze(-1).float()
    assert (in_bf16 - want).abs().max() > 1e-3  # the test can tell the two apart
