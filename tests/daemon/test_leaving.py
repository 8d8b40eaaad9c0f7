"""A node that leaves by itself (Slurm's SIGTERM ahead of a preemption or a time limit) against a real
daemon (loopback, local allocation source, real planner) and real agents whose workers are
stand-ins (``acking_agent``: orders acknowledged without moving state; the daemon's side is what is
tested): the agent tells the daemon ``Leaving`` and keeps serving while the node's state moves away,
exits 0 once the daemon answers ``Release`` and the node is never handed back through the source;
when no plan fits without the node the refusal is an event and the agent goes at its grace end; a
Leaving for another user's job or another node is refused.

The daemon runs as ``nereusd serve`` (a console script): from a worktree, set PYTHONPATH to it so the
daemon runs the code under test.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from agent.node import leave_reason
from nereusd.wire import protocol

from .conftest import DaemonHandle, store_rows, wait_for
from .live_helpers import DEVS, ELASTIC, SPEC, WAIT_S
from .live_helpers import alloc_kinds as _alloc_kinds
from .live_helpers import events_of as _events


def _plan_gpus(daemon: DaemonHandle, job: str) -> set[int]:
    return {g for s in daemon.admin("job-plan", job=job)["stages"] for g in s["gpus"]}


def _exit_within(proc: subprocess.Popen[bytes], timeout_s: float, what: str) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}") from None


def _stop(agents: list[subprocess.Popen[bytes]]) -> None:
    for a in agents:
        if a.poll() is None:
            a.kill()
        a.wait()


@pytest.mark.multiprocess
def test_sigterm_drains_the_node_then_the_agent_goes_and_the_source_is_not_asked(daemon: DaemonHandle) -> None:
    grace_s = 50.0
    daemon.start()
    daemon.admin("job-add", job="j", user="alice", spec={**SPEC, "elastic": ELASTIC})
    wait_for(lambda: _alloc_kinds(daemon, "j") == ["granted"], timeout_s=WAIT_S, what="local0 granted")
    agents = [daemon.acking_agent("alice", "j", "local0")]
    try:
        wait_for(lambda: daemon.admin("job", job="j")["plan_version"] >= 1, timeout_s=WAIT_S,
                 what="the initial placement committed on local0")
        daemon.admin("alloc", job="j", action="grow", nodes=1)
        wait_for(lambda: _alloc_kinds(daemon, "j") == ["granted", "grown"], timeout_s=WAIT_S, what="local1 grown")
        agents.append(daemon.acking_agent("alice", "j", "local1", "--leave-grace-s", str(grace_s)))
        # local0 registered first: GPUs 0, 1; local1: 2, 3. The replan on four GPUs uses local1.
        wait_for(lambda: daemon.admin("job", job="j")["state"] == "running" and _plan_gpus(daemon, "j") & {2, 3},
                 timeout_s=WAIT_S, what="a committed plan using local1's GPUs")
        before = {t["id"] for t in daemon.admin("transitions", job="j")}

        t0 = time.monotonic()
        agents[1].send_signal(signal.SIGTERM)  # Slurm's preemption notice
        leaving = wait_for(lambda: _events(daemon, "j", "node-leaving"), timeout_s=WAIT_S, what="node-leaving")
        assert leaving[0]["data"]["node"] == "local1" and leaving[0]["data"]["reason"] == "agent shutdown"
        assert 0 < leaving[0]["data"]["grace_s"] <= grace_s
        code = _exit_within(agents[1], WAIT_S, "local1's agent to exit after its Release")
        took = time.monotonic() - t0
        assert code == 0 and took < grace_s, (code, took)

        moved = [t for t in daemon.admin("transitions", job="j") if t["id"] not in before]
        assert [t["state"] for t in moved] == ["done"], moved
        t = moved[0]
        history = daemon.admin("transition", id=t["id"])["history"]
        assert any(h["to_state"] == "ordered" and "2 node(s)" in h["reason"] for h in history), history
        assert daemon.admin("job", job="j")["plan_version"] == t["to_version"] and _plan_gpus(daemon, "j") <= {0, 1}
        decision = daemon.admin("explain", id=t["decision_id"])
        assert decision["urgent"] and "drain local1" in str(decision["inputs"])
        left = _events(daemon, "j", "node-left")
        assert [e["data"] for e in left] == [{"node": "local1", "reason": "agent shutdown"}]
        done_at = store_rows(daemon.state_dir, f"SELECT at FROM status_history WHERE kind='transition' AND "
                                               f"key='{t['id']}' AND to_state='done'")[0][0]
        assert done_at <= left[0]["at"], "released before the transition away from it was done"
        # Slurm takes the node: no shrink went to the source, the store says why the node is gone
        assert "shrunk" not in _alloc_kinds(daemon, "j"), _alloc_kinds(daemon, "j")
        nodes = {n["node"]: n for n in daemon.admin("job", job="j")["nodes"]}
        assert nodes["local1"]["state"] == "released" and nodes["local0"]["state"] == "alive"
        assert daemon.admin("alloc", job="j")["draining"] == []
        assert daemon.admin("job", job="j")["state"] == "running"
        log = (daemon.tmp / "agent-local1.log").read_text()
        assert '"leaving"' in log and '"released"' in log and "leave-grace-over" not in log
    finally:
        _stop(agents)


@pytest.mark.multiprocess
def test_a_leave_no_plan_survives_is_refused_and_the_agent_goes_at_its_grace_end(daemon: DaemonHandle) -> None:
    grace_s = 3.0
    daemon.start()
    daemon.admin("job-add", job="j", user="alice", spec=SPEC)
    agent = daemon.acking_agent("alice", "j", "n1", "--leave-grace-s", str(grace_s))
    try:
        wait_for(lambda: daemon.admin("job", job="j")["plan_version"] >= 1, timeout_s=WAIT_S,
                 what="the initial placement committed on n1")
        t0 = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        code = _exit_within(agent, grace_s + WAIT_S, "n1's agent to exit at its grace end")
        took = time.monotonic() - t0
        assert code == 0 and grace_s - 0.5 <= took, (code, took)  # it waited: the daemon never released it
        refused = wait_for(lambda: _events(daemon, "j", "alloc-refused"), timeout_s=WAIT_S, what="alloc-refused")
        data = refused[0]["data"]
        assert data["op"] == "leave" and data["nodes"] == ["n1"] and "no GPU would be left" in data["reason"]
        assert "grace end" in data["reason"]
        assert [e["data"]["node"] for e in _events(daemon, "j", "node-leaving")] == ["n1"]
        assert not _events(daemon, "j", "node-left")
        log = (daemon.tmp / "agent-n1.log").read_text()
        assert "leave-grace-over" in log and '"released"' not in log
    finally:
        _stop([agent])


@pytest.mark.multiprocess
def test_a_second_sigterm_stops_the_agent_at_once(daemon: DaemonHandle) -> None:
    daemon.start()
    daemon.admin("job-add", job="j", user="alice", spec=SPEC)
    agent = daemon.acking_agent("alice", "j", "n1", "--leave-grace-s", "600")
    try:
        wait_for(lambda: daemon.admin("job", job="j")["plan_version"] >= 1, timeout_s=WAIT_S,
                 what="the initial placement committed on n1")
        agent.send_signal(signal.SIGTERM)
        wait_for(lambda: _events(daemon, "j", "node-leaving"), timeout_s=WAIT_S, what="node-leaving")
        assert agent.poll() is None, "the first SIGTERM must not stop it"
        agent.send_signal(signal.SIGTERM)
        assert _exit_within(agent, WAIT_S, "the agent to stop on the second SIGTERM") == 0
    finally:
        _stop([agent])


@pytest.mark.multiprocess
def test_a_leaving_for_another_job_or_node_is_refused(daemon: DaemonHandle) -> None:
    daemon.start()
    daemon.admin("job-add", job="j", user="alice", spec={})
    daemon.admin("job-add", job="k", user="bob", spec={})
    alice = daemon.client("alice", identity=b"agent-alice")
    bob = daemon.client("bob", identity=b"agent-bob")
    for c, job, node in ((alice, "j", "n1"), (bob, "k", "m1")):
        welcome = c.request(protocol.Register(job_id=job, node=node, incarnation=node, devices=DEVS), timeout_s=WAIT_S)
        assert isinstance(welcome, protocol.Welcome), welcome
    for c, job, node in ((bob, "j", "n1"), (alice, "j", "n2"), (alice, "k", "m1")):
        reply = c.request(protocol.Leaving(job_id=job, node=node, reason="preempt", grace_s=10.0), timeout_s=WAIT_S)
        assert isinstance(reply, protocol.ErrorReply) and reply.code == "forbidden", (job, node, reply)
    stranger = daemon.client("alice", identity=b"agent-stranger")
    reply = stranger.request(protocol.Leaving(job_id="j", node="n1", reason="preempt", grace_s=10.0),
                             timeout_s=WAIT_S)
    assert isinstance(reply, protocol.ErrorReply) and reply.code == "unknown-session", reply
    assert not _events(daemon, "j", "node-leaving") and not _events(daemon, "k", "node-leaving")
    # its own node of its own job: taken (a job without a plan: nothing to move, it may go at once)
    reply = alice.request(protocol.Leaving(job_id="j", node="n1", reason="time-limit", grace_s=10.0),
                          timeout_s=WAIT_S)
    assert isinstance(reply, protocol.Release) and reply.node == "n1" and reply.reason == "time limit", reply
    assert [e["data"]["reason"] for e in _events(daemon, "j", "node-leaving")] == ["time limit"]
    again = alice.request(protocol.Leaving(job_id="j", node="n1", reason="time-limit", grace_s=9.0),
                          timeout_s=WAIT_S)  # the agent repeats it every beat: answered alike, recorded once
    assert isinstance(again, protocol.Release), again
    assert alice.recv(timeout_s=0.5) is None, "one reply per Leaving"
    assert len(_events(daemon, "j", "node-leaving")) == 1 and len(_events(daemon, "j", "node-left")) == 1
    assert {n["node"]: n["state"] for n in daemon.admin("job", job="j")["nodes"]} == {"n1": "released"}


def test_leaving_is_checked_at_the_protocol_boundary() -> None:
    good = {"v": 1, "type": "leaving", "job_id": "j", "node": "n1", "reason": "preempt", "grace_s": 25.0}
    want = protocol.Leaving(job_id="j", node="n1", reason="preempt", grace_s=25.0)
    assert protocol.decode(json.dumps(good).encode(), 4096) == want
    assert protocol.decode(protocol.encode(want), 4096) == want  # msgpack too
    for field, bad in (("reason", "because"), ("reason", ""), ("grace_s", -1.0), ("grace_s", "5"),
                       ("grace_s", True), ("grace_s", 1e9), ("node", "a/b"), ("job_id", "x" * 65)):
        with pytest.raises(protocol.ProtocolError) as exc:
            protocol.decode(json.dumps({**good, field: bad}).encode(), 4096)
        assert exc.value.code == "invalid" and field in str(exc.value), (field, bad, exc.value)
    for bad_float in (math.nan, math.inf):
        with pytest.raises(protocol.ProtocolError):
            protocol.decode(json.dumps({**good, "grace_s": bad_float}).encode(), 4096)
    with pytest.raises(protocol.ProtocolError, match="Extra inputs"):
        protocol.decode(json.dumps({**good, "why": "x"}).encode(), 4096)


def test_the_reason_comes_from_slurms_end_time() -> None:
    now = 1_000_000.0
    assert leave_reason({}, now) == "shutdown"
    assert leave_reason({"SLURM_JOB_ID": "7"}, now) == "preempt"
    assert leave_reason({"SLURM_JOB_ID": "7", "SLURM_JOB_END_TIME": str(int(now) + 30)}, now) == "time-limit"
    assert leave_reason({"SLURM_JOB_ID": "7", "SLURM_JOB_END_TIME": str(int(now) + 86400)}, now) == "preempt"


_NOTICED = """
import pathlib, signal, sys, time
seen = []
def on_term(*_):
    seen.append(1)
    if sys.argv[1] == "leaves" or len(seen) > 1:
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
pathlib.Path(sys.argv[2]).write_text("ready")
while True:
    time.sleep(0.05)
