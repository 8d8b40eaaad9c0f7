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


@pytest.mark.parametrize(("text", "named"), [
    ("[control]\nheartbeat_interval_s = inf\n", "control.heartbeat_interval_s: Input should be a finite number"),
    ("[control]\nheartbeat_timeout_s = nan\n", "control.heartbeat_timeout_s"),
    ("[control]\nheartbeat_interval_s = 5.0\nheartbeat_timeout_s = 2.0\n", "must exceed heartbeat_interval_s"),
    ("[control]\nport = 7000\nadmin_port = 7000\n", "give them different ports"),
    ("[control]\nmax_message_bytes = 10000000000\n", "control.max_message_bytes"),
    ("[planner]\ngamma = -1\n", "planner.gamma"),
    ("[slurm]\npoll_interval_s = 1e400\n", "slurm.poll_interval_s"),
    ("[slurm]\ngrow_horizon_steps = 0\n", "slurm.grow_horizon_steps"),
    ("[slurm]\ntime_limit_lead_s = -1\n", "slurm.time_limit_lead_s"),
    ('[slurm]\ngrow = "maybe"\n', "slurm.grow"),
    ('[daemon]\nstate_dir = ""\n', "daemon.state_dir: must be an absolute directory path"),
    ('[daemon]\nstate_dir = "relative/dir"\n', "daemon.state_dir"),
    ("[control\nport = 1\n", "is not valid TOML"),
    ("\xff\xfe", "cannot read"),
])
def test_every_bad_value_is_one_line_naming_the_key(tmp_path: Path, text: str, named: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_bytes(text.encode("latin-1"))
    with pytest.raises(SpecError) as info:
        load_settings(cfg)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_a_bad_environment_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEREUS_CONTROL__HEARTBEAT_INTERVAL_S", "inf")
    with pytest.raises(SpecError, match="control.heartbeat_interval_s"):
        load_settings(ROOT / "etc" / "nereusd.toml")
