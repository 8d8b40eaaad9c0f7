"""Job files: every key the engine reads is documented in etc/jobs/, every example loads and runs a
step, and a wrong key, type or combination is refused with what is allowed."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from agent.engine.hf_io import save_hf_dir
from agent.engine.jobfile import SCHEMA, load_job
from agent.engine.loop import TINY_BYTE, RLLoop, uniform_plan
from agent.engine.model import build_decoder
from planner.errors import SpecError
from planner.models import ModelSpec
from planner.plan import Layout

JOBS = Path(__file__).resolve().parents[2] / "etc" / "jobs"
ASSIGN = re.compile(r"^#?\s*([a-z_]+)\s*=")
SECTION = re.compile(r"^#?\s*\[([a-z_]+)\]\s*$")


def documented_keys() -> set[tuple[str, str]]:
    """(section, key) of every key in an example that a prose comment explains (a comment above it, or
    above the run of assignments it belongs to)."""
    out = set()
    for f in JOBS.glob("*.toml"):
        section, explained = "", False
        for line in f.read_text().splitlines():
            s = line.strip()
            if m := SECTION.match(s):
                section, explained = m.group(1), False
            elif m := ASSIGN.match(s):
                if explained:
                    out.add((section, m.group(1)))
            elif s.startswith("#"):
                explained = True
            else:
                explained = False
    return out


def test_every_key_is_documented_in_an_example() -> None:
    from nereusd.jobfile import PLACEMENT

    keys = {(s, k) for s, keys in SCHEMA.items() for k in keys} | {("placement", k) for k in PLACEMENT}
    missing = keys - documented_keys()
    assert not missing, f"undocumented job-file keys: {sorted(missing)}"


@pytest.mark.parametrize("algo", ["grpo", "ppo", "remax"])
def test_each_algorithm_example_loads_and_runs_a_step(algo: str) -> None:
    cfg, steps = load_job(JOBS / f"{algo}.toml")
    assert cfg.algo == algo and steps >= 1
    torch.manual_seed(0)
    loop = RLLoop(cfg, uniform_plan(cfg, Layout(1, 1), (0,)))
    try:
        r = loop.step(0)
    finally:
        if loop.reward is not None:
            loop.reward.close()
    assert 0.0 <= r.mean_score <= 1.0 and r.reward_errors == ()


def test_a_hf_model_dir_in_a_job_gives_spec_weights_and_tokenizer(tmp_path: Path) -> None:
    spec = ModelSpec(name="m", num_layers=1, hidden_size=32, num_attention_heads=2, num_kv_heads=1, head_dim=16,
                     ffn_hidden_size=64, vocab_size=300, rope_theta=10_000.0, rms_norm_eps=1e-6)
    save_hf_dir(tmp_path / "models" / "m", spec, build_decoder(spec).state_dict())
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    (tmp_path / "job.toml").write_text(
        'algo = "ppo"\n[model]\npath = "models/m"\n[data]\npath = "p.jsonl"\nmax_prompt_tokens = 4\n'
        '[reward]\nfunction = "r.py:f"\non_error = "score"\n[rollout]\nmax_new_tokens = 2\n')
    (tmp_path / "r.py").write_text("def f(prompts, responses, ground_truths, finished, **kw):\n    return [0.0]\n")
    cfg, _ = load_job(tmp_path / "job.toml")
    assert cfg.model == dataclasses.replace(spec, bytes_per_param=4)  # float32 weights
    assert cfg.actor_weights == cfg.critic_weights != ()  # PPO's critic trunk starts from the actor
    assert cfg.tokenizer == str((tmp_path / "models" / "m").resolve())
    assert cfg.data is not None and cfg.data.path == str((tmp_path / "p.jsonl").resolve())
    assert cfg.reward is not None and cfg.reward.base_dir == str(tmp_path.resolve())


def test_wrong_keys_types_and_combinations_are_refused(tmp_path: Path) -> None:
    f = tmp_path / "job.toml"

    def load(text: str):
        f.write_text(text)
        return load_job(f)

    with pytest.raises(SpecError, match="data.prompt_feild: is not a known key.*allowed: path, prompt_field"):
        load('[data]\npath = "p.jsonl"\nprompt_feild = "q"\n')
    with pytest.raises(SpecError, match=r"\[rewards\]: is not a section"):
        load('[rewards]\nfunction = "a:b"\n')
    with pytest.raises(SpecError, match="prompts_per_step: must be int, got str"):
        load('prompts_per_step = "8"\n')
    with pytest.raises(SpecError, match="not both"):
        load('[data]\npath = "p.jsonl"\n[task]\nname = "sort_digits"\n')
    with pytest.raises(SpecError, match="is not valid TOML"):
        load("algo = \n")
    with pytest.raises(SpecError, match="task.name: unknown 'sorting'"):
        load('[task]\nname = "sorting"\n')
    with pytest.raises(SpecError, match="max_prompt_tokens: is needed with a prompt file"):
        (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
        load('[data]\npath = "p.jsonl"\n[reward]\nfunction = "agent.engine.tasks:rule_scores"\n')
    cfg, steps = load('algo = "remax"\nsteps = 3\n[task]\nname = "add_numbers"\nmax_operand = 9\n')
    assert (cfg.algo, steps, cfg.task.max_prompt_chars, cfg.model) == ("remax", 3, 4, TINY_BYTE)
