"""planner/hf_config.py, what its other tests left open (mutation testing, tests/mutate.py --module
planner/hf_config.py: 45 of 498 mutants survived tests/planner): the whole config.json written for each
architecture, key by key; a null partial_rotary_factor; a scaled rope with no context anywhere; the
job-spec form's error paths and its optional keys."""

from __future__ import annotations

import pytest
from test_hf_config_fields import BASE, LLAMA3  # noqa: E402  the same config.json as the field tests

from planner.errors import SpecError
from planner.hf_config import (
    ARCHITECTURE_KEYS,
    hf_config,
    model_from_mapping,
    model_to_mapping,
    spec_from_hf_config,
)
from planner.models import ModelSpec, RopeScaling


def _spec(**change: object) -> ModelSpec:
    kw: dict = {"name": "m", "num_layers": 3, "hidden_size": 48, "num_attention_heads": 6, "num_kv_heads": 2,
                "head_dim": 8, "ffn_hidden_size": 80, "vocab_size": 120, "rope_theta": 1e6, "rms_norm_eps": 1e-5}
    return ModelSpec(**{**kw, **change})


def test_the_config_json_written_for_each_architecture_key_by_key() -> None:
    common = {"hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3, "num_attention_heads": 6,
              "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 120, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    assert hf_config(_spec()) == {
        **common, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "tie_word_embeddings": False,
        "max_position_embeddings": 4096, "torch_dtype": "float32", "dtype": "float32"}
    assert hf_config(_spec(qkv_bias=True, tie_word_embeddings=True), dtype="bfloat16") == {
        **common, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "tie_word_embeddings": True,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "dtype": "bfloat16"}
    scaled = hf_config(_spec(qk_norm=True, rope_scaling=RopeScaling(**LLAMA3)), token_ids={"eos_token_id": 7})
    assert scaled == {
        **common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "rope_scaling": LLAMA3, "rope_parameters": {"rope_theta": 1e6, **LLAMA3}, "tie_word_embeddings": False,
        "max_position_embeddings": 65536, "torch_dtype": "float32", "dtype": "float32", "eos_token_id": 7}


def test_a_null_partial_rotary_factor_is_a_full_rotary_embedding() -> None:
    s = spec_from_hf_config({**BASE, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": None}},
                            name="m")
    assert s.rope_scaling is None
    s = spec_from_hf_config({**BASE, "rope_scaling": {**LLAMA3, "partial_rotary_factor": 1.0}}, name="m")
    assert s.rope_scaling == RopeScaling(**LLAMA3)


def test_a_scaled_rope_with_no_context_anywhere_is_refused_by_name() -> None:
    no_context = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    with pytest.raises(SpecError) as err:
        spec_from_hf_config({**BASE, "rope_scaling": no_context}, name="m", where="d/config.json")
    assert err.value.field == "d/config.json.rope_scaling.original_max_position_embeddings"


def test_an_error_of_a_config_names_config_json_by_default() -> None:
    with pytest.raises(SpecError) as err:
        spec_from_hf_config({k: v for k, v in BASE.items() if k != "vocab_size"}, name="m")
    assert err.value.field == "config.json.vocab_size"


def test_the_job_spec_form_names_the_allowed_keys_and_its_own_path() -> None:
    arch = model_to_mapping(spec_from_hf_config(BASE, name="m"))
    with pytest.raises(SpecError) as err:
        model_from_mapping({**arch, "beta": 1})
    assert err.value.allowed == ", ".join(ARCHITECTURE_KEYS) and err.value.allowed.startswith("name, num_layers, ")
    with pytest.raises(SpecError) as err:
        model_from_mapping({**arch, "rope_scaling": {**LLAMA3, "factor": None}}, where="jobs[2].model")
    assert err.value.field == "jobs[2].model.rope_scaling.factor"


def test_an_optional_key_left_out_does_not_drop_the_keys_after_it() -> None:
    arch = {**model_to_mapping(spec_from_hf_config(BASE, name="m")), "qk_norm": True, "rope_theta": 3e5,
            "rms_norm_eps": 1e-4, "rope_scaling": LLAMA3, "grad_bytes_per_param": 4}
    del arch["bytes_per_param"]
    s = model_from_mapping(arch)
    assert (s.bytes_per_param, s.grad_bytes_per_param, s.qk_norm, s.rope_theta, s.rms_norm_eps) == (2, 4, True, 3e5, 1e-4)
    assert s.rope_scaling == RopeScaling(**LLAMA3)


def test_one_is_a_positive_integer_in_the_job_spec_form() -> None:
    arch = model_to_mapping(spec_from_hf_config(BASE, name="m"))
    s = model_from_mapping({**arch, "num_layers": 1, "num_kv_heads": 1})
    assert (s.num_layers, s.num_kv_heads) == (1, 1)
