"""The controller's passive paths around a drain, in process (real Store, real PlannerBinding, tiny model,
CPU "GPUs"): which nodes a drain gives back at once and which drain first, its refusals word for word, a
refused release and a node that leaves by itself, the source asked only once no plan uses a node, orders
that time out, nodes lost mid-transition, a failed step and a restart from the checkpoint. Found by
mutation testing (tests/mutate.py --module nereusd/controller.py): these paths were reached only by
daemon tests, or by none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog

from nereusd.allocation import AllocationError
from nereusd.controller import JobController
from nereusd.metrics import Metrics
from nereusd.planning import PlannerBinding
from nereusd.store import Store
from nereusd.wire import protocol
from nereusd.wire.logs import get_logger
from planner import admission
from planner.errors import InfeasibleError

SPEC = {"model": "tiny-3m", "algo": "grpo", "device": "cpu", "gpus_per_node": 2,
        "workload": {"prompts_per_step": 8, "prompt_tokens": 32, "response_tokens": 64}}
DEVICES = [{"index": i, "kind": "cpu", "name": "cpu", "memory_bytes": 1 << 33} for i in range(2)]


class Refusing(PlannerBinding):
    """The real binding, whose search refuses every pool once ``refuse`` is set (the world changed between
    a drain's check and its replan); the message has a second line, as InfeasibleError's reasons do."""

    refuse = False

    def search(self, job: dict[str, Any], pool: frozenset[int], version: int) -> Any:
        if self.refuse:
            raise InfeasibleError(f"nothing fits on {len(pool)} GPU(s)", ("actor-train: 1 byte over",))
        return super().search(job, pool, version)


class Job:
    """Job j on two 2-GPU nodes, its initial placement done (plan v1 on GPUs 0-3), and a clock of its own."""

    def __init__(self, tmp_path: Path, planner: PlannerBinding | None = None, release: bool = True,
                 store: Store | None = None) -> None:
        self.orders: list[tuple[str, protocol.TransitionOrder]] = []
        self.released: list[list[str]] = []
        self.now = 100.0
        self.store = store or Store(tmp_path / "s.db")
        fresh = store is None
        if fresh:
            self.store.add_job(job_id="j", user="alice", spec=SPEC)
        self.ctl = JobController(job_id="j", store=self.store, metrics=Metrics(), planner=planner, gamma=0.5,
                                 thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                                 send_order=lambda node, order: self.orders.append((node, order)) is None,
                                 clock=lambda: self.now, release_nodes=self.released.append if release else None)
        if fresh:
            for node in ("n1", "n2"):
                self.join(node)
            assert self.ctl.step() is not None
            self.ack()
            assert self.ctl.plan is not None and self.ctl.plan.gpus == {0, 1, 2, 3}, self.ctl.plan

    def join(self, node: str) -> None:
        self.store.register_node(job_id="j", node=node, devices=DEVICES, slurm_job_id=None, host="h",
                                 incarnation=node)
        self.ctl.on_node_joined(node, "new")

    def ack(self, nodes: tuple[str, ...] | None = None, measured_s: float = 0.1) -> None:
        for node, order in list(self.orders):
            if nodes is None or node in nodes:
                self.ctl.on_transition_report(protocol.TransitionReport(
                    job_id="j", node=node, transition_id=order.transition_id, ok=True, measured_s=measured_s))
                self.orders.remove((node, order))

    def events(self, kind: str) -> list[Any]:
        return [e["data"] for e in self.store.events("j") if e["kind"] == kind]

    def saved_draining(self) -> dict[str, str]:
        return (self.store.controller_state("j") or {})["draining"]


def _open_transition(store: Store, job: str, nodes: list[str], to_version: int = 1) -> dict[str, Any]:
    """An ordered transition row as an older daemon left it (v1 -> v1: no plan to commit)."""
    tid = store.add_transition(job_id=job, decision_id=None, from_version=1, to_version=to_version, dag={}, bytes_moved=0,
                               predicted_s=0.0, parts=nodes)
    store.set_transition_state(tid, "ordered", "test")
    return store.transition(tid) or {}


def test_a_drain_gives_back_unused_nodes_at_once_and_drains_used_ones_first(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())
    job.join("n3")  # joined after the placement: no plan uses it
    job.now = 105.0
    with structlog.testing.capture_logs() as logs:
        assert job.ctl.drain(["n3", "n2", "n3"], "alloc --shrink") == ["n3"]
    assert job.ctl.pool_changed_at == 105.0  # the pool grew by n3's GPUs when the drain refreshed it
    assert job.ctl.draining == {"n3": "alloc --shrink", "n2": "alloc --shrink"} == job.saved_draining()
    assert job.ctl.drained("n3") and not job.ctl.drained("n2") and job.ctl.pool_dirty
    assert job.ctl.urgent_reasons == ["drain n2"]
    assert job.events("node-draining") == [{"nodes": ["n2"], "reason": "alloc --shrink"}]
    assert [(e["log_level"], e["nodes"], e["reason"]) for e in logs if e["event"] == "node-draining"] == [
        ("info", ["n2"], "alloc --shrink")]

    job.now = 107.0  # the same nodes again: nothing new, but the pool now leaves them out
    assert job.ctl.drain(["n2", "n3"], "again") == [] and job.ctl.pool == frozenset({0, 1})
    assert job.ctl.pool_changed_at == 107.0 and not job.ctl.pool_dirty
    assert job.ctl.draining == {"n3": "alloc --shrink", "n2": "alloc --shrink"}
    job.now = 109.0  # the pool did not change this time
    assert job.ctl.drain(["n2"], "again") == [] and job.ctl.pool_changed_at == 107.0
    assert len(job.events("node-draining")) == 1


def test_drains_that_leave_nothing_or_no_planner_or_no_plan_are_refused_word_for_word(tmp_path: Path) -> None:
    planner = Refusing()
    job = Job(tmp_path, planner)
    msg = ("drain n1, n2 of job j: no GPU would be left to hold the job's state; the node(s) stay "
           "(give the job more nodes first, or end the job)")
    with pytest.raises(AllocationError) as err:
        job.ctl.drain(["n1", "n2"], "test")
    assert str(err.value) == msg
    planner.refuse = True
    with pytest.raises(AllocationError) as err:
        job.ctl.drain(["n2"], "test")
    assert str(err.value) == ("drain n2 of job j: no plan fits on the 2 GPU(s) left (nothing fits on 2 GPU(s)); "
                              "the node(s) stay")
    assert job.ctl.draining == {} and job.ctl.urgent_reasons == [] and job.events("node-draining") == []

    bare = Job(tmp_path, None, store=job.store)  # a daemon with no planner bound, on the same job
    with pytest.raises(AllocationError) as err:
        bare.ctl.drain(["n2"], "test")
    assert str(err.value) == "drain n2 of job j: no planner is bound to the daemon to plan without them"


def test_the_source_is_asked_once_no_plan_uses_a_drained_node(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())
    job.store.add_job(job_id="k", user="alice", spec=SPEC)  # another job's open transition changes nothing here
    job.store.register_node(job_id="k", node="m1", devices=DEVICES, slurm_job_id=None, host="h", incarnation="m1")
    _open_transition(job.store, "k", ["m1"])
    assert job.ctl.drain(["n2"], "test") == []
    assert job.ctl.step() is not None and {n for n, _ in job.orders} == {"n1", "n2"}
    job.ack()
    assert job.ctl.plan is not None and job.ctl.plan.gpus <= {0, 1}
    with structlog.testing.capture_logs() as logs:
        assert job.ctl.step() is None
    assert job.released == [["n2"]] and job.ctl.drained("n2")
    assert job.events("node-drained") == [{"nodes": ["n2"], "plan_version": job.ctl.plan.version}]
    assert [(e["log_level"], e["nodes"]) for e in logs if e["event"] == "node-drained"] == [("info", ["n2"])]
    assert job.ctl.step() is None and job.released == [["n2"]]  # asked once


def test_no_release_while_a_transition_of_the_job_is_open_nor_without_a_source(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())
    job.ctl.drain(["n2"], "test")
    job.ctl.step()
    job.ack()
    _open_transition(job.store, "j", ["n1"])  # left ordered by an older daemon
    assert job.ctl.step() is None and job.released == [] and not job.ctl.drained("n2")

    (tmp_path / "b").mkdir()
    other = Job(tmp_path / "b", PlannerBinding(), release=False)
    other.ctl.drain(["n2"], "test")
    other.ctl.step()
    other.ack()
    assert other.ctl.step() is None  # nobody to ask: the node stays draining
    assert other.ctl.draining == {"n2": "test"} and not other.ctl.drained("n2") and other.events("node-drained") == []


def test_a_drained_node_without_a_plan_is_released_with_no_version(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())
    job.ctl.drain(["n2"], "test")  # drains first: plan v1 uses it
    job.ctl.on_restarted("checkpoint restart")  # the plan is gone: nothing uses n2 any more
    job.ctl.step()
    assert job.released == [["n2"]]
    assert job.events("node-drained") == [{"nodes": ["n2"], "plan_version": None}]


def test_a_refused_release_brings_the_nodes_back_and_a_node_that_leaves_is_released(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())
    job.join("n3")
    job.join("n4")
    assert job.ctl.drain(["n3", "n4"], "shrink") == ["n3", "n4"]
    job.ctl._refresh_pool()
    assert not job.ctl.pool_dirty
    job.ctl.on_release_refused(["n9"], "not ours")  # no such draining node: nothing changes
    assert not job.ctl.pool_dirty and job.ctl.draining == {"n3": "shrink", "n4": "shrink"} == job.saved_draining()
    job.ctl.on_release_refused(["n3"], "the source is busy")
    assert job.ctl.draining == {"n4": "shrink"} == job.saved_draining()
    assert not job.ctl.drained("n3") and job.ctl.drained("n4") and job.ctl.pool_dirty
    job.ctl._refresh_pool()
    assert job.ctl.pool == frozenset({0, 1, 2, 3, 4, 5})  # n3 is back in the pool, n4 (GPUs 6-7) is not

    job.ctl.on_node_left("n4", "preempted by Slurm")
    assert job.store.node("j", "n4")["state"] == "released"  # type: ignore[index]
    assert job.store.history("node", "j/n4")[-1]["reason"] == "preempted by Slurm"
    assert job.ctl.draining == {} == job.saved_draining() and not job.ctl.drained("n4") and job.ctl.pool_dirty
    job.ctl.on_node_left("n3", "left: its grace ended")  # not draining (its drain was refused): released all the same
    assert job.store.node("j", "n3")["state"] == "released" and job.ctl.draining == {}  # type: ignore[index]


def test_an_order_times_out_only_past_its_bound_and_names_every_late_node(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())
    job.store.add_job(job_id="k", user="alice", spec=SPEC)
    job.store.register_node(job_id="k", node="m1", devices=DEVICES, slurm_job_id=None, host="h", incarnation="m1")
    theirs = _open_transition(job.store, "k", ["m1"])
    mine = _open_transition(job.store, "j", ["n1", "n2"])
    job.ctl.check_order_timeouts(3600.0)  # the wall clock now: not an hour old
    assert job.store.transition(mine["id"])["state"] == "ordered"  # type: ignore[index]
    job.ctl.check_order_timeouts(5.0, now=float(mine["created_at"]) + 5.0)  # exactly the bound: not late yet
    assert job.store.transition(mine["id"])["state"] == "ordered"  # type: ignore[index]
    job.ctl.check_order_timeouts(5.0, now=float(mine["created_at"]) + 5.5)
    assert job.store.transition(mine["id"])["state"] == "failed"  # type: ignore[index]
    assert job.store.history("transition", str(mine["id"]))[-1]["reason"] == "node(s) n1, n2 did not finish within 5 s"
    assert job.store.transition(theirs["id"])["state"] == "ordered"  # type: ignore[index]  # k's own controller's

    none_left = _open_transition(job.store, "j", ["n1"])
    job.store.set_transition_state(none_left["id"], "ordered", "every part reported", parts_pending=[])
    job.ctl.check_order_timeouts(0.25, now=float(none_left["created_at"]) + 1.0)
    assert job.store.history("transition", str(none_left["id"]))[-1]["reason"] == \
        "node(s) none did not finish within 0.25 s"


def test_a_node_lost_mid_transition_fails_it_only_while_its_part_is_pending(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())
    job.store.add_job(job_id="k", user="alice", spec=SPEC)
    job.store.register_node(job_id="k", node="n1", devices=DEVICES, slurm_job_id=None, host="h", incarnation="n1")
    theirs = _open_transition(job.store, "k", ["n1"])  # another job's node of the same name
    job.ctl.drain(["n2"], "test")
    job.ctl.step()
    tid = job.orders[0][1].transition_id
    job.ack(("n2",))  # n2's part is done: losing n2 now fails nothing
    assert job.ctl.resend_orders("n2") == 0  # nor is it sent again (the job has no anchor: no driver's node)
    job.store.set_node_state("j", "n2", "lost", "no heartbeat")
    job.ctl.on_node_lost("n2", "no heartbeat")
    assert job.store.transition(tid)["state"] == "ordered"  # type: ignore[index]
    job.store.set_node_state("j", "n1", "lost", "no heartbeat")
    job.ctl.on_node_lost("n1", "no heartbeat")
    assert job.store.transition(tid)["state"] == "failed"  # type: ignore[index]
    assert job.store.history("transition", str(tid))[-1]["reason"] == "node n1 lost mid-transition: no heartbeat"
    assert f"transition {tid} failed: node n1 lost mid-transition: no heartbeat" in job.ctl.urgent_reasons
    assert job.store.transition(theirs["id"])["state"] == "ordered"  # type: ignore[index]
    assert job.store.job("j")["state"] == "lost"  # type: ignore[index]  # by the failed transition
    assert job.store.history("job", "j")[-1]["reason"] == f"transition {tid} failed"

    job.store.register_node(job_id="j", node="n1", devices=DEVICES, slurm_job_id=None, host="h", incarnation="n1b")
    job.ctl.on_node_joined("n1", "rejoined")
    assert job.store.job("j")["state"] == "running"  # type: ignore[index]
    assert job.store.history("job", "j")[-1]["reason"] == "node n1 rejoined"
    job.store.set_node_state("j", "n1", "lost", "no heartbeat")
    job.ctl.on_node_lost("n1", "no heartbeat")  # no transition open: the count of alive nodes says it
    assert job.store.job("j")["state"] == "lost"  # type: ignore[index]
    assert job.store.history("job", "j")[-1]["reason"] == "every node is lost (last: n1)"


def test_a_failed_step_of_the_running_plan_asks_for_an_urgent_replan(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())
    with structlog.testing.capture_logs() as logs:
        job.ctl.on_step_failed(node="n1", step=7, plan_version=0, reason="an older plan's OOM")
    assert not job.ctl.memory_violation
    job.ctl.on_step_failed(node="n2", step=8, plan_version=1, reason="CUDA out of memory")
    assert job.ctl.memory_violation
    assert job.events("step-failed") == [
        {"node": "n1", "step": 7, "plan_version": 0, "reason": "an older plan's OOM"},
        {"node": "n2", "step": 8, "plan_version": 1, "reason": "CUDA out of memory"}]
    assert [(e["log_level"], e["node"], e["step"], e["plan_version"], e["reason"]) for e in logs
            if e["event"] == "step-failed"] == [("warning", "n1", 7, 0, "an older plan's OOM")]
    did = job.ctl.step()
    assert did is not None and job.store.decision(did)["urgent"]  # type: ignore[index]
    assert not job.ctl.memory_violation


def test_a_restart_from_the_checkpoint_forgets_the_plan_and_places_the_job_again(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())
    job.ctl.on_step_failed(node="n1", step=3, plan_version=1, reason="oom")
    job.ctl._refresh_pool()
    with structlog.testing.capture_logs() as logs:
        job.ctl.on_restarted("no transition reaches the plan")
    assert job.events("restarted") == [{"reason": "no transition reaches the plan", "from_version": 1}]
    assert [(e["log_level"], e["reason"]) for e in logs if e["event"] == "restarted"] == [
        ("warning", "no transition reaches the plan")]
    assert job.ctl.plan is None and job.ctl.prediction is None and job.ctl.trigger_state is None
    assert not job.ctl.memory_violation and job.ctl.pool_dirty
    assert (job.store.controller_state("j") or {})["trigger"] is None
    did = job.ctl.step()
    assert did is not None
    decision = job.store.decision(did) or {}
    assert decision["from_version"] is None and decision["to_version"] == 2 and decision["urgent"]
    assert "initial placement on 4 GPUs" in str(decision["inputs"])
    job.ctl.on_restarted("again")
    assert job.events("restarted")[-1] == {"reason": "again", "from_version": None}


def test_a_drain_whose_replan_orders_nothing_is_refused_and_the_nodes_stay(tmp_path: Path) -> None:
    planner = Refusing()
    job = Job(tmp_path, planner)
    assert job.ctl.drain(["n2"], "test") == []
    planner.refuse = True  # the replan finds no plan after all
    with structlog.testing.capture_logs() as logs:
        did = job.ctl.step()
    assert did is not None
    decision = job.store.decision(did) or {}
    assert not decision["admitted"] and job.orders == []
    reason = f"decision {did} ordered no transition away from them: {decision['reason']}"
    assert job.events("alloc-refused") == [{"op": "shrink", "nodes": ["n2"], "reason": reason}]
    assert [(e["log_level"], e["op"], e["nodes"], e["reason"]) for e in logs if e["event"] == "alloc-refused"] == [
        ("warning", "shrink", ["n2"], reason)]
    assert job.ctl.draining == {} == job.saved_draining() and job.ctl.pool_dirty
    job.ctl._refresh_pool()
    assert job.ctl.pool == frozenset({0, 1, 2, 3})


def test_a_restarted_daemon_resends_open_orders_to_pending_nodes_and_the_anchors_node(tmp_path: Path) -> None:
    """A v1 -> v2 transition ordered by an earlier daemon: its orders are rebuilt from the store (the old
    plan's DAG, the same parts), sent to a node whose part is pending, and to the anchor's node (the job's
    driver runs there) even once its own part is done; each carries the incarnations of now."""
    store = Store(tmp_path / "s.db")
    store.add_job(job_id="j", user="alice", spec=SPEC, slurm_job_id="100")
    job = Job(tmp_path, PlannerBinding(), store=store)
    for node, slurm in (("n1", "100"), ("n2", "200"), ("n3", "200")):
        store.register_node(job_id="j", node=node, devices=DEVICES, slurm_job_id=slurm, host="h", incarnation=node)
        job.ctl.on_node_joined(node, "new")
    assert job.ctl.drain(["n3"], "test") == ["n3"]  # not used by any plan: n1, n2 hold the placement
    assert job.ctl.step() is not None
    job.ack()
    assert job.ctl.drain(["n2"], "test") == []
    assert job.ctl.step() is not None
    sent = dict(job.orders)
    assert set(sent) == {"n1", "n2", "n3"} and sent["n1"].from_version == 1 and sent["n1"].to_version == 2
    job.ack(("n1", "n3"))  # n1's and n3's parts are done; n2's is pending

    store.register_node(job_id="j", node="n2", devices=DEVICES, slurm_job_id="200", host="h", incarnation="n2b")
    resent: list[tuple[str, protocol.TransitionOrder]] = []
    refuse = {"n2"}
    again = JobController(job_id="j", store=store, metrics=Metrics(), planner=PlannerBinding(), gamma=0.5,
                          thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                          send_order=lambda node, order: resent.append((node, order)) is None and node not in refuse)
    assert again.resend_orders("n3") == 0 and resent == []  # a member's node with no part pending: nothing
    assert again.resend_orders("n2") == 0 and len(resent) == 1  # its link refused the order: not counted
    refuse.clear()
    with structlog.testing.capture_logs() as logs:
        assert again.resend_orders("n2") == 1 and again.resend_orders("n1") == 1
    assert [(e["log_level"], e["node"], e["transition"]) for e in logs if e["event"] == "order-resent"] == [
        ("info", "n2", sent["n2"].transition_id), ("info", "n1", sent["n1"].transition_id)]
    for node, order in resent:
        assert (order.transition_id, order.from_version, order.to_version) == (
            sent[node].transition_id, 1, 2)
        assert order.part["incarnations"] == {"n1": "n1", "n2": "n2b", "n3": "n3"}
        assert {k: v for k, v in order.part.items() if k != "incarnations"} == {
            k: v for k, v in sent[node].part.items() if k != "incarnations"}
    assert sent["n2"].part["incarnations"]["n2"] == "n2"
    assert again.resend_orders("n1") == 1 and len(resent) == 4  # kept: sent again, not rebuilt
    store.register_node(job_id="j", node="n2", devices=DEVICES, slurm_job_id="200", host="h", incarnation="n2c")
    assert again.resend_orders("n2") == 1  # the kept order, with the agent that registered just now
    assert resent[-1][1].part["incarnations"] == {"n1": "n1", "n2": "n2c", "n3": "n3"}
    assert resent[-1][1].part["plan"] == sent["n2"].part["plan"]

    store.add_job(job_id="k", user="alice", spec=SPEC)  # another job's open order for a node of the same name
    store.register_node(job_id="k", node="n2", devices=DEVICES, slurm_job_id=None, host="h", incarnation="k2")
    _open_transition(store, "k", ["n2"])
    gone = _open_transition(store, "j", ["n3"], to_version=9)  # its plan was never stored: nothing to send
    extra = _open_transition(store, "j", ["n2", "n3"])  # one more open transition v1 -> v1
    resent.clear()
    assert again.resend_orders("n3") == 1 and again.resend_orders("n2") == 2  # extra's (n3); the first's and extra's
    assert [(n, o.transition_id) for n, o in resent] == [
        ("n3", extra["id"]), ("n2", sent["n2"].transition_id), ("n2", extra["id"])]
    for t in (gone, extra):
        store.set_transition_state(t["id"], "failed", "test")

    resent.clear()
    for node in ("n2", "n1"):  # the restarted daemon kept no prediction: it predicts the plan it commits
        again.on_transition_report(protocol.TransitionReport(job_id="j", node=node, ok=True, measured_s=0.2,
                                                             transition_id=sent["n2"].transition_id))
    assert store.transition(sent["n2"].transition_id)["state"] == "done"  # type: ignore[index]
    assert again.plan is not None and again.plan.version == 2 and again.prediction is not None
    assert again.metrics.step_latency.labels("j", "predicted")._value.get() == again.prediction.step_latency_s


class BrokenDag(PlannerBinding):
    """The real binding, whose DAG build fails (the transition layer refuses it after a restart)."""

    def transition(self, *args: Any, **kwargs: Any) -> Any:
        raise InfeasibleError("no DAG reaches the plan", ("reward-inf: the last copy is gone",))


def test_an_order_rebuilt_without_its_dag_is_sent_with_the_plan_and_logged(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())
    assert job.ctl.drain(["n2"], "test") == [] and job.ctl.step() is not None
    tid = job.orders[0][1].transition_id
    resent: list[tuple[str, protocol.TransitionOrder]] = []
    again = JobController(job_id="j", store=job.store, metrics=Metrics(), planner=BrokenDag(), gamma=0.5,
                          thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                          send_order=lambda node, order: resent.append((node, order)) is None)
    with structlog.testing.capture_logs() as logs:
        assert again.resend_orders("n1") == 1
    assert [(e["log_level"], e["transition"], e["error"]) for e in logs if e["event"] == "order-rebuild-without-dag"] \
        == [("warning", tid, "no DAG reaches the plan\n  - reward-inf: the last copy is gone")]
    [(node, order)] = resent
    assert node == "n1" and order.part["plan"] == job.orders[0][1].part["plan"]
    assert set(order.part) == {"plan", "pool", "gpus_per_node", "draining", "incarnations"}  # no DAG part


def test_failed_transitions_back_off_doubling_to_a_minute_and_a_success_resets_it(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())
    job.ctl.draining = {"n2": "shrink"}  # a drain not yet asked of the source: replanned after each failure
    waits = []
    for i in range(1, 9):
        t = _open_transition(job.store, "j", ["n1"])
        job.now = 1000.0 * i
        with structlog.testing.capture_logs() as logs:
            job.ctl.check_order_timeouts(1.0, now=float(t["created_at"]) + 2.0)
        waits.append(job.ctl.retry_at - job.now)
        [failed] = [e for e in logs if e["event"] == "transition-failed"]
        assert (failed["log_level"], failed["transition"], failed["failed_in_row"], failed["retry_in_s"]) == (
            "warning", t["id"], i, waits[-1])
        assert failed["reason"] == "node(s) n1 did not finish within 1 s"
        assert job.ctl.urgent_reasons[-2:] == [f"transition {t['id']} failed: {failed['reason']}", "drain n2"]
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert job.ctl.metrics.transitions.labels("j", "failed")._value.get() == 8
    assert job.ctl.pool_dirty and job.store.job("j")["state"] == "running"  # type: ignore[index]

    job.ctl.urgent_reasons = []
    job.ctl.retry_at = -float("inf")
    assert job.ctl.drain(["n2"], "shrink") == [] and job.ctl.step() is not None  # the drain's transition, v1 -> v2
    moved = job.store.transitions("j")[-1]
    job.ack(measured_s=0.0)  # reported as taking no time: the histogram's sum stays the placement's 0.1 s
    assert job.store.transition(moved["id"])["state"] == "done"  # type: ignore[index]
    assert job.store.history("job", "j")[-1]["reason"] == f"transition {moved['id']} done"
    assert job.ctl.metrics.transition_cost.labels("measured")._sum.get() == pytest.approx(0.1)
    done = [t for t in job.store.transitions("j") if t["state"] == "done"]
    assert sum(t["bytes_moved"] for t in done) > 0  # the drain moved n2's state to n1
    assert job.ctl.metrics.transition_bytes.labels("j")._value.get() == sum(t["bytes_moved"] for t in done)
    assert job.ctl._orders == {}  # no order of a finished transition kept
    assert job.ctl.failed_in_row == 0 and job.ctl.retry_at == -float("inf")
    assert job.ctl.metrics.transitions.labels("j", "done")._value.get() == 2  # the placement and this one
    assert job.store.job("j")["plan_version"] == 2 and job.ctl.plan.version == 2  # type: ignore[index,union-attr]
    assert job.ctl.prediction is not None
    assert job.ctl.metrics.step_latency.labels("j", "predicted")._value.get() == job.ctl.prediction.step_latency_s


def test_the_pool_counts_gpus_by_node_rank_and_the_jobs_gpus_per_node(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    store.add_job(job_id="j", user="alice", spec={k: v for k, v in SPEC.items() if k != "gpus_per_node"})
    job = Job(tmp_path, PlannerBinding(), store=store)
    wide = [{"index": i, "kind": "cpu", "name": "cpu", "memory_bytes": 1 << 33} for i in range(3)]
    for node, devices in (("n1", DEVICES), ("n2", wide), ("n3", DEVICES)):
        store.register_node(job_id="j", node=node, devices=devices, slurm_job_id=None, host="h", incarnation=node)
    store.set_node_state("j", "n3", "lost", "no heartbeat")
    job.ctl._refresh_pool()  # no gpus_per_node in the spec: the widest node's 3
    assert job.ctl.gpus_per_node == 3 and job.ctl.gpu_owner == {0: "n1", 1: "n1", 3: "n2", 4: "n2", 5: "n2"}
    assert job.ctl.pool == frozenset({0, 1, 3, 4, 5}) and job.ctl.pool_dirty is False
    assert job.ctl.metrics.gpus_held.labels("j")._value.get() == 5

    (tmp_path / "x").mkdir()
    job2 = Job(tmp_path / "x", PlannerBinding())
    job2.store.register_node(job_id="j", node="n3", devices=wide, slurm_job_id=None, host="h", incarnation="n3")
    job2.ctl.draining = {"n2": "shrink"}
    job2.ctl._refresh_pool()  # gpus_per_node 2: n3's third device is left out, the draining n2 out of the pool
    assert job2.ctl.gpus_per_node == 2 and job2.ctl.gpu_owner == {0: "n1", 1: "n1", 2: "n2", 3: "n2", 4: "n3", 5: "n3"}
    assert job2.ctl.pool == frozenset({0, 1, 4, 5}) and job2.ctl.metrics.gpus_held.labels("j")._value.get() == 4

    store.add_job(job_id="e", user="alice", spec={k: v for k, v in SPEC.items() if k != "gpus_per_node"})
    empty = JobController(job_id="e", store=store, metrics=Metrics(), planner=None, gamma=0.5,
                          thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                          send_order=lambda node, order: True)
    empty._refresh_pool()  # no node yet and no gpus_per_node in the spec: one GPU per node, none held
    assert empty.gpus_per_node == 1 and empty.pool == frozenset() and empty.gpu_owner == {}


def test_the_spec_planned_for_carries_todays_measured_response_length(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())
    assert job.ctl._spec_now()["workload"] == {**SPEC["workload"], "max_response_tokens": 64}  # as specified
    job.ctl.signals[admission.Signal.SEQUENCE_LENGTH] = 32 + 80.4
    assert job.ctl._spec_now()["workload"] == {**SPEC["workload"], "response_tokens": 80, "max_response_tokens": 80}
    job.ctl.signals[admission.Signal.SEQUENCE_LENGTH] = 32.2  # shorter than one token: one
    assert job.ctl._spec_now()["workload"]["response_tokens"] == 1
    assert job.store.job("j")["spec"]["workload"] == SPEC["workload"]  # type: ignore[index]  # the stored spec stays

    store = Store(tmp_path / "m.db")
    store.add_job(job_id="j", user="alice",
                  spec={**SPEC, "workload": {**SPEC["workload"], "max_response_tokens": 128}})
    capped = Job(tmp_path, None, store=store)
    capped.ctl.signals[admission.Signal.SEQUENCE_LENGTH] = 32 + 100.0
    assert capped.ctl._spec_now()["workload"]["max_response_tokens"] == 128  # the cap stays above today's 100
    capped.ctl.signals[admission.Signal.SEQUENCE_LENGTH] = 32 + 200.0
    assert capped.ctl._spec_now()["workload"] == {**SPEC["workload"], "response_tokens": 200,
                                                   "max_response_tokens": 200}
