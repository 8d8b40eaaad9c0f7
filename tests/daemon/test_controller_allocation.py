"""The controller's allocation events in process (real Store, no planner needed): every event stored as
an allocation row and an event; nodes that leave (DOWN, shrink, preemption, a member job's end) released
from Slurm's state and no longer draining; the anchor's end ending the job in the state its kind says.
Found by mutation testing (tests/mutate.py --module nereusd/controller.py): no in-process test sent one."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereusd.allocation import AllocationEvent, EventKind, NodeAllocation
from nereusd.controller import JobController
from nereusd.metrics import Metrics
from nereusd.store import Store
from nereusd.wire import protocol
from nereusd.wire.logs import get_logger
from planner import admission

SPEC = {"model": "tiny-3m", "algo": "grpo", "device": "cpu", "gpus_per_node": 2}
DEVICES = [{"index": i, "kind": "cpu", "name": "cpu", "memory_bytes": 1 << 33} for i in range(2)]


def _job(store: Store, job: str, anchor: str | None, nodes: tuple[str, ...] = ("n1", "n2")) -> JobController:
    store.add_job(job_id=job, user="alice", spec=SPEC, slurm_job_id=anchor)
    ctl = JobController(job_id=job, store=store, metrics=Metrics(), planner=None, gamma=0.5,
                        thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                        send_order=lambda node, order: True)
    for node in nodes:
        store.register_node(job_id=job, node=node, devices=DEVICES, slurm_job_id=anchor, host="h", incarnation=node)
        ctl.on_node_joined(node, "new")
    assert store.job(job)["state"] == "running"  # type: ignore[index]
    return ctl


def _event(kind: EventKind, job: str, slurm: str | None, nodes: tuple[str, ...] = (), reason: str = "",
           holder: str = "100") -> AllocationEvent:
    return AllocationEvent(kind=kind, job_id=job, slurm_job_id=slurm, reason=reason, time_s=1.0,
                           nodes=tuple(NodeAllocation(node=n, gpu_indices=(0, 1), holder_job_id=holder) for n in nodes))


def test_nodes_that_leave_are_released_from_slurms_state_and_stop_draining(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    other = _job(store, "k", "300", ("n3",))  # another job's node of the same name stays
    ctl = _job(store, "j", "100", ("n1", "n2", "n3", "n4"))
    ctl.draining = {"n3": "shrink", "n4": "shrink"}
    ctl._release_asked = {"n3"}
    ctl._refresh_pool()

    down = _event(EventKind.NODE_DOWN, "j", "100", ("n3", "ghost"), "gpu fell off the bus")
    ctl.on_allocation(down)  # ghost is no node of the job: skipped
    assert store.node("j", "n3")["state"] == "released" and store.node("k", "n3")["state"] == "alive"  # type: ignore[index]
    assert store.history("node", "j/n3")[-1]["reason"] == "node_down: gpu fell off the bus"
    assert ctl.draining == {"n4": "shrink"} == store.controller_state("j")["draining"]  # type: ignore[index]
    assert not ctl.drained("n3") and ctl.pool_dirty
    assert store.allocations("j")[-1] | {"at": 0, "id": 0} == {
        "id": 0, "at": 0, "job_id": "j", "gpus": 4, "nodes": ["n3", "ghost"], "source": "node_down",
        "reason": "gpu fell off the bus"}
    assert [e["data"] for e in store.events("j") if e["kind"] == "allocation"] == [down.to_dict()]
    ctl.on_allocation(_event(EventKind.PREEMPTED, "j", "100", ("n4",), "preempted"))  # only draining nodes
    assert ctl.draining == {} == store.controller_state("j")["draining"]  # type: ignore[index]
    ctl.draining = {"n4": "shrink"}

    ctl._refresh_pool()
    member_end = _event(EventKind.TIME_LIMIT, "j", "200", ("n2",), holder="200")  # a member job's end: its nodes
    ctl.on_allocation(member_end)
    assert store.node("j", "n2")["state"] == "released" and store.job("j")["state"] == "running"  # type: ignore[index]
    assert store.history("node", "j/n2")[-1]["reason"] == "time_limit: "
    assert store.allocations("j")[-1]["reason"] == "time_limit" and ctl.pool_dirty  # no reason given: the kind
    assert ctl.draining == {"n4": "shrink"}
    assert store.job("k")["state"] == "running"  # type: ignore[index]
    assert other.draining == {}


def test_a_grant_or_growth_changes_no_node_and_no_state(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    ctl = _job(store, "j", "100")
    ctl._refresh_pool()
    ctl.draining = {"n2": "shrink"}
    for kind in (EventKind.GRANTED, EventKind.GROWN, EventKind.REQUESTED, EventKind.REQUEST_FAILED):
        ctl.on_allocation(_event(kind, "j", "100", ("n2",), "why"))
    ctl.on_allocation(_event(EventKind.GROWN, "j", "200", ("n2",), "why", holder="200"))  # a member's growth
    assert [n["state"] for n in store.nodes("j")] == ["alive", "alive"] and ctl.draining == {"n2": "shrink"}
    assert store.job("j")["state"] == "running" and ctl.pool_dirty  # type: ignore[index]
    assert [a["source"] for a in store.allocations("j")] == ["granted", "grown", "requested", "request_failed", "grown"]


@pytest.mark.parametrize(("kind", "anchor", "final"), [
    (EventKind.COMPLETED, "100", "finished"), (EventKind.RELEASED, "100", "finished"),
    (EventKind.CANCELLED, "100", "cancelled"), (EventKind.TIME_LIMIT, "100", "failed"),
    (EventKind.FAILED, None, "failed")])  # None: the local source, whose events are the anchor's
def test_the_anchors_end_ends_the_job_in_the_state_its_kind_says(tmp_path: Path, kind: EventKind,
                                                                  anchor: str | None, final: str) -> None:
    store = Store(tmp_path / "s.db")
    ctl = _job(store, "j", "100")
    ctl.on_allocation(_event(kind, "j", anchor, ("n1",), "the end"))
    assert store.job("j")["state"] == final  # type: ignore[index]
    assert store.history("job", "j")[-1]["reason"] == f"{kind.value}: the end"
    assert [n["state"] for n in store.nodes("j")] == ["alive", "alive"]  # the job ends; no node is released one by one


def test_without_a_workload_the_measured_length_is_the_response_and_the_spec_stays(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    ctl = _job(store, "j", None)
    assert ctl._spec_now() == SPEC  # no workload to correct
    ctl.on_measurement(protocol.Measurement(job_id="j", node="n1", step=1, plan_version=0, step_latency_s=0.5,
                                            response_tokens=50.0))
    assert ctl.signals[admission.Signal.SEQUENCE_LENGTH] == 50.0 and ctl._spec_now() == SPEC  # no prompt: 0 tokens

    spec = {**SPEC, "workload": {"prompts_per_step": 8, "prompt_tokens": 32}}  # no response length: no reference
    store.add_job(job_id="k", user="alice", spec=spec)
    k = JobController(job_id="k", store=store, metrics=Metrics(), planner=None, gamma=0.5,
                      thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                      send_order=lambda node, order: True)
    assert admission.Signal.SEQUENCE_LENGTH not in k.signals and k._spec_now() == spec
