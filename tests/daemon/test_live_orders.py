"""The live job's orders against a real daemon (loopback, local allocation source, real planner):
orders carry the pool map, a graceful shrink drains a node before it is released (and is refused when
nothing would hold the state), an order nobody finishes fails after daemon.order_timeout_s and the job
replans, and every refused alloc request lands in the events. The last test walks the controller
through the same steps in process, one call at a time.

The daemon runs as ``nereusd serve`` (a console script): from a worktree, set PYTHONPATH to it so the
daemon runs the code under test.
"""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path
from typing import Any

import pytest

from nereusd.allocation import AllocationError
from nereusd.daemon import _SourceWorker
from nereusd.wire import protocol
from nereusd.wire.logs import get_logger

from .conftest import DaemonHandle, store_rows, wait_for
from .live_helpers import DEVS, ELASTIC, SPEC, WAIT_S
from .live_helpers import alloc_kinds as _alloc_kinds
from .live_helpers import events_of as _events


def _node_states(daemon: DaemonHandle, job: str) -> dict[str, str]:
    return {n["node"]: n["state"] for n in daemon.admin("job", job=job)["nodes"]}


def _plan_gpus(daemon: DaemonHandle, job: str) -> set[int]:
    return {g for s in daemon.admin("job-plan", job=job)["stages"] for g in s["gpus"]}


def _done(daemon: DaemonHandle, job: str) -> list[dict[str, Any]]:
    return [t for t in daemon.admin("transitions", job=job) if t["state"] == "done"]


def _ts_at(daemon: DaemonHandle, kind: str, key: str, state: str) -> float:
    rows = store_rows(daemon.state_dir, f"SELECT at FROM status_history WHERE kind='{kind}' AND key='{key}' "
                                        f"AND to_state='{state}' ORDER BY id")
    assert rows, (kind, key, state)
    return float(rows[-1][0])


def _register_and_await_order(daemon: DaemonHandle, identity: bytes, incarnation: str) -> protocol.TransitionOrder:
    """Register n1 of job j as a fresh connection, then heartbeat as an agent does until an order comes."""
    agent = daemon.client("alice", identity=identity)
    welcome = agent.request(protocol.Register(job_id="j", node="n1", incarnation=incarnation, devices=DEVS),
                            timeout_s=WAIT_S)
    assert isinstance(welcome, protocol.Welcome), welcome
    deadline, seq = time.monotonic() + WAIT_S, 0
    while True:
        assert time.monotonic() < deadline, f"timed out after {WAIT_S} s waiting for an order to {identity!r}"
        seq += 1
        agent.send(protocol.Heartbeat(job_id="j", node="n1", seq=seq))
        msg = agent.recv(timeout_s=0.2)
        if isinstance(msg, protocol.TransitionOrder):
            return msg


@pytest.mark.multiprocess
def test_orders_carry_the_pool_map_and_are_sent_again_to_a_node_that_registers_again(daemon: DaemonHandle) -> None:
    daemon.start()
    daemon.admin("job-add", job="j", user="alice", spec=SPEC)
    order = _register_and_await_order(daemon, b"agent-n1", "a")
    part = order.part
    assert part["pool"] == {"n1": [0, 1]} and part["gpus_per_node"] == 2 and part["draining"] == []
    assert set(part["gpus"]) <= {0, 1} and part["plan"]["version"] == order.to_version == 1
    # the agent restarts (a new process, a new connection) before it reported: the order comes again
    again = _register_and_await_order(daemon, b"agent-n1-restarted", "b")
    assert order.part["incarnations"] == {"n1": "a"} and again.part["incarnations"] == {"n1": "b"}

    def same(o: protocol.TransitionOrder) -> dict[str, Any]:  # but for whose workers to take
        return {**o.model_dump(), "part": {k: v for k, v in o.part.items() if k != "incarnations"}}

    assert same(again) == same(order)
    # so it does after a daemon restart (this daemon never sent it: it builds the order again)
    assert daemon.stop() == 0
    for c in daemon.clients:
        c.close()
    daemon.clients.clear()
    daemon.start()
    rebuilt = _register_and_await_order(daemon, b"agent-n1-after-restart", "b")
    assert same(rebuilt) == same(order) and rebuilt.part["incarnations"] == {"n1": "b"}
    reporter = daemon.clients[-1]
    reporter.send(protocol.TransitionReport(job_id="j", node="n1", transition_id=order.transition_id, ok=True,
                                            measured_s=0.01))
    wait_for(lambda: daemon.admin("job", job="j")["plan_version"] == 1, timeout_s=WAIT_S, what="plan v1 committed")
    assert [t["state"] for t in daemon.admin("transitions", job="j")] == ["done"]


