"""The per-job controller in process, with the real planner and transition layer (tiny model, CPU
"GPUs"): initial placement, an ordered and completed transition, a drift decision, a node loss."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereusd.controller import JobController, plan_from_dict, plan_to_dict
from nereusd.metrics import Metrics
from nereusd.planning import PlannerBinding, job_spec
from nereusd.store import Store
from nereusd.wire import protocol
from nereusd.wire.logs import get_logger
from planner import admission
from planner.errors import SpecError

SPEC = {"model": "tiny-3m", "algo": "grpo", "device": "cpu", "gpus_per_node": 2,
        "workload": {"prompts_per_step": 8, "prompt_tokens": 32, "response_tokens": 64}}


def _controller(tmp_path: Path, orders: list[tuple[str, protocol.TransitionOrder]],
                spec: dict | None = None) -> tuple[JobController, Store]:
    store = Store(tmp_path / "s.db")
    store.add_job(job_id="j", user="alice", spec=spec or SPEC)
    ctl = JobController(job_id="j", store=store, metrics=Metrics(), planner=PlannerBinding(), gamma=0.5,
                        thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                        send_order=lambda node, order: orders.append((node, order)) is None)
    return ctl, store


def _join(ctl: JobController, store: Store, node: str, gpus: int = 2) -> None:
    devices = [{"index": i, "kind": "cpu", "name": "cpu", "memory_bytes": 1 << 33} for i in range(gpus)]
    store.register_node(job_id="j", node=node, devices=devices, slurm_job_id=None, host="h", incarnation=node)
    ctl.on_node_joined(node, "new")


def _ack_all(ctl: JobController, orders: list[tuple[str, protocol.TransitionOrder]],
             measured_s: float | dict[str, float]) -> None:
    for node, order in orders:
        took = measured_s[node] if isinstance(measured_s, dict) else measured_s
        ctl.on_transition_report(protocol.TransitionReport(job_id="j", node=node, transition_id=order.transition_id,
                                                           ok=True, measured_s=took, bytes_moved=0))
    orders.clear()


def test_plan_round_trips_through_storage() -> None:
    from planner.hardware import cluster_preset
    from planner.search import search

    plan = search(job_spec(SPEC), cluster_preset("cpu", 4, gpus_per_node=2), pool=[0, 1, 2, 3], version=3).plan
    assert plan_from_dict(plan_to_dict(plan)) == plan
    with pytest.raises(SpecError, match="unknown keys"):
        job_spec({**SPEC, "modle": "x"})


# Four 1-GPU nodes: on 4 GPUs the planner gives the reference GPUs 0-1 and the reward model GPUs 2-3
# (tiny-3m, 64 tokens), so a lost node leaves a copy of every model. On two 2-GPU nodes the same plan
# puts each frozen model on one node only, and a node loss is a checkpoint restore
# (tests/daemon/test_live_orders.py covers that path).
SPEC_1_GPU = {**SPEC, "gpus_per_node": 1}
NODES = ("n1", "n2", "n3", "n4")


def test_initial_placement_drift_and_node_loss_are_decided_and_recorded(tmp_path: Path) -> None:
    orders: list[tuple[str, protocol.TransitionOrder]] = []
    ctl, store = _controller(tmp_path, orders, SPEC_1_GPU)
    for node in NODES:
        _join(ctl, store, node, gpus=1)
    assert store.job("j")["state"] == "running"  # type: ignore[index]

    d1 = ctl.step()
    assert d1 is not None
    dec = store.decision(d1)
    assert dec is not None and dec["admitted"] and dec["rule"] == "urgent-feasibility"
    assert "initial placement on 4 GPUs" in str(dec["inputs"]["trigger"]["reasons"])
    assert {n for n, _ in orders} == set(NODES)  # every node gets its part of the DAG
    t1 = store.transitions("j")[0]
    assert t1["state"] == "ordered" and store.job("j")["state"] == "transitioning"  # type: ignore[index]
    assert all(o.part["plan"]["version"] == 1 for _, o in orders)
    assert ctl.step() is None  # nothing is decided while a transition is in flight
    assert [n for n, _ in orders] == list(NODES)
    _ack_all(ctl, orders, measured_s={"n1": 0.5, "n2": 0.2, "n3": 0.1, "n4": 0.3})  # the slowest reports first
    t1 = store.transitions("j")[0]
    # a transition takes as long as its slowest node, not the last to report
    assert t1["state"] == "done" and t1["measured_s"] == 0.5 and t1["parts_pending"] == []
    assert store.job("j")["plan_version"] == 1 and store.job("j")["state"] == "running"  # type: ignore[index]
    assert ctl.step() is None  # no trigger, no decision

    # sequence length drifts 32+64 -> 32+400 tokens: an opportunistic replan, judged by the payback rule.
    # No stage times: the step moves the length signal only, so the plans compared are the model's own
    # (a made-up stage time would refit the efficiencies, and which plan wins would ride on the fit's
    # prior pull; calibration has its tests: test_binding_calibrates_predictions_towards_measured_stage_times)
    ctl.on_measurement(protocol.Measurement(job_id="j", node="n1", step=5, plan_version=1, step_latency_s=0.4,
                                            response_tokens=400))
    assert store.measurements("j")[-1]["predicted_step_s"] is not None
    d2 = ctl.step()
    assert d2 is not None
    dec2 = store.decision(d2)
    assert dec2 is not None and dec2["trigger"] == "opportunistic" and not dec2["urgent"]
    # the drift finds a faster plan whose transition does not pay back within gamma * H_x steps: the
    # payback rule refuses it, and the record carries the arithmetic it was refused on
    assert dec2["rule"] == "payback" and not dec2["admitted"], dec2
    assert dec2["delta_l_s"] > 0 and dec2["l_tran_s"] > 0 and dec2["h_x"] >= 1
    assert dec2["l_tran_s"] / dec2["delta_l_s"] > 0.5 * dec2["h_x"]  # gamma = 0.5 in _controller
    assert not orders and store.job("j")["plan_version"] == 1  # type: ignore[index]  # nothing moves

    # a node is lost: urgent replan onto what is left, admitted on feasibility alone
    store.set_node_state("j", "n4", "lost", "test")
    ctl.on_node_lost("n4", "test")
    d3 = ctl.step()
    assert d3 is not None
    dec3 = store.decision(d3)
    assert dec3 is not None and dec3["urgent"] and dec3["admitted"] and dec3["rule"] == "urgent-feasibility"
    assert "GPU pool changed: 4 -> 3 GPUs" in str(dec3["inputs"]["trigger"]["reasons"])
    assert {n for n, _ in orders} == {"n1", "n2", "n3"}  # only the survivors are ordered
    last = store.transitions("j", detail=True)[-1]
    assert last["dag"]["lost_units"] or last["dag"]["nodes"]  # the DAG rebuilds from intact units
    _ack_all(ctl, orders, measured_s=0.2)
    plan = plan_from_dict(store.plan("j")["plan"])  # type: ignore[index]
    assert plan.gpus <= {0, 1, 2}
    assert [d["id"] for d in store.decisions("j")] == [d1, d2, d3]

    # a restarted daemon's controller resumes the monitor state (H_x, references) and the plan
    again, _ = JobController(job_id="j", store=store, metrics=Metrics(), planner=PlannerBinding(), gamma=0.5,
                             thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                             send_order=lambda node, order: True), None
    assert again.trigger_state == ctl.trigger_state and again.trigger_state is not None
    assert again.trigger_state.h(admission.Signal.SEQUENCE_LENGTH) == ctl.trigger_state.h(  # type: ignore[union-attr]
        admission.Signal.SEQUENCE_LENGTH)
    assert again.signals == ctl.signals and again.last_step == 5 and again.plan == ctl.plan
    assert again.step() is None and again.prediction is not None  # same pool, no drift: nothing to decide
    assert len(store.decisions("j")) == 3


def test_a_restarted_controller_rebuilds_an_open_order_once_for_all_its_nodes(tmp_path: Path) -> None:
    """After a daemon restart the orders of an open transition are rebuilt from the store when the nodes'
    agents register again: one DAG build for the transition, every node's part equal to the original."""
    orders: list[tuple[str, protocol.TransitionOrder]] = []
    ctl, store = _controller(tmp_path, orders)
    _join(ctl, store, "n1")
    _join(ctl, store, "n2")
    ctl.step()
    sent = dict(orders)
    assert set(sent) == {"n1", "n2"}

    builds: list[int] = []

    class Counting(PlannerBinding):
        def transition(self, *a, **k):  # type: ignore[no-untyped-def]
            builds.append(1)
            return super().transition(*a, **k)

    resent: list[tuple[str, protocol.TransitionOrder]] = []
    again = JobController(job_id="j", store=store, metrics=Metrics(), planner=Counting(), gamma=0.5,
                          thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                          send_order=lambda node, order: resent.append((node, order)) is None)
    assert again.resend_orders("n1") == 1 and again.resend_orders("n2") == 1
    assert len(builds) == 1
    for node, order in resent:
        assert order.transition_id == sent[node].transition_id and order.part == sent[node].part


