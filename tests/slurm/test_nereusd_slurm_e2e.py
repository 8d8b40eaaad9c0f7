"""End to end on the real cluster: nereusd (Slurm source) tracks an elastic job submitted with
nereusd.launch; the anchor's agent joins; `nereusctl alloc --grow` submits a member whose agent joins;
`--shrink` releases it; a node DOWN under the anchor is noticed; the store records each change and
nereusctl shows it; an anchor requeued by Slurm is followed as the same job, which goes on on its member
while the requeued anchor's agent joins again."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lab import SlurmLab, wait_for

from nereusd.launch import nereusctl_job_add, submit_elastic_job
from nereusd.wire.keys import KeyStore

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.xdist_group("slurm")]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def nereusd(lab: SlurmLab, tmp_path: Path) -> Iterator[dict[str, Any]]:
    state = tmp_path / "state"
    keys = KeyStore(state / "keys")
    keys.init()
    keys.create_client(name="admin", user="root", role="admin", out_dir=tmp_path / "admin")
    keys.create_client(name="root-agent", user="root", role="agent", out_dir=tmp_path / "agent")
    cfg = tmp_path / "nereusd.toml"
    cfg.write_text(f"""
[daemon]
state_dir = "{state}"
log_format = "json"
[control]
port = {_free_port()}
admin_port = {_free_port()}
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 5.0
[metrics]
enabled = false
[slurm]
poll_interval_s = 0.3
poll_backoff_max_s = 2.0
command_timeout_s = 10.0
""")
    log = open(tmp_path / "nereusd.log", "ab")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([str(BIN / "nereusd"), "serve", "--config", str(cfg)], stdout=log,
                            stderr=subprocess.STDOUT, env=lab.env)
    try:
        wait_for(lambda: (state / "endpoints.json").exists() or proc.poll() is not None, 20, "nereusd to start")
        assert proc.poll() is None, (tmp_path / "nereusd.log").read_text()
        endpoints = json.loads((state / "endpoints.json").read_text())
        yield {"state": state, "tmp": tmp_path, "endpoints": endpoints, "proc": proc}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def _ctl(d: dict[str, Any], *argv: str) -> Any:
    proc = subprocess.run([str(BIN / "nereusctl"), *argv, "--state-dir", str(d["state"]), "--keys",
                           str(d["tmp"] / "admin")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"nereusctl {argv} exited {proc.returncode}: {proc.stderr}"
    return json.loads(proc.stdout) if "--json" in argv else proc.stdout


def _allocs(d: dict[str, Any]) -> list[dict[str, Any]]:
    return _ctl(d, "alloc", "e2e", "--json")["allocations"]


def _events(d: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    rows = _ctl(d, "events", "e2e", "--json")
    out = []
    for row in rows:
        data = row["data"] if isinstance(row["data"], dict) else json.loads(row["data"])
        if row["kind"] == kind:
            out.append(data)
    return out


def _joined(d: dict[str, Any]) -> set[str]:
    return {e["node"] for e in _events(d, "node-registered")}


def _alive(d: dict[str, Any]) -> int:
    return next(int(j["nodes_alive"]) for j in _ctl(d, "jobs", "--json") if j["job"] == "e2e")


def test_nereusd_tracks_elastic_job_through_grow_shrink_and_node_down(lab: SlurmLab, nereusd: dict[str, Any],
                                                                      tmp_path: Path) -> None:
    d = nereusd
    job = submit_elastic_job(
        job_id="e2e", min_gpus=4, max_gpus=12, gpus_per_node=4, endpoint=d["endpoints"]["control"],
        folder=str(tmp_path / "submitit"), keys_dir=str(tmp_path / "agent"), partition=lab.partition,
        agent_args=("--log-format", "json"), env=lab.env,
        register=nereusctl_job_add(ctl_args=["--state-dir", str(d["state"]), "--keys", str(tmp_path / "admin")]))
    assert job.slurm_user == "root" and job.anchor_job_id

    # the anchor starts: the daemon records GRANTED and the anchor's agent joins
    wait_for(lambda: any(a["source"] == "granted" for a in _allocs(d)), 40, "granted in the store", 0.5)
    anchor_node = lab.job_field(job.anchor_job_id, "BatchHost")
    wait_for(lambda: anchor_node in _joined(d), 40, "anchor agent to join", 0.5)

    # grow through the admin CLI: a member job starts and its agent joins
    assert "request queued" in _ctl(d, "alloc", "e2e", "--grow", "1")
    grown = wait_for(lambda: [a for a in _allocs(d) if a["source"] == "grown"], 40, "grown in the store", 0.5)
    member_node = grown[0]["nodes"][0] if isinstance(grown[0]["nodes"], list) else json.loads(grown[0]["nodes"])[0]
    assert member_node != anchor_node and grown[0]["gpus"] == 4
    wait_for(lambda: member_node in _joined(d), 40, "member agent to join", 0.5)
    assert _alive(d) == 2
    member_id = next(e["slurm_job_id"] for e in _events(d, "allocation") if e["kind"] == "grown")
    assert member_id not in (None, job.anchor_job_id)

    # shrink through the admin CLI: the member is cancelled, the store says shrunk, the node released
    _ctl(d, "alloc", "e2e", "--shrink", member_node)
    wait_for(lambda: any(a["source"] == "shrunk" for a in _allocs(d)), 30, "shrunk in the store", 0.5)
    wait_for(lambda: lab.job_field(member_id, "JobState") in ("CANCELLED", "COMPLETED", None), 30, "member to end", 0.5)
    wait_for(lambda: _alive(d) == 1, 30, "the member's node to leave the job", 0.5)

    # Slurm takes a node: grow again, then down the member's node
    _ctl(d, "alloc", "e2e", "--grow", "1")
    wait_for(lambda: len([a for a in _allocs(d) if a["source"] == "grown"]) == 2, 40, "second growth", 0.5)
    second = [a for a in _allocs(d) if a["source"] == "grown"][-1]
    lost = second["nodes"][0] if isinstance(second["nodes"], list) else json.loads(second["nodes"])[0]
    lab.run("scontrol", "update", f"NodeName={lost}", "State=DOWN", "Reason=e2e-down")
    down = wait_for(lambda: [a for a in _allocs(d) if a["source"] == "node_down"], 30, "node_down in the store", 0.5)
    # the reason is the node's (from sinfo) or, if the member's NODE_FAIL was seen first, the job's
    assert "e2e-down" in down[0]["reason"] or "NODE_FAIL" in down[0]["reason"], down[0]

    # people see it: the table lists each change in order
    table = _ctl(d, "alloc", "e2e")
    order = [table.find(word) for word in ("granted", "grown", "shrunk", "node_down")]
    assert all(i >= 0 for i in order) and order == sorted(order), table

    # Slurm requeues the anchor (by hand here; a node failure or a preemption does the same, and Slurm
    # restamps its submit time): not ended as a reused id, the job goes on on its member, and the
    # requeued anchor's agent joins again
    _ctl(d, "alloc", "e2e", "--grow", "1")
    third = wait_for(lambda: [a for a in _allocs(d) if a["source"] == "grown"][2:], 40, "third growth", 0.5)[0]  # type: ignore[index]
    third_node = third["nodes"][0] if isinstance(third["nodes"], list) else json.loads(third["nodes"])[0]
    wait_for(lambda: third_node in _joined(d) and _alive(d) == 2, 40, "the third member's agent to join", 0.5)
    registered = len(_events(d, "node-registered"))
    lab.run("scontrol", "requeue", job.anchor_job_id)
    wait_for(lambda: len([a for a in _allocs(d) if a["source"] == "granted"]) == 2, 90,
             "the requeued anchor granted again", 0.5)
    wait_for(lambda: len(_events(d, "node-registered")) > registered and _alive(d) == 2, 60,
             "the requeued anchor's agent to join again", 0.5)
    assert next(j["state"] for j in _ctl(d, "jobs", "--json") if j["job"] == "e2e") == "running"
    requeued = [a for a in _allocs(d) if a["source"] == "node_down"][-1]
    assert "requeued" in requeued["reason"], requeued

    # a member's time limit comes near (cut to one minute from its start): the daemon sees its end time
    # ahead and releases it through the graceful shrink before Slurm's SIGTERM, which would end it TIMEOUT
    third_id = [e["slurm_job_id"] for e in _events(d, "allocation") if e["kind"] == "grown"][-1]
    shrunk_before = len([a for a in _allocs(d) if a["source"] == "shrunk"])
    h, m, sec = (int(x) for x in str(lab.job_field(third_id, "RunTime")).split("-")[-1].split(":"))
    limit_min = h * 60 + m + 2  # ends 60-120 s from now: inside the daemon's 120 s lead
    lab.run("scontrol", "update", f"JobId={third_id}", f"TimeLimit={limit_min}")
    ahead = wait_for(lambda: _events(d, "time-limit-ahead"), 40, "the member's time limit seen ahead", 0.5)
    assert ahead[0]["node"] == third_node and 0 < ahead[0]["ends_in_s"] <= 120, ahead
    wait_for(lambda: len([a for a in _allocs(d) if a["source"] == "shrunk"]) > shrunk_before, 30,
             "the member released ahead of its time limit", 0.5)
    def ended() -> str | None:
        state = lab.job_field(third_id, "JobState")
        return None if state in ("RUNNING", "COMPLETING") else str(state)

    end = wait_for(ended, 40, "the member job to end", 0.5)
    assert end in ("CANCELLED", "COMPLETED", "None"), end  # released by the daemon, not TIMEOUT
    assert d["proc"].poll() is None  # the daemon kept serving throughout
