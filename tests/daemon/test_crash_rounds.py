"""kill -9 of a real nereusd, ROUNDS rounds per family: during writes and registrations, and during
a transition (an order open in the store). After each restart the store passes integrity_check, every
acknowledged record is there, and an open transition is resolved: sent again to the agent that
registers again (which completes it), or failed by ``daemon.order_timeout_s`` when none comes back.

Rounds are cheap: one daemon restart per write round (its store grows by ~60 rows a round), a tiny
store per transition round (a fresh state dir with the fixture's keys), no sleeps, every wait bounded
and named. ``NEREUS_CRASH_ROUNDS`` sets the rounds (default 20).
"""

from __future__ import annotations

import os
import random
import shutil
import time

import pytest

from nereusd.wire import protocol
from nereusd.wire.client import CurveClient

from .conftest import DaemonHandle, store_rows, wait_for, write_config

pytestmark = pytest.mark.multiprocess

ROUNDS = int(os.environ.get("NEREUS_CRASH_ROUNDS", "20"))
DEV = (protocol.Device(index=0, kind="cpu", name="cpu", memory_bytes=1 << 30),)
DEV2 = tuple(protocol.Device(index=i, kind="cpu", name="cpu", memory_bytes=8 << 30) for i in range(2))
SPEC = {"model": "tiny-3m", "algo": "grpo", "device": "cpu", "gpus_per_node": 2,
        "workload": {"prompts_per_step": 8, "prompt_tokens": 32, "response_tokens": 64}}
KILL_POINTS = ("resent", "timed-out", "report-in-flight", "reported")


def _fresh(base: DaemonHandle, name: str) -> DaemonHandle:
    """A daemon of its own (tiny store, free ports) that takes the fixture's keys."""
    state = base.tmp / name / "state"
    shutil.copytree(base.state_dir / "keys", state / "keys")
    cfg = base.tmp / name / "nereusd.toml"
    write_config(cfg, state)
    cfg.write_text(cfg.read_text().replace("pool_settle_s = 0.3", "pool_settle_s = 0.0"))  # one node: no burst
    return DaemonHandle(tmp=base.tmp, config=cfg, state_dir=state)


def _close(h: DaemonHandle, *clients: CurveClient) -> None:
    for c in clients:
        c.close()
        h.clients.remove(c)


def _integrity(h: DaemonHandle) -> None:
    assert store_rows(h.state_dir, "PRAGMA integrity_check") == [("ok",)]


def test_kill9_during_writes_and_registrations_loses_no_acknowledged_record(daemon: DaemonHandle) -> None:
    rng = random.Random(13)
    daemon.start()
    daemon.admin("job-add", job="j", user="alice")
    acked: set[int] = set()
    welcomed: set[str] = set()
    step = 0
    for round_ in range(ROUNDS):
        writer = daemon.client("alice", identity=f"agent-w{round_}".encode())
        assert isinstance(writer.request(protocol.Register(job_id="j", node="writer", incarnation="w", devices=DEV),
                                         timeout_s=10), protocol.Welcome)
        joiners = [daemon.client("alice", identity=f"agent-r{round_}-{i}".encode(), monitor=False)
                   for i in range(8)]
        for i, c in enumerate(joiners):  # registrations in flight when the daemon dies
            c.send(protocol.Register(job_id="j", node=f"r{round_}-{i}", incarnation="r", devices=DEV))
        for _ in range(60):  # pipelined: the daemon is killed with writes in flight
            step += 1
            writer.send(protocol.Measurement(job_id="j", node="writer", step=step, plan_version=0,
                                             step_latency_s=0.25))
        for _ in range(rng.randint(1, 40)):
            reply = writer.recv(timeout_s=10)
            assert isinstance(reply, protocol.Ack), reply
            acked.add(reply.seq)
        for i, c in enumerate(joiners):
            while c.sock.poll(0):
                if isinstance(c.recv(timeout_s=1), protocol.Welcome):
                    welcomed.add(f"r{round_}-{i}")
        daemon.kill9()
        _close(daemon, writer, *joiners)
        daemon.start()
        stored = {s for (s,) in store_rows(daemon.state_dir, "SELECT step FROM measurements")}
        assert acked <= stored, f"round {round_}: acknowledged but lost: {sorted(acked - stored)[:5]}"
        nodes = {n for (n,) in store_rows(daemon.state_dir, "SELECT node FROM nodes")}
        assert welcomed <= nodes, f"round {round_}: welcomed but lost: {sorted(welcomed - nodes)[:5]}"
        _integrity(daemon)
    assert len(acked) >= ROUNDS and daemon.admin("status")["jobs_damaged"] == {}