"""


@pytest.mark.multiprocess
def test_the_local_sources_preempt_gives_notice_like_slurm(tmp_path: Any) -> None:
    """``preempt`` SIGTERMs the node's agent and takes the node once the agent left, or after KillWait."""
    from nereusd.allocation import ElasticJob, EventKind
    from nereusd.local_source import LocalSource, ScheduleStep

    how = {"local1": "leaves", "local2": "stays"}

    def argv(job: ElasticJob, node: Any) -> list[str]:
        return [sys.executable, "-c", _NOTICED, how.get(node.node, "stays"), str(tmp_path / f"{node.node}.ready")]

    now = [0.0]
    steps = (ScheduleStep(at_s=0, job="demo", action="grant", nodes=3),
             ScheduleStep(at_s=1, job="demo", action="preempt", nodes=2))
    src = LocalSource(num_nodes=3, slots_per_node=2, schedule=steps, agent_argv=argv, kill_wait_s=10.0,
                      clock=lambda: now[0])
    try:
        src.track(ElasticJob(job_id="demo", anchor_job_id="a", min_gpus=2, max_gpus=6, gpus_per_node=2,
                             slurm_user="alice"))
        assert [e.kind for e in src.poll()] == [EventKind.GRANTED]
        wait_for(lambda: all((tmp_path / f"local{i}.ready").exists() for i in range(3)), timeout_s=WAIT_S,
                 what="the three node processes ready for SIGTERM")
        procs = {n: p for t in src._jobs.values() for n, p in t.procs.items()}  # noqa: SLF001
        now[0] = 1.0
        # a notice, not a loss: the nodes stay held until their agents leave. local1's may already have
        # left by the end of the very poll that SIGTERMed it (a loaded machine runs the child first),
        # so its departure is taken from that poll or the next
        events = src.poll()
        assert all(e.kind is EventKind.PREEMPTED and [n.node for n in e.nodes] == ["local1"] for e in events)
        if not events:
            assert src.allocation("demo").node_names == ("local0", "local1", "local2")
            _exit_within(procs["local1"], WAIT_S, "local1's process to leave on the notice")
            events = src.poll()
        (left,) = events
        assert left.kind is EventKind.PREEMPTED and [n.node for n in left.nodes] == ["local1"]
        assert "agent left (exit 0)" in left.reason and procs["local2"].poll() is None
        now[0] = 11.0
        (taken,) = src.poll()
        assert taken.kind is EventKind.PREEMPTED and [n.node for n in taken.nodes] == ["local2"]
        assert "KillWait 10 s over" in taken.reason and procs["local2"].returncode is not None
        assert src.allocation("demo").node_names == ("local0",)
    finally:
        src.close()
