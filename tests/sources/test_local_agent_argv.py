"""The local source's agents: the argv each granted node's agent gets (keys, slots, worker command,
the driver's port shared by the job's nodes, the driver command on the anchor only), their process
lifecycle (a fake agent that records its argv and environment and waits for SIGTERM), and a job whose
agents cannot start refused before it is tracked."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import pytest

from nereusd.allocation import AllocationError, ElasticJob, NodeAllocation
from nereusd.local_source import LocalSource
from nereusd.settings import Settings, load_settings
from nereusd.sources import LocalAgents
from nereusd.wire.keys import KeyStore

ROOT = Path(__file__).resolve().parents[2]
LIVE = str(ROOT / "etc" / "jobs" / "live.toml")
CONTROL = "tcp://127.0.0.1:47001"

FAKE_AGENT = f"""#!{sys.executable}
# stands in for `python -m agent.node`: records its argv and environment, runs until SIGTERM
import json, os, signal, sys, time
node = sys.argv[sys.argv.index("--node") + 1]
out = os.path.join(os.environ["FAKE_AGENT_DIR"], node)
def record(state):
    with open(out + ".tmp", "w") as f:
        json.dump({{"argv": sys.argv[1:], "env": dict(os.environ), "state": state}}, f)
    os.replace(out + ".tmp", out)
signal.signal(signal.SIGTERM, lambda *_: (record("terminated"), sys.exit(0)))
record("running")
while True:
    time.sleep(0.05)
