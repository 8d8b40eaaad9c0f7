"""Hostile and careless input against a real nereusd: out-of-range values, other users' keys, floods,
damaged stores and key files. After each: the daemon answers, nothing invalid was stored, a restart works.

Every wait names what it waits for and is bounded (``wait_for``, ``recv(timeout_s=...)``); the only
waits for an *absence* (a refused routing id gets no reply) are bounded and short.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from nereusd.wire import protocol
from nereusd.wire.client import CurveClient
from nereusd.wire.keys import KeyStore, load_bundle

from .conftest import DaemonHandle, free_port, store_rows, wait_for, write_config

pytestmark = pytest.mark.multiprocess

DEV = (protocol.Device(index=0, kind="cpu", name="cpu", memory_bytes=1 << 30),)
SPEC = {"model": "tiny-3m", "algo": "grpo", "device": "cpu", "gpus_per_node": 2,
        "workload": {"prompts_per_step": 8, "prompt_tokens": 32, "response_tokens": 64}}


def _register(c: CurveClient, job: str, node: str) -> Any:
    return c.request(protocol.Register(job_id=job, node=node, incarnation="t", devices=DEV), timeout_s=10)


def _raw(c: CurveClient, data: dict[str, Any]) -> Any:
    c.send_raw(json.dumps(data).encode())
    reply = c.recv(timeout_s=10)
    assert reply is not None, f"no reply to {str(data)[:120]}"
    return reply


def _admin_reply(daemon: DaemonHandle, op: str, **args: Any) -> protocol.AdminReply:
    return daemon.admin_reply(op, **args)


# --- values that must be refused, with the field named -------------------------------------------

BAD_VALUES: list[tuple[str, str, Any]] = [
    # (message type, field, value)
    ("measurement", "response_tokens", float("inf")),
    ("measurement", "response_tokens", float("nan")),
    ("measurement", "step_latency_s", -1.0),
    ("measurement", "step_latency_s", "1e400"),  # sent as the JSON number 1e400 (parses to inf)
    ("measurement", "step", 2**63),
    ("measurement", "step", -1),
    ("measurement", "stage_times_s", {"actor-gen": float("inf")}),
    ("measurement", "stage_times_s", {"a/b": 1.0}),
    ("measurement", "peak_memory_bytes", {"0": -5}),
    ("measurement", "peak_memory_bytes", {"0": 2**64}),
    ("measurement", "job_id", ""),
    ("measurement", "job_id", None),
    ("measurement", "node", "x" * 100_000),
    ("measurement", "node", "y/z"),
    ("heartbeat", "seq", 2**63),
    ("heartbeat", "seq", True),
    ("heartbeat", "workers", [{"device": 0, "pid": 1, "state": "running", "restarts": -1}]),
    ("heartbeat", "workers", [{"device": 0, "pid": 2**40, "state": "running"}]),
    ("transition-report", "measured_s", float("nan")),
    ("transition-report", "measured_s", -0.5),
    ("transition-report", "transition_id", 2**64),
    ("transition-report", "bytes_moved", -1),
    ("register", "devices", [{"index": 0, "kind": "cpu", "name": "c", "memory_bytes": -1}]),
    ("register", "node", "x/y"),
    ("register", "job_id", "j" * 65),
    ("register", "slurm_job_id", "../1"),
]


def _good(kind: str) -> dict[str, Any]:
    msgs = {
        "measurement": protocol.Measurement(job_id="j", node="n1", step=1, plan_version=0, step_latency_s=1.0),
        "heartbeat": protocol.Heartbeat(job_id="j", node="n1", seq=1),
        "transition-report": protocol.TransitionReport(job_id="j", node="n1", transition_id=1, ok=True,
                                                       measured_s=0.1),
        "register": protocol.Register(job_id="j", node="n1", incarnation="t", devices=DEV),
    }
    return json.loads(protocol.encode(msgs[kind], "json"))


def _frame(kind: str, field: str, value: Any) -> bytes:
    data = {**_good(kind), field: value}
    if value == "1e400":
        return json.dumps({**data, field: 0.0}).replace(f'"{field}": 0.0', f'"{field}": 1e400').encode()
    return json.dumps(data).encode()  # NaN/Infinity are written as JSON's extensions, as a careless client would


def _patient(daemon: DaemonHandle) -> None:
    """A 30 s node time-out: these tests check who may speak for a node, not heartbeats, and a loaded
    machine must not see a node go lost between two assertions."""
    write_config(daemon.config, daemon.state_dir, port=free_port(), admin_port=free_port(), timeout_s=30.0)


def _production_limit(daemon: DaemonHandle) -> None:
    """The default 1 MiB message limit, so a 100,000-character name is refused by the schema (the test
    config's 4 KiB would have it refused as oversized, or dropped by ZeroMQ's hard guard at 16x)."""
    daemon.config.write_text(daemon.config.read_text().replace("max_message_bytes = 4096",
                                                               f"max_message_bytes = {1 << 20}"))


def test_out_of_range_values_are_refused_naming_the_field_and_nothing_is_stored(daemon: DaemonHandle) -> None:
    _production_limit(daemon)
    daemon.start()
    daemon.admin("job-add", job="j", user="alice", spec=SPEC)
    c = daemon.client("alice", identity=b"agent-n1")
    assert isinstance(_register(c, "j", "n1"), protocol.Welcome)
    for kind, field, value in BAD_VALUES:
        c.send_raw(_frame(kind, field, value))
        reply = c.recv(timeout_s=10)
        assert isinstance(reply, protocol.ErrorReply), (kind, field, value)
        assert reply.code == "invalid" and field in reply.message, (kind, field, reply)
        assert len(reply.message) < 400  # one line, the value shortened
    # nothing of it was stored; the good session still works and the store is sound
    assert store_rows(daemon.state_dir, "SELECT COUNT(*) FROM measurements") == [(0,)]
    assert isinstance(c.request(protocol.Heartbeat(job_id="j", node="n1", seq=2), timeout_s=10), protocol.Ack)
    assert store_rows(daemon.state_dir, "PRAGMA integrity_check") == [("ok",)]
    assert daemon.stop() == 0
    daemon.start()
    assert [(j["job"], j["damaged"]) for j in daemon.admin("jobs")] == [("j", None)]


ADMIN_BAD: list[tuple[str, dict[str, Any], str]] = [
    ("job-add", {"job": "", "user": "alice"}, "job"),
    ("job-add", {"job": None, "user": "alice"}, "job"),
    ("job-add", {"job": "a/b", "user": "alice"}, "job"),
    ("job-add", {"job": "x" * 100_000, "user": "alice"}, "job"),
    ("job-add", {"job": "ok", "user": "al/ice"}, "user"),
    ("job-add", {"job": "ok", "user": "alice", "spec": {"workload": {"prompts_per_step": "8"}}}, "spec"),
    ("job-add", {"job": "ok", "user": "alice", "spec": {**SPEC, "workload": {**SPEC["workload"],
                                                                             "prompt_tokens": 2**63}}},
     "spec.workload.prompt_tokens"),
    ("job-add", {"job": "ok", "user": "alice", "spec": {**SPEC, "model": "no-such-model"}}, "spec.model"),
    ("job-add", {"job": "ok", "user": "alice", "spec": {"elastic": {"anchor_job_id": "a", "min_gpus": 16,
                                                                     "max_gpus": 16, "gpus_per_node": 16}}},
     "slots"),  # the local source has 8 slots per node: refused before anything is stored
    ("job-add", {"job": "ok", "user": "alice", "spec": {"elastic": {"anchor_job_id": "a", "min_gpus": 8,
                                                                     "max_gpus": 4, "gpus_per_node": 2}}},
     "min_gpus"),
    ("job-add", {"job": "ok", "user": "alice", "spec": {"nope": 1}}, "spec.nope"),
    ("transition", {"id": 2**63}, "id"),
    ("transition", {"id": -1}, "id"),
    ("events", {"limit": 10**9}, "limit"),
    ("alloc", {"job": "j", "action": "grow", "nodes": -3}, "nodes"),
    ("alloc", {"job": "j", "action": "shrink", "names": ["no-such-node"]}, "no-such-node"),
    ("alloc", {"job": "j", "action": "grow", "nodes": 99}, "max_gpus"),
    ("alloc", {"job": "j", "action": "launch"}, "action"),
    ("no-such-op", {}, "unknown op"),
]


def test_admin_requests_are_validated_before_anything_is_stored(daemon: DaemonHandle) -> None:
    _production_limit(daemon)
    daemon.start()
    elastic = {"anchor_job_id": "local-j", "min_gpus": 2, "max_gpus": 4, "gpus_per_node": 2}
    daemon.admin("job-add", job="j", user="alice", spec={"elastic": elastic})
    before = store_rows(daemon.state_dir, "SELECT job_id, spec FROM jobs")
    for op, args, named in ADMIN_BAD:
        reply = _admin_reply(daemon, op, **args)
        assert not reply.ok and reply.code == "invalid", (op, args, reply)
        assert named in reply.error, (op, named, reply.error)
        assert "\n" not in reply.error
    assert store_rows(daemon.state_dir, "SELECT job_id, spec FROM jobs") == before
    # the same through nereusctl: exit 2 and one line
    for argv, named in ((("alloc", "j", "--grow", "-3"), "nodes"), (("alloc", "j", "--shrink", "no-such-node"),
                                                                   "no-such-node")):
        proc = daemon.ctl(*argv)
        assert proc.returncode == 2 and named in proc.stderr and len(proc.stderr.splitlines()) == 1, proc
    assert daemon.stop() == 0
    daemon.start()  # nothing refused was stored, so nothing breaks the next start
    assert [j["job"] for j in daemon.admin("jobs")] == ["j"]


# --- identity from the key -------------------------------------------------------------------------

def test_another_key_cannot_take_an_agents_routing_id_or_speak_for_its_node(daemon: DaemonHandle) -> None:
    ks = KeyStore(daemon.state_dir / "keys")
    ks.create_client(name="alice-agent-2", user="alice", role="agent", out_dir=daemon.tmp / "alice2")
    _patient(daemon)
    daemon.start()
    daemon.admin("job-add", job="alice-job", user="alice")
    daemon.admin("job-add", job="bob-job", user="bob")
    victim = daemon.client("alice", identity=b"agent-victim")
    assert isinstance(_register(victim, "alice-job", "n1"), protocol.Welcome)
    good = {k: _good(k) | {"job_id": "alice-job", "node": "n1"}
            for k in ("register", "heartbeat", "measurement", "transition-report")}
    # 1. bob on his own connection: every message type about alice's node is refused
    bob = daemon.client("bob", identity=b"agent-bob")
    for kind, data in good.items():
        reply = _raw(bob, data)
        assert isinstance(reply, protocol.ErrorReply) and reply.code in ("forbidden", "unknown-session"), kind
    # 2. bob claiming alice's routing id: the ROUTER refuses the second connection; he gets nothing
    thief = daemon.client("bob", identity=b"agent-victim")
    for data in good.values():
        thief.send_raw(json.dumps(data).encode())
    assert thief.recv(timeout_s=1.0) is None
    # 3. another key of alice's own user cannot take over the live node either
    other = CurveClient(daemon.endpoints["control"], load_bundle(daemon.tmp / "alice2"), identity=b"agent-other")
    daemon.clients.append(other)
    reply = _register(other, "alice-job", "n1")
    assert isinstance(reply, protocol.ErrorReply) and reply.code == "forbidden" and "another key" in reply.message
    # 4. "x/y" + "z" cannot collide with "x" + "y/z": names have no '/'
    assert _raw(bob, good["register"] | {"job_id": "alice-job/n1", "node": "z"}).code == "invalid"
    # the victim's session is untouched
    for seq in (10, 11):
        assert isinstance(victim.request(protocol.Heartbeat(job_id="alice-job", node="n1", seq=seq), timeout_s=10),
                          protocol.Ack)
    job = daemon.admin("job", job="alice-job")
    assert [(n["node"], n["state"]) for n in job["nodes"]] == [("n1", "alive")]
    assert [e["data"]["how"] for e in daemon.admin("events", job="alice-job") if e["kind"] == "node-registered"] \
        == ["new"]
    assert store_rows(daemon.state_dir, "SELECT COUNT(*) FROM measurements") == [(0,)]


def test_one_node_per_connection_and_a_node_limit_per_job(daemon: DaemonHandle) -> None:
    _patient(daemon)
    daemon.start()
    elastic = {"anchor_job_id": "local-j", "min_gpus": 2, "max_gpus": 4, "gpus_per_node": 2}  # 2 nodes at most
    daemon.admin("job-add", job="j", user="alice", spec={"elastic": elastic})
    c = daemon.client("alice", identity=b"agent-a")
    assert isinstance(_register(c, "j", "n1"), protocol.Welcome)
    again = _register(c, "j", "n2")  # the same connection for a second node
    assert isinstance(again, protocol.ErrorReply) and again.code == "forbidden" and "one node per connection" \
        in again.message
    c2 = daemon.client("alice", identity=b"agent-b")
    assert isinstance(_register(c2, "j", "n2"), protocol.Welcome)
    c3 = daemon.client("alice", identity=b"agent-c")
    over = _register(c3, "j", "n3")
    assert isinstance(over, protocol.ErrorReply) and over.code == "forbidden" and "max_gpus" in over.message
    assert {n["node"] for n in daemon.admin("job", job="j")["nodes"]} == {"n1", "n2"}


def test_admin_answers_within_a_second_under_a_registration_flood(daemon: DaemonHandle) -> None:
    _patient(daemon)
    daemon.start()
    daemon.admin("job-add", job="j", user="alice")
    ctx = zmq.Context()
    latencies: list[float] = []
    done = threading.Event()
    admin = daemon.client("admin", "admin")
    # connected first: the bound is on answering requests (a fresh connection under a storm of agent
    # handshakes: test_connection_limits.py, and its latency in bench/daemon.py)
    assert isinstance(admin.request(protocol.AdminRequest(op="status"), timeout_s=10), protocol.AdminReply)

    def watch() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            reply = admin.request(protocol.AdminRequest(op="status"), timeout_s=10)
            assert isinstance(reply, protocol.AdminReply) and reply.ok
            latencies.append(time.monotonic() - t0)

    bundle = load_bundle(daemon.tmp / "alice")
    clients = [CurveClient(daemon.endpoints["control"], bundle, identity=f"agent-f{i}".encode(), context=ctx,
                           monitor=False) for i in range(150)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        # every connection registers its node and then floods: 150 registrations + 150 x 20 extra frames
        for i, c in enumerate(clients):
            c.send(protocol.Register(job_id="j", node=f"f{i}", incarnation="t", devices=DEV))
            for k in range(20):
                c.send(protocol.Register(job_id="j", node=f"f{i}-{k}", incarnation="t", devices=DEV))
        welcomed = 0
        for c in clients:
            for _ in range(21):
                reply = c.recv(timeout_s=30)
                assert reply is not None, "a flooded daemon must still answer every frame"
                welcomed += isinstance(reply, protocol.Welcome)
        assert welcomed == len(clients)
    finally:
        done.set()
        watcher.join(30)
        for c in clients:
            c.close()
        ctx.term()
    assert latencies and max(latencies) < 1.0, f"admin status took up to {max(latencies):.2f} s"
    assert daemon.admin("status")["agents_connected"] == len(clients)


# --- the store: damaged rows and a damaged file ----------------------------------------------------

def test_an_unreadable_job_is_reported_damaged_and_the_others_are_served(daemon: DaemonHandle) -> None:
    daemon.start()
    daemon.admin("job-add", job="good", user="alice")
    daemon.admin("job-add", job="poisoned", user="alice", spec=SPEC)
    daemon.admin("job-add", job="garbled", user="alice")
    assert daemon.stop() == 0
    db = sqlite3.connect(daemon.state_dir / "nereusd.db")
    # what an older daemon let in (the inf that bricked every start), and a hand-damaged row
    db.execute("INSERT INTO controller_state VALUES ('poisoned', ?, 0)",
               (json.dumps({"trigger": None, "signals": {"sequence_length": "Infinity"}, "last_step": "x"}),))
    db.execute("UPDATE jobs SET spec='{not json' WHERE job_id='garbled'")
    db.commit()
    db.close()
    daemon.start()
    jobs = {j["job"]: j for j in daemon.admin("jobs")}
    assert jobs["good"]["damaged"] is None
    assert "not readable JSON" in jobs["garbled"]["damaged"] or "JSON" in jobs["garbled"]["damaged"]
    assert jobs["poisoned"]["damaged"]
    assert set(daemon.admin("status")["jobs_damaged"]) == {"poisoned", "garbled"}
    table = daemon.ctl("jobs")
    assert table.returncode == 0 and "DAMAGED" in table.stdout and "garbled: damaged" in table.stdout
    c = daemon.client("alice", identity=b"agent-g")
    assert isinstance(_register(c, "good", "n1"), protocol.Welcome)
    refused = _register(daemon.client("alice", identity=b"agent-p"), "garbled", "n1")
    assert isinstance(refused, protocol.ErrorReply) and "damaged" in refused.message
    assert daemon.proc is not None and daemon.proc.poll() is None


def _serve(daemon: DaemonHandle, *extra: str, timeout: float = 60) -> Any:
    import subprocess

    from .conftest import BIN

    return subprocess.run([str(BIN / "nereusd"), "serve", "--config", str(daemon.config), *extra],
                          capture_output=True, text=True, timeout=timeout)


def _one_line_failure(proc: Any, code: int, *needles: str) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    # stderr also carries the daemon's JSON log records; the error itself is one plain line
    lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("{")]
    assert len(lines) == 1 and lines[0].startswith("nereusd: ") and "Traceback" not in proc.stderr, \
        proc.stderr[-2000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_a_vanished_empty_or_damaged_store_is_refused_in_one_line(daemon: DaemonHandle) -> None:
    daemon.start()
    daemon.admin("job-add", job="j", user="alice")
    assert daemon.stop() == 0
    db = daemon.state_dir / "nereusd.db"
    saved = db.read_bytes()
    for wal in (db.with_name("nereusd.db-wal"), db.with_name("nereusd.db-shm")):
        wal.unlink(missing_ok=True)
    db.unlink()
    _one_line_failure(_serve(daemon), 3, "is missing", "--new-store")
    (daemon.state_dir / "store.json").unlink()  # a state dir of a daemon older than the marker
    _one_line_failure(_serve(daemon), 3, "is missing", "endpoints.json says so")
    db.write_bytes(b"")
    _one_line_failure(_serve(daemon), 3, "empty")
    db.write_bytes(b"this is not an SQLite database" * 100)
    _one_line_failure(_serve(daemon), 3, "cannot be opened", "nereusd.db")
    db.write_bytes(saved[: len(saved) // 2])  # truncated mid-file
    _one_line_failure(_serve(daemon), 3, "nereusd.db")
    rotten = bytearray(saved)  # a sound file header; every page after the schema's: its header kept, the rest rot
    page = int.from_bytes(rotten[16:18], "big")
    for off in range(page, len(rotten), page):
        rotten[off + 8:off + page] = b"\xa5" * (page - 8)
    db.write_bytes(bytes(rotten))
    _one_line_failure(_serve(daemon), 3, "nereusd.db", "--new-store")
    db.write_bytes(saved)
    daemon.start()
    assert [j["job"] for j in daemon.admin("jobs")] == ["j"]
    assert daemon.stop() == 0
    db.unlink()
    daemon.proc = None
    # the operator says so: an empty store on purpose
    import subprocess

    from .conftest import BIN

    daemon.start_argv = [str(BIN / "nereusd"), "serve", "--config", str(daemon.config), "--new-store"]  # type: ignore[attr-defined]
    proc = subprocess.Popen(daemon.start_argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # type: ignore[attr-defined]
    try:
        wait_for(lambda: db.exists() and (daemon.state_dir / "endpoints.json").exists()
                 and json.loads((daemon.state_dir / "endpoints.json").read_text())["pid"] == proc.pid,
                 timeout_s=30, what="the daemon started with --new-store")
        daemon.endpoints = json.loads((daemon.state_dir / "endpoints.json").read_text())
        assert daemon.admin("jobs") == []
    finally:
        proc.terminate()
        assert proc.wait(15) == 0


def test_start_up_problems_are_one_line_with_exit_code_3(daemon: DaemonHandle, tmp_path: Path) -> None:
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        write_config(daemon.config, daemon.state_dir, port=busy.getsockname()[1], admin_port=0)
        _one_line_failure(_serve(daemon), 3, "control.port")
    finally:
        busy.close()
    text = daemon.config.read_text()
    daemon.config.write_text(text.replace("[control]", '[control]\nbind_host = "no-such-host.invalid"'))
    _one_line_failure(_serve(daemon), 3, "control.bind_host")
    other = tmp_path / "other-state"
    (other / "nereusd.db").mkdir(parents=True)
    write_config(daemon.config, other)
    _one_line_failure(_serve(daemon), 3, "is a directory")
    write_config(daemon.config, daemon.state_dir)
    keys = daemon.state_dir / "keys"
    keys.chmod(0o777)
    _one_line_failure(_serve(daemon), 3, f"chmod 700 {keys}")
    keys.chmod(0o700)
    secret = keys / "server.key_secret"
    secret.chmod(0o644)
    _one_line_failure(_serve(daemon), 3, f"chmod 600 {secret}")
    secret.chmod(0o600)
    daemon.config.write_text("[control\nport = 1\n")
    _one_line_failure(_serve(daemon), 2, "not valid TOML")
    daemon.config.write_text('[daemon]\nstate_dir = ""\n')
    _one_line_failure(_serve(daemon), 2, "daemon.state_dir")
    daemon.config.write_text("[control]\nheartbeat_interval_s = inf\n")
    _one_line_failure(_serve(daemon), 2, "control.heartbeat_interval_s")
    daemon.config.write_text("[control]\nheartbeat_interval_s = 5.0\nheartbeat_timeout_s = 2.0\n")
    _one_line_failure(_serve(daemon), 2, "heartbeat_timeout_s")
    write_config(daemon.config, daemon.state_dir)
    daemon.start()  # and with everything put right, it starts
    assert daemon.admin("status")["pid"] == daemon.proc.pid  # type: ignore[union-attr]


# --- the key store ---------------------------------------------------------------------------------

def test_a_bad_client_key_file_is_skipped_and_authentication_goes_on(daemon: DaemonHandle) -> None:
    daemon.start()
    clients = daemon.state_dir / "keys" / "clients"
    (clients / "broken.json").write_text('{"name": "broken", "user": ')  # truncated
    (clients / "stray.json").write_text("[1, 2, 3]")
    for attempt in range(3):  # new connections keep being answered (the ZAP thread lives on)
        assert daemon.admin("status")["pid"] == daemon.proc.pid, attempt  # type: ignore[union-attr]
    c = daemon.client("alice", identity=b"agent-k")
    daemon.admin("job-add", job="j", user="alice")
    assert isinstance(_register(c, "j", "n1"), protocol.Welcome)
    wait_for(lambda: "key-file-skipped" in daemon.log() and "broken.json" in daemon.log(), timeout_s=10,
             what="the skipped key file in the log")
    (clients / "broken.json").unlink()
    assert daemon.admin("status")["pid"] == daemon.proc.pid  # type: ignore[union-attr]
    # revoke takes names only, never paths
    victim = daemon.tmp / "victim.json"
    victim.write_text("{}")
    import subprocess

    from .conftest import BIN

    rel = "../../../" + victim.name
    proc = subprocess.run([str(BIN / "nereusd"), "keys", "revoke", rel, "--state-dir", str(daemon.state_dir)],
                          capture_output=True, text=True, timeout=60, cwd=daemon.tmp)
    assert proc.returncode == 2 and "not a valid name" in proc.stderr and victim.exists()


# --- restart-safe allocation source -----------------------------------------------------------------

def test_the_local_source_grants_once_and_keeps_grown_nodes_across_restarts(daemon: DaemonHandle) -> None:
    daemon.start()
    elastic = {"anchor_job_id": "local-j", "min_gpus": 2, "max_gpus": 6, "gpus_per_node": 2}
    daemon.admin("job-add", job="j", user="alice", spec={"elastic": elastic})

    def kinds() -> list[str]:
        return [a["source"] for a in daemon.admin("alloc", job="j")["allocations"]]

    wait_for(lambda: kinds() == ["granted"], what="the grant in the store")
    daemon.admin("alloc", job="j", action="grow", nodes=1)
    wait_for(lambda: kinds() == ["granted", "grown"], what="the growth in the store")
    grown = daemon.admin("alloc", job="j")["allocations"][-1]["nodes"]
    for how in ("term", "kill9", "term", "kill9"):
        if how == "term":
            assert daemon.stop() == 0
        else:
            daemon.kill9()
        daemon.start()
        # the source's own view, asked synchronously: it holds both nodes (a fresh grant would hold one,
        # leaving room for two), so asking for two more is refused with room for one
        over = _admin_reply(daemon, "alloc", job="j", action="grow", nodes=2)
        assert not over.ok and "holds 2, 0 pending, room for 1" in over.error, (how, over.error)
        assert kinds() == ["granted", "grown"], how
    # the restored source knows the grown node: it can be shrunk, and the room under max_gpus is right
    daemon.admin("alloc", job="j", action="shrink", names=grown)
    wait_for(lambda: kinds() == ["granted", "grown", "shrunk"], what="the shrink in the store")
    over = _admin_reply(daemon, "alloc", job="j", action="grow", nodes=3)
    assert not over.ok and "room for 2" in over.error
    assert kinds() == ["granted", "grown", "shrunk"]
    assert len([e for e in daemon.admin("events", job="j") if e["kind"] == "allocation"]) == 3