@pytest.mark.multiprocess
def test_a_shrink_drains_the_node_first_and_a_shrink_that_leaves_nothing_is_refused(daemon: DaemonHandle) -> None:
    daemon.start()
    daemon.admin("job-add", job="j", user="alice", spec={**SPEC, "elastic": ELASTIC})
    wait_for(lambda: _alloc_kinds(daemon, "j") == ["granted"], timeout_s=WAIT_S, what="local0 granted")
    agents = [daemon.acking_agent("alice", "j", "local0")]
    try:
        wait_for(lambda: daemon.admin("job", job="j")["plan_version"] >= 1, timeout_s=WAIT_S,
                 what="the initial placement committed on local0")
        daemon.admin("alloc", job="j", action="grow", nodes=1)
        wait_for(lambda: _alloc_kinds(daemon, "j") == ["granted", "grown"], timeout_s=WAIT_S, what="local1 grown")
        agents.append(daemon.acking_agent("alice", "j", "local1"))
        # local0 registered first: GPUs 0, 1; local1: 2, 3. The replan on four GPUs uses local1.
        wait_for(lambda: daemon.admin("job", job="j")["state"] == "running" and _plan_gpus(daemon, "j") & {2, 3},
                 timeout_s=WAIT_S, what="a committed plan using local1's GPUs")
        before = {t["id"] for t in daemon.admin("transitions", job="j")}

        shrink = daemon.ctl("alloc", "j", "--shrink", "local1")
        assert shrink.returncode == 0, shrink.stderr
        drain = wait_for(lambda: _events(daemon, "j", "node-draining"), timeout_s=WAIT_S, what="node-draining")
        assert drain[0]["data"]["nodes"] == ["local1"]
        wait_for(lambda: "shrunk" in _alloc_kinds(daemon, "j"), timeout_s=WAIT_S, what="local1 given back")
        moved = [t for t in _done(daemon, "j") if t["id"] not in before]
        assert len(moved) == 1, daemon.admin("transitions", job="j")
        t = moved[0]
        decision = daemon.admin("explain", id=t["decision_id"])
        assert decision["urgent"] and "drain local1" in json.dumps(decision["inputs"])
        plan = daemon.admin("job-plan", job="j")
        assert plan["plan_version"] == t["to_version"] and _plan_gpus(daemon, "j") <= {0, 1}
        # ordered to both nodes (local1 sends its state away), and released only after every part was done
        history = daemon.admin("transition", id=t["id"])["history"]
        assert any(h["to_state"] == "ordered" and "2 node(s)" in h["reason"] for h in history), history
        shrunk_at = max(a["at"] for a in daemon.admin("alloc", job="j")["allocations"] if a["source"] == "shrunk")
        assert _ts_at(daemon, "transition", str(t["id"]), "done") <= shrunk_at
        drained = _events(daemon, "j", "node-drained")
        assert drained and drained[0]["data"]["nodes"] == ["local1"]
        wait_for(lambda: _node_states(daemon, "j").get("local1") == "released", timeout_s=WAIT_S,
                 what="local1 released in the store")
        assert daemon.admin("job", job="j")["state"] == "running"
        wait_for(lambda: daemon.admin("alloc", job="j")["draining"] == [], timeout_s=WAIT_S,
                 what="local1 no longer draining once given back")

        # the last node holds the only copy of everything: refused, with the exit code and an event
        refused = daemon.ctl("alloc", "j", "--shrink", "local0")
        assert refused.returncode == 2 and "no GPU would be left" in refused.stderr, refused
        event = wait_for(lambda: _events(daemon, "j", "alloc-refused"), timeout_s=WAIT_S, what="alloc-refused")
        assert event[0]["data"]["op"] == "shrink" and event[0]["data"]["nodes"] == ["local0"]
        assert "no GPU would be left" in event[0]["data"]["reason"]
        assert _node_states(daemon, "j")["local0"] == "alive" and _alloc_kinds(daemon, "j").count("shrunk") == 1
        assert daemon.admin("job", job="j")["state"] == "running" and _plan_gpus(daemon, "j") <= {0, 1}
    finally:
        for a in agents:
            a.kill()
            a.wait()


