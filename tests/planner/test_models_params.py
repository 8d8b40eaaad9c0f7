"""Parameter counts derived from the architectures match the published ones within 1%."""

from __future__ import annotations

import pytest

from planner.models import PUBLISHED_PARAMS, model_preset


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_param_count_matches_model_card(name: str) -> None:
    derived = model_preset(name).num_params()
    assert abs(derived - PUBLISHED_PARAMS[name]) / PUBLISHED_PARAMS[name] < 0.01, derived


def test_llama3_presets_carry_llama31_rope_scaling_and_it_changes_no_count() -> None:
    """Llama 3.1 and 3.3's config.json: rope_theta 500000 and the llama3 rope scaling; it touches only
    the rotary embedding, so parameter counts (and the planner's memory) are those of plain RoPE."""
    import dataclasses

    for name in ("llama-3.1-8b", "llama-3.3-70b"):
        spec = model_preset(name)
        assert spec.rope_theta == 500_000.0 and spec.rope_scaling is not None
        assert spec.rope_scaling.to_dict() == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        plain = dataclasses.replace(spec, rope_scaling=None)
        assert plain.num_params() == spec.num_params() and plain.kv_bytes_per_token == spec.kv_bytes_per_token
    assert model_preset("qwen3-14b").rope_scaling is None
