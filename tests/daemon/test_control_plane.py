"""Control plane against a real nereusd process: CURVE refusal, per-user authorisation, bad messages."""

from __future__ import annotations

import json

import msgpack
import pytest
import zmq

from nereusd.wire import protocol
from nereusd.wire.client import AuthRefused, CurveClient
from nereusd.wire.keys import ClientBundle, load_bundle

from .conftest import DaemonHandle

pytestmark = pytest.mark.multiprocess


def _register(c: CurveClient, job: str, node: str) -> object:
    return c.request(protocol.Register(job_id=job, node=node, incarnation="t",
                                       devices=(protocol.Device(index=0, kind="cpu", name="cpu", memory_bytes=1),)),
                     timeout_s=10)


def test_client_without_the_right_key_is_refused(daemon: DaemonHandle) -> None:
    daemon.start()
    admin = load_bundle(daemon.tmp / "admin")
    stranger_pub, stranger_sec = zmq.curve_keypair()
    cases = {
        "unknown key": (daemon.endpoints["control"],
                        ClientBundle(public_key=stranger_pub, secret_key=stranger_sec,
                                     server_public_key=admin.server_public_key)),
        "agent key on the admin socket": (daemon.endpoints["admin"], load_bundle(daemon.tmp / "alice")),
        "admin key on the agent socket": (daemon.endpoints["control"], admin),
    }
    for what, (endpoint, bundle) in cases.items():
        c = CurveClient(endpoint, bundle)
        try:
            with pytest.raises(AuthRefused):
                c.request(protocol.AdminRequest(op="status"), timeout_s=10)
        finally:
            c.close()
        assert daemon.proc is not None and daemon.proc.poll() is None, what
    # a client with the wrong server key never completes the handshake: no reply at all
    other_pub, _ = zmq.curve_keypair()
    c = CurveClient(daemon.endpoints["admin"], ClientBundle(public_key=admin.public_key, secret_key=admin.secret_key,
                                                            server_public_key=other_pub))
    try:
        c.send(protocol.AdminRequest(op="status"))
        assert c.recv(timeout_s=1.0) is None
    finally:
        c.close()
    assert daemon.admin("status")["pid"] == daemon.proc.pid
    assert "curve-refused" in daemon.log()


def test_another_users_agent_cannot_act_on_the_job(daemon: DaemonHandle) -> None:
    daemon.start()
    daemon.admin("job-add", job="alice-job", user="alice")
    daemon.admin("job-add", job="bob-job", user="bob")
    alice, bob = daemon.client("alice", identity=b"alice-n1"), daemon.client("bob", identity=b"bob-n1")
    assert isinstance(_register(alice, "alice-job", "n1"), protocol.Welcome)

    refused = _register(bob, "alice-job", "n2")
    assert isinstance(refused, protocol.ErrorReply) and refused.code == "forbidden"
    # without a session bob cannot heartbeat for alice's node either
    hb = bob.request(protocol.Heartbeat(job_id="alice-job", node="n1", seq=1), timeout_s=10)
    assert isinstance(hb, protocol.ErrorReply) and hb.code == "unknown-session"
    # bob registered on his own job still cannot speak for alice's job through that session
    assert isinstance(_register(bob, "bob-job", "n1"), protocol.Welcome)
    for msg in (protocol.Heartbeat(job_id="alice-job", node="n1", seq=2),
                protocol.Measurement(job_id="alice-job", node="n1", step=1, plan_version=0, step_latency_s=1.0),
                protocol.TransitionReport(job_id="alice-job", node="n1", transition_id=1, ok=True, measured_s=0)):
        reply = bob.request(msg, timeout_s=10)
        assert isinstance(reply, protocol.ErrorReply) and reply.code == "forbidden", msg.type
    # alice's own session still works, and her node never saw bob's measurement
    assert isinstance(alice.request(protocol.Heartbeat(job_id="alice-job", node="n1", seq=1), timeout_s=10),
                      protocol.Ack)
    nodes = {n["node"] for n in daemon.admin("job", job="alice-job")["nodes"]}
    assert nodes == {"n1"}
    events = [e["kind"] for e in daemon.admin("events", job="alice-job")]
    assert "register-forbidden" in events


def test_bad_messages_get_error_replies_and_the_daemon_keeps_serving(daemon: DaemonHandle) -> None:
    daemon.start()
    daemon.admin("job-add", job="j", user="alice")
    c = daemon.client("alice", identity=b"n1")
    good = json.loads(protocol.encode(protocol.Heartbeat(job_id="j", node="n1", seq=1), "json"))
    frames = {
        "malformed": [b"\xc1\xc1 not msgpack", b"{not json", b"[1, 2]", b""],
        "oversized": [json.dumps({**good, "pad": "x" * 5000}).encode()],  # limit is 4096 in the test config
        "wrong-version": [json.dumps({**good, "v": 99}).encode(), msgpack.packb({**good, "v": 0})],
        "invalid": [json.dumps({**good, "seq": -1}).encode(), json.dumps({"v": 1, "type": "launch-missiles"}).encode(),
                    json.dumps({**good, "extra": 1}).encode()],
    }
    for code, bad in frames.items():
        for frame in bad:
            c.send_raw(frame)
            reply = c.recv(timeout_s=10)
            assert isinstance(reply, protocol.ErrorReply), (code, frame[:30])
            assert reply.code == code, (code, frame[:30], reply)
    # the daemon is still alive and serving both agents and admins
    assert isinstance(_register(c, "j", "n1"), protocol.Welcome)
    assert daemon.proc is not None and daemon.proc.poll() is None
    assert daemon.admin("status")["agents_connected"] == 1
    log = daemon.log()
    assert log.count('"message-rejected"') >= sum(len(v) for v in frames.values())
    metrics = daemon.admin("status")["endpoints"]["metrics"]
    import urllib.request

    text = urllib.request.urlopen(metrics, timeout=10).read().decode()
    assert 'nereus_control_messages_rejected_total{code="oversized"} 1.0' in text
    assert 'nereus_control_messages_rejected_total{code="malformed"} 4.0' in text
