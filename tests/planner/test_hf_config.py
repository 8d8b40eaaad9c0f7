"""A model given by its architecture in a job spec (a HF directory's config.json): carried as JSON,
checked field by field at the boundary, planned like a preset."""

from __future__ import annotations

import json

import pytest

from nereusd.planning import job_spec
from nereusd.wire.job_models import ArchitectureSpec, JobSpecModel
from planner.errors import SpecError
from planner.hf_config import model_from_mapping, model_to_mapping, spec_from_hf_config
from planner.models import MODELS

QWEN2_CONFIG = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 416, "rope_theta": 1e6,
                "rms_norm_eps": 1e-6, "use_sliding_window": False, "sliding_window": 4096, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_preset_survives_json_both_ways(name: str) -> None:
    spec = MODELS[name]
    assert model_from_mapping(json.loads(json.dumps(model_to_mapping(spec)))) == spec
    wire = ArchitectureSpec.model_validate(model_to_mapping(spec)).model_dump(mode="json", exclude_none=True)
    assert model_from_mapping(wire) == spec  # the wire takes it and gives back the same model


def test_a_qwen2_config_is_planned_from_its_architecture() -> None:
    arch = model_to_mapping(spec_from_hf_config(QWEN2_CONFIG, name="qwen2-tiny"))
    assert arch["qkv_bias"] and not arch["qk_norm"] and arch["head_dim"] == 16
    spec = {"model": arch, "algo": "grpo", "device": "cpu", "gpus_per_node": 2,
            "workload": {"prompts_per_step": 8, "samples_per_prompt": 2, "prompt_tokens": 8, "response_tokens": 8}}
    stored = JobSpecModel.model_validate(spec).stored()
    job = job_spec(stored)
    assert job.models[job.workflow.roles[0]] == spec_from_hf_config(QWEN2_CONFIG, name="qwen2-tiny")


@pytest.mark.parametrize(("change", "named"), [
    ({"num_layers": True}, "model.num_layers: must be a positive integer"),
    ({"num_layers": 0}, "model.num_layers"),
    ({"hidden_size": 64.0}, "model.hidden_size"),
    ({"rope_theta": float("inf")}, "model.rope_theta: must be a positive finite number"),
    ({"qkv_bias": 1}, "model.qkv_bias: must be true or false"),
    ({"heads": 4}, "model.heads: is not an architecture key"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "model.rope_scaling.rope_type"),
    ({"num_kv_heads": 3}, "model.num_kv_heads"),  # ModelSpec's own relation: 3 does not divide 4
    ({"name": ""}, "model.name"),
])
def test_a_bad_architecture_is_one_error_naming_the_key(change: dict, named: str) -> None:
    arch = {**model_to_mapping(spec_from_hf_config(QWEN2_CONFIG, name="q")), **change}
    with pytest.raises(SpecError) as info:
        model_from_mapping(arch)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_a_missing_key_is_named_and_the_wire_refuses_bad_types() -> None:
    arch = model_to_mapping(spec_from_hf_config(QWEN2_CONFIG, name="q"))
    with pytest.raises(SpecError, match="model.vocab_size: is missing"):
        model_from_mapping({k: v for k, v in arch.items() if k != "vocab_size"})
    with pytest.raises(Exception, match="num_layers"):
        JobSpecModel.model_validate({"model": {**arch, "num_layers": "2"}})