@pytest.mark.multiprocess
def test_an_order_nobody_finishes_fails_after_order_timeout_and_the_job_replans(daemon: DaemonHandle) -> None:
    daemon.config.write_text(daemon.config.read_text().replace('log_level = "debug"',
                                                               'log_level = "debug"\norder_timeout_s = 2'))
    daemon.start()
    daemon.admin("job-add", job="j", user="alice", spec=SPEC)
    agent = daemon.agent("alice", "j", "n1")  # no --ack-orders and no workers: nothing ever reports
    try:
        def failed() -> list[dict[str, Any]]:
            return [t for t in daemon.admin("transitions", job="j") if t["state"] == "failed"]

        first = wait_for(failed, timeout_s=WAIT_S, what="the initial placement failed by its time-out")[0]
        reason = daemon.admin("transition", id=first["id"])["history"][-1]["reason"]
        assert reason == "node(s) n1 did not finish within 2 s", reason
        took = _ts_at(daemon, "transition", str(first["id"]), "failed") - \
            _ts_at(daemon, "transition", str(first["id"]), "ordered")
        assert took >= 2.0
        # the job is not left transitioning: it went back to running and a new decision ordered again
        history = daemon.admin("job", job="j")["history"]
        assert any(h["to_state"] == "running" and f"transition {first['id']} failed" in h["reason"] for h in history)
        again = wait_for(lambda: [t for t in daemon.admin("transitions", job="j") if t["id"] > first["id"]],
                         timeout_s=WAIT_S, what="a transition ordered by the replan")
        decision = daemon.admin("explain", id=again[0]["decision_id"])
        assert decision["urgent"] and f"transition {first['id']} failed" in json.dumps(decision["inputs"])
    finally:
        agent.kill()
        agent.wait()


@pytest.mark.multiprocess
def test_a_refused_alloc_request_exits_non_zero_and_is_an_event(daemon: DaemonHandle) -> None:
    daemon.start()
    daemon.admin("job-add", job="j", user="alice", spec={"elastic": ELASTIC})
    wait_for(lambda: _alloc_kinds(daemon, "j") == ["granted"], timeout_s=WAIT_S, what="the grant")
    over = daemon.ctl("alloc", "j", "--grow", "5")
    assert over.returncode == 2 and "max_gpus" in over.stderr and len(over.stderr.splitlines()) == 1, over
    event = wait_for(lambda: _events(daemon, "j", "alloc-refused"), timeout_s=WAIT_S, what="alloc-refused")
    assert event[0]["data"]["op"] == "grow" and event[0]["data"]["nodes"] == 5
    assert "max_gpus" in event[0]["data"]["reason"]
    # two grows that each fit alone, asked back to back: the second is refused (at once, or by the source
    # thread once the first was carried out) and lands in the events either way
    first = daemon.ctl("alloc", "j", "--grow", "2")
    assert first.returncode == 0, first.stderr
    daemon.ctl("alloc", "j", "--grow", "2")
    wait_for(lambda: len(_events(daemon, "j", "alloc-refused")) == 2, timeout_s=WAIT_S,
             what="the second grow's refusal in the events")
    wait_for(lambda: _alloc_kinds(daemon, "j") == ["granted", "grown"], timeout_s=WAIT_S, what="the first grow")
    assert _alloc_kinds(daemon, "j") == ["granted", "grown"]


def test_order_timeout_s_is_a_positive_bound(tmp_path: Path) -> None:
    from nereusd.settings import load_settings
    from planner.errors import SpecError

    state = {"state_dir": str(tmp_path / "state")}
    assert load_settings(None, daemon=state).daemon.order_timeout_s == 120.0
    assert load_settings(None, daemon={**state, "order_timeout_s": 2}).daemon.order_timeout_s == 2.0
    for bad in (0, -1, float("inf")):
        with pytest.raises(SpecError, match="daemon.order_timeout_s"):
            load_settings(None, daemon={**state, "order_timeout_s": bad})


