"""Parameter counts derived from the architectures match the published ones within 1%."""

from __future__ import annotations

import pytest

from planner.models import PUBLISHED_PARAMS, model_preset


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_param_count_matches_model_card(name: str) -> None:
    derived = model_preset(name).num_params()
    assert abs(derived - PUBLISHED_PARAMS[name]) / PUBLISHED_PARAMS[name] < 0.01, derived
