"""The Qwen2.5 presets (q/k/v biases): parameter counts include the biases, and the planner plans them
within their head counts (28 attention heads: TP 1, 2 or 4; never 8)."""

from __future__ import annotations

import pytest
from planner_jobs import h200, job

from planner.errors import SpecError
from planner.models import Head, model_preset
from planner.search import search


def test_the_biases_are_tensors_of_every_layer_split_like_their_projections() -> None:
    m = model_preset("qwen2.5-7b")
    biases = [t for t in m.tensors() if t.name.endswith(".bias")]
    assert len(biases) == 3 * m.num_layers
    q = next(t for t in biases if t.name == "model.layers.0.self_attn.q_proj.bias")
    k = next(t for t in biases if t.name == "model.layers.0.self_attn.k_proj.bias")
    assert q.shape == (28 * 128,) and k.shape == (4 * 128,) and q.parallel is k.parallel
    without = sum(t.numel for t in m.tensors(Head.LM) if not t.name.endswith(".bias"))
    assert m.num_params() - without == 28 * (3584 + 2 * 512)


def test_tp_follows_the_head_counts() -> None:
    m = model_preset("qwen2.5-7b")
    for tp in (1, 2, 4):
        m.check_tp(tp)
    with pytest.raises(SpecError, match="28"):
        m.check_tp(8)


def test_grpo_on_qwen25_7b_plans_on_16_gpus() -> None:
    res = search(job("grpo", model="qwen2.5-7b", prompts=64, samples=8, prompt_tokens=512, response_tokens=2048),
                 h200(16))
    assert res.prediction.feasible
    assert {s.layout.tp for s in res.plan.stages} <= {1, 2, 4}
    assert res.plan.gpus <= set(range(16))


def test_qk_norms_and_qkv_biases_together_are_refused() -> None:
    import dataclasses

    with pytest.raises(SpecError, match="model.qkv_bias"):
        dataclasses.replace(model_preset("qwen3-14b"), qkv_bias=True)
