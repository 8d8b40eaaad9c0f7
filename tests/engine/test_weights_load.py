"""A run starts from HF-layout safetensors: actor, reference and actor-gen hold the file's tensors; a
critic loaded from the same LM checkpoint keeps the trunk and gets a fresh value head."""

from __future__ import annotations

from pathlib import Path

import torch

from agent.engine.loop import TINY_BYTE, RLLoop, RunConfig, uniform_plan
from agent.engine.model import build_decoder, save_safetensors
from planner.plan import Layout


def test_run_loads_safetensors_per_role(tmp_path: Path) -> None:
    source = build_decoder(TINY_BYTE, seed=42)
    path = str(tmp_path / "actor.safetensors")
    save_safetensors(source, path)
    cfg = RunConfig(algo="ppo", prompts_per_step=4, actor_weights=(path,), critic_weights=(path,), seed=0)
    loop = RLLoop(cfg, uniform_plan(cfg, Layout(1, 1), (0,)))
    want = source.state_dict()
    for name in ("actor-gen", "ref-inf", "actor-train"):
        got = dict(loop.engines[name].local_tensors())
        assert all(torch.equal(got[n], want[n]) for n in want), name
    critic = dict(loop.engines["critic-train"].local_tensors())
    assert torch.equal(critic["model.layers.1.mlp.down_proj.weight"], want["model.layers.1.mlp.down_proj.weight"])
    assert "score.weight" in critic and "lm_head.weight" not in critic
    loop.step(0)  # and it trains from there
    after = dict(loop.engines["actor-train"].local_tensors())
    assert not torch.equal(after["lm_head.weight"], want["lm_head.weight"])


def test_learned_reward_scores_the_last_real_token() -> None:
    from agent.engine.rollout import Rollout
    from planner.models import Head

    cfg = RunConfig(algo="ppo", prompts_per_step=4, reward_model=TINY_BYTE, seed=3)
    loop = RLLoop(cfg, uniform_plan(cfg, Layout(1, 1), (0,)))
    assert "reward-inf" in loop.engines
    tokens = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(0))
    attn = torch.ones(4, 9, dtype=torch.long)
    attn[1, 6:] = 0  # row 1 stopped early: its score is read at position 5
    roll = Rollout(tokens=tokens, attention_mask=attn, action_mask=torch.zeros(4, 9), logprobs=torch.zeros(4, 9),
                   prompt_tokens=3)
    scores = loop._scores(0, roll, [])
    rm = build_decoder(TINY_BYTE, Head.VALUE, seed=cfg.seed + 2)
    with torch.no_grad():
        values = rm(tokens, attn)
    torch.testing.assert_close(scores, torch.stack([values[0, 8], values[1, 5], values[2, 8], values[3, 8]]))
