"""Torch rollout: stop tokens end a row, per-sequence seeds make samples independent of the batch they
are in, top-p restricts to the nucleus, and log-probs match a fresh forward of the sampled tokens."""

from __future__ import annotations

import pytest
import torch

from agent.engine.losses import token_logprobs
from agent.engine.model import build_decoder
from agent.engine.rollout import LocalRunner, Rollout, SamplingParams, generate, sample_top_p
from planner.errors import SpecError
from planner.models import ModelSpec

SPEC = ModelSpec(name="s", num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2, head_dim=8,
                 ffn_hidden_size=48, vocab_size=40, rope_theta=10_000.0)
PAD = 39
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8], [9, 10]]


def run(prompts: list[list[int]], seeds: list[int], **kw: object) -> Rollout:
    model = build_decoder(SPEC, seed=0)
    params = SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 6), **kw)  # type: ignore[arg-type]
    return generate(LocalRunner(model), prompts, seeds, params, prompt_tokens=4, pad_id=PAD)


def test_samples_do_not_depend_on_batch_composition() -> None:
    whole = run(PROMPTS, [10, 11, 12, 13], temperature=1.5)
    halves = [run(PROMPTS[:2], [10, 11], temperature=1.5), run(PROMPTS[2:], [12, 13], temperature=1.5)]
    assert torch.equal(whole.tokens, torch.cat([h.tokens for h in halves]))
    assert not torch.equal(whole.tokens, run(PROMPTS, [20, 21, 22, 23], temperature=1.5).tokens)


def test_logprobs_match_a_forward_of_the_samples() -> None:
    model = build_decoder(SPEC, seed=0)
    roll = generate(LocalRunner(model), PROMPTS, [1, 2, 3, 4], SamplingParams(max_new_tokens=5, temperature=0.7),
                    prompt_tokens=4, pad_id=PAD)
    lp = token_logprobs(model(roll.tokens, roll.attention_mask), roll.next_tokens, 0.7)
    torch.testing.assert_close(lp * roll.action_mask, roll.logprobs, rtol=1e-5, atol=1e-5)
    assert roll.action_mask.sum() == 4 * 5


def test_greedy_tokens_are_the_argmax_of_a_forward_of_the_sequence() -> None:
    model = build_decoder(SPEC, seed=0)
    roll = generate(LocalRunner(model), PROMPTS, [0] * 4, SamplingParams(max_new_tokens=6, greedy=True),
                    prompt_tokens=4, pad_id=PAD)
    want = model(roll.tokens, roll.attention_mask).argmax(-1)[:, 3:-1]  # teacher-forced next-token argmax
    assert torch.equal(roll.tokens[:, 4:], want)
    assert len(set(roll.tokens[:, 4:].flatten().tolist())) > 1  # not one constant token


def test_stop_token_ends_a_row_and_pads_after_it() -> None:
    free = run(PROMPTS, [5, 6, 7, 8], temperature=2.0, max_new_tokens=8)
    stop = int(free.tokens[0, 4 + 2])  # the third token row 0 samples
    roll = run(PROMPTS, [5, 6, 7, 8], temperature=2.0, max_new_tokens=8, stop_ids=(stop,))
    resp = roll.responses()[0]
    assert resp[-1] == stop and stop not in resp[:-1] and len(resp) <= 3
    row = roll.tokens[0, 4 + len(resp):]
    assert bool((row == PAD).all()) and int(roll.attention_mask[0, 4 + len(resp):].sum()) == 0


def test_top_p_keeps_only_the_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).repeat(200, 1)
    u = torch.rand(200, generator=torch.Generator().manual_seed(0))
    picks = sample_top_p(probs, u, top_p=0.7)
    assert set(picks.tolist()) == {0, 1}
    assert set(sample_top_p(probs, u, top_p=1.0).tolist()) == {0, 1, 2, 3}
    greedy = run(PROMPTS, [1, 2, 3, 4], greedy=True)
    assert torch.equal(run(PROMPTS, [7, 7, 7, 7], top_p=1e-6).tokens, greedy.tokens)


def test_sampling_params_are_validated() -> None:
    with pytest.raises(SpecError, match="top_p"):
        SamplingParams(max_new_tokens=3, top_p=0.0)
    with pytest.raises(SpecError, match="temperature"):
        SamplingParams(max_new_tokens=3, temperature=0.0)


@pytest.mark.gpu
def test_torch_backend_on_gpu_matches_cpu_greedy() -> None:
    cpu = build_decoder(SPEC, seed=0)
    gpu = build_decoder(SPEC, seed=0).cuda()
    params = SamplingParams(max_new_tokens=6, greedy=True)
    want = generate(LocalRunner(cpu), PROMPTS, [0] * 4, params, prompt_tokens=4, pad_id=PAD)
    got = generate(LocalRunner(gpu), PROMPTS, [0] * 4, params, prompt_tokens=4, pad_id=PAD)
    assert torch.equal(got.tokens, want.tokens)
