"""A live job's one description: nereusd.jobfile reads the engine's job file (etc/jobs/live.toml and
its [placement]) as the daemon's job spec, with the engine's own prompt and response lengths, and
refuses a bad file naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nereusd.jobfile import SECTIONS, job_spec
from nereusd.wire.job_models import JobSpecModel
from planner.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
LIVE = ROOT / "etc" / "jobs" / "live.toml"
PLACEMENT = '[placement]\ndevice = "cpu"\ngpus_per_node = 2\nmin_gpus = 2\nmax_gpus = 4\n'


def _file(tmp_path: Path, text: str, placement: str = PLACEMENT) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text + "\n" + placement)
    return path


def test_the_live_job_file_as_a_spec() -> None:
    spec = job_spec(LIVE, anchor_job_id="local-live")
    assert spec == {
        "model": "tiny-byte", "algo": "grpo", "device": "cpu", "gpus_per_node": 2, "learned_reward": False,
        "old_logprob_pass": False,
        "workload": {"prompts_per_step": 8, "samples_per_prompt": 2, "prompt_tokens": 5, "response_tokens": 4,
                     "train_mini_batches_per_step": 2},
        "elastic": {"anchor_job_id": "local-live", "min_gpus": 2, "max_gpus": 4, "gpus_per_node": 2,
                    "extra": {"job_file": str(LIVE)}}}
    JobSpecModel.model_validate(spec)  # what job-add takes, extra.job_file included


def test_prompt_file_lengths_algo_defaults_and_learned_reward(tmp_path: Path) -> None:
    spec = job_spec(_file(tmp_path, 'algo = "ppo"\nprompts_per_step = 4\n[model]\npreset = "tiny-3m"\n'
                          'reward_path = "/models/rm"\n[data]\npath = "p.jsonl"\nmax_prompt_tokens = 64\n'
                          '[rollout]\nmax_new_tokens = 128\n[grpo]\nsamples_per_prompt = 8\n'),
                    anchor_job_id="7")
    assert spec["workload"] == {"prompts_per_step": 4, "samples_per_prompt": 1, "prompt_tokens": 64,
                                "response_tokens": 128, "train_mini_batches_per_step": 1}
    assert spec["learned_reward"] is True and spec["model"] == "tiny-3m" and spec["algo"] == "ppo"
    bare = job_spec(_file(tmp_path, ""), anchor_job_id="a")  # the engine's defaults: ppo, 16 prompts, sort 3
    assert (bare["algo"], bare["model"], bare["workload"]["prompts_per_step"]) == ("ppo", "tiny-byte", 16)
    assert (bare["workload"]["prompt_tokens"], bare["workload"]["response_tokens"]) == (5, 4)


@pytest.mark.parametrize(("text", "placement", "named"), [
    ("algo = 'dpo'", PLACEMENT, "algo"),
    ("prompts_per_step = '8'", PLACEMENT, "prompts_per_step"),
    ("prompts_per_step = 0", PLACEMENT, "prompts_per_step"),
    ("[model]\npath = '/models/x'", PLACEMENT, "model.path"),
    ("[data]\npath = 'p.jsonl'\n[rollout]\nmax_new_tokens = 4", PLACEMENT, "data.max_prompt_tokens"),
    ("[data]\npath = 'p.jsonl'\nmax_prompt_tokens = 4", PLACEMENT, "rollout.max_new_tokens"),
    ("[data]\npath = 'p.jsonl'\n[task]\nname = 'sort_digits'", PLACEMENT, "data"),
    ("[task]\nname = 'chess'", PLACEMENT, "task.name"),
    ("[task]\nnum_digits = 17", PLACEMENT, "task.num_digits"),
    ("algo = 'grpo'\n[grpo]\nsamples_per_prompt = true", PLACEMENT, "grpo.samples_per_prompt"),
    ("[placment]\nx = 1", PLACEMENT, "[placment]"),
    ("", "", "[placement]"),
    ("", "[placement]\ngpus_per_node = 2\nmin_gpus = 2", "placement.max_gpus"),
    ("", PLACEMENT + "slots = 3\n", "placement.slots"),
    ("", PLACEMENT.replace('"cpu"', '"tpu"'), "placement.device"),
    ("", PLACEMENT.replace("min_gpus = 2", "min_gpus = 8"), "placement.max_gpus"),
    ("", PLACEMENT.replace("max_gpus = 4", "max_gpus = 1").replace("min_gpus = 2", "min_gpus = 1"),
     "placement.max_gpus"),
    ("algo = ", PLACEMENT, "not valid TOML"),
])
def test_a_bad_job_file_names_the_key(tmp_path: Path, text: str, placement: str, named: str) -> None:
    path = _file(tmp_path, text, placement)
    with pytest.raises(SpecError) as err:
        job_spec(path, anchor_job_id="a")
    assert named in str(err.value) and str(path) in str(err.value), str(err.value)


def test_a_missing_job_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="does not exist"):
        job_spec(tmp_path / "none.toml", anchor_job_id="a")


def test_importing_it_imports_no_torch() -> None:
    code = "import sys, nereusd.jobfile, nereusd.admin_cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize("task", ["", "[task]\nname = 'sort_digits'\nnum_digits = 7",
                                  "[task]\nname = 'add_numbers'", "[task]\nname = 'add_numbers'\nmax_operand = 5",
                                  "[task]\nname = 'add_numbers'\nmax_operand = 500\n[rollout]\nmax_new_tokens = 9"])
def test_task_lengths_are_the_engines(tmp_path: Path, task: str) -> None:
    pytest.importorskip("torch")
    from agent.engine.jobfile import load_job

    path = _file(tmp_path, "algo = 'grpo'\n" + task)
    cfg, _ = load_job(path)  # the engine accepts [placement] and reads the same lengths
    workload = job_spec(path, anchor_job_id="a")["workload"]
    assert (workload["prompt_tokens"], workload["response_tokens"]) == (cfg.prompt_tokens, cfg.response_tokens)
    assert workload["samples_per_prompt"] == cfg.samples_per_prompt
    assert workload["prompts_per_step"] == cfg.prompts_per_step


def test_sections_are_the_engines_and_the_live_file_loads_in_the_engine() -> None:
    pytest.importorskip("torch")
    from agent.engine.jobfile import SCHEMA, load_job

    assert set(SECTIONS) == {s for s in SCHEMA if s}
    cfg, steps = load_job(LIVE)
    spec = job_spec(LIVE, anchor_job_id="a")
    assert (cfg.algo, cfg.model.name, cfg.sequences_per_step, steps) == ("grpo", spec["model"], 16, 20)
    assert cfg.train_mini_batches_per_step == spec["workload"]["train_mini_batches_per_step"]
