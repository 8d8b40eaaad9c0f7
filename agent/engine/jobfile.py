"""The job file (TOML) as the engine reads it: algorithm, model, prompts, reward, rollout, training
and export, into one validated ``RunConfig``.

Every key is listed in ``SCHEMA`` and documented, with an example per algorithm, in ``etc/jobs/``;
an unknown key or section is an error that lists the allowed ones (a typo never falls back to a
default silently). Paths are relative to the job file's folder. A ``[model] path`` is a Hugging Face
directory: it gives the model spec (``config.json``), the weights and, unless ``[tokenizer]`` says
otherwise, the tokenizer; without it the engine's tiny byte-level model starts from random weights.
The placement keys of a live job under nereusd (device, GPUs, elastic bounds) are the daemon's, not
read here.

Run: ``python -m agent.engine.jobfile etc/jobs/grpo.toml`` prints the RunConfig; train with
``python -m agent.engine.loop --job etc/jobs/grpo.toml``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from agent.engine.data import DataConfig
from agent.engine.grpo import GRPOConfig
from agent.engine.hf_io import ExportConfig, read_hf_dir
from agent.engine.loop import TINY_BYTE, RunConfig
from agent.engine.ppo import PPOConfig
from agent.engine.remax import ReMaxConfig
from agent.engine.rewards import RewardConfig
from agent.engine.tasks import AddNumbers, SortDigits
from planner.errors import SpecError
from planner.models import model_preset

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# section ("" = top level) -> key -> accepted types
SCHEMA: dict[str, dict[str, tuple[type, ...]]] = {
    "": {"algo": (str,), "seed": (int,), "steps": (int,), "prompts_per_step": (int,)},
    "model": {"path": (str,), "preset": (str,), "critic_path": (str,), "reward_path": (str,)},
    "tokenizer": {"path": (str,), "chat_template": (bool,)},
    "data": {"path": (str,), "prompt_field": (str,), "ground_truth_field": (str,), "shuffle": (bool,),
             "max_prompt_tokens": (int,)},
    "task": {"name": (str,), "num_digits": (int,), "max_operand": (int,)},
    "reward": {"function": (str,), "timeout_s": (int, float), "on_error": (str,), "error_score": (int, float)},
    "rollout": {"max_new_tokens": (int,), "temperature": (int, float), "top_p": (int, float), "backend": (str,)},
    "train": {"actor_lr": (float,), "critic_lr": (float,), "mini_batches_per_step": (int,)},
    "ppo": {"gamma": (int, float), "lam": (int, float), "clip": (float,), "value_clip": (float,),
            "kl_beta": (float,), "whiten_advantages": (bool,)},
    "grpo": {"samples_per_prompt": (int,), "clip": (float,), "kl_coef": (float,), "eps": (float,)},
    "remax": {"clip": (float,), "kl_coef": (float,)},
    "export": {"dir": (str,), "every_steps": (int,), "dtype": (str,), "keep": (int,)},
    # the daemon's (nereusd/jobfile.py): where a live job runs; the engine ignores it
    "placement": {"device": (str,), "gpus_per_node": (int,), "min_gpus": (int,), "max_gpus": (int,)},
}
TASKS: dict[str, type[SortDigits] | type[AddNumbers]] = {"sort_digits": SortDigits, "add_numbers": AddNumbers}


def _check(doc: dict[str, Any], where: str) -> None:
    sections = [s for s in SCHEMA if s]
    for key, value in doc.items():
        if isinstance(value, dict):
            if key not in sections:
                raise SpecError(f"{where}: [{key}]", "is not a section", ", ".join(sections))
            _check_keys(value, key, where)
    _check_keys({k: v for k, v in doc.items() if not isinstance(v, dict)}, "", where)


def _check_keys(table: dict[str, Any], section: str, where: str) -> None:
    allowed = SCHEMA[section]
    for key, value in table.items():
        name = f"{section}.{key}" if section else key
        if key not in allowed:
            raise SpecError(f"{where}: {name}", "is not a known key", ", ".join(allowed))
        types = allowed[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise SpecError(f"{where}: {name}", f"must be {' or '.join(t.__name__ for t in types)}, "
                            f"got {type(value).__name__} {value!r}")


def load_job(path: str | Path) -> tuple[RunConfig, int]:
    """The ``RunConfig`` of a job file, and its number of steps (for a local run)."""
    file = Path(path)
    try:
        doc = tomllib.loads(file.read_text())
    except FileNotFoundError:
        raise SpecError(str(file), "does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(str(file), f"is not valid TOML: {e}") from None
    _check(doc, str(file))
    base = file.parent.resolve()

    def rel(p: str) -> str:
        return str((base / p).resolve())

    sec = {s: dict(doc.get(s, {})) for s in SCHEMA if s}
    model_sec, tok_sec, data_sec = sec["model"], sec["tokenizer"], sec["data"]
    kw: dict[str, Any] = {k: doc[k] for k in ("algo", "seed", "prompts_per_step") if k in doc}
    # model: a HF directory, or a preset with random weights
    if "path" in model_sec and "preset" in model_sec:
        raise SpecError(f"{file}: model", "give path or preset, not both")
    tokenizer = tok_sec.get("path")
    if "path" in model_sec:
        hf = read_hf_dir(rel(model_sec["path"]))
        kw.update(model=hf.spec, actor_weights=hf.weight_files)
        if kw.get("algo", "ppo") == "ppo":
            kw["critic_weights"] = hf.weight_files  # the critic's trunk starts from the actor
        tokenizer = tokenizer or model_sec["path"]
    else:
        preset = model_sec.get("preset", "tiny-byte")
        kw["model"] = TINY_BYTE if preset == "tiny-byte" else model_preset(preset)
    for role, key in (("critic", "critic_path"), ("reward", "reward_path")):
        if key in model_sec:
            hf = read_hf_dir(rel(model_sec[key]))
            kw[f"{role}_model"], kw[f"{role}_weights"] = hf.spec, hf.weight_files
    if tokenizer is not None:
        kw["tokenizer"] = rel(tokenizer)
    kw["chat_template"] = tok_sec.get("chat_template", False)
    # prompts: a file, or a synthetic task
    if data_sec and sec["task"]:
        raise SpecError(f"{file}: data", "give [data] (a prompt file) or [task] (synthetic), not both")
    if data_sec:
        if "path" not in data_sec:
            raise SpecError(f"{file}: data.path", "is required")
        if "max_prompt_tokens" in data_sec:
            kw["max_prompt_tokens"] = data_sec.pop("max_prompt_tokens")
        kw["data"] = DataConfig(**{**data_sec, "path": rel(data_sec["path"])})
    if sec["task"]:
        task = dict(sec["task"])
        name = task.pop("name", "sort_digits")
        if name not in TASKS:
            raise SpecError(f"{file}: task.name", f"unknown {name!r}", ", ".join(TASKS))
        kw["task"] = TASKS[name](**task)
    if sec["reward"]:
        if "function" not in sec["reward"]:
            raise SpecError(f"{file}: reward.function", "is required in [reward]")
        kw["reward"] = RewardConfig(**sec["reward"], base_dir=str(base))
    r = sec["rollout"]
    kw.update({k: r[k] for k in ("max_new_tokens", "temperature", "top_p") if k in r})
    if "backend" in r:
        kw["rollout_backend"] = r["backend"]
    t = sec["train"]
    kw.update({k: t[k] for k in ("actor_lr", "critic_lr") if k in t})
    if "mini_batches_per_step" in t:
        kw["train_mini_batches_per_step"] = t["mini_batches_per_step"]
    for name, cls in (("ppo", PPOConfig), ("grpo", GRPOConfig), ("remax", ReMaxConfig)):
        if sec[name]:
            kw[name] = cls(**sec[name])
    if sec["export"]:
        export: dict[str, Any] = dict(sec["export"])
        if "dir" not in export or "every_steps" not in export:
            raise SpecError(f"{file}: export", "needs dir and every_steps")
        kw["export"] = ExportConfig(**{**export, "dir": rel(export["dir"])})
    steps = int(doc.get("steps", 10))
    if steps < 1:
        raise SpecError(f"{file}: steps", f"must be >= 1, got {steps}")
    return RunConfig(**kw), steps


if __name__ == "__main__":
    cfg, steps = load_job(sys.argv[1])
    print(cfg)
    print(f"steps = {steps}")
