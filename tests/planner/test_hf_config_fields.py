"""config.json -> ModelSpec field by field (planner/hf_config.py): each key and its fallbacks in
transformers 4 and 5 spellings, every refusal's exact text, the rope scaling's sources and precedence,
and the job-spec form's bounds. Found by mutation testing (tests/mutate.py --module
planner/hf_config.py: 214 of 497 mutants survived tests/planner; the round trips in tests/engine pin
only what the tiny test configs set)."""

from __future__ import annotations

import pytest

from planner.errors import SpecError
from planner.hf_config import (
    ARCHITECTURE_KEYS,
    hf_config,
    model_from_mapping,
    model_to_mapping,
    spec_from_hf_config,
)
from planner.models import RopeScaling

BASE = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 100}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _refused(cfg: dict, field: str, text: str, allowed: str | None = None) -> None:
    with pytest.raises(SpecError) as err:
        spec_from_hf_config(cfg, name="m", where="dir/config.json")
    assert (err.value.field, str(err.value)) == (field, f"{field}: {text}" + (f" (allowed: {allowed})" if allowed else ""))


def test_the_minimal_llama_config_takes_every_default() -> None:
    s = spec_from_hf_config(BASE, name="mine")
    assert (s.name, s.num_layers, s.hidden_size, s.num_attention_heads, s.ffn_hidden_size, s.vocab_size) == (
        "mine", 2, 64, 4, 96, 100)
    assert (s.num_kv_heads, s.head_dim) == (4, 16)  # no GQA given: one KV head per head; head_dim = hidden / heads
    assert (s.tie_word_embeddings, s.qk_norm, s.qkv_bias, s.rope_scaling) == (False, False, False, None)
    assert (s.rope_theta, s.rms_norm_eps, s.bytes_per_param) == (10_000.0, 1e-6, 2)  # bf16 when no dtype is said


def test_each_key_is_read_in_both_spellings() -> None:
    v4 = spec_from_hf_config({**BASE, "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True,
                              "rope_theta": 5e5, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}, name="m")
    assert (v4.num_kv_heads, v4.head_dim, v4.tie_word_embeddings, v4.rope_theta, v4.rms_norm_eps,
            v4.bytes_per_param) == (2, 32, True, 5e5, 1e-5, 4)
    v5 = spec_from_hf_config({**BASE, "rope_parameters": {"rope_theta": 2e5, "rope_type": "default"},
                              "rope_theta": 1.0, "dtype": "float32", "torch_dtype": "bfloat16"}, name="m")
    assert (v5.rope_theta, v5.bytes_per_param) == (2e5, 4)  # 5's rope_parameters and dtype win over 4's keys
    nulls = spec_from_hf_config({**BASE, "num_key_value_heads": None, "head_dim": None, "rms_norm_eps": None,
                                 "rope_theta": None, "dtype": None}, name="m")
    assert (nulls.num_kv_heads, nulls.head_dim, nulls.rms_norm_eps, nulls.rope_theta) == (4, 16, 1e-6, 10_000.0)
    assert spec_from_hf_config({**BASE, "model_type": "qwen3"}, name="m").qk_norm
    q2 = spec_from_hf_config({**BASE, "model_type": "qwen2"}, name="m")
    assert q2.qkv_bias and not q2.qk_norm


def test_what_the_engine_cannot_build_is_refused_by_name() -> None:
    _refused({**BASE, "model_type": "mistral"}, "dir/config.json.model_type",
             "'mistral' is not a decoder the engine builds", "llama, qwen2, qwen3")
    _refused({k: v for k, v in BASE.items() if k != "model_type"}, "dir/config.json.model_type",
             "None is not a decoder the engine builds", "llama, qwen2, qwen3")
    for key in ("attention_bias", "mlp_bias"):
        _refused({**BASE, key: True}, f"dir/config.json.{key}", "biases are not part of the engine's decoder")
        assert spec_from_hf_config({**BASE, key: False}, name="m")  # false is the engine's own
    _refused({**BASE, "hidden_act": "gelu"}, "dir/config.json.hidden_act", "'gelu' is not supported", "silu")
    assert spec_from_hf_config({**BASE, "hidden_act": "silu"}, name="m")
    _refused({**BASE, "use_sliding_window": True}, "dir/config.json.use_sliding_window",
             "sliding-window attention is not supported")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        _refused({k: v for k, v in BASE.items() if k != key}, f"dir/config.json.{key}", "is missing")
        _refused({**BASE, key: None}, f"dir/config.json.{key}", "is missing")


