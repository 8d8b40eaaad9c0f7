"""Per-key connection limits and nereusctl under a storm of agent handshakes, against a real nereusd.

A key may hold its user's jobs' node limits plus ``control.spare_connections_per_key`` connections;
the one past it is refused naming the limit and closed, and every other session goes on. The admin
socket has a context (I/O thread, ZAP handler) of its own, so a fresh nereusctl connection answers
while hundreds of agent connections handshake. Latency figures are in bench/daemon.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from nereusd.wire import protocol
from nereusd.wire.client import CurveClient
from nereusd.wire.keys import load_bundle

from .conftest import DaemonHandle, wait_for

pytestmark = pytest.mark.multiprocess

DEV = (protocol.Device(index=0, kind="cpu", name="cpu", memory_bytes=1 << 30),)


def _control(daemon: DaemonHandle, **values: Any) -> None:
    """Set [control] keys of the test config (a 30 s node time-out: heartbeats are not under test)."""
    lines = "".join(f"{k} = {v}\n" for k, v in values.items())
    text = daemon.config.read_text().replace("[control]\n", f"[control]\n{lines}")
    daemon.config.write_text(text.replace("heartbeat_timeout_s = 1.5", "heartbeat_timeout_s = 30.0"))


def _disconnects(c: CurveClient) -> zmq.Socket:
    return c.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)


def _await_disconnect(mon: zmq.Socket, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if mon.poll(100) and parse_monitor_message(mon.recv_multipart())["event"] == zmq.EVENT_DISCONNECTED:
            return
    raise AssertionError(f"timed out after {timeout_s} s waiting for the daemon to close {what}")


def test_a_key_past_its_connection_limit_is_refused_and_closed_and_others_are_untouched(
        daemon: DaemonHandle) -> None:
    _control(daemon, spare_connections_per_key=2)
    daemon.start()
    elastic = {"anchor_job_id": "local-j", "min_gpus": 2, "max_gpus": 4, "gpus_per_node": 2}  # 2 nodes
    daemon.admin("job-add", job="j", user="alice", spec={"elastic": elastic})
    daemon.admin("job-add", job="b", user="bob")
    victim = daemon.client("alice", identity=b"agent-victim")
    bob = daemon.client("bob", identity=b"agent-bob")
    for c, job in ((victim, "j"), (bob, "b")):
        reply = c.request(protocol.Register(job_id=job, node="n1", incarnation="t", devices=DEV), timeout_s=10)
        assert isinstance(reply, protocol.Welcome), reply
    # alice's key: 2 nodes + 2 spare = 4 connections; the victim holds one, three more speak unregistered
    extra = [daemon.client("alice", identity=f"agent-x{i}".encode()) for i in range(3)]
    for c in extra:
        reply = c.request(protocol.Heartbeat(job_id="j", node="nx", seq=1), timeout_s=10)
        assert isinstance(reply, protocol.ErrorReply) and reply.code == "unknown-session", reply
    over = daemon.client("alice", identity=b"agent-over", monitor=False)
    mon = _disconnects(over)
    reply = over.request(protocol.Register(job_id="j", node="n2", incarnation="t", devices=DEV), timeout_s=10)
    assert isinstance(reply, protocol.ErrorReply) and reply.code == "forbidden", reply
    assert "limit 4" in reply.message and "control.spare_connections_per_key" in reply.message, reply.message
    _await_disconnect(mon, 10, "the connection past the limit")
    mon.close(linger=0)
    # the victims' sessions are untouched, and bob's key has its own limit
    for c, job in ((victim, "j"), (bob, "b")):
        assert isinstance(c.request(protocol.Heartbeat(job_id=job, node="n1", seq=2), timeout_s=10), protocol.Ack)
    other = daemon.client("bob", identity=b"agent-bob-2")
    reply = other.request(protocol.Heartbeat(job_id="b", node="n9", seq=1), timeout_s=10)
    assert isinstance(reply, protocol.ErrorReply) and reply.code == "unknown-session", reply
    assert {n["node"]: n["state"] for n in daemon.admin("job", job="j")["nodes"]} == {"n1": "alive"}
    counts = daemon.admin("status")["agent_connections"]
    assert counts["refused"] >= 1 and counts["closed"] >= 1, counts
    # connections that close free their places: alice registers her second node on a new connection
    for c in extra:
        c.close()
        daemon.clients.remove(c)
    attempts: list[int] = []

    def registered() -> bool:  # each try on a connection of its own: a refused one is closed by the daemon
        attempts.append(1)
        c = daemon.client("alice", identity=f"agent-n2-{len(attempts)}".encode())
        try:
            reply = c.request(protocol.Register(job_id="j", node="n2", incarnation="t", devices=DEV),
                              timeout_s=10)
        finally:
            c.close()
            daemon.clients.remove(c)
        assert isinstance(reply, (protocol.Welcome, protocol.ErrorReply)), reply
        return isinstance(reply, protocol.Welcome)

    wait_for(registered, 30, "a place freed by closed connections")
    assert {n["node"] for n in daemon.admin("job", job="j")["nodes"]} == {"n1", "n2"}


def test_a_silent_connection_is_closed(daemon: DaemonHandle) -> None:
    _control(daemon, silent_connection_s=1.0)
    daemon.start()
    silent = daemon.client("alice", identity=b"agent-silent", monitor=False)
    mon = _disconnects(silent)
    _await_disconnect(mon, 30, "a connection that never sent a message")
    mon.close(linger=0)
    assert daemon.admin("status")["agent_connections"]["closed"] >= 1


def test_a_fresh_admin_connection_answers_under_a_storm_of_agent_handshakes(daemon: DaemonHandle) -> None:
    daemon.start()
    daemon.admin("job-add", job="j", user="alice")
    ctx = zmq.Context()
    bundle = load_bundle(daemon.tmp / "alice")
    storm = []
    try:
        for i in range(300):
            c = CurveClient(daemon.endpoints["control"], bundle, identity=f"agent-s{i}".encode(), context=ctx,
                            monitor=False)
            storm.append(c)
            c.send(protocol.Register(job_id="j", node=f"s{i}", incarnation="t", devices=DEV))
        t0 = time.monotonic()  # a connection opened now: its handshake meets the storm's in the daemon
        fresh = daemon.client("admin", "admin")
        reply = fresh.request(protocol.AdminRequest(op="status"), timeout_s=30)
        took = time.monotonic() - t0
        assert isinstance(reply, protocol.AdminReply) and reply.ok, reply
        assert took < 5.0, f"a fresh admin connection took {took:.2f} s under the storm (bench/daemon.py measures it)"
        for c in storm:  # the storm itself is served: every connection answered
            assert c.recv(timeout_s=60) is not None
    finally:
        for c in storm:
            c.close()
        ctx.term()


def test_the_admin_socket_has_its_own_context_and_authenticator(tmp_path: Path) -> None:
    from nereusd.daemon import Daemon
    from nereusd.settings import load_settings

    settings = load_settings(None, daemon={"state_dir": str(tmp_path / "state")},
                             control={"port": 0, "admin_port": 0}, metrics={"enabled": False})
    d = Daemon(settings)
    try:
        assert d.admin.sock.context is not d.agents.sock.context
        assert d.auth is not d.admin_auth and d.auth.is_alive() and d.admin_auth.is_alive()
        d._tick()
        assert not d.stopping.is_set()
        d.admin_auth.stop()
        d._tick()
        assert d.stopping.is_set() and d.fatal is not None and "admin" in d.fatal
    finally:
        d.close()


def test_a_missed_close_frees_its_place_and_a_reused_descriptor_is_never_cut() -> None:
    """The monitor may drop events: a key at its limit forgets descriptors that no longer hold their
    peer, and a shutdown goes only to the connection it was meant for."""
    import socket

    from nereusd.connections import ConnectionGuard
    from nereusd.wire.logs import get_logger

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    guard = ConnectionGuard(router, limit_of=lambda user: (1, "a test limit"), silent_s=30, log=get_logger("test"))
    listener = socket.create_server(("127.0.0.1", 0))
    opened: list[socket.socket] = []

    def connection() -> socket.socket:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        opened.extend((client, server))
        return server

    try:
        first, second = connection(), connection()
        assert guard.admit(first.fileno(), b"a", "alice", "K") is None
        refused = guard.admit(second.fileno(), b"b", "alice", "K")
        assert refused is not None and "limit 1 (a test limit)" in refused
        assert guard.admit(second.fileno(), b"b", "bob", "K2") is None  # another key: a limit of its own
        old_fd = first.fileno()
        first.close()  # closed with no monitor event: the guard still counts it
        third = connection()  # most likely on the freed descriptor number
        guard._shutdown(old_fd, guard.conns[old_fd].peer)  # the old connection's peer: the new one is kept
        third.sendall(b"x")
        assert guard.admit(third.fileno(), b"c", "alice", "K") is None  # the missed close freed its place
        guard.to_cut = [(0.0, third.fileno(), ("127.0.0.1", 1))]  # a peer that is not this connection's
        guard.service()
        third.sendall(b"still open")
    finally:
        for s in opened:
            s.close()
        listener.close()
        guard.close()
        router.close(linger=0)
        ctx.term()
