"""One path for every way a member job leaves: its end (cancelled, time limit, failed) releases its nodes at
once from the source's event, as a node DOWN or a preemption does; only the anchor's end ends the job."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereusd.allocation import AllocationEvent, EventKind, NodeAllocation
from nereusd.controller import JobController
from nereusd.metrics import Metrics
from nereusd.store import Store
from nereusd.wire.logs import get_logger
from planner import admission

SPEC = {"model": "tiny-3m", "algo": "grpo", "device": "cpu", "gpus_per_node": 2,
        "workload": {"prompts_per_step": 8, "prompt_tokens": 32, "response_tokens": 64}}
DEVICES = [{"index": i, "kind": "gpu", "name": "gpu", "memory_bytes": 0} for i in range(2)]


def _job(tmp_path: Path) -> tuple[Store, JobController]:
    store = Store(tmp_path / "s.db")
    store.add_job(job_id="j", user="alice", spec=SPEC, slurm_job_id="100")
    ctl = JobController(job_id="j", store=store, metrics=Metrics(), planner=None, gamma=0.5,
                        thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                        send_order=lambda node, order: True, release_nodes=lambda nodes: None)
    for node, holder in (("n1", "100"), ("n2", "101"), ("n3", "102")):
        store.register_node(job_id="j", node=node, devices=DEVICES, slurm_job_id=holder, host="h", incarnation=node)
        ctl.on_node_joined(node, "new")
    return store, ctl


def _event(kind: EventKind, holder: str, node: str) -> AllocationEvent:
    return AllocationEvent(kind=kind, job_id="j", slurm_job_id=holder, reason=f"Slurm job {holder} {kind.value}",
                           nodes=(NodeAllocation(node=node, gpu_indices=(0, 1), holder_job_id=holder),), time_s=1.0)


@pytest.mark.parametrize("kind", [EventKind.CANCELLED, EventKind.TIME_LIMIT, EventKind.FAILED, EventKind.NODE_DOWN,
                                  EventKind.PREEMPTED])
def test_a_members_end_releases_its_node_at_once_and_the_job_goes_on(tmp_path: Path, kind: EventKind) -> None:
    store, ctl = _job(tmp_path)
    ctl.on_allocation(_event(kind, "101", "n2"))
    states = {n["node"]: n["state"] for n in store.nodes("j")}
    assert states == {"n1": "alive", "n2": "released", "n3": "alive"}  # no heartbeat time-out needed
    assert store.job("j")["state"] == "running"


def test_the_anchors_end_ends_the_job(tmp_path: Path) -> None:
    store, ctl = _job(tmp_path)
    ctl.on_allocation(_event(EventKind.CANCELLED, "100", "n1"))
    assert store.job("j")["state"] == "cancelled"
