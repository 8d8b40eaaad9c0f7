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
