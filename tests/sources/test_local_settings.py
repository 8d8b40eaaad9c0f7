"""The [local] settings section: read from TOML and from NEREUS_LOCAL__* environment, bad values and
unknown keys refused naming the key, and make_source building the local source from it."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from nereusd.local_source import LocalSource
from nereusd.settings import load_settings
from nereusd.sources import LocalAgents, make_source
from planner.errors import SpecError


def _toml(tmp_path: Path, local: str) -> Path:
    cfg = tmp_path / "nereusd.toml"
    cfg.write_text(f'[daemon]\nstate_dir = "{tmp_path}"\n[slurm]\nenabled = false\n[local]\n{local}\n')
    return cfg


def test_local_section_from_toml(tmp_path: Path) -> None:
    schedule = tmp_path / "schedule.toml"
    schedule.write_text('[[step]]\nat_s = 1.0\njob = "demo"\naction = "grow"\nnodes = 1\n')
    local = load_settings(_toml(tmp_path, f'num_nodes = 2\nslots_per_node = 3\nschedule_path = "{schedule}"\n'
                                          'agent_args = "--ack-orders"\nworker_cmd = ""\n')).local
    assert (local.num_nodes, local.slots_per_node, local.schedule_path) == (2, 3, schedule)
    assert (local.agent_args, local.worker_cmd, local.start_agents) == ("--ack-orders", "", True)
    assert local.driver_cmd == "{python} -m agent.driver"
    source = make_source(load_settings(_toml(tmp_path, f'num_nodes = 2\nschedule_path = "{schedule}"')),
                         structlog.get_logger())
    assert isinstance(source, LocalSource) and source.nodes == ("local0", "local1")
    assert len(source.schedule) == 1 and isinstance(source.agent_argv, LocalAgents)


def test_local_section_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEREUS_LOCAL__NUM_NODES", "6")
    monkeypatch.setenv("NEREUS_LOCAL__START_AGENTS", "false")
    monkeypatch.setenv("NEREUS_LOCAL__AGENT_ARGS", "--ack-orders --log-format json")
    settings = load_settings(_toml(tmp_path, "num_nodes = 2\nslots_per_node = 3"))
    assert (settings.local.num_nodes, settings.local.slots_per_node) == (6, 3)  # the environment wins
    assert not settings.local.start_agents and settings.local.agent_args == "--ack-orders --log-format json"
    source = make_source(settings, structlog.get_logger())
    assert isinstance(source, LocalSource) and len(source.nodes) == 6 and source.agent_argv is None


@pytest.mark.parametrize(("local", "env", "named"), [
    ("num_nodes = 0", {}, "local.num_nodes"),
    ("slots_per_node = 2000", {}, "local.slots_per_node"),
    ("nodes = 2", {}, "unknown key 'local.nodes'"),
    ('schedule_path = "relative.toml"', {}, "local.schedule_path: must be an absolute"),
    ('schedule_path = "/no/such/schedule.toml"', {}, "local.schedule_path: no such file"),
    ("worker_cmd = 'python -m \"agent.worker'", {}, "local.worker_cmd: is not a command line"),
    ('driver_cmd = ""', {}, "local.driver_cmd"),
    ("start_agents = 'maybe'", {}, "local.start_agents"),
    ("", {"NEREUS_LOCAL__BOGUS": "1"}, "unknown key 'local.bogus'"),
    ("", {"NEREUS_LOCAL__NUM_NODES": "many"}, "local.num_nodes"),
])
def test_bad_local_settings_name_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local: str,
                                         env: dict[str, str], named: str) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SpecError) as err:
        load_settings(_toml(tmp_path, local))
    assert named in str(err.value) and "\n" not in str(err.value)