class _RefusingSource:
    name = "local"

    def poll(self) -> list[Any]:
        return []

    def grow(self, job_id: str, n_nodes: int) -> tuple[str, ...]:
        raise AllocationError(f"grow {job_id}: no node is free")


def test_the_source_threads_refusals_come_back_to_the_serve_loop() -> None:
    worker = _SourceWorker(_RefusingSource(), 0.01, get_logger("test"))  # type: ignore[arg-type]
    worker.requests.put(("grow", ("j", 2)))
    worker.start()
    try:
        got = worker.refused.get(timeout=WAIT_S)
    except queue.Empty:
        raise AssertionError(f"no refusal came back within {WAIT_S} s") from None
    finally:
        worker.stop_event.set()
        worker.join(timeout=WAIT_S)
    assert got == ("grow", ("j", 2), "grow j: no node is free")
    assert not worker.is_alive()


# --- the controller in process (real planner, tiny model): the drain's steps one by one -----------------

def test_the_controller_drains_before_it_releases_and_fails_late_orders(tmp_path: Path) -> None:
    from nereusd.controller import JobController
    from nereusd.metrics import Metrics
    from nereusd.planning import PlannerBinding
    from nereusd.store import Store
    from planner import admission

    store = Store(tmp_path / "s.db")
    store.add_job(job_id="j", user="alice", spec=SPEC)
    orders: list[tuple[str, protocol.TransitionOrder]] = []
    released: list[list[str]] = []
    ctl = JobController(job_id="j", store=store, metrics=Metrics(), planner=PlannerBinding(), gamma=0.5,
                        thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                        send_order=lambda node, order: orders.append((node, order)) is None,
                        release_nodes=released.append)
    devices = [d.model_dump() for d in DEVS]
    for node in ("n1", "n2"):
        store.register_node(job_id="j", node=node, devices=devices, slurm_job_id=None, host="h", incarnation=node)
        ctl.on_node_joined(node, "new")

    def ack_all() -> None:
        for node, order in orders:
            ctl.on_transition_report(protocol.TransitionReport(job_id="j", node=node, ok=True, measured_s=0.1,
                                                               transition_id=order.transition_id))
        orders.clear()

    assert ctl.step() is not None
    assert all(o.part["pool"] == {"n1": [0, 1], "n2": [2, 3]} and o.part["gpus_per_node"] == 2 for _, o in orders)
    ack_all()
    assert ctl.plan is not None and ctl.plan.gpus & {2, 3}, "the tiny job's plan on 4 GPUs uses n2"

    assert ctl.drain(["n2"], "test") == []  # n2 holds state: it drains, nothing is released yet
    assert released == [] and ctl.draining == {"n2": "test"}
    did = ctl.step()
    decision = store.decision(did or -1)
    assert decision is not None and decision["urgent"] and "drain n2" in json.dumps(decision["inputs"])
    assert {n for n, _ in orders} == {"n1", "n2"}  # the draining node takes part: it sends its state away
    assert all(o.part["draining"] == ["n2"] and o.part["pool"] == {"n1": [0, 1], "n2": [2, 3]} for _, o in orders)
    assert {g for s in orders[0][1].part["plan"]["stages"] for gs in s["gpu_sets"] for g in gs} <= {0, 1}
    assert ctl.step() is None and released == []  # not before every part reported
    ack_all()
    assert ctl.step() is None and released == [["n2"]]  # now: no plan uses it
    assert ctl.plan.gpus <= {0, 1}
    with pytest.raises(AllocationError, match="no GPU would be left"):
        ctl.drain(["n1"], "test")  # the last node: refused, and it stays
    assert ctl.draining == {"n2": "test"} and ctl.pool == frozenset({0, 1})

    # an order nobody reports (another job's initial placement): failed after the bound, and the next pass
    # replans urgently
    store.add_job(job_id="k", user="alice", spec=SPEC)
    clock = [1000.0]
    k = JobController(job_id="k", store=store, metrics=Metrics(), planner=PlannerBinding(), gamma=0.5,
                      thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                      send_order=lambda node, order: orders.append((node, order)) is None, clock=lambda: clock[0])
    store.register_node(job_id="k", node="m1", devices=devices, slurm_job_id=None, host="h", incarnation="m1")
    k.on_node_joined("m1", "new")
    assert k.step() is not None and orders
    late = store.transitions("k")[-1]
    k.check_order_timeouts(5.0, now=float(late["created_at"]) + 4.0)
    assert store.transition(late["id"])["state"] == "ordered"  # type: ignore[index]
    k.check_order_timeouts(5.0, now=float(late["created_at"]) + 6.0)
    assert store.transition(late["id"])["state"] == "failed" and store.job("k")["state"] == "running"  # type: ignore[index]
    assert store.history("transition", str(late["id"]))[-1]["reason"] == "node(s) m1 did not finish within 5 s"
    assert k.step() is None  # backing off after a failed transition (1 s after the first)
    clock[0] += 1.5
    again = k.step()
    assert again is not None and f"transition {late['id']} failed" in json.dumps(store.decision(again)["inputs"])  # type: ignore[index]
    assert store.transitions("k")[-1]["state"] == "ordered" and store.transitions("k")[-1]["id"] != late["id"]


