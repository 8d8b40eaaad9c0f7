"""The growth policy takes its throttle, horizon and time-limit lead from the daemon's settings
(``[slurm]`` in nereusd.toml), and ``grow = false`` leaves growth to the operator."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from nereusd.growth import GrowthPolicy, make_growth
from nereusd.settings import load_settings


def _daemon(tmp_path: Path, toml: str, source: str = "slurm") -> Any:
    cfg = tmp_path / "nereusd.toml"
    cfg.write_text(toml)
    return SimpleNamespace(settings=load_settings(cfg), source=SimpleNamespace(name=source), controllers={},
                           worker=SimpleNamespace(requests=None), store=None)


def test_the_policy_uses_the_slurm_sections_values(tmp_path: Path) -> None:
    d = _daemon(tmp_path, "[slurm]\ngrow_interval_s = 7.5\ngrow_horizon_steps = 400\ntime_limit_lead_s = 300\n")
    policy = make_growth(d)
    assert isinstance(policy, GrowthPolicy)
    assert (policy.interval_s, policy.horizon_steps, policy.time_limit_lead_s) == (7.5, 400.0, 300.0)


def test_grow_false_and_a_local_source_have_no_policy(tmp_path: Path) -> None:
    assert make_growth(_daemon(tmp_path, "[slurm]\ngrow = false\n")) is None
    assert make_growth(_daemon(tmp_path, "", source="local")) is None
    assert isinstance(make_growth(_daemon(tmp_path, "")), GrowthPolicy)  # the default grows
