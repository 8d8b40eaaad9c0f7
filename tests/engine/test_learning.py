"""On a synthetic verifiable task (sort 3 digits, byte tokenizer, rule reward) PPO and GRPO raise the
mean reward, and the task accuracy inside it, within a CPU-sized run with a fixed seed. ReMax runs."""

from __future__ import annotations

import math

import pytest
import torch

from agent.engine.loop import RLLoop, RunConfig, StepResult, uniform_plan
from agent.engine.tasks import SortDigits
from planner.plan import Layout


def train(cfg: RunConfig, steps: int) -> list[StepResult]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    loop = RLLoop(cfg, uniform_plan(cfg, Layout(1, 1), (0,)))
    return [loop.step(s) for s in range(steps)]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def assert_learns(runs: list[StepResult]) -> None:
    first, last = runs[:10], runs[-10:]
    s0, s1 = mean([r.mean_score for r in first]), mean([r.mean_score for r in last])
    a0, a1 = mean([r.mean_accuracy for r in first]), mean([r.mean_accuracy for r in last])
    # random init scores ~0.02; formatting alone (random digits) gives ~0.25 with accuracy ~0.075, so
    # accuracy above 0.1 means the policy learned something about sorting, not only the format
    assert s1 > s0 + 0.12, (s0, s1)
    assert a1 > max(a0 + 0.04, 0.1), (a0, a1)


@pytest.mark.slow
def test_grpo_raises_reward() -> None:
    cfg = RunConfig(algo="grpo", task=SortDigits(num_digits=3), prompts_per_step=16, actor_lr=3e-3,
                    train_mini_batches_per_step=4, seed=0)
    assert_learns(train(cfg, 60))


@pytest.mark.slow
def test_ppo_raises_reward() -> None:
    cfg = RunConfig(algo="ppo", task=SortDigits(num_digits=3), prompts_per_step=32, actor_lr=3e-3, critic_lr=3e-3,
                    train_mini_batches_per_step=4, seed=0)
    # 140 steps: at 100 the last ten steps' accuracy sat on the 0.1 line (seed 0: 0.099 on this machine's
    # kernels, above it on others); by 140, seeds 0-2 reach 0.14, 0.27 and 0.15
    runs = train(cfg, 140)
    assert_learns(runs)
    assert all(r.critic_loss is not None for r in runs)


def test_remax_step_runs_with_greedy_baseline() -> None:
    cfg = RunConfig(algo="remax", task=SortDigits(num_digits=3), prompts_per_step=8, seed=0)
    runs = train(cfg, 3)
    assert {"actor-gen", "actor-gen-greedy", "ref-inf", "actor-train"} <= set(runs[-1].stage_seconds)
    assert all(math.isfinite(r.actor_loss) for r in runs)  # neither NaN nor inf