"""


def _settings(state: Path, **local: object) -> Settings:
    state.mkdir(parents=True, exist_ok=True)
    (state / "endpoints.json").write_text(json.dumps({"control": CONTROL, "admin": "tcp://127.0.0.1:47002"}))
    return load_settings(None, daemon={"state_dir": str(state)}, slurm={"enabled": False}, local=local)


def _bundle(state: Path, user: str, out: Path | None = None) -> Path:
    ks = KeyStore(state / "keys")
    ks.init()
    out = out or state / "keys" / f"agent-{user}"
    ks.create_client(name=f"{user}-agent", user=user, role="agent", out_dir=out)
    return out


def _job(job_id: str = "live", **extra: str) -> ElasticJob:
    return ElasticJob(job_id=job_id, anchor_job_id=f"local-{job_id}", min_gpus=2, max_gpus=6, gpus_per_node=2,
                      slurm_user="alice", extra=extra)


def _node(name: str) -> NodeAllocation:
    return NodeAllocation(node=name, gpu_indices=(0, 1), holder_job_id=f"live/{name}")


def test_argv_per_node_anchor_runs_the_driver(tmp_path: Path) -> None:
    state = tmp_path / "state"
    keys = _bundle(state, "alice")
    agents = LocalAgents(_settings(state, agent_args="--ack-orders --log-format json"), python="/py")
    job = _job(job_file=LIVE)
    anchor, other = agents(job, _node("local0")), agents(job, _node("local1"))
    assert anchor is not None and other is not None
    port = agents.driver_ports["live"]
    common = ["--endpoint", CONTROL, "--keys", str(keys), "--job", "live"]
    assert anchor == ["/py", "-m", "agent.node", *common, "--node", "local0", "--cpu-slots", "2",
                      "--worker-cmd", "/py -m agent.worker", "--driver", f"tcp://127.0.0.1:{port}",
                      "--driver-cmd", f"/py -m agent.driver --job-file {LIVE}", "--ack-orders", "--log-format", "json"]
    assert other == ["/py", "-m", "agent.node", *common, "--node", "local1", "--cpu-slots", "2",
                     "--worker-cmd", "/py -m agent.worker", "--driver", f"tcp://127.0.0.1:{port}",
                     "--ack-orders", "--log-format", "json"]
    assert agents(job, _node("local0")) == anchor  # restarted on the anchor: the driver again, same port
    second = agents(_job("other", job_file=LIVE), _node("local2"))
    assert second is not None and f"tcp://127.0.0.1:{port}" not in second  # a port of its own
    assert "--driver-cmd" in second  # its own anchor


def test_argv_without_a_job_file_or_workers(tmp_path: Path) -> None:
    state = tmp_path / "state"
    keys = _bundle(state, "alice", tmp_path / "alice")
    agents = LocalAgents(_settings(state, worker_cmd="", driver_cmd="{python} -m my.driver --fast"),
                         python="/opt/py 3/python")
    argv = agents(_job(keys_dir=str(keys)), _node("local0"))  # agents only: no driver, no workers
    assert argv == ["/opt/py 3/python", "-m", "agent.node", "--endpoint", CONTROL, "--keys", str(keys), "--job",
                    "live", "--node", "local0", "--cpu-slots", "2"]
    with_file = agents(_job(keys_dir=str(keys), job_file=LIVE), _node("local0"))
    assert with_file is not None
    assert shlex.split(with_file[with_file.index("--driver-cmd") + 1]) == [
        "/opt/py 3/python", "-m", "my.driver", "--fast", "--job-file", LIVE]
    assert agents(_job(), _node("local0")) is None  # neither job file nor keys: only tracked


def test_a_job_whose_agents_cannot_start_is_refused_before_it_is_tracked(tmp_path: Path) -> None:
    state = tmp_path / "state"
    src = LocalSource(num_nodes=3, slots_per_node=2, agent_argv=LocalAgents(_settings(state)))
    try:
        with pytest.raises(AllocationError) as err:
            src.track(_job(job_file=LIVE))  # no bundle at <state>/keys/agent-alice
        assert "agent key bundle for user alice" in str(err.value) and "keys_dir" in str(err.value)
        assert str(state / "keys" / "agent-alice") in str(err.value)
        with pytest.raises(AllocationError, match="keys_dir"):
            src.track(_job(keys_dir=str(tmp_path / "nowhere")))
        _bundle(state, "alice")
        with pytest.raises(AllocationError, match="job_file 'etc/jobs/live.toml' is not an existing absolute"):
            src.track(_job(job_file="etc/jobs/live.toml"))
        assert src.jobs() == () and src.free_nodes() == ("local0", "local1", "local2") and src.poll() == []
        src.track(_job("plain"))  # names neither: tracked and granted, no process
        assert src.allocation("plain").num_gpus == 2 and not src._jobs["plain"].procs  # noqa: SLF001
    finally:
        src.close()


def _records(where: Path, nodes: set[str], state: str) -> dict[str, dict]:  # type: ignore[type-arg]
    deadline = time.monotonic() + 20
    while True:
        got = {p.name: json.loads(p.read_text()) for p in where.iterdir() if not p.name.endswith(".tmp")}
        if set(got) >= nodes and all(got[n]["state"] == state for n in nodes):
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {sorted(nodes)} {state}: {got}")
        time.sleep(0.05)


@pytest.mark.multiprocess
def test_fake_agents_started_per_node_and_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state, seen = tmp_path / "state", tmp_path / "seen"
    seen.mkdir()
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_AGENT)
    fake.chmod(0o755)
    keys = _bundle(state, "alice")
    monkeypatch.setenv("FAKE_AGENT_DIR", str(seen))
    src = LocalSource(num_nodes=3, slots_per_node=2, agent_argv=LocalAgents(_settings(state), python=str(fake)),
                      log_dir=state / "local")
    try:
        src.track(_job(job_file=LIVE))  # min_gpus 2: one node, the anchor
        src.grow("live", 1)
        got = _records(seen, {"local0", "local1"}, "running")
        a0, a1 = got["local0"]["argv"], got["local1"]["argv"]
        assert a0[:2] == ["-m", "agent.node"] and a0[a0.index("--keys") + 1] == str(keys)
        assert a0[a0.index("--driver") + 1] == a1[a1.index("--driver") + 1]  # one driver endpoint per job
        assert "--driver-cmd" in a0 and "--driver-cmd" not in a1
        assert got["local1"]["env"]["FAKE_AGENT_DIR"] == str(seen)  # the daemon's environment
        procs = dict(src._jobs["live"].procs)  # noqa: SLF001
        assert {os.getpgid(p.pid) for p in procs.values()} == {p.pid for p in procs.values()}  # own groups
        src.shrink("live", ["local1"])
        assert _records(seen, {"local1"}, "terminated") and procs["local1"].returncode == 0
        assert procs["local0"].poll() is None
        assert (state / "local" / "live.local0.log").exists()
    finally:
        src.close()
    assert _records(seen, {"local0"}, "terminated") and procs["local0"].returncode == 0
