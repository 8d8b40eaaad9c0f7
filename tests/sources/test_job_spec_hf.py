"""A job file whose ``[model] path`` is a HF directory: the daemon's spec carries the directory's
architecture (its config.json, relative to the job file); what cannot be planned is one clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nereusd.jobfile import job_spec
from planner.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 416, "rope_theta": 1e6}


def _job(tmp_path: Path, model_section: str, config: dict | None = CONFIG) -> Path:
    if config is not None:
        (tmp_path / "models" / "qwen2-tiny").mkdir(parents=True)
        (tmp_path / "models" / "qwen2-tiny" / "config.json").write_text(json.dumps(config))
    text = (ROOT / "etc" / "jobs" / "live.toml").read_text()
    job = tmp_path / "jobs" / "job.toml"
    job.parent.mkdir()
    job.write_text(text.replace('preset = "tiny-byte"', model_section))
    return job


def test_the_directory_architecture_is_the_jobs_model(tmp_path: Path) -> None:
    spec = job_spec(_job(tmp_path, 'path = "../models/qwen2-tiny"'), anchor_job_id="local-j")
    m = spec["model"]
    assert (m["name"], m["num_layers"], m["num_kv_heads"], m["head_dim"], m["qkv_bias"]) == ("qwen2-tiny", 2, 2, 16,
                                                                                            True)


@pytest.mark.parametrize(("section", "config", "named"), [
    ('path = "../models/none"', CONFIG, "model.path: " + "{tmp}/models/none is not a Hugging Face model directory"),
    ('path = "../models/qwen2-tiny"\npreset = "tiny-3m"', CONFIG, "model: give path or preset, not both"),
    ('path = "../models/qwen2-tiny"', {**CONFIG, "model_type": "mistral"}, "config.json.model_type: 'mistral'"),
    ('path = "../models/qwen2-tiny"', {**CONFIG, "use_sliding_window": True}, "use_sliding_window"),
    ('path = 3', None, "model.path: must be str"),
])
def test_what_cannot_be_planned_is_named(tmp_path: Path, section: str, config: dict | None, named: str) -> None:
    with pytest.raises(SpecError) as info:
        job_spec(_job(tmp_path, section, config), anchor_job_id="local-j")
    assert named.format(tmp=tmp_path) in str(info.value) and "\n" not in str(info.value), str(info.value)
