"""The controller's bookkeeping around a decision, field by field: a measurement's row, metric and
sequence-length signal; calibration only of the running plan, and its skips logged; reports of stale
or finished transitions ignored and logged; the monitor's thresholds and urgent reasons merged with a
drift. Found by mutation testing (tests/mutate.py --module nereusd/controller.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog

from nereusd.controller import JobController
from nereusd.metrics import Metrics
from nereusd.planning import PlannerBinding
from nereusd.store import Store
from nereusd.wire import protocol
from nereusd.wire.logs import get_logger
from planner import admission
from planner.errors import SpecError

SPEC = {"model": "tiny-3m", "algo": "grpo", "device": "cpu", "gpus_per_node": 2,
        "workload": {"prompts_per_step": 8, "prompt_tokens": 32, "response_tokens": 64}}
SEQ = admission.Signal.SEQUENCE_LENGTH


class Recording(PlannerBinding):
    """The real planner binding, counting what the controller asks of it."""

    def __init__(self, fail_calibration: bool = False) -> None:
        super().__init__()
        self.calibrated: list[int] = []
        self.predicted = 0
        self.fail_calibration = fail_calibration

    def calibrate(self, job: dict[str, Any], measurement: protocol.Measurement, plan: Any) -> None:
        self.calibrated.append(measurement.step)
        if self.fail_calibration:
            raise SpecError("measurement", "stage times do not match the plan")
        super().calibrate(job, measurement, plan)

    def predict(self, job: dict[str, Any], pool: frozenset[int], plan: Any) -> Any:
        self.predicted += 1
        return super().predict(job, pool, plan)


def _running(tmp_path: Path, planner: PlannerBinding | None = None,
             thresholds: dict[admission.Signal, float] | None = None) -> tuple[JobController, Store, list[Any]]:
    """A controller with two 2-GPU nodes whose initial placement is done (plan v1 running)."""
    orders: list[Any] = []
    store = Store(tmp_path / "s.db")
    store.add_job(job_id="j", user="alice", spec=SPEC)

    def send(node: str, order: Any) -> bool:
        orders.append((node, order))
        return True

    ctl = JobController(job_id="j", store=store, metrics=Metrics(), planner=planner or PlannerBinding(), gamma=0.5,
                        thresholds=thresholds or dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                        send_order=send)
    for node in ("n1", "n2"):
        devices = [{"index": i, "kind": "cpu", "name": "cpu", "memory_bytes": 1 << 33} for i in range(2)]
        store.register_node(job_id="j", node=node, devices=devices, slurm_job_id=None, host="h", incarnation=node)
        ctl.on_node_joined(node, "new")
    assert ctl.step() is not None
    _ack(ctl, orders, 0.3)
    assert store.job("j")["plan_version"] == 1  # type: ignore[index]
    return ctl, store, orders


def _ack(ctl: JobController, orders: list[Any], measured_s: float) -> None:
    for node, order in orders:
        ctl.on_transition_report(protocol.TransitionReport(job_id="j", node=node, transition_id=order.transition_id,
                                                           ok=True, measured_s=measured_s, bytes_moved=0))
    orders.clear()


def _measure(ctl: JobController, step: int, plan_version: int = 1, tokens: float | None = 80.0) -> None:
    ctl.on_measurement(protocol.Measurement(job_id="j", node="n1", step=step, plan_version=plan_version,
                                            step_latency_s=0.25, stage_times_s={"actor-gen": 0.1},
                                            peak_memory_bytes={"0": 123}, response_tokens=tokens))


def test_a_measurement_is_stored_whole_and_sets_the_signal_and_metric(tmp_path: Path) -> None:
    ctl, store, _ = _running(tmp_path)
    _measure(ctl, 3)
    row = store.measurements("j")[-1]
    assert (row["step"], row["plan_version"], row["step_latency_s"], row["response_tokens"]) == (3, 1, 0.25, 80.0)
    assert row["stage_times"] == {"actor-gen": 0.1} and row["peak_memory"] == {"0": 123}
    assert row["predicted_step_s"] == ctl.prediction.step_latency_s  # type: ignore[union-attr]
    assert ctl.signals[SEQ] == 32 + 80.0  # prompt + response tokens
    assert ctl.metrics.step_latency.labels("j", "measured")._value.get() == 0.25
    _measure(ctl, 4, plan_version=7)  # not the running plan's: no prediction to compare with
    assert store.measurements("j")[-1]["predicted_step_s"] is None


def test_only_the_running_plans_measurements_calibrate_and_each_step_repredicts(tmp_path: Path) -> None:
    planner = Recording()
    ctl, _, _ = _running(tmp_path, planner)
    _measure(ctl, 3)
    _measure(ctl, 4, plan_version=7)
    assert planner.calibrated == [3]
    first = ctl.current_prediction()
    assert first is not None and first[1] == 3
    _measure(ctl, 4)  # one step later (REPREDICT_EVERY_STEPS = 1): predicted again after step 4
    assert ctl.current_prediction()[1] == 4  # type: ignore[index]


def test_a_calibration_that_fails_is_logged_and_skipped(tmp_path: Path) -> None:
    ctl, _, _ = _running(tmp_path, Recording(fail_calibration=True))
    with structlog.testing.capture_logs() as logs:
        _measure(ctl, 3)
    assert [(e["log_level"], e["error"]) for e in logs if e["event"] == "calibration-skipped"] == [
        ("warning", "measurement: stage times do not match the plan")]
    assert ctl.current_prediction() is None  # nothing re-predicted from a calibration that did not happen


def test_reports_of_unknown_or_finished_transitions_are_ignored_and_logged(tmp_path: Path) -> None:
    ctl, store, _ = _running(tmp_path)
    done = store.transitions("j")[-1]
    assert done["state"] == "done"
    with structlog.testing.capture_logs() as logs:
        for tid in (done["id"], 999):
            ctl.on_transition_report(protocol.TransitionReport(job_id="j", node="n1", transition_id=tid, ok=False,
                                                               measured_s=9.0, bytes_moved=0, error="late"))
    stale = [e for e in logs if e["event"] == "stale-transition-report"]
    assert [(e["transition"], e["node"]) for e in stale] == [(done["id"], "n1"), (999, "n1")]
    assert store.transitions("j")[-1]["state"] == "done" and ctl.urgent_reasons == []  # not turned into a failure


def test_each_part_done_is_recorded_by_node(tmp_path: Path) -> None:
    ctl, store, orders = _running(tmp_path)
    devices = [{"index": i, "kind": "cpu", "name": "cpu", "memory_bytes": 1 << 33} for i in range(2)]
    store.register_node(job_id="j", node="n3", devices=devices, slurm_job_id=None, host="h", incarnation="n3")
    ctl.on_node_joined("n3", "new")  # 4 -> 6 GPUs: one transition, a part for each node
    assert ctl.step() is not None and sorted(n for n, _ in orders) == ["n1", "n2", "n3"]
    for i, (node, order) in enumerate(orders):
        ctl.on_transition_report(protocol.TransitionReport(job_id="j", node=node, transition_id=order.transition_id,
                                                           ok=True, measured_s=0.1 * (i + 1), bytes_moved=0))
        t = store.transition(order.transition_id)
        assert t is not None and sorted(t["parts_pending"]) == sorted(n for n, _ in orders[i + 1:])
        assert t["state"] == ("done" if i == 2 else "ordered")
    assert t["measured_s"] == pytest.approx(0.3)  # the slowest part


def test_the_monitor_uses_the_controllers_thresholds(tmp_path: Path) -> None:
    ctl, store, _ = _running(tmp_path, thresholds={SEQ: 0.02})
    _measure(ctl, 3, tokens=64.0)  # the reference: 32 + 64
    assert ctl.step() is None
    _measure(ctl, 4, tokens=68.0)  # 4% longer: over 2%, far under the default 30%
    did = ctl.step()
    assert did is not None and store.decision(did)["trigger"] == "opportunistic"  # type: ignore[index]


def test_an_urgent_reason_and_a_drift_make_one_urgent_trigger_with_both_reasons(tmp_path: Path) -> None:
    ctl, store, _ = _running(tmp_path)
    _measure(ctl, 3, tokens=64.0)
    assert ctl.step() is None
    ctl.urgent_reasons.append("transition 9 failed: test")
    _measure(ctl, 4, tokens=400.0)
    did = ctl.step()
    assert did is not None
    dec = store.decision(did)
    assert dec is not None and dec["urgent"] and dec["trigger"] == "urgent"
    reasons = dec["inputs"]["trigger"]["reasons"]
    assert reasons[0] == "transition 9 failed: test" and reasons[1].startswith("sequence_length drifted")
    assert dec["inputs"]["trigger"]["step"] == 4 and ctl.urgent_reasons == []


class Observing(Recording):
    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.observed: list[Any] = []
        self.fail = fail

    def observe_transition(self, job: dict[str, Any], transition: dict[str, Any]) -> None:
        self.observed.append(transition.get("id"))
        if self.fail:
            raise SpecError("transition", "no measured time")


def test_transition_calibration_skips_restores_and_logs_its_failures(tmp_path: Path) -> None:
    planner = Observing(fail=True)
    with structlog.testing.capture_logs() as logs:
        ctl, store, _ = _running(tmp_path, planner)
    first = store.transitions("j")[-1]["id"]
    assert planner.observed == [first]  # the initial placement's transition was observed (and failed)
    skipped = [e for e in logs if e["event"] == "transition-calibration-skipped"]
    assert [(e["transition"], e["error"]) for e in skipped] == [(first, "transition: no measured time")]
    ctl._observe_transition({"id": 77, "dag": {"kind": "restore"}})  # a checkpoint load: no DAG ran
    ctl._observe_transition({"id": 78, "dag": None})
    assert planner.observed == [first, 78]


def test_a_plan_on_gpus_outside_the_pool_is_not_predicted(tmp_path: Path) -> None:
    planner = Recording()
    ctl, _, _ = _running(tmp_path, planner)
    plan = ctl.plan
    assert plan is not None
    before = planner.predicted
    assert ctl._predict(plan) is not None and planner.predicted == before + 1
    ctl.pool = frozenset(sorted(plan.gpus)[1:])  # one of its GPUs is gone
    assert ctl._predict(plan) is None and planner.predicted == before + 1  # not even asked


class Unpredictable(Recording):
    def predict(self, job: dict[str, Any], pool: frozenset[int], plan: Any) -> Any:
        self.predicted += 1
        return None  # the committed plan no longer fits the model of today (say)


def test_a_restarted_controller_predicts_its_committed_plan_once(tmp_path: Path) -> None:
    ctl, store, _ = _running(tmp_path)
    planner = Unpredictable()
    again = JobController(job_id="j", store=store, metrics=Metrics(), planner=planner, gamma=0.5,
                          thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                          send_order=lambda node, order: True)
    assert again.plan == ctl.plan and again.prediction is None
    assert again.step() is None and again.step() is None
    assert planner.predicted == 1  # once after the restart, not on every pass


def test_a_decision_is_stored_counted_and_logged_with_its_versions_and_time(tmp_path: Path) -> None:
    with structlog.testing.capture_logs() as logs:
        ctl, store, _ = _running(tmp_path)
        _measure(ctl, 3, tokens=64.0)
        _measure(ctl, 4, tokens=400.0)  # a drift: a second decision, from v1
        second = ctl.step()
    assert second is not None
    first_row, second_row = store.decisions("j")
    assert (first_row["from_version"], first_row["to_version"]) == (None, 1)  # the initial placement
    assert (second_row["from_version"], second_row["to_version"]) == (1, 2)  # a candidate, admitted or not
    for row in (first_row, second_row):
        assert 0 < row["decision_ms"] < 60_000  # milliseconds of real planning, not seconds or microseconds
    logged = [e for e in logs if e["event"] == "decision"]
    assert [(e["id"], e["trigger"], e["admitted"], e["rule"], e["reason"]) for e in logged] == [
        (r["id"], r["trigger"], bool(r["admitted"]), r["rule"], r["reason"]) for r in (first_row, second_row)]
    assert all(e["decision_ms"] == round(r["decision_ms"], 3) for e, r in zip(logged, (first_row, second_row)))
    admitted = sum(bool(r["admitted"]) for r in (first_row, second_row))
    assert ctl.metrics.decisions.labels("j", "true")._value.get() == admitted
    assert ctl.metrics.decisions.labels("j", "false")._value.get() == 2 - admitted
    assert store.plan("j", 1)["prediction"]["step_latency_s"] > 0  # type: ignore[index]
    assert not ctl.memory_violation


def test_without_a_planner_the_decision_says_so(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    store.add_job(job_id="j", user="alice", spec=SPEC)
    ctl = JobController(job_id="j", store=store, metrics=Metrics(), planner=None, gamma=0.5,
                        thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                        send_order=lambda node, order: True)
    devices = [{"index": i, "kind": "cpu", "name": "cpu", "memory_bytes": 1 << 33} for i in range(2)]
    store.register_node(job_id="j", node="n1", devices=devices, slurm_job_id=None, host="h", incarnation="n1")
    ctl.on_node_joined("n1", "new")
    did = ctl.step()
    assert did is not None
    dec = store.decision(did)
    assert dec is not None and not dec["admitted"] and dec["rule"] == "checkpoint-restart"
    assert "(no planner is bound to the daemon (planner.search missing))" in dec["reason"]


def test_a_second_report_of_a_step_is_not_repredicted_but_a_new_plans_first_is(tmp_path: Path) -> None:
    planner = Recording()
    ctl, store, orders = _running(tmp_path, planner)
    _measure(ctl, 5)
    first, predicted = ctl.current_prediction(), planner.predicted
    assert first is not None and first[1] == 5
    _measure(ctl, 5)  # the same step from another node: calibrated, not predicted again
    assert planner.calibrated == [5, 5] and planner.predicted == predicted and ctl.current_prediction() == first
    _measure(ctl, 4)  # an older step, late: neither
    assert planner.predicted == predicted and ctl.current_prediction() == first

    assert ctl.drain(["n2"], "shrink") == []  # the next pass orders v2, on n1 alone
    assert ctl.step() is not None and orders
    _ack(ctl, orders, 0.3)
    assert ctl.plan is not None and ctl.plan.version == 2
    assert ctl.current_prediction() is None  # v1's re-prediction is not v2's
    _measure(ctl, 5, plan_version=2)  # v2's first measurement, at a step already seen under v1
    now = ctl.current_prediction()
    assert now is not None and now[1] == 5 and now[0] != first[0]


def test_orders_leave_before_the_dag_records_body_which_follows_them(tmp_path: Path) -> None:
    """The transition row an order is sent under holds the record's head (cost, L_tran, counts); the
    unit-level body (primitives, edges, order, units) is added once every order is out."""
    ctl, store, orders = _running(tmp_path)
    seen: list[dict[str, Any]] = []
    send = ctl.send_order

    def watching(node: str, order: Any) -> bool:
        seen.append(store.transition(order.transition_id, detail=True)["dag"])  # type: ignore[index]
        return send(node, order)

    ctl.send_order = watching  # type: ignore[method-assign]
    devices = [{"index": i, "kind": "cpu", "name": "cpu", "memory_bytes": 1 << 33} for i in range(2)]
    store.register_node(job_id="j", node="n3", devices=devices, slurm_job_id=None, host="h", incarnation="n3")
    ctl.on_node_joined("n3", "new")
    assert ctl.step() is not None and len(seen) == 3
    assert all("nodes" not in dag and {"cost", "l_tran", "primitives", "num_nodes"} <= set(dag) for dag in seen)
    stored = store.transition(orders[0][1].transition_id, detail=True)["dag"]  # type: ignore[index]
    assert len(stored["nodes"]) == stored["num_nodes"] == sum(stored["primitives"].values())
    assert {k: stored[k] for k in seen[0]} == seen[0]  # the head as it was when the orders left
