"""A requeued anchor's agent registers again while a transition ordered to the members alone is open
(the daemon replanned onto them when the anchor went): the driver runs on the anchor, so its agent is
sent that order too, and the new driver takes it over. Another node that is no part of it is not."""

from __future__ import annotations

from pathlib import Path

from nereusd.controller import JobController
from nereusd.metrics import Metrics
from nereusd.planning import PlannerBinding
from nereusd.store import Store
from nereusd.wire import protocol
from nereusd.wire.logs import get_logger
from planner import admission

SPEC = {"model": "tiny-3m", "algo": "grpo", "device": "cpu", "gpus_per_node": 2,
        "workload": {"prompts_per_step": 8, "prompt_tokens": 32, "response_tokens": 64}}
DEVICES = [{"index": i, "kind": "cpu", "name": "cpu", "memory_bytes": 1 << 33} for i in range(2)]


def test_the_anchors_agent_gets_the_open_orders_it_is_no_part_of(tmp_path: Path) -> None:
    orders: list[tuple[str, protocol.TransitionOrder]] = []
    store = Store(tmp_path / "s.db")
    store.add_job(job_id="j", user="alice", spec=SPEC, slurm_job_id="100")  # 100: the anchor
    ctl = JobController(job_id="j", store=store, metrics=Metrics(), planner=PlannerBinding(), gamma=0.5,
                        thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                        send_order=lambda node, order: orders.append((node, order)) is None)
    store.register_node(job_id="j", node="m1", devices=DEVICES, slurm_job_id="101", host="h", incarnation="a")
    ctl.on_node_joined("m1", "new")
    ctl.step()
    ((node, order),) = orders  # ordered to the member alone
    assert node == "m1" and store.transition(order.transition_id)["state"] == "ordered"  # type: ignore[index]
    orders.clear()
    for name, slurm_job in (("a0", "100"), ("m2", "102")):
        store.register_node(job_id="j", node=name, devices=DEVICES, slurm_job_id=slurm_job, host="h", incarnation="b")
    assert ctl.resend_orders("m2") == 0 and not orders  # a member that is no part of it
    assert ctl.resend_orders("a0") == 1
    ((node, again),) = orders
    assert node == "a0" and again.transition_id == order.transition_id
    # the same plan; the pool map of now (rebuilt: the nodes registered since are in it)
    assert again.part["plan"] == order.part["plan"] and again.part["pool"]["m1"] == order.part["pool"]["m1"]
