"""Real agent processes: heartbeats, node-lost detection, and a daemon killed with SIGKILL and restarted."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .conftest import DaemonHandle, wait_for

SPEC = {"model": "tiny-3m", "algo": "grpo", "device": "cpu", "gpus_per_node": 2,
        "workload": {"prompts_per_step": 8, "prompt_tokens": 32, "response_tokens": 64}}

pytestmark = pytest.mark.multiprocess


def _node(daemon: DaemonHandle, job: str, node: str) -> dict | None:
    for n in daemon.admin("job", job=job)["nodes"]:
        if n["node"] == node:
            return n
    return None


def _registrations(daemon: DaemonHandle, job: str, node: str) -> list[str]:
    return [e["data"]["how"] for e in daemon.admin("events", job=job)
            if e["kind"] == "node-registered" and e["data"]["node"] == node]


def test_heartbeats_keep_a_node_alive_and_silence_marks_it_lost(daemon: DaemonHandle) -> None:
    daemon.start()
    daemon.admin("job-add", job="j", user="alice")
    a1 = daemon.agent("alice", "j", "n1", "--worker-cmd", "sleep 600")
    a2 = daemon.agent("alice", "j", "n2")
    try:
        wait_for(lambda: daemon.admin("status")["nodes"]["alive"] == 2, what="two nodes alive")
        first = _node(daemon, "j", "n1")["last_heartbeat"]  # type: ignore[index]
        # heartbeats are persisted in batches; the node stays alive well past the 1.5 s time-out
        wait_for(lambda: _node(daemon, "j", "n1")["last_heartbeat"] > first + 2, timeout_s=15,  # type: ignore[index]
                 what="a later heartbeat in the store")
        assert _node(daemon, "j", "n1")["state"] == "alive"  # type: ignore[index]
        assert daemon.admin("jobs")[0]["state"] == "running"
        a2.send_signal(signal.SIGKILL)  # no goodbye: only missed heartbeats can tell
        a2.wait(10)
        wait_for(lambda: _node(daemon, "j", "n2")["state"] == "lost", timeout_s=10, what="n2 lost")  # type: ignore[index]
        assert _node(daemon, "j", "n1")["state"] == "alive"  # type: ignore[index]
        hist = daemon.admin("job", job="j")["history"]
        assert hist[-1]["to_state"] == "running"  # one node left: still running
        a1.send_signal(signal.SIGKILL)
        a1.wait(10)
        wait_for(lambda: daemon.admin("jobs")[0]["state"] == "lost", timeout_s=10, what="job lost")
        reasons = [h["reason"] for h in daemon.admin("job", job="j")["history"]]
        assert any("every node is lost" in r for r in reasons)
    finally:
        for a in (a1, a2):
            if a.poll() is None:
                a.kill()
                a.wait()


def _settled(daemon: DaemonHandle) -> bool:
    """Nothing more to decide: a decision taken after both nodes registered (if the second joined after
    the initial placement, the pool change's), every transition closed, the job running with a plan.
    Waiting for plan v1 alone raced a second decision on a loaded machine (node 2 joining late)."""
    regs = [e["at"] for e in daemon.admin("events", job="j") if e["kind"] == "node-registered"]
    if len(regs) < 2:
        return False
    later = [d for d in daemon.admin("decisions", job="j") if d["at"] > max(regs)]
    open_ = [t for t in daemon.admin("transitions", job="j") if t["state"] in ("planned", "ordered")]
    job = daemon.admin("job", job="j")
    return bool(later) and not open_ and job["state"] == "running" and job["plan_version"] >= 1


def test_sigkill_and_restart_loses_nothing_and_agents_reconnect(daemon: DaemonHandle) -> None:
    daemon.start()
    daemon.admin("job-add", job="j", user="alice", spec=SPEC)
    agents = [daemon.acking_agent("alice", "j", f"n{i}") for i in (1, 2)]
    try:
        wait_for(lambda: daemon.admin("status")["nodes"]["alive"] == 2, what="two nodes alive")
        wait_for(lambda: _settled(daemon), timeout_s=30, what="a plan decided after both nodes joined, committed")
        before = {op: daemon.admin(op, job="j") for op in ("decisions", "transitions", "job")}
        events_before = daemon.admin("events", job="j")
        pids = [a.pid for a in agents]
        old_pid = daemon.proc.pid  # type: ignore[union-attr]

        daemon.kill9()
        daemon.start()
        assert daemon.proc.pid != old_pid  # type: ignore[union-attr]

        # every record is back
        assert daemon.admin("decisions", job="j") == before["decisions"]
        assert daemon.admin("transitions", job="j") == before["transitions"]
        job = daemon.admin("job", job="j")
        assert job["state"] == before["job"]["state"] == "running"
        assert job["plan_version"] == before["job"]["plan_version"] >= 1
        assert job["history"][:len(before["job"]["history"])] == before["job"]["history"]
        assert daemon.admin("events", job="j")[:len(events_before)] == events_before
        # the same agent processes come back on their own: a reconnection, not a new registration
        for node in ("n1", "n2"):
            wait_for(lambda node=node: _registrations(daemon, "j", node)[-1:] == ["reconnected"], timeout_s=15,
                     what=f"{node} reconnected")
        assert [a.pid for a in agents] == pids and all(a.poll() is None for a in agents)
        assert daemon.admin("status")["agents_connected"] == 2
        assert all(n["state"] == "alive" for n in daemon.admin("job", job="j")["nodes"])
        # no node was marked lost across the restart (the restarted daemon granted a fresh grace period)
        assert not [e for e in daemon.admin("events", job="j") if e["kind"] == "node-lost"]
        # and the restarted controller kept the committed plan: nothing was decided again
        assert daemon.admin("decisions", job="j") == before["decisions"]
    finally:
        for a in agents:
            a.kill()
            a.wait()


def test_agent_of_another_user_exits_refused(daemon: DaemonHandle) -> None:
    daemon.start()
    daemon.admin("job-add", job="j", user="alice")
    bob = daemon.agent("bob", "j", "n1")
    assert bob.wait(20) == 3  # EXIT_REFUSED: fail fast, let the scheduler decide
    assert daemon.admin("job", job="j")["nodes"] == []


WORKER = """
import os, sys, time, zmq
from nereusd.wire import protocol
if os.environ["NEREUS_DEVICE"] == "1":
    sys.exit(7)  # a broken worker: restarted once, then reported failed
sock = zmq.Context.instance().socket(zmq.PUSH)
sock.connect(os.environ["NEREUS_AGENT_IPC"])
sock.send(protocol.encode(protocol.Measurement(job_id=os.environ["NEREUS_JOB_ID"], node=os.environ["NEREUS_NODE"],
                                               step=3, plan_version=0, step_latency_s=1.25,
                                               stage_times_s={"actor-gen": 0.5}, response_tokens=70)))
sock.close(linger=5000)
time.sleep(600)
"""


def test_agent_supervises_workers_and_relays_their_measurements(daemon: DaemonHandle) -> None:
    daemon.start()
    daemon.admin("job-add", job="j", user="alice")
    script = daemon.tmp / "worker.py"
    script.write_text(WORKER)
    import sys

    agent = daemon.agent("alice", "j", "n1", "--worker-cmd", f"{sys.executable} {script}", "--max-restarts", "1")
    try:
        def workers() -> list[dict]:
            nodes = daemon.admin("job", job="j")["nodes"]
            return nodes[0]["workers"] if nodes else []

        ws = wait_for(lambda: (w := workers()) and {x["state"] for x in w} == {"running", "failed"} and w,
                      timeout_s=20, what="worker 0 running and worker 1 failed")
        failed = next(w for w in ws if w["device"] == 1)
        assert failed["exit_code"] == 7 and failed["restarts"] == 1
        # the measurement pushed by worker 0 went agent -> daemon -> store
        m = wait_for(lambda: daemon.admin("job-plan", job="j")["measured_step_s"], timeout_s=20,
                     what="the relayed measurement")
        assert m == 1.25
        assert daemon.admin("job-plan", job="j")["measured_at_step"] == 3
    finally:
        agent.send_signal(signal.SIGINT)  # SIGTERM would leave gracefully (test_leaving.py); SIGINT stops now
        assert agent.wait(20) == 0  # workers stopped, clean exit


STANDIN_WORKER = """
import os
from agent.node import AgentLink
from nereusd.wire import protocol
link = AgentLink.from_env()
while True:
    order = link.next_order(timeout_s=600)
    if order is None:
        break
    link.report(protocol.TransitionReport(job_id=link.job_id, node=link.node, transition_id=order.transition_id,
                                          ok=True, measured_s=0.04 + 0.002 * int(os.environ["NEREUS_DEVICE"]),
                                          bytes_moved=0))
"""


def test_agent_relays_one_report_per_node_from_standin_workers(daemon: DaemonHandle) -> None:
    """The agent's relay alone: stand-in worker scripts report a part each, the agent reports the node
    once with the slowest part. The real workers running the DAG are tests/live/test_live_job.py."""
    daemon.start()
    daemon.admin("job-add", job="j", user="alice", spec=SPEC)
    script = daemon.tmp / "standin_worker.py"
    script.write_text(STANDIN_WORKER)
    import sys

    # both worker slots run the stand-in (each "runs" its device's part of the DAG); the agent reports
    # the node done once both did, with the slowest part's time
    agent = daemon.agent("alice", "j", "n1", "--worker-cmd", f"{sys.executable} {script}")
    try:
        wait_for(lambda: daemon.admin("job", job="j")["plan_version"] == 1, timeout_s=30, what="plan v1 committed")
        (t,) = daemon.admin("transitions", job="j")
        assert t["state"] == "done" and t["measured_s"] == 0.042  # max over the node's two workers
        assert "stale-transition-report" not in daemon.log()  # one report per node, not per worker
        assert [h["to_state"] for h in daemon.admin("transition", id=t["id"])["history"]] == ["planned", "ordered",
                                                                                            "done"]
    finally:
        agent.send_signal(signal.SIGINT)
        agent.wait(20)


def test_agents_remove_their_ipc_files_and_clean_stale_ones(daemon: DaemonHandle, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # a short folder of its own: tmp_path under xdist is too long for a Unix socket's path
    ipc = Path(tempfile.mkdtemp(prefix="nipc-", dir="/tmp"))
    daemon.start()  # before TMPDIR is set: only the agents' files are to be in the folder
    monkeypatch.setenv("TMPDIR", str(ipc))  # the agents' ipc_dir (tempfile.gettempdir())
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = [ipc / f"nereus-agent-{dead.pid}-0badc0de.in", ipc / f"nereus-agent-{dead.pid}-0badc0de.orders"]
    for f in stale:
        f.write_text("")  # what a SIGKILLed agent leaves
    daemon.admin("job-add", job="j", user="alice", spec=SPEC)
    agent = daemon.agent("alice", "j", "n1")
    wait_for(lambda: (_node(daemon, "j", "n1") or {}).get("state") == "alive", 60, "agent n1 registered")
    assert not any(f.exists() for f in stale)  # cleaned at start: their pid is gone
    live = sorted(p.name for p in ipc.iterdir())
    assert len(live) == 2 and all(n.startswith(f"nereus-agent-{agent.pid}-") for n in live), live
    agent.send_signal(signal.SIGINT)  # stops at once (SIGTERM would leave gracefully first)
    assert agent.wait(60) == 0
    assert list(ipc.iterdir()) == []  # removed on the way out
    refused = daemon.agent("bob", "j", "n2")  # another user's agent: refused, exit 3, nothing left behind
    assert refused.wait(60) == 3
    assert list(ipc.iterdir()) == []
    shutil.rmtree(ipc)


def test_an_ipc_folder_too_long_for_a_unix_socket_is_one_clear_error(tmp_path: Path) -> None:
    from agent.node import ipc_endpoint
    from planner.errors import SpecError

    assert ipc_endpoint(Path("/tmp"), "nereus-agent-1-ab.in") == "ipc:///tmp/nereus-agent-1-ab.in"
    deep = tmp_path / ("d" * 90)
    deep.mkdir()  # tempfile.gettempdir() ignores a TMPDIR that does not exist
    with pytest.raises(SpecError, match="TMPDIR"):
        ipc_endpoint(deep, "nereus-agent-123456-0badc0de.orders")
    from nereusd.wire.keys import KeyStore

    store = KeyStore(tmp_path / "state" / "keys")
    store.init()
    store.create_client(name="a", user="alice", role="agent", out_dir=tmp_path / "agent")
    (tmp_path / "empty").mkdir()

    def agent(keys: Path, tmpdir: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "agent.node", "--endpoint", "tcp://127.0.0.1:9", "--keys",
                               str(keys), "--job", "j", "--cpu-slots", "1"], env={**os.environ, "TMPDIR": str(tmpdir)},
                              capture_output=True, text=True, timeout=120)

    too_deep = agent(tmp_path / "agent", deep)
    assert too_deep.returncode == 2 and "a Unix socket's path holds at most 107" in too_deep.stderr, too_deep.stderr
    no_keys = agent(tmp_path / "empty", Path("/tmp"))  # an incomplete bundle: one line too
    assert no_keys.returncode == 2 and "incomplete key bundle" in no_keys.stderr, no_keys.stderr
    assert "Traceback" not in too_deep.stderr + no_keys.stderr


@pytest.mark.multiprocess
def test_a_burst_of_sigterms_stops_the_daemon_cleanly(daemon: DaemonHandle) -> None:
    """The signal handler runs on the main thread between any two bytecodes, so it may land inside the
    logger's write (its lock held): a handler that logged deadlocked the daemon on SIGTERM (seen in CI,
    a daemon stuck for good in structlog's PrintLogger). A burst of signals, each landing in the
    previous one's handling, made that near-certain; the handler now only records the signal, and the
    loop logs it and stops."""
    daemon.start()
    assert daemon.proc is not None
    for _ in range(300):
        daemon.proc.send_signal(signal.SIGTERM)
    try:
        rc = daemon.proc.wait(30)
    except subprocess.TimeoutExpired:
        daemon.proc.kill()
        raise AssertionError(f"nereusd did not stop within 30 s of a SIGTERM burst; log:\n{daemon.log()}") from None
    assert rc == 0, daemon.log()
    events = [line for line in daemon.log().splitlines() if '"event": "signal"' in line or '"stopping"' in line]
    assert any('"SIGTERM"' in e for e in events) and any('"stopping"' in e for e in events), events


def test_the_stop_handler_takes_no_lock_the_interrupted_code_may_hold() -> None:
    """The handler runs wherever the main thread was interrupted: here the log's write lock is held (as
    inside any log line), and the handler, called meanwhile, must return at once and record the signal
    (the one that logged waited on that lock for good)."""
    import threading
    from types import SimpleNamespace

    import structlog

    from nereusd.cli import stop_handler
    from nereusd.wire.logs import configure_logging

    configure_logging("json", "info", stream=sys.stderr)  # as nereusd.cli.serve configures it
    lock = structlog._output._get_lock_for_file(sys.stderr)  # PrintLogger's write lock on that stream
    daemon = SimpleNamespace(signalled=None)
    with lock:
        done = threading.Thread(target=stop_handler(daemon), args=(signal.SIGTERM, None), daemon=True)
        done.start()
        done.join(10)
        assert not done.is_alive(), "the stop handler waited on the log's lock"
    assert daemon.signalled == signal.SIGTERM