def test_a_lost_last_copy_is_ordered_as_a_restore_from_the_checkpoint(tmp_path: Path) -> None:
    """No DAG can reach the new plan (the last copy of some state died with a node): the daemon does not
    stop at a checkpoint/restart decision, it orders the plan as a restore (the driver loads it from
    its checkpoint), admitted, and L_tran learns nothing from it. The real planner: on two 2-GPU nodes
    it gives tiny-3m's reference GPUs 0-1 and its reward model GPUs 2-3, so n2's loss takes the reward
    model's every copy."""
    from nereusd.controller import JobController
    from nereusd.metrics import Metrics
    from nereusd.planning import PlannerBinding
    from nereusd.store import Store
    from planner import admission

    class Observed(PlannerBinding):  # the real binding, recording what it is fed back
        def observe_transition(self, job, transition):  # type: ignore[no-untyped-def]
            observed.append(transition["id"])
            super().observe_transition(job, transition)

    observed: list[int] = []
    store = Store(tmp_path / "s.db")
    store.add_job(job_id="j", user="alice", spec=SPEC)
    orders: list[tuple[str, protocol.TransitionOrder]] = []
    ctl = JobController(job_id="j", store=store, metrics=Metrics(), planner=Observed(), gamma=0.5,
                        thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                        send_order=lambda node, order: orders.append((node, order)) is None, restore_by_order=True)
    for node in ("n1", "n2"):
        store.register_node(job_id="j", node=node, devices=[d.model_dump() for d in DEVS], slurm_job_id=None,
                            host="h", incarnation=node)
        ctl.on_node_joined(node, "new")
    assert ctl.step() is not None
    for node, order in list(orders):
        ctl.on_transition_report(protocol.TransitionReport(job_id="j", node=node, ok=True, measured_s=0.1,
                                                           transition_id=order.transition_id))
    assert ctl.plan is not None
    only_on_n2 = [s.model_stage for s in ctl.plan.stages if all(g in (2, 3) for gs in s.gpu_sets for g in gs)]
    assert only_on_n2 == ["reward-inf"], ctl.plan  # the premise: n2 holds the reward model's every copy
    first = orders[-1][1].to_version
    orders.clear()
    store.set_node_state("j", "n2", "lost", "no heartbeat")
    ctl.on_node_lost("n2", "no heartbeat")
    did = ctl.step()
    decision = store.decision(did)  # type: ignore[arg-type]
    assert decision["admitted"] and decision["rule"] == "checkpoint-restart", decision
    assert "restore plan" in decision["reason"] and "checkpoint" in decision["reason"]
    assert "reward-inf" in json.dumps(decision["inputs"]["infeasible_reasons"])  # what was lost, said
    assert [n for n, _ in orders] == ["n1"] and orders[0][1].to_version > first
    t = store.transitions("j")[-1]
    assert t["state"] == "ordered" and t["dag"]["kind"] == "restore"
    ctl.on_transition_report(protocol.TransitionReport(job_id="j", node="n1", ok=True, measured_s=2.5,
                                                       transition_id=t["id"]))
    assert store.transition(t["id"])["state"] == "done"  # type: ignore[index]
    assert t["id"] not in observed  # a checkpoint load is no sample of L_tran
    assert store.job("j")["plan_version"] == orders[0][1].to_version  # type: ignore[index]
