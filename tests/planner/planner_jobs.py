"""Small jobs and clusters shared by the planner tests."""

from __future__ import annotations

from planner.hardware import LinkSpec, cluster_preset
from planner.models import ModelSpec, model_preset
from planner.workflow import JobSpec, Workload, same_model_job, workflow_preset


def job(algo: str = "ppo", model: str = "llama-3.1-8b", prompts: int = 64, samples: int = 1,
        prompt_tokens: int = 1024, response_tokens: int = 2048, mini_batches: int = 1) -> JobSpec:
    w = Workload(prompts_per_step=prompts, samples_per_prompt=samples, prompt_tokens=prompt_tokens,
                 response_tokens=response_tokens, train_mini_batches_per_step=mini_batches)
    return same_model_job(workflow_preset(algo), model_preset(model), w)


def h200(gpus: int, gpus_per_node: int | None = None):  # type: ignore[no-untyped-def]
    return cluster_preset("h200", gpus, gpus_per_node)


# A small model whose sizes all differ (4 layers, h=64, 8 heads of 16, 2 KV heads, f=96, vocab 1000), for
# tests that work figures out by hand: per decoder layer q 8,192 + k 2,048 + v 2,048 + o 8,192 + MLP
# 18,432 + 2 norms 128 = 39,040 parameters; embedding 64,000; LM head and final norm 64,064.
SMALL = ModelSpec(name="m", num_layers=4, hidden_size=64, num_attention_heads=8, num_kv_heads=2, head_dim=16,
                  ffn_hidden_size=96, vocab_size=1000, tie_word_embeddings=False, rope_theta=10_000.0)
# links whose figures differ from every preset's, so a swapped link changes a number
INTRA_LINK = LinkSpec(name="intra", bytes_per_s=7e9, latency_s=1e-5)
INTER_LINK = LinkSpec(name="inter", bytes_per_s=5e8, latency_s=3e-4)
