"""A GRPO run whose actor DP degree changes mid-way (2 -> 1, the surviving replica on another rank)
keeps the global batch, the data order and the sampled tokens of a DP=1 run, and ends on the same
weights: per-replica batch and accumulation adjust, the live AdamW state moves with ``replan``."""

from __future__ import annotations

import pytest
import torch
from engine_dist import run_workers

from agent.engine.grpo import GRPOConfig
from agent.engine.loop import RLLoop, RunConfig, rebatched
from agent.engine.model import build_decoder
from agent.engine.tasks import SortDigits
from planner.plan import GlobalPlan, Layout, StagePlan

ONE = Layout(1, 1)
CFG = RunConfig(algo="grpo", task=SortDigits(num_digits=3), prompts_per_step=4, grpo=GRPOConfig(samples_per_prompt=4),
                train_mini_batches_per_step=2, seed=11)


def plan(dp_gpus: tuple[tuple[int, ...], ...], mbs: int, accum: int) -> GlobalPlan:
    n = CFG.sequences_per_step
    return GlobalPlan(version=0, stages=(
        StagePlan(model_stage="actor-gen", layout=ONE, gpu_sets=dp_gpus, micro_batch_size=n // len(dp_gpus)),
        StagePlan(model_stage="ref-inf", layout=ONE, gpu_sets=((0,),), micro_batch_size=n // 2),
        StagePlan(model_stage="actor-train", layout=ONE, gpu_sets=dp_gpus, micro_batch_size=mbs, grad_accum=accum),
    ))


def actor_weights(loop: RLLoop) -> dict[str, torch.Tensor]:
    eng = loop.engines["actor-train"]
    if eng.coord is None or eng.coord.replica != 0:
        return {}
    return {n: t.clone() for n, t in eng.local_tensors()}


def worker(rank: int, world: int) -> dict[str, object]:
    torch.manual_seed(0)
    fixed = plan(((0,),), mbs=4, accum=2)
    a = RLLoop(CFG, fixed, rank=rank)
    runs_a = [a.step(s) for s in range(3)]
    wide = plan(((0,), (1,)), mbs=2, accum=2)
    # rank 0's replica is dropped, rank 1's carries on; accumulation doubles to keep the global batch
    narrow = plan(((1,),), mbs=2, accum=4)
    assert rebatched(wide.stage("actor-train"), ((1,),)) == narrow.stage("actor-train")
    b = RLLoop(CFG, wide, rank=rank)
    runs_b = [b.step(s) for s in range(2)]
    b.replan(narrow)
    runs_b.append(b.step(2))
    return {"a_tokens": [r.tokens for r in runs_a], "b_tokens": [r.tokens for r in runs_b],
            "a_scores": [r.mean_score for r in runs_a], "b_scores": [r.mean_score for r in runs_b],
            "a_w": actor_weights(a), "b_w": actor_weights(b)}


@pytest.mark.multiprocess
def test_dp_change_keeps_batch_order_and_result() -> None:
    r0, r1 = run_workers(worker, 2)
    for r in (r0, r1):
        for ta, tb in zip(r["a_tokens"], r["b_tokens"]):
            assert torch.equal(ta, tb)  # same prompts, same order, same samples
        assert r["a_scores"] == r["b_scores"]
    a_w, b_w = r0["a_w"], r1["b_w"]  # A trained on rank 0; B ended on rank 1
    assert a_w and set(a_w) == set(b_w)
    init = build_decoder(CFG.model, seed=CFG.seed).state_dict()
    moved = max(float((a_w[n] - init[n]).abs().max()) for n in a_w)
    assert moved > 1e-3  # training really changed the weights, so equal weights mean equal training
    for n in a_w:
        # Adam amplifies summation-order noise of near-zero gradients: 1e-5 is ~0.3% of one update
        torch.testing.assert_close(b_w[n], a_w[n], rtol=1e-4, atol=1e-5, msg=n)