def test_a_transition_ends_in_one_commit_with_the_plan_it_commits(tmp_path: Path) -> None:
    """A daemon that dies between the transition's row and the plan's (here: the plan commit raises, as a
    kill -9 there would stop it) leaves neither: the transition is still ordered, the job still on v0
    and transitioning, so a restarted daemon re-sends the order (the crash suite once found a done
    transition under a job stuck transitioning on v0)."""
    orders: list[tuple[str, protocol.TransitionOrder]] = []
    ctl, store = _controller(tmp_path, orders)
    _join(ctl, store, "n1")
    ctl.step()
    (node, order), = orders

    def dies(*a: object, **k: object) -> None:
        raise RuntimeError("killed here")

    store.commit_plan_version = dies  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="killed here"):
        ctl.on_transition_report(protocol.TransitionReport(job_id="j", node=node, transition_id=order.transition_id,
                                                           ok=True, measured_s=0.1))
    again = Store(tmp_path / "s.db")  # what a restarted daemon reads
    assert again.transition(order.transition_id)["state"] == "ordered"  # type: ignore[index]
    # the last part is rolled back with the end, so it stays pending and its order is re-sent (the crash
    # suite once left a transition ordered with every part done: nothing would ever finish it)
    t = again.transition(order.transition_id)
    assert t is not None and (t["parts_pending"], t["measured_s"]) == (["n1"], None)
    job = again.job("j")
    assert job is not None and job["plan_version"] == 0 and job["state"] == "transitioning"


