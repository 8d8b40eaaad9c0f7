"""The live job through a real nereusd: `nereusctl job-add --job-file` stores the job file's spec, a job
whose agents cannot start is refused before anything is stored, and the local source starts a real
`python -m agent.node` per granted node that registers on its own (no agent started by the test) and
is stopped with the daemon."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from nereusd.jobfile import job_spec
from planner.models import MODELS

from .conftest import ROOT, DaemonHandle, store_rows, wait_for

LIVE = ROOT / "etc" / "jobs" / "live.toml"


def _local(daemon: DaemonHandle, text: str) -> None:
    with open(daemon.config, "a") as f:
        f.write("[local]\n" + text + "\n")


def _stored(daemon: DaemonHandle, job: str) -> dict:  # type: ignore[type-arg]
    rows = store_rows(daemon.state_dir, f"SELECT spec FROM jobs WHERE job_id = '{job}'")
    assert len(rows) == 1, rows
    return json.loads(rows[0][0])


def _expected(spec: dict, job: str, user: str) -> dict:  # type: ignore[type-arg]
    """The spec as the daemon stores it: the elastic section completed as an ElasticJob."""
    return {**spec, "elastic": {**spec["elastic"], "job_id": job, "slurm_user": user, "member_job_ids": [],
                                "partition": None, "submitted_at_s": None}}


def _job_file(tmp_path: Path) -> Path:
    """live.toml on a planner preset that exists on every branch (tiny-3m)."""
    path = tmp_path / "live.toml"
    path.write_text(LIVE.read_text().replace('preset = "tiny-byte"', 'preset = "tiny-3m"'))
    return path


def test_job_add_from_a_job_file_stores_its_spec(daemon: DaemonHandle, tmp_path: Path) -> None:
    _local(daemon, "start_agents = false")
    daemon.start()
    job_file = _job_file(tmp_path)
    proc = daemon.ctl("job-add", "live", "--user", "alice", "--job-file", str(job_file))
    assert proc.returncode == 0 and "added job live" in proc.stdout, proc.stderr
    spec = job_spec(job_file, anchor_job_id="local-live")
    assert _stored(daemon, "live") == _expected(spec, "live", "alice")
    assert _stored(daemon, "live")["elastic"]["extra"] == {"job_file": str(job_file.resolve())}
    kinds = lambda: [a["source"] for a in daemon.admin("alloc", job="live")["allocations"]]  # noqa: E731
    wait_for(lambda: kinds() == ["granted"], what="the local grant of min_gpus")
    # refused before the daemon is asked: one line naming the key, exit 2
    bad = tmp_path / "bad.toml"
    bad.write_text(job_file.read_text().replace("min_gpus = 2", "min_gpus = 8"))
    for argv, named in (((bad,), "placement.max_gpus"), ((tmp_path / "none.toml",), "does not exist")):
        proc = daemon.ctl("job-add", "other", "--user", "alice", "--job-file", *map(str, argv))
        assert proc.returncode == 2 and named in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    proc = daemon.ctl("job-add", "other", "--user", "alice", "--job-file", str(job_file), "--spec", "{}")
    assert proc.returncode == 2 and "not allowed with" in proc.stderr
    proc = daemon.ctl("job-add", "other", "--user", "alice", "--agent-keys", str(tmp_path / "alice"))
    assert proc.returncode == 2 and "--agent-keys goes with --job-file" in proc.stderr
    assert [r[0] for r in store_rows(daemon.state_dir, "SELECT job_id FROM jobs")] == ["live"]
    # --agent-keys: the bundle the local source starts the job's agents with
    proc = daemon.ctl("job-add", "keyed", "--user", "alice", "--job-file", str(job_file), "--agent-keys",
                      str(tmp_path / "alice"))
    assert proc.returncode == 0, proc.stderr
    assert _stored(daemon, "keyed")["elastic"]["extra"] == {"job_file": str(job_file.resolve()),
                                                            "keys_dir": str(tmp_path / "alice")}


@pytest.mark.skipif("tiny-byte" not in MODELS, reason="etc/jobs/live.toml needs the planner preset tiny-byte")
def test_job_add_of_the_live_job_file(daemon: DaemonHandle) -> None:
    _local(daemon, "start_agents = false")
    daemon.start()
    proc = daemon.ctl("job-add", "live", "--user", "alice", "--job-file", str(LIVE))
    assert proc.returncode == 0, proc.stderr
    assert _stored(daemon, "live") == _expected(job_spec(LIVE, anchor_job_id="local-live"), "live", "alice")


@pytest.mark.multiprocess
def test_the_local_source_starts_real_agents_that_register(daemon: DaemonHandle, tmp_path: Path) -> None:
    _local(daemon, 'num_nodes = 2\nslots_per_node = 2\nworker_cmd = ""\nagent_args = "--ack-orders --log-format json"')
    daemon.start()
    # a job file but no agent keys anywhere: refused, nothing stored, no node granted
    proc = daemon.ctl("job-add", "live", "--user", "alice", "--job-file", str(_job_file(tmp_path)))
    assert proc.returncode == 2 and "no agent key bundle for user alice" in proc.stderr, proc.stderr
    assert store_rows(daemon.state_dir, "SELECT job_id FROM jobs") == []
    # agents only (keys, no job file: no driver): the source starts them, they register by themselves
    elastic = {"anchor_job_id": "local-j", "min_gpus": 2, "max_gpus": 4, "gpus_per_node": 2,
               "extra": {"keys_dir": str(tmp_path / "alice")}}
    daemon.admin("job-add", job="j", user="alice", spec={"elastic": elastic})

    def alive() -> list[str]:
        return sorted(n["node"] for n in daemon.admin("job", job="j")["nodes"] if n["state"] == "alive")

    wait_for(lambda: alive() == ["local0"], timeout_s=60, what="the agent of local0 to register")
    daemon.admin("alloc", job="j", action="grow", nodes=1)
    wait_for(lambda: alive() == ["local0", "local1"], timeout_s=60, what="the grown node's agent to register")
    nodes = {n["node"]: n for n in daemon.admin("job", job="j")["nodes"]}
    devices = nodes["local1"]["devices"]
    assert len(json.loads(devices) if isinstance(devices, str) else devices) == 2, nodes  # --cpu-slots 2
    log = daemon.state_dir / "local" / "j.local0.log"
    assert log.exists() and log.read_text()
    pids = [int(p) for p in _agent_pids(daemon.state_dir)]
    assert len(pids) == 2
    try:
        assert daemon.stop() == 0
        for pid in pids:  # the daemon's exit stopped its node processes
            wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists() or _zombie(pid), timeout_s=20,
                     what=f"agent {pid} to stop")
    finally:
        for pid in map(int, _agent_pids(daemon.state_dir)):  # none left behind, whatever failed
            os.kill(pid, signal.SIGKILL)


def _agent_pids(state: Path) -> list[str]:
    """Processes whose command line is an agent of this daemon's job (its state dir is in --keys ...)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"agent.node" in cmd and str(state.parent / "alice").encode() in cmd:
            out.append(proc.name)
    return out


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


