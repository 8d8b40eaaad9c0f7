"""Which allocation source nereusd picks, the member launch spec it builds, and the local source
driven through a real nereusd: a job added with an elastic spec is granted nodes, and
`nereusctl alloc --grow/--shrink` reaches the source and lands in the store."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog

from nereusd.allocation import ElasticJob
from nereusd.local_source import LocalSource
from nereusd.settings import load_settings
from nereusd.sources import launch_spec_for, make_source
from nereusd.wire.keys import KeyStore

BIN = Path(sys.executable).parent


def _settings(tmp_path: Path, slurm: bool):  # type: ignore[no-untyped-def]
    return load_settings(None, daemon={"state_dir": str(tmp_path)}, slurm={"enabled": slurm})


def test_local_when_slurm_disabled_or_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = structlog.get_logger()
    assert isinstance(make_source(_settings(tmp_path, slurm=False), log), LocalSource)
    monkeypatch.setenv("PATH", str(tmp_path))  # no squeue/sbatch on PATH
    assert isinstance(make_source(_settings(tmp_path, slurm=True), log), LocalSource)


def test_slurm_when_enabled_and_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("squeue", "sbatch"):  # present on PATH is all make_source asks
        tool = bin_dir / name
        tool.write_text("#!/bin/sh\nexit 1\n")
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    source = make_source(_settings(tmp_path, slurm=True), structlog.get_logger())
    assert source.name == "slurm"
    assert source.poll() == []  # nothing tracked: no command run, nothing raised


def test_member_launch_spec_from_job_and_daemon(tmp_path: Path) -> None:
    settings = _settings(tmp_path, slurm=True)
    (tmp_path / "endpoints.json").write_text(json.dumps({"control": "tcp://10.0.0.1:40001"}))
    job = ElasticJob(job_id="j", anchor_job_id="7", min_gpus=8, max_gpus=16, gpus_per_node=8, slurm_user="u",
                     partition="gpu", extra={"keys_dir": "/k", "agent_args": "--cpu-slots 2"})
    spec = launch_spec_for(settings)(job)
    assert spec.endpoint == "tcp://10.0.0.1:40001"  # the port the daemon really bound
    assert spec.folder == str(tmp_path / "slurm" / "j") and spec.partition == "gpu"
    assert spec.agent_command()[-4:] == ["--keys", "/k", "--cpu-slots", "2"]
    with_own = ElasticJob.from_dict({**job.to_dict(), "extra": {"endpoint": "tcp://head:1", "folder": "/f"}})
    own = launch_spec_for(settings)(with_own)
    assert (own.endpoint, own.folder) == ("tcp://head:1", "/f")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(cond, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return value


@pytest.mark.multiprocess
@pytest.mark.slow
def test_local_source_through_nereusd_and_nereusctl(tmp_path: Path) -> None:
    state = tmp_path / "state"
    keys = KeyStore(state / "keys")
    keys.init()
    keys.create_client(name="admin", user="root", role="admin", out_dir=tmp_path / "admin")
    cfg = tmp_path / "nereusd.toml"
    cfg.write_text(f'[daemon]\nstate_dir = "{state}"\nlog_format = "json"\n[control]\nport = {_free_port()}\n'
                   f'admin_port = {_free_port()}\n[metrics]\nenabled = false\n[slurm]\nenabled = false\n')
    with open(tmp_path / "nereusd.log", "ab") as log:
        daemon = subprocess.Popen([str(BIN / "nereusd"), "serve", "--config", str(cfg)], stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        _wait(lambda: (state / "endpoints.json").exists() or daemon.poll() is not None, 20, "nereusd to start")
        assert daemon.poll() is None, (tmp_path / "nereusd.log").read_text()

        def ctl(*argv: str) -> str:
            proc = subprocess.run([str(BIN / "nereusctl"), *argv, "--state-dir", str(state), "--keys",
                                   str(tmp_path / "admin")], capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, proc.stderr
            return proc.stdout

        def kinds() -> list[str]:
            return [a["source"] for a in json.loads(ctl("alloc", "demo", "--json"))["allocations"]]

        elastic = {"anchor_job_id": "local-demo", "min_gpus": 4, "max_gpus": 8, "gpus_per_node": 2,
                   "slurm_user": "root"}
        ctl("job-add", "demo", "--user", "root", "--spec", json.dumps({"elastic": elastic}))
        _wait(lambda: kinds() == ["granted"], 20, "the local grant in the store")
        assert "request queued" in ctl("alloc", "demo", "--grow", "1")
        _wait(lambda: kinds() == ["granted", "grown"], 20, "growth in the store")
        ctl("alloc", "demo", "--shrink", "local0")
        _wait(lambda: kinds() == ["granted", "grown", "shrunk"], 20, "shrink in the store")
        rows = json.loads(ctl("alloc", "demo", "--json"))["allocations"]
        assert [r["gpus"] for r in rows] == [4, 2, 2]
        assert "shrunk" in ctl("alloc", "demo") and "local" in json.dumps(rows[-1]["nodes"])
    finally:
        daemon.terminate()
        daemon.wait(15)