def test_failed_part_fails_the_transition_and_keeps_the_old_plan(tmp_path: Path) -> None:
    orders: list[tuple[str, protocol.TransitionOrder]] = []
    ctl, store = _controller(tmp_path, orders)
    _join(ctl, store, "n1")
    ctl.step()
    (node, order), = orders
    ctl.on_transition_report(protocol.TransitionReport(job_id="j", node=node, transition_id=order.transition_id,
                                                       ok=False, measured_s=0.1, error="worker 0 died"))
    t = store.transition(order.transition_id)
    assert t is not None and t["state"] == "failed"
    assert "worker 0 died" in store.history("transition", str(t["id"]))[-1]["reason"]
    assert store.job("j")["plan_version"] == 0 and store.job("j")["state"] == "running"  # type: ignore[index]


def test_binding_calibrates_predictions_towards_measured_stage_times() -> None:
    """Agents report stage times 1.8x the prior prediction: after a few steps the binding's prediction of
    the running plan lands within 5% of what was measured (it learned efficiencies, not a constant)."""
    from planner.hardware import cluster_preset
    from planner.search import search

    binding = PlannerBinding()
    pool = frozenset(range(4))
    plan = search(job_spec(SPEC), cluster_preset("cpu", 4, gpus_per_node=2), pool=sorted(pool)).plan
    prior = binding.predict(SPEC, pool, plan)
    assert prior is not None
    measured = {name: 1.8 * t for name, t in prior.stage_seconds.items()}
    for step in range(8):
        binding.calibrate(SPEC, protocol.Measurement(job_id="j", node="n1", step=step, plan_version=plan.version,
                                                               step_latency_s=1.8 * prior.step_latency_s,
                                                               stage_times_s=measured),
                          plan)
    fitted = binding.predict(SPEC, pool, plan)
    assert fitted is not None
    assert fitted.step_latency_s == pytest.approx(1.8 * prior.step_latency_s, rel=0.05)


def test_an_order_is_stored_before_it_leaves_and_a_planned_leftover_is_cancelled(tmp_path: Path) -> None:
    seen: list[tuple[str, str]] = []
    store = Store(tmp_path / "s.db")
    store.add_job(job_id="j", user="alice", spec=SPEC)

    def send(node: str, order: protocol.TransitionOrder) -> bool:  # what a daemon killed right now leaves
        row = store.transition(order.transition_id)
        seen.append((row["state"], store.job("j")["state"]))  # type: ignore[index]
        return True

    ctl = JobController(job_id="j", store=store, metrics=Metrics(), planner=PlannerBinding(), gamma=0.5,
                        thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"), send_order=send)
    _join(ctl, store, "n1")
    assert ctl.step() is not None
    assert seen == [("ordered", "transitioning")]
    # a transition an older daemon stored but never ordered is cancelled by the next controller
    tid = store.add_transition(job_id="j", decision_id=None, from_version=1, to_version=9, dag={}, bytes_moved=0,
                               predicted_s=0.0, parts=["n1"])
    JobController(job_id="j", store=store, metrics=Metrics(), planner=PlannerBinding(), gamma=0.5,
                  thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"), send_order=send)
    assert store.transition(tid)["state"] == "cancelled"  # type: ignore[index]


def test_a_transition_left_with_every_part_done_is_finished_by_the_next_controller(tmp_path: Path) -> None:
    orders: list[tuple[str, protocol.TransitionOrder]] = []
    ctl, store = _controller(tmp_path, orders)
    _join(ctl, store, "n1")
    ctl.step()
    (_, order), = orders
    # what the controller of before left when killed between the last part and the end
    store.set_transition_state(order.transition_id, "ordered", "n1 done", measured_s=0.2, parts_pending=[])
    again = JobController(job_id="j", store=store, metrics=Metrics(), planner=PlannerBinding(), gamma=0.5,
                          thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                          send_order=lambda node, order: True)
    t = store.transition(order.transition_id)
    assert t is not None and t["state"] == "done" and t["measured_s"] == 0.2
    job = store.job("j")
    assert job is not None and job["plan_version"] == order.to_version and job["state"] == "running"
    assert again.plan is not None and again.plan.version == order.to_version
    # one never reported stays open for its agent (it is re-sent on registration)
    assert [x["state"] for x in store.transitions("j")] == ["done"]
