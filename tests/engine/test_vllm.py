"""vLLM backend: the HF config a ModelSpec maps to (everywhere); on a GPU with vLLM installed,
greedy tokens equal the torch backend's, pushed weights take effect, and sleep frees memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agent.engine.model import build_decoder
from agent.engine.rollout import LocalRunner, SamplingParams, generate
from agent.engine.vllm_backend import hf_config, write_model_dir
from planner.models import QWEN3_14B, TINY_3M, ModelSpec

GPU_SPEC = ModelSpec(name="g", num_layers=2, hidden_size=128, num_attention_heads=4, num_kv_heads=2, head_dim=32,
                     ffn_hidden_size=256, vocab_size=512, rope_theta=10_000.0)


def test_hf_config_of_modelspec(tmp_path: Path) -> None:
    c = hf_config(TINY_3M)
    assert c["model_type"] == "llama" and c["num_key_value_heads"] == 4 and c["intermediate_size"] == 688
    q = hf_config(QWEN3_14B)
    assert q["architectures"] == ["Qwen3ForCausalLM"] and q["rope_theta"] == 1_000_000.0
    d = write_model_dir(TINY_3M, tmp_path / "m")
    assert json.loads((d / "config.json").read_text())["hidden_size"] == 256


@pytest.mark.vllm
def test_vllm_greedy_matches_torch_and_weights_push(tmp_path: Path) -> None:
    from agent.engine.vllm_backend import VLLMBackend

    a, b = build_decoder(GPU_SPEC, seed=1), build_decoder(GPU_SPEC, seed=2)
    eng = VLLMBackend(GPU_SPEC, write_model_dir(GPU_SPEC, tmp_path / "m", a.state_dict()), dtype="float32",
                      gpu_memory_utilization=0.2)
    prompts = [[1, 2, 3], [7, 8], [9, 10, 11, 12]]
    params = SamplingParams(max_new_tokens=6, greedy=True)
    for model in (a, b):
        if model is b:
            eng.push_weights(model.state_dict().items())
        want = generate(LocalRunner(model), prompts, [0, 0, 0], params, prompt_tokens=4, pad_id=0)
        got = eng.generate(prompts, [0, 0, 0], params, prompt_tokens=4, pad_id=0)
        assert torch.equal(got.tokens, want.tokens)
    before = torch.cuda.mem_get_info()[0]
    eng.release()
    assert torch.cuda.mem_get_info()[0] > before  # sleep mode handed memory back
    eng.wake()


@pytest.mark.vllm
def test_grpo_loop_with_vllm_rollouts() -> None:
    from agent.engine.loop import RLLoop, RunConfig, uniform_plan
    from planner.plan import Layout

    cfg = RunConfig(algo="grpo", prompts_per_step=4, rollout_backend="vllm", seed=0)
    loop = RLLoop(cfg, uniform_plan(cfg, Layout(1, 1), (0,)))
    runs = [loop.step(s) for s in range(2)]
    assert all(0.0 <= r.mean_score <= 1.0 for r in runs)
    assert loop.vllm is not None and runs[-1].mean_response_tokens > 0
