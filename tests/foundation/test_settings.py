from __future__ import annotations

from pathlib import Path

import pytest

from nereusd.settings import load_settings
from planner.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]


def test_example_config_loads() -> None:
    s = load_settings(ROOT / "etc" / "nereusd.toml")
    assert s.planner.gamma == 0.5
    assert s.control.port == 7501


def test_environment_overrides_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEREUS_CONTROL__PORT", "7601")
    assert load_settings(ROOT / "etc" / "nereusd.toml").control.port == 7601


def test_unknown_key_is_named(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[control]\nprot = 1\n")
    with pytest.raises(SpecError, match="unknown key 'control.prot'"):
        load_settings(cfg)


def test_bad_value_is_named(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[daemon]\nlog_format = "xml"\n')
    with pytest.raises(SpecError, match="daemon.log_format"):
        load_settings(cfg)


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")
