"""The live job's Slurm launch without a cluster: what each srun task runs (anchor: the driver command;
member: the anchor whose driver it reads), the daemon's member spec from the registered record, and
agent.slurm_task publishing and finding the driver's endpoint (run with a stand-in agent that prints
its argv)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nereusd.allocation import ElasticJob
from nereusd.settings import load_settings
from nereusd.slurm.submit import LaunchSpec, SubmititLauncher
from nereusd.sources import launch_spec_for
from planner.errors import SpecError

PY = "/opt/nereus/bin/python"
ECHO = [sys.executable, "-c", "import json, sys; print('ARGV ' + json.dumps(sys.argv[1:]))"]


def _spec(**kw: object) -> LaunchSpec:
    base: dict[str, object] = {"job_id": "live", "folder": "/shared/nereus/live", "gpus_per_node": 2,
                               "endpoint": "tcp://head:7501", "keys_dir": "/k", "python": PY,
                               "agent_args": ("--cpu-slots", "2"), "job_file": "/shared/jobs/live.toml",
                               "driver_args": ("--events", "/shared/nereus/live/events.jsonl")}
    return LaunchSpec(**{**base, **kw})  # type: ignore[arg-type]


def test_live_task_commands_anchor_runs_the_driver_members_find_it() -> None:
    agent = [PY, "-m", "agent.node", "--endpoint", "tcp://head:7501", "--job", "live", "--keys", "/k", "--cpu-slots",
             "2", "--worker-cmd", f"{PY} -m agent.worker"]
    driver_file = "/shared/nereus/live/driver-live.json"
    assert _spec().task_command("anchor") == [
        PY, "-m", "agent.slurm_task", "--driver-file", driver_file, "--driver-cmd",
        f"{PY} -m agent.driver --job-file /shared/jobs/live.toml --events /shared/nereus/live/events.jsonl",
        "--", *agent]
    assert _spec(anchor_job_id="41").task_command("member") == [
        PY, "-m", "agent.slurm_task", "--driver-file", driver_file, "--anchor-job", "41", "--", *agent]
    with pytest.raises(SpecError, match="anchor_job_id"):
        _spec().task_command("member")
    assert _spec(job_file=None).task_command("anchor") == _spec(job_file=None).agent_command()  # not live
    assert _spec(folder="/shared/x/%j").driver_file == "/shared/x/driver-live.json"
    with pytest.raises(SpecError, match="launch.job_file"):
        _spec(job_file="jobs/live.toml")
    extra = SubmititLauncher(_spec(exclusive=True)).parameters("member", 1)["additional_parameters"]
    assert extra["exclusive"] is True
    assert "exclusive" not in SubmititLauncher(_spec()).parameters("member", 1)["additional_parameters"]


def test_daemon_launches_members_like_the_anchor(tmp_path: Path) -> None:
    job = ElasticJob(job_id="live", anchor_job_id="41", min_gpus=2, max_gpus=4, gpus_per_node=2, slurm_user="root",
                     extra={"folder": "/shared/nereus/live", "endpoint": "tcp://head:7501", "keys_dir": "/k",
                            "python": PY, "agent_args": "--cpu-slots 2", "job_file": "/shared/jobs/live.toml",
                            "driver_args": "--events /shared/nereus/live/events.jsonl", "exclusive": "1"})
    settings = load_settings(None, daemon={"state_dir": str(tmp_path)})
    spec = launch_spec_for(settings)(job)
    assert spec == _spec(anchor_job_id="41", exclusive=True, sbatch_timeout_s=settings.slurm.command_timeout_s)


def _task(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.slurm_task", "--driver-file", str(tmp_path / "driver-live.json"),
                           "--wait-s", "3", *args, "--", *ECHO, "--endpoint", "tcp://127.0.0.1:7501"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SLURMD_NODENAME": "node1", **env})


def _argv(proc: subprocess.CompletedProcess[str]) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    return list(json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("ARGV "))[5:]))


def test_slurm_task_publishes_and_reads_the_driver_endpoint(tmp_path: Path) -> None:
    # a member waits for its anchor's file: none yet, so it gives up after --wait-s
    early = _task(tmp_path, {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0"}, "--anchor-job", "41")
    assert early.returncode == 4 and "no driver endpoint from anchor job 41" in early.stderr
    # the anchor's task 0 publishes an address that reaches nereusd and starts the driver there
    anchor = _argv(_task(tmp_path, {"SLURM_JOB_ID": "41", "SLURM_PROCID": "0"}, "--driver-cmd", "drv --x"))
    published = json.loads((tmp_path / "driver-live.json").read_text())
    assert published["anchor_job_id"] == "41" and published["node"] == "node1"
    endpoint = published["endpoint"]
    assert endpoint.startswith("tcp://127.0.0.1:") and int(endpoint.rsplit(":", 1)[1]) > 0
    assert anchor[-4:] == ["--driver", endpoint, "--driver-cmd", "drv --x"]
    # the anchor's other nodes and its members read it (and give no driver command)
    other = _argv(_task(tmp_path, {"SLURM_JOB_ID": "41", "SLURM_PROCID": "1"}, "--driver-cmd", "drv --x"))
    member = _argv(_task(tmp_path, {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0"}, "--anchor-job", "41"))
    assert other[-2:] == member[-2:] == ["--driver", endpoint] and "--driver-cmd" not in member
    # a file left by another anchor is not this job's driver
    stale = _task(tmp_path, {"SLURM_JOB_ID": "43", "SLURM_PROCID": "0"}, "--anchor-job", "40")
    assert stale.returncode == 4