def test_the_rope_scaling_comes_from_either_key_with_its_context() -> None:
    four = spec_from_hf_config({**BASE, "rope_scaling": LLAMA3}, name="m")
    assert four.rope_scaling == RopeScaling(**{k: v for k, v in LLAMA3.items()})
    five = spec_from_hf_config({**BASE, "rope_parameters": {"rope_theta": 5e5, **LLAMA3}}, name="m")
    assert five.rope_scaling == four.rope_scaling and five.rope_theta == 5e5
    old = {**LLAMA3}
    old["type"] = old.pop("rope_type")  # the older spelling
    assert spec_from_hf_config({**BASE, "rope_scaling": old}, name="m").rope_scaling == four.rope_scaling
    # a top-level original_max_position_embeddings wins; max_position_embeddings is the last fallback
    bare = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    top = spec_from_hf_config({**BASE, "rope_scaling": LLAMA3, "original_max_position_embeddings": 4096,
                               "max_position_embeddings": 131072}, name="m")
    assert top.rope_scaling is not None and top.rope_scaling.original_max_position_embeddings == 4096
    fallback = spec_from_hf_config({**BASE, "rope_scaling": bare, "max_position_embeddings": 2048}, name="m")
    assert fallback.rope_scaling is not None and fallback.rope_scaling.original_max_position_embeddings == 2048
    assert spec_from_hf_config({**BASE, "rope_scaling": {"rope_type": "default"}}, name="m").rope_scaling is None
    assert spec_from_hf_config({**BASE, "rope_scaling": {"type": None}}, name="m").rope_scaling is None
    assert spec_from_hf_config({**BASE, "rope_parameters": {"partial_rotary_factor": 1.0}}, name="m").rope_scaling is None


def test_rope_scalings_the_engine_cannot_apply_are_refused() -> None:
    _refused({**BASE, "rope_scaling": "llama3"}, "dir/config.json.rope_scaling", "must be an object, got 'llama3'")
    _refused({**BASE, "rope_parameters": [1]}, "dir/config.json.rope_parameters", "must be an object, got [1]")
    _refused({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "dir/config.json.rope_scaling.rope_type",
             "rope type 'yarn' is not supported", "default, llama3")
    _refused({**BASE, "rope_parameters": {"partial_rotary_factor": 0.5}},
             "dir/config.json.rope_parameters.partial_rotary_factor", "partial rotary embeddings are not supported", "1.0")
    with pytest.raises(SpecError) as err:
        spec_from_hf_config({**BASE, "rope_scaling": {**LLAMA3, "beta": 1}}, name="m", where="c.json")
    assert err.value.field == "c.json.rope_scaling.beta"


def test_a_config_written_back_reads_the_same() -> None:
    spec = spec_from_hf_config({**BASE, "model_type": "qwen2", "rope_scaling": LLAMA3, "num_key_value_heads": 2},
                               name="m")
    cfg = hf_config(spec, dtype="bfloat16")
    assert spec_from_hf_config(cfg, name="m") == spec
    assert cfg["max_position_embeddings"] == 8 * 8192 and hf_config(spec, max_position_embeddings=99)[
        "max_position_embeddings"] == 99
    plain = spec_from_hf_config(BASE, name="m")
    assert hf_config(plain)["max_position_embeddings"] == 4096 and "rope_scaling" not in hf_config(plain)
    assert hf_config(plain)["rope_parameters"] == {"rope_theta": 10_000.0, "rope_type": "default"}


def _arch(**change: object) -> dict:
    return {**model_to_mapping(spec_from_hf_config(BASE, name="m")), **change}


def _arch_refused(d: object, field: str, text: str) -> None:
    with pytest.raises(SpecError) as err:
        model_from_mapping(d, where="job.model")  # type: ignore[arg-type]
    assert str(err.value).startswith(f"{field}: {text}") and err.value.field == field, str(err.value)


def test_the_job_spec_form_bounds_every_field() -> None:
    _arch_refused(["m"], "job.model", "must be a preset name or an architecture object, got list")
    _arch_refused(_arch(zeta=1, alpha=2), "job.model.alpha", "is not an architecture key")
    for key in ("name", "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
                "ffn_hidden_size", "vocab_size"):
        _arch_refused({k: v for k, v in _arch().items() if k != key}, f"job.model.{key}", "is missing")
        _arch_refused(_arch(**{key: None}), f"job.model.{key}", "is missing")
    optional = {k: v for k, v in _arch().items() if k not in ("bytes_per_param", "grad_bytes_per_param", "qk_norm",
                                                              "rope_theta", "rope_scaling")}
    assert model_from_mapping(optional).name == "m"  # the rest have the ModelSpec's defaults
    assert model_from_mapping(_arch(name="x" * 128)).name == "x" * 128
    for bad in ("", "x" * 129, 5):
        _arch_refused(_arch(name=bad), "job.model.name", f"must be a name of 1-128 characters, got {bad!r}")
    assert model_from_mapping(_arch(vocab_size=1 << 24)).vocab_size == 1 << 24
    for bad in (0, -1, (1 << 24) + 1, True, 2.0, "2"):
        _arch_refused(_arch(vocab_size=bad), "job.model.vocab_size", f"must be a positive integer, got {bad!r}")
    for bad in (1, "true"):
        _arch_refused(_arch(tie_word_embeddings=bad), "job.model.tie_word_embeddings", f"must be true or false, got {bad!r}")
    assert model_from_mapping(_arch(rope_theta=500000)).rope_theta == 500000.0  # an int is a number
    for bad in (0, -1.0, float("nan"), True, "1e4"):
        _arch_refused(_arch(rms_norm_eps=bad), "job.model.rms_norm_eps", f"must be a positive finite number, got {bad!r}")
    _arch_refused(_arch(rope_scaling="llama3"), "job.model.rope_scaling", "must be an object or null, got 'llama3'")
    assert model_from_mapping(_arch(rope_scaling=LLAMA3)).rope_scaling == RopeScaling(**LLAMA3)
    assert set(_arch()) == set(ARCHITECTURE_KEYS)
