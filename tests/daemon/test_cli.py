"""nereusctl and nereusd as console scripts: tables, --json, exit codes, settings errors, keys, systemd."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import urllib.request
from pathlib import Path

import pytest

from .conftest import BIN, ROOT, DaemonHandle, wait_for, write_config

SPEC = {"model": "tiny-3m", "algo": "grpo", "device": "cpu", "gpus_per_node": 2,
        "workload": {"prompts_per_step": 8, "prompt_tokens": 32, "response_tokens": 64}}


@pytest.mark.multiprocess
def test_nereusctl_against_a_running_daemon(daemon: DaemonHandle) -> None:
    daemon.start()
    # READY=1 arrived (start() checks it); how fast is bench/daemon.py's to measure, not a test's
    assert daemon.proc is not None and daemon.proc.poll() is None
    added = daemon.ctl("job-add", "grpo-tiny", "--user", "alice", "--spec", json.dumps(SPEC))
    assert added.returncode == 0, added.stderr
    agent = daemon.acking_agent("alice", "grpo-tiny", "n1")
    try:
        # the initial placement is decided, ordered, acknowledged by the agent and committed
        wait_for(lambda: daemon.admin("job", job="grpo-tiny")["plan_version"] == 1, timeout_s=20,
                 what="plan v1 committed")
        jobs = daemon.ctl("jobs")
        assert jobs.returncode == 0
        header, row = jobs.stdout.splitlines()[:2]
        assert header.split()[:3] == ["JOB", "USER", "STATE"]
        assert row.split()[:3] == ["grpo-tiny", "alice", "running"]
        latest = daemon.admin("events", job="grpo-tiny")[-1]["at"]  # read first: later events only raise it
        listed = next(j for j in json.loads(daemon.ctl("jobs", "--json").stdout) if j["job"] == "grpo-tiny")
        assert listed["updated_at"] >= latest  # the job's last change, not only its last state change
        assert listed["members_pending"] == 0

        plan = daemon.ctl("job-plan", "grpo-tiny", "--json")
        data = json.loads(plan.stdout)
        assert data["plan_version"] == 1
        assert {s["model_stage"] for s in data["stages"]} == {"actor-gen", "ref-inf", "reward-inf", "actor-train"}
        assert all(set(s["gpus"]) <= {0, 1} and s["predicted_s"] > 0 for s in data["stages"])
        assert "MODEL_STAGE" in daemon.ctl("job-plan", "grpo-tiny").stdout
        # `nereusctl plan JOB` is the same view (the what-if form takes flags instead of a job)
        assert json.loads(daemon.ctl("plan", "grpo-tiny", "--json").stdout) == data

        decisions = json.loads(daemon.ctl("decisions", "grpo-tiny", "--json").stdout)
        assert decisions[0]["admitted"] is True and decisions[0]["rule"] == "urgent-feasibility"
        explain = daemon.ctl("explain", str(decisions[0]["id"]))
        assert "ADMITTED by rule urgent-feasibility" in explain.stdout
        assert "initial placement on 2 GPUs" in explain.stdout

        transitions = json.loads(daemon.ctl("transitions", "grpo-tiny", "--json").stdout)
        assert transitions[0]["state"] == "done" and transitions[0]["decision_id"] == decisions[0]["id"]
        one = daemon.ctl("transition", str(transitions[0]["id"]))
        assert one.returncode == 0 and "initial-placement" in one.stdout and "ordered" in one.stdout

        status = json.loads(daemon.ctl("status", "--json").stdout)
        assert status["jobs"] == {"running": 1} and status["agents_connected"] == 1
        assert status["planner"] == "planner.search"
        keys = json.loads(daemon.ctl("keys", "--json").stdout)
        assert {k["name"] for k in keys} == {"admin", "alice-agent", "bob-agent"}
        assert all("secret" not in json.dumps(k) for k in keys)
        alloc = daemon.ctl("alloc", "--json")
        assert alloc.returncode == 0 and json.loads(alloc.stdout)["source"] == "local"  # slurm.enabled = false

        metrics = urllib.request.urlopen(status["endpoints"]["metrics"], timeout=10).read().decode()
        assert 'nereus_jobs{state="running"} 1.0' in metrics
        assert 'nereus_gpus_held{job="grpo-tiny"} 2.0' in metrics
        assert 'nereus_transitions_total{job="grpo-tiny",outcome="done"} 1.0' in metrics
        assert "nereus_decision_seconds_count 1.0" in metrics
    finally:
        agent.kill()
        agent.wait()

    # exit codes and errors that say what to do
    missing = daemon.ctl("job-plan", "nope")
    assert missing.returncode == 1 and "no job 'nope'" in missing.stderr and "grpo-tiny" in missing.stderr
    dup = daemon.ctl("job-add", "grpo-tiny", "--user", "alice")
    assert dup.returncode == 2 and "exists" in dup.stderr
    refused = subprocess.run([str(BIN / "nereusctl"), "status", "--state-dir", str(daemon.state_dir),
                              "--keys", str(daemon.tmp / "alice")], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 3 and "not an authorised admin key" in refused.stderr
    daemon.stop()
    down = daemon.ctl("status", "--timeout", "0.5")
    assert down.returncode == 3 and "is nereusd running" in down.stderr


def test_nereusctl_without_a_daemon_says_what_to_do(tmp_path: Path) -> None:
    proc = subprocess.run([str(BIN / "nereusctl"), "jobs", "--state-dir", str(tmp_path), "--keys", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--keys" in proc.stderr  # no key bundle there
    (tmp_path / "k").mkdir()
    for f in ("client.key", "client.key_secret", "server.key"):
        (tmp_path / "k" / f).write_text("x" * 40)
    secret = tmp_path / "k" / "client.key_secret"
    secret.chmod(0o644)  # a secret others can read is refused, with the fix named
    proc = subprocess.run([str(BIN / "nereusctl"), "jobs", "--state-dir", str(tmp_path), "--keys", str(tmp_path / "k")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"chmod 600 {secret}" in proc.stderr and "Traceback" not in proc.stderr
    secret.chmod(0o600)
    proc = subprocess.run([str(BIN / "nereusctl"), "jobs", "--state-dir", str(tmp_path), "--keys", str(tmp_path / "k")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and "endpoints.json" in proc.stderr
    secret.write_text("not a key\n")  # a garbage key: one line, no traceback
    proc = subprocess.run([str(BIN / "nereusctl"), "jobs", "--endpoint", "tcp://127.0.0.1:9", "--keys",
                           str(tmp_path / "k")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not a CURVE key" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_settings_errors_name_the_key(tmp_path: Path) -> None:
    bad = {"[control]\nprot = 1\n": "unknown key 'control.prot'",
           "[control]\nport = 70000\n": "control.port",
           '[daemon]\nlog_level = "loud"\n': "daemon.log_level"}
    for text, expected in bad.items():
        cfg = tmp_path / "bad.toml"
        cfg.write_text(text)
        proc = subprocess.run([str(BIN / "nereusd"), "serve", "--config", str(cfg)], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert expected in proc.stderr
    proc = subprocess.run([str(BIN / "nereusd"), "serve", "--config", str(tmp_path / "missing.toml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    # the environment overrides the file, and is validated the same way
    cfg = tmp_path / "ok.toml"
    write_config(cfg, tmp_path / "state")
    proc = subprocess.run([str(BIN / "nereusd"), "serve", "--config", str(cfg)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "NEREUS_CONTROL__HEARTBEAT_TIMEOUT_S": "-1"})
    assert proc.returncode == 2 and "control.heartbeat_timeout_s" in proc.stderr


def test_keys_command_writes_private_files(tmp_path: Path) -> None:
    state = tmp_path / "state"
    run = lambda *a: subprocess.run([str(BIN / "nereusd"), "keys", *a, "--state-dir", str(state)],  # noqa: E731
                                    capture_output=True, text=True, timeout=60)
    assert run("init").returncode == 0
    created = run("create", "carol-agent", "--user", "carol", "--out", str(tmp_path / "carol"))
    assert created.returncode == 0, created.stderr
    for secret in (state / "keys" / "server.key_secret", tmp_path / "carol" / "client.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "carol").stat().st_mode) == 0o700
    assert (tmp_path / "carol" / "server.key").read_text() == (state / "keys" / "server.key").read_text()
    listed = json.loads(run("list", "--json").stdout)
    assert [(k["name"], k["user"], k["role"]) for k in listed] == [("carol-agent", "carol", "agent")]
    again = run("create", "carol-agent", "--user", "carol", "--out", str(tmp_path / "c2"))
    assert again.returncode == 2 and "exists" in again.stderr
    bad = run("create", "x/../y", "--user", "carol", "--out", str(tmp_path / "c3"))
    assert bad.returncode == 2 and "keys.name" in bad.stderr
    assert run("revoke", "carol-agent").returncode == 0
    assert json.loads(run("list", "--json").stdout) == []
    assert run("revoke", "carol-agent").returncode == 2


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd) so the unit cannot be verified")
    unit = (ROOT / "etc" / "nereusd.service").read_text()
    assert "Type=notify" in unit and "NoNewPrivileges=yes" in unit and "ProtectSystem=strict" in unit
    # verify needs the ExecStart binary to exist: point it at this environment's console script
    local = tmp_path / "nereusd.service"
    local.write_text(unit.replace("/usr/bin/nereusd", str(BIN / "nereusd")))
    proc = subprocess.run([analyze, "verify", str(local)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "nereusd.service" not in proc.stderr, proc.stderr  # no warnings about our unit either
    broken = tmp_path / "broken.service"
    broken.write_text(unit.replace("/usr/bin/nereusd", str(tmp_path / "missing")))
    assert subprocess.run([analyze, "verify", str(broken)], capture_output=True, timeout=120).returncode != 0


def test_keys_create_refuses_a_state_dir_without_the_daemons_keypair(tmp_path: Path) -> None:
    state = tmp_path / "nowhere"
    proc = subprocess.run([str(BIN / "nereusd"), "keys", "create", "x", "--user", "u", "--out", str(tmp_path / "out"),
                           "--state-dir", str(state)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "keys init" in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert not state.exists() and not (tmp_path / "out").exists()  # nothing invented: no dir, no keypair


def test_nereusctl_into_a_closed_pipe_exits_quietly() -> None:
    """`nereusctl ... | head`: the reader goes first; no BrokenPipeError traceback, the shell's SIGPIPE code."""
    proc = subprocess.Popen([str(BIN / "nereusctl"), "plan", "--model", "llama-3.1-8b", "--algo", "ppo", "--device",
                             "h200", "--gpus", "64", "--prompt-tokens", "1024", "--response-tokens", "4096"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the child prints anything (it is still importing)
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
