"""Small jobs and clusters shared by the planner tests."""

from __future__ import annotations

from planner.hardware import cluster_preset
from planner.models import model_preset
from planner.workflow import JobSpec, Workload, same_model_job, workflow_preset


def job(algo: str = "ppo", model: str = "llama-3.1-8b", prompts: int = 64, samples: int = 1,
        prompt_tokens: int = 1024, response_tokens: int = 2048, mini_batches: int = 1) -> JobSpec:
    w = Workload(prompts_per_step=prompts, samples_per_prompt=samples, prompt_tokens=prompt_tokens,
                 response_tokens=response_tokens, train_mini_batches_per_step=mini_batches)
    return same_model_job(workflow_preset(algo), model_preset(model), w)


def h200(gpus: int, gpus_per_node: int | None = None):  # type: ignore[no-untyped-def]
    return cluster_preset("h200", gpus, gpus_per_node)
