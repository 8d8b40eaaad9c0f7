"""A user's job on 2 real ranks (actor-gen DP2, ref-inf PP2, actor-train TP2): each replica takes its
rows of the prompt file's batch, the user's reward runs once (rank 0) and reaches every rank, and the
periodic export gathers TP shards and PP stages into the single-process run's weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_dist import run_workers

from agent.engine.data import DataConfig
from agent.engine.grpo import GRPOConfig
from agent.engine.hf_io import ExportConfig, full_state, read_hf_dir
from agent.engine.loop import RLLoop, RunConfig, uniform_plan
from agent.engine.model import load_safetensors
from agent.engine.rewards import RewardConfig
from planner.plan import GlobalPlan, Layout, StagePlan

PLAN = GlobalPlan(version=0, stages=(
    StagePlan(model_stage="actor-gen", layout=Layout(1, 1), gpu_sets=((0,), (1,)), micro_batch_size=8),
    StagePlan(model_stage="ref-inf", layout=Layout(1, 2), gpu_sets=((0, 1),), micro_batch_size=8),
    StagePlan(model_stage="actor-train", layout=Layout(2, 1), gpu_sets=((0, 1),), micro_batch_size=8),
))
REWARD = ("import os\n"
          "def digits(prompts, responses, ground_truths, finished, **kw):\n"
          "    with open(os.path.join(os.path.dirname(__file__), f'calls-{os.getpid()}'), 'a') as f:\n"
          "        f.write('x')\n"
          "    return [sum(c.isdigit() for c in r) / 4 for r in responses]\n")


def config(root: Path, export_dir: str) -> RunConfig:
    return RunConfig(algo="grpo", prompts_per_step=4, grpo=GRPOConfig(samples_per_prompt=4),
                     train_mini_batches_per_step=2, seed=3, max_prompt_tokens=6, max_new_tokens=4,
                     data=DataConfig(path=str(root / "p.jsonl")),
                     reward=RewardConfig(function="r.py:digits", base_dir=str(root)),
                     export=ExportConfig(dir=str(root / export_dir), every_steps=2, dtype="float32"))


def worker(rank: int, world: int, root: str) -> dict[str, object]:
    loop = RLLoop(config(Path(root), "dist"), PLAN, rank=rank)
    runs = [loop.step(s) for s in range(2)]
    ref = full_state(loop.engines["ref-inf"])  # PP2: stage 1 sends its tensors to rank 0
    assert loop.reward is not None
    loop.reward.close()
    return {"tokens": [r.tokens for r in runs], "scores": [r.mean_score for r in runs], "ref": ref}


@pytest.mark.multiprocess
def test_user_job_on_two_ranks_matches_one_process_and_exports_the_same_actor(tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"{i}{i + 1}>"}) + "\n" for i in range(10)))
    (tmp_path / "r.py").write_text(REWARD)
    torch.manual_seed(0)
    cfg = config(tmp_path, "single")
    single = RLLoop(cfg, uniform_plan(cfg, Layout(1, 1), (0,)))
    want = [single.step(s) for s in range(2)]
    assert single.reward is not None
    single.reward.close()
    for f in tmp_path.glob("calls-*"):
        f.unlink()
    results = run_workers(worker, 2, str(tmp_path))
    calls = list(tmp_path.glob("calls-*"))
    assert len(calls) == 1 and calls[0].read_text() == "xx"  # one reward process, one call per step
    for r in results:
        for got, w in zip(r["tokens"], want):
            assert torch.equal(got, w.tokens)
        assert r["scores"] == [w.mean_score for w in want]
    names = [t.name for t in cfg.model.tensors()]
    a = load_safetensors(read_hf_dir(tmp_path / "single" / "latest").weight_files, names)
    b = load_safetensors(read_hf_dir(tmp_path / "dist" / "latest").weight_files, names)
    assert sorted(a) == sorted(b) == sorted(names)
    for n in names:
        torch.testing.assert_close(b[n], a[n], atol=1e-5, rtol=1e-4)
    ref_single = dict(single.engines["ref-inf"].module.named_parameters())
    assert results[1]["ref"] is None and sorted(results[0]["ref"]) == sorted(names)
    assert all(torch.equal(results[0]["ref"][n], ref_single[n].detach()) for n in names)
