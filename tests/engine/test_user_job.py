"""The step loop on what a user brings: a prompt file and a reward function give the very rollouts
the synthetic task gives; reward failures reach the step's result; a HF model directory (weights
and tokenizer) trains; the actor is exported periodically as a HF directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agent.engine.data import DataConfig
from agent.engine.hf_io import ExportConfig, read_hf_dir, save_hf_dir
from agent.engine.loop import TINY_BYTE, RLLoop, RunConfig, uniform_plan
from agent.engine.model import build_decoder, load_safetensors
from agent.engine.rewards import RewardConfig, RewardError
from agent.engine.tasks import SortDigits, problems_for_step
from planner.models import ModelSpec
from planner.plan import Layout


def run(cfg: RunConfig, steps: int) -> tuple[RLLoop, list]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    loop = RLLoop(cfg, uniform_plan(cfg, Layout(1, 1), (0,)))
    return loop, [loop.step(s) for s in range(steps)]


def test_prompt_file_and_builtin_reward_give_the_synthetic_run(tmp_path: Path) -> None:
    syn = RunConfig(algo="grpo", prompts_per_step=4, seed=5)
    rows = [{"q": p.prompt, "a": p.answer} for s in range(2) for p in problems_for_step(SortDigits(), 5, s, 4)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    user = RunConfig(algo="grpo", prompts_per_step=4, seed=5,
                     data=DataConfig(path=str(tmp_path / "p.jsonl"), prompt_field="q", ground_truth_field="a",
                                     shuffle=False),
                     reward=RewardConfig(function="agent.engine.tasks:rule_scores"),
                     max_prompt_tokens=syn.prompt_tokens, max_new_tokens=syn.response_tokens)
    _, a = run(syn, 2)
    _, b = run(user, 2)
    assert [r.prompts_consumed for r in b] == [4, 8] and a[1].prompts_consumed == 0
    for x, y in zip(a, b):
        assert torch.equal(x.tokens, y.tokens)
        assert (x.mean_score, x.actor_loss) == (y.mean_score, y.actor_loss)


def test_reward_failures_reach_the_step_result_or_stop_it(tmp_path: Path) -> None:
    (tmp_path / "r.py").write_text(
        "def every_third_fails(prompts, responses, ground_truths, finished, **kw):\n"
        "    return [float('inf') if i % 3 == 0 else 1.0 for i in range(len(responses))]\n")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"{i}>"}) + "\n" for i in range(6)))
    base = dict(algo="grpo", prompts_per_step=2, max_prompt_tokens=4, max_new_tokens=3,
                data=DataConfig(path=str(tmp_path / "p.jsonl")))
    fn = "r.py:every_third_fails"
    loop, (r,) = run(RunConfig(**base, reward=RewardConfig(function=fn, base_dir=str(tmp_path), on_error="score",
                                                            error_score=-1.0)), 1)
    loop.reward.close()
    assert [i for i, _ in r.reward_errors] == [0, 3, 6]  # 2 prompts x 4 samples per group
    assert r.mean_score == pytest.approx((5 * 1.0 - 3) / 8) and "not finite" in r.reward_errors[0][1]
    assert r.mean_accuracy != r.mean_accuracy  # NaN: user prompts have no synthetic accuracy
    loop = RLLoop(RunConfig(**base, reward=RewardConfig(function=fn, base_dir=str(tmp_path))),
                  uniform_plan(RunConfig(**base, reward=RewardConfig(function=fn, base_dir=str(tmp_path))),
                               Layout(1, 1), (0,)))
    with pytest.raises(RewardError, match="failed on sample 0: score inf is not finite"):
        loop.step(0)
    loop.reward.close()


def test_a_hf_model_dir_trains_and_the_actor_is_exported(tmp_path: Path) -> None:
    from tests.engine.test_tokenizer import make_tokenizer_dir

    model_dir = make_tokenizer_dir(tmp_path / "model", chat_template=False)
    spec = ModelSpec(name="m", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                     ffn_hidden_size=96, vocab_size=416, rope_theta=10_000.0, rms_norm_eps=1e-6)
    save_hf_dir(tmp_path / "staging", spec, build_decoder(spec, seed=9).state_dict())
    for f in (tmp_path / "staging").iterdir():
        f.rename(model_dir / f.name)  # the weights beside the tokenizer, as on the Hub
    hf = read_hf_dir(model_dir)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"what is {i} plus 7"}) + "\n" for i in range(8)))
    cfg = RunConfig(algo="grpo", prompts_per_step=2, model=hf.spec, actor_weights=hf.weight_files,
                    tokenizer=str(model_dir), data=DataConfig(path=str(tmp_path / "p.jsonl")),
                    reward=RewardConfig(function="agent.engine.tasks:rule_scores"), max_prompt_tokens=12,
                    max_new_tokens=4, export=ExportConfig(dir=str(tmp_path / "out"), every_steps=2, dtype="float32",
                                                          keep=1))
    with pytest.raises(RewardError, match="no ground truth"):  # the rule reward needs one: said, not guessed
        run(cfg, 1)
    (tmp_path / "r.py").write_text("def short(prompts, responses, ground_truths, finished, **kw):\n"
                                   "    return [1.0 / (1 + len(r)) for r in responses]\n")
    cfg = RunConfig(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
                       "reward": RewardConfig(function="r.py:short", base_dir=str(tmp_path))})
    loop, results = run(cfg, 4)
    loop.reward.close()
    assert all(r.mean_score > 0 for r in results)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["latest", "step-000004"]  # keep=1: step 2 pruned
    assert (out / "latest").resolve() == (out / "step-000004").resolve()
    exported = read_hf_dir(out / "latest")
    assert exported.spec.vocab_size == 416 and (out / "latest" / "tokenizer.json").exists()
    got = load_safetensors(exported.weight_files, [t.name for t in spec.tensors()])
    trained = dict(loop.engines["actor-train"].module.named_parameters())
    start = load_safetensors(hf.weight_files, ["lm_head.weight"])
    assert not torch.equal(got["lm_head.weight"], start["lm_head.weight"])  # trained, not the input
    assert all(torch.equal(got[n], trained[n].detach()) for n in got)
    assert json.loads((out / "latest" / "config.json").read_text())["eos_token_id"] == loop.tok.stop_ids[0]


def test_byte_tokenizer_export_names_its_special_ids(tmp_path: Path) -> None:
    cfg = RunConfig(algo="grpo", prompts_per_step=2, export=ExportConfig(dir=str(tmp_path), every_steps=1))
    loop, _ = run(cfg, 1)
    config = json.loads((tmp_path / "latest" / "config.json").read_text())
    assert (config["eos_token_id"], config["dtype"], config["vocab_size"]) == (258, "bfloat16", TINY_BYTE.vocab_size)
