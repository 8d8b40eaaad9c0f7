"""A live job's one description: the engine's job file (etc/jobs/*.toml) read as the daemon's job spec.

The planner plans what the engine runs, so both read the same file: the engine its RL keys
(agent/engine/jobfile.py, which imports torch), the daemon the same keys as a planner workload plus the
file's ``[placement]`` section (the engine ignores it)::

    [placement]
    device = "cpu"       # a planner device preset (cpu, h100, h200, a100-64g, mi250x ...); default cpu
    gpus_per_node = 2    # devices per node (CPU worker slots locally)
    min_gpus = 2         # the elastic job's bounds, in devices
    max_gpus = 4

``job_spec`` returns what ``nereusctl job-add --spec`` takes (``nereusctl job-add JOB --job-file PATH``
calls it): model, algo, device, gpus_per_node, learned_reward, workload and elastic, whose
``extra.job_file`` is the file's absolute path (the local source hands it to the job's driver). The model
is ``[model] preset``, or the architecture read from ``[model] path``'s config.json (a HF directory: the
engine loads its weights, the planner plans its shape). Only tomllib, json and the planner's pure
modules: the daemon and nereusctl import this, never torch.
Prompt and response lengths mirror the engine's (``RunConfig.prompt_tokens``/``response_tokens``): a
prompt file gives ``data.max_prompt_tokens`` and ``rollout.max_new_tokens``; a synthetic task its
longest prompt plus BOS and its longest answer plus EOS (agent/engine/tasks.py), unless
``rollout.max_new_tokens`` is given.

Run: ``python -m nereusd.jobfile etc/jobs/live.toml`` prints the spec as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from planner.errors import SpecError
from planner.hf_config import model_to_mapping, spec_from_hf_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (pydantic-settings brings tomli there)
    import tomli as tomllib

# the engine's sections (agent.engine.jobfile.SCHEMA; a test keeps the two equal), placement included
SECTIONS = ("model", "tokenizer", "data", "task", "reward", "rollout", "train", "ppo", "grpo", "remax", "export",
            "placement")
PLACEMENT = ("device", "gpus_per_node", "min_gpus", "max_gpus")
ALGOS = ("ppo", "grpo", "remax")
# the engine's defaults (RunConfig, GRPOConfig, SortDigits, AddNumbers)
DEFAULT_PROMPTS_PER_STEP = 16
DEFAULT_SAMPLES_PER_PROMPT = 4
DEFAULT_NUM_DIGITS = 3
DEFAULT_MAX_OPERAND = 99


def _get(doc: dict[str, Any], section: str, key: str, kind: type, default: Any, where: str) -> Any:
    table = doc.get(section, {}) if section else doc
    if key not in table:
        return default
    value = table[key]
    name = f"{section}.{key}" if section else key
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise SpecError(f"{where}: {name}", f"must be {kind.__name__}, got {type(value).__name__} {value!r}")
    if isinstance(value, int) and kind is int and value < 1:
        raise SpecError(f"{where}: {name}", f"must be >= 1, got {value}")
    return value


def task_lengths(doc: dict[str, Any], where: str) -> tuple[int, int]:
    """(prompt tokens, response tokens) of the synthetic task: longest prompt + BOS, longest answer + EOS."""
    name = _get(doc, "task", "name", str, "sort_digits", where)
    if name == "sort_digits":
        digits = _get(doc, "task", "num_digits", int, DEFAULT_NUM_DIGITS, where)
        if digits > 16:
            raise SpecError(f"{where}: task.num_digits", f"must be in 1..16, got {digits}")
        return digits + 1 + 1, digits + 1
    if name == "add_numbers":
        top = _get(doc, "task", "max_operand", int, DEFAULT_MAX_OPERAND, where)
        return 2 * len(str(top)) + 2 + 1, len(str(2 * top)) + 1
    raise SpecError(f"{where}: task.name", f"unknown {name!r}", "sort_digits, add_numbers")


def _placement(doc: dict[str, Any], where: str) -> dict[str, Any]:
    table = doc.get("placement")
    if not isinstance(table, dict):
        raise SpecError(f"{where}: [placement]", "a live job needs it: device, gpus_per_node, min_gpus, max_gpus")
    unknown = sorted(set(table) - set(PLACEMENT))
    if unknown:
        raise SpecError(f"{where}: placement.{unknown[0]}", "is not a known key", ", ".join(PLACEMENT))
    for key in ("gpus_per_node", "min_gpus", "max_gpus"):
        if key not in table:
            raise SpecError(f"{where}: placement.{key}", "is required")
    out = {"device": _get(doc, "placement", "device", str, "cpu", where),
           **{k: _get(doc, "placement", k, int, None, where) for k in ("gpus_per_node", "min_gpus", "max_gpus")}}
    from planner.hardware import device_preset  # pure, and cheap: dataclasses only

    try:
        device_preset(out["device"])
    except SpecError as exc:
        raise SpecError(f"{where}: placement.device", str(exc).removeprefix("device: ")) from None
    if out["max_gpus"] < out["min_gpus"]:
        raise SpecError(f"{where}: placement.max_gpus", f"{out['max_gpus']} is below min_gpus {out['min_gpus']}")
    if out["max_gpus"] < out["gpus_per_node"]:
        raise SpecError(f"{where}: placement.max_gpus", f"{out['max_gpus']} is less than one node of "
                        f"gpus_per_node {out['gpus_per_node']}")
    return out


def _model(doc: dict[str, Any], file: Path, where: str) -> str | dict[str, Any]:
    """The planner's model: a preset name, or the architecture of the HF directory ``[model] path``
    (its config.json, read as the engine reads it; relative to the job file)."""
    sec = doc.get("model", {})
    if "path" not in sec:
        return str(_get(doc, "model", "preset", str, "tiny-byte", where))
    if "preset" in sec:
        raise SpecError(f"{where}: model", "give path or preset, not both")
    path = _get(doc, "model", "path", str, None, where)
    cfg_file = (file.parent / str(path)).resolve() / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise SpecError(f"{where}: model.path", f"{cfg_file.parent} is not a Hugging Face model directory "
                        "(no config.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"{where}: model.path", f"cannot read {cfg_file}: {exc}") from None
    if not isinstance(cfg, dict):
        raise SpecError(str(cfg_file), "is not a JSON object")
    return model_to_mapping(spec_from_hf_config(cfg, name=cfg_file.parent.name, where=str(cfg_file)))


def job_spec(path: str | Path, *, anchor_job_id: str) -> dict[str, Any]:
    """The daemon's job spec of the job file at ``path`` (SpecError naming the file and key otherwise).
    ``anchor_job_id`` names the job's first node group (local) or its anchor Slurm job."""
    file = Path(path).resolve()
    where = str(file)
    try:
        doc = tomllib.loads(file.read_text())
    except FileNotFoundError:
        raise SpecError(where, "does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(where, f"cannot be read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(where, f"is not valid TOML: {exc}") from None
    for key, value in doc.items():
        if isinstance(value, dict) and key not in SECTIONS:
            raise SpecError(f"{where}: [{key}]", "is not a section", ", ".join(SECTIONS))
    for section in SECTIONS:
        if not isinstance(doc.get(section, {}), dict):
            raise SpecError(f"{where}: {section}", "must be a section ([" + section + "])")
    algo = _get(doc, "", "algo", str, "ppo", where)
    if algo not in ALGOS:
        raise SpecError(f"{where}: algo", f"unknown {algo!r}", ", ".join(ALGOS))
    model = _model(doc, file, where)
    if doc.get("data") and doc.get("task"):
        raise SpecError(f"{where}: data", "give [data] (a prompt file) or [task] (synthetic), not both")
    max_new = _get(doc, "rollout", "max_new_tokens", int, None, where)
    if doc.get("data"):
        prompt_tokens = _get(doc, "data", "max_prompt_tokens", int, None, where)
        if prompt_tokens is None:
            raise SpecError(f"{where}: data.max_prompt_tokens", "is needed with a prompt file")
        if max_new is None:
            raise SpecError(f"{where}: rollout.max_new_tokens", "is needed with a prompt file")
        response_tokens = max_new
    else:
        prompt_tokens, task_response = task_lengths(doc, where)
        response_tokens = max_new or task_response
    samples = _get(doc, "grpo", "samples_per_prompt", int, DEFAULT_SAMPLES_PER_PROMPT, where) if algo == "grpo" \
        else 1
    placement = _placement(doc, where)
    workload = {"prompts_per_step": _get(doc, "", "prompts_per_step", int, DEFAULT_PROMPTS_PER_STEP, where),
                "samples_per_prompt": samples, "prompt_tokens": prompt_tokens, "response_tokens": response_tokens,
                "train_mini_batches_per_step": _get(doc, "train", "mini_batches_per_step", int, 1, where)}
    return {"model": model, "algo": algo, "device": placement["device"], "gpus_per_node": placement["gpus_per_node"],
            "learned_reward": "reward_path" in doc.get("model", {}), "workload": workload,
            # the engine takes the old policy's log-probs from the rollout: no recompute pass to price
            "old_logprob_pass": False,
            "elastic": {"anchor_job_id": anchor_job_id, "min_gpus": placement["min_gpus"],
                        "max_gpus": placement["max_gpus"], "gpus_per_node": placement["gpus_per_node"],
                        "extra": {"job_file": where}}}


if __name__ == "__main__":
    print(json.dumps(job_spec(sys.argv[1], anchor_job_id="local-job"), indent=1))