def _connect(h: DaemonHandle) -> CurveClient:
    c = h.client("alice", identity=b"agent-t")
    reply = c.request(protocol.Register(job_id="j", node="n1", incarnation="t", devices=DEV2), timeout_s=10)
    assert isinstance(reply, protocol.Welcome), reply
    return c


def _await_order(c: CurveClient, timeout_s: float = 60) -> protocol.TransitionOrder:
    deadline = time.monotonic() + timeout_s
    seq = 0
    while time.monotonic() < deadline:
        msg = c.recv(timeout_s=0.5)
        if isinstance(msg, protocol.TransitionOrder):
            return msg
        seq += 1
        c.send(protocol.Heartbeat(job_id="j", node="n1", seq=seq))
    raise AssertionError(f"no transition order within {timeout_s} s")


def _reported(c: CurveClient, report: protocol.TransitionReport) -> None:
    """Send the report and wait for ITS ack (the heartbeats' acks may still be on their way)."""
    c.send(report)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        msg = c.recv(timeout_s=max(0.01, deadline - time.monotonic()))
        if isinstance(msg, protocol.Ack) and msg.ref == "transition-report":
            assert msg.seq == report.transition_id
            return
        assert not isinstance(msg, protocol.ErrorReply), msg
    raise AssertionError("the transition report was not acknowledged within 10 s")


def _transition_round(base: DaemonHandle, round_: int, kill_at: str) -> str:
    """One kill -9 with the initial placement's order open; returns how the transition ended."""
    h = _fresh(base, f"t{round_}")
    try:
        h.start()
        h.admin("job-add", job="j", user="alice", spec=SPEC)
        c = _connect(h)
        order = _await_order(c)
        report = protocol.TransitionReport(job_id="j", node="n1", transition_id=order.transition_id, ok=True,
                                           measured_s=0.01)
        if kill_at == "reported":
            _reported(c, report)
        elif kill_at == "report-in-flight":
            c.send(report)
        h.kill9()
        _close(h, c)
        if kill_at == "timed-out":  # nobody comes back: the order's time-out (from its creation) fails it
            h.config.write_text(h.config.read_text().replace("[daemon]\n", "[daemon]\norder_timeout_s = 0.5\n"))
        h.start()
        _integrity(h)
        (t,) = h.admin("transitions", job="j")
        assert t["id"] == order.transition_id
        if kill_at == "reported":
            assert t["state"] == "done", t
        if kill_at == "timed-out":
            failed = wait_for(lambda: h.admin("transition", id=order.transition_id)["state"] == "failed", 30,
                              "the open order failed by daemon.order_timeout_s")
            assert failed
            return "failed by the order time-out"
        was_open = t["state"] == "ordered"
        if was_open:
            assert h.admin("job", job="j")["state"] == "transitioning"
        c = _connect(h)
        if was_open:  # never reported: the agent that registers again gets the same order again
            resent = _await_order(c, 30)
            assert resent.transition_id == order.transition_id and resent.part == order.part
            _reported(c, report)
        assert h.admin("transition", id=order.transition_id)["state"] == "done"
        job = h.admin("job", job="j")
        assert job["plan_version"] == order.to_version and job["state"] == "running", job
        _integrity(h)
        assert h.admin("status")["jobs_damaged"] == {}
        return "re-sent and completed" if was_open else "completed before the kill"
    finally:
        for c in h.clients:
            c.close()
        h.clients.clear()
        if h.proc is not None and h.proc.poll() is None:
            h.proc.kill()
            h.proc.wait(10)


def test_kill9_during_a_transition_resolves_every_open_order_after_restart(daemon: DaemonHandle) -> None:
    outcomes: dict[str, int] = {}
    for round_ in range(ROUNDS):
        kill_at = KILL_POINTS[round_ % len(KILL_POINTS)]
        how = _transition_round(daemon, round_, kill_at)
        outcomes[f"{kill_at}: {how}"] = outcomes.get(f"{kill_at}: {how}", 0) + 1
    print("transition crash rounds:", outcomes)
    assert sum(outcomes.values()) == ROUNDS
    if len(KILL_POINTS) <= ROUNDS:  # every path was taken: a re-sent order and a timed-out one
        assert any(k.startswith("resent: re-sent") for k in outcomes), outcomes
        assert any(k.startswith("timed-out: failed") for k in outcomes), outcomes
