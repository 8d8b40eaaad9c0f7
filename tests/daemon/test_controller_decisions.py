"""The controller's decisions, field by field, in process (real Store, real PlannerBinding, tiny model, CPU
"GPUs"; the job of tests/daemon/test_controller_drain.py): the checkpoint/restart record of a plan that
no transition reaches, the restore ordered in its stead, the GPUs a drain finds in use while a
transition is ordered, ... Found by mutation testing (tests/mutate.py --module nereusd/controller.py,
the decision functions): these records were checked by a word or two, or only by daemon tests."""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from nereusd.controller import JobController, plan_to_dict
from nereusd.metrics import Metrics
from nereusd.planning import PlannerBinding
from nereusd.store import Store
from nereusd.wire import protocol
from nereusd.wire.logs import get_logger
from planner import admission
from planner.errors import InfeasibleError, SpecError

from .test_controller_drain import SPEC, Job, _open_transition
from .test_controller_records import Recording

LOST = "the last copy of some state was lost; the checkpoint path is needed"  # transitions' LastCopyLostError
REWARD_LOST = "reward-inf: no intact replica survives (lost GPUs [2, 3]) and no other model-stage holds its state"


@pytest.fixture
def ticks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The controller's perf_counter (its only use is a decision's time) steps a quarter second a call:
    every decision takes 250 ms exactly."""
    now = iter(10.0 + 0.25 * i for i in range(10_000))
    shim = types.SimpleNamespace(perf_counter=lambda: next(now), time=time.time, monotonic=time.monotonic)
    monkeypatch.setattr("nereusd.controller.time", shim)
    yield


def _lose_n2(job: Job) -> None:
    """n2 holds the reward model's every copy in plan v1 (GPUs 2-3): losing it leaves no transition."""
    job.orders.clear()
    job.store.set_node_state("j", "n2", "lost", "no heartbeat")
    job.ctl.on_node_lost("n2", "no heartbeat")


def _row(d: dict[str, Any] | None) -> dict[str, Any]:
    assert d is not None
    return {k: v for k, v in d.items() if k not in ("id", "at")}


def _controller(store: Store, planner: PlannerBinding | None, send: Any = None) -> JobController:
    """A controller of job j as a (re)started daemon builds it, with no clock of its own."""
    return JobController(job_id="j", store=store, metrics=Metrics(), planner=planner, gamma=0.5,
                         thresholds=dict(admission.DEFAULT_THRESHOLDS), log=get_logger("test"),
                         send_order=send or (lambda node, order: True))


TRIGGER = {"kind": "urgent", "step": 0, "reasons": ["GPU pool changed: 4 -> 2 GPUs (-2 +0)"], "signals": [],
           "h_steps": 1.0}  # no signal crossed: H_x is one step


def _passed_over_on_n1() -> list[dict[str, Any]]:
    """The one plan tried: the best on n1's GPUs 0-1 (the planner asked again, on its own)."""
    best = PlannerBinding().search(SPEC, frozenset({0, 1}), 2)
    return [{"rank": 1, "why": "transition-infeasible", "reason": LOST,
             "predicted_step_s": best.prediction.step_latency_s, "transition_s": None, "note": ""}]


def test_a_plan_no_transition_reaches_is_recorded_as_a_checkpoint_restart_field_by_field(
        tmp_path: Path, ticks: None) -> None:
    job = Job(tmp_path, PlannerBinding())
    _lose_n2(job)
    with structlog.testing.capture_logs() as logs:
        did = job.ctl.step()
    assert did is not None
    reason = f"no transition can reach the new plan: fall back to checkpoint/restart ({LOST})"
    assert _row(job.store.decision(did)) == {
        "job_id": "j", "trigger": "urgent", "urgent": True, "admitted": False, "rule": "checkpoint-restart",
        "reason": reason, "from_version": 1, "to_version": None, "delta_l_s": None, "l_tran_s": None, "h_x": 1.0,
        "gamma": 0.5, "decision_ms": 250.0,
        "inputs": {"trigger": TRIGGER, "infeasible_reasons": [REWARD_LOST], "passed_over": _passed_over_on_n1()}}
    assert [e for e in logs if e["event"] == "decision"] == [
        {"event": "decision", "log_level": "warning", "role": "test", "job": "j", "id": did, "admitted": False,
         "rule": "checkpoint-restart", "reason": reason}]
    assert job.ctl.metrics.decisions.labels("j", "false")._value.get() == 1
    assert job.ctl.metrics.decisions.labels("j", "true")._value.get() == 1  # the initial placement
    assert job.orders == [] and job.store.max_plan_version("j") == 1  # nothing stored, nothing ordered
    assert job.store.job("j")["state"] == "running"  # type: ignore[index]


def test_a_plan_no_transition_reaches_is_ordered_as_a_restore_field_by_field(tmp_path: Path, ticks: None) -> None:
    planner = Recording()
    job = Job(tmp_path, planner)
    job.ctl.restore_by_order = True
    _lose_n2(job)
    with structlog.testing.capture_logs() as logs:
        did = job.ctl.step()
    assert did is not None
    best = PlannerBinding().search(SPEC, frozenset({0, 1}), 2)  # what the restore orders, asked again
    reason = f"no transition can reach the new plan ({LOST}): restore plan v2 from the job's latest checkpoint"
    assert _row(job.store.decision(did)) == {
        "job_id": "j", "trigger": "urgent", "urgent": True, "admitted": True, "rule": "checkpoint-restart",
        "reason": reason, "from_version": 1, "to_version": 2, "delta_l_s": None, "l_tran_s": None, "h_x": 1.0,
        "gamma": 0.5, "decision_ms": 250.0,
        "inputs": {"trigger": TRIGGER, "infeasible_reasons": [REWARD_LOST], "passed_over": _passed_over_on_n1()}}
    assert [e for e in logs if e["event"] == "decision"] == [
        {"event": "decision", "log_level": "warning", "role": "test", "job": "j", "id": did, "admitted": True,
         "rule": "checkpoint-restart", "reason": reason}]
    assert job.ctl.metrics.decisions.labels("j", "true")._value.get() == 2  # the placement and the restore
    assert job.ctl.metrics.decisions.labels("j", "false")._value.get() == 0

    stored = job.store.plan("j", 2)
    assert stored is not None and stored["plan"] == plan_to_dict(best.plan)
    assert stored["prediction"] == admission._plain(best.prediction)
    [t] = [t for t in job.store.transitions("j") if t["to_version"] == 2]
    assert {k: v for k, v in t.items() if k not in ("id", "created_at", "updated_at")} == {
        "job_id": "j", "decision_id": did, "state": "ordered", "from_version": 1, "to_version": 2,
        "dag": {"kind": "restore", "new_version": 2, "reasons": [REWARD_LOST]}, "bytes_moved": 0,
        "predicted_s": 0.0, "measured_s": None, "parts_pending": ["n1"]}
    # n1 alone is ordered: its part names the GPUs it loads the plan's units onto from the checkpoint
    assert job.orders == [("n1", protocol.TransitionOrder(
        job_id="j", transition_id=t["id"], from_version=1, to_version=2,
        part={"plan": plan_to_dict(best.plan), "gpus": [0, 1], "pool": {"n1": [0, 1]}, "gpus_per_node": 2,
              "draining": [], "incarnations": {"n1": "n1"}}))]

    predicted = planner.predicted
    job.ack(measured_s=2.5)
    assert job.store.transition(t["id"])["state"] == "done"  # type: ignore[index]
    assert job.ctl.plan == best.plan and job.ctl.prediction == best.prediction
    assert planner.predicted == predicted  # the restore's own prediction is kept, not predicted again
    assert job.ctl.metrics.transition_cost.labels("predicted")._sum.get() == 0.0  # placement and restore: none
    assert job.ctl.metrics.transition_bytes.labels("j")._value.get() == 0


class NoNextPlan(PlannerBinding):
    """The real binding, whose DAG build fails and whose next plans cannot be searched: a bare
    InfeasibleError (one line, no reasons, no plans passed over) reaches the controller."""

    def transition(self, *args: Any, **kwargs: Any) -> Any:
        if args[1] is None:  # the initial placement builds no DAG
            return super().transition(*args, **kwargs)
        raise InfeasibleError("no DAG reaches the plan", ("reward-inf: the old plan's copy is gone",))

    def alternatives(self, *args: Any) -> Any:
        raise InfeasibleError("the next plans could not be searched")


def test_a_bare_infeasible_error_is_recorded_as_its_message_with_no_plan_passed_over(
        tmp_path: Path, ticks: None) -> None:
    job = Job(tmp_path, NoNextPlan())
    job.ctl.restore_by_order = True
    _lose_n2(job)
    did = job.ctl.step()
    assert did is not None
    d = job.store.decision(did) or {}
    assert d["reason"] == ("no transition can reach the new plan (the next plans could not be searched): "
                           "restore plan v2 from the job's latest checkpoint")
    assert d["inputs"] == {"trigger": TRIGGER, "infeasible_reasons": ["the next plans could not be searched"],
                           "passed_over": []}
    [t] = [t for t in job.store.transitions("j") if t["to_version"] == 2]
    assert t["dag"] == {"kind": "restore", "new_version": 2, "reasons": ["the next plans could not be searched"]}

    (tmp_path / "b").mkdir()
    fallback = Job(tmp_path / "b", NoNextPlan())
    _lose_n2(fallback)
    d = fallback.store.decision(fallback.ctl.step()) or {}  # type: ignore[arg-type]
    assert d["reason"] == ("no transition can reach the new plan: fall back to checkpoint/restart "
                           "(the next plans could not be searched)")


def test_a_drain_counts_the_gpus_of_the_committed_plan_and_of_every_ordered_transitions_plan(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())  # plan v1 on n1 and n2 (GPUs 0-3)
    job.join("n3")  # GPUs 4-5
    job.join("n4")  # GPUs 6-7
    for version, gpus, state in ((2, {4, 5}, "ordered"), (3, {6, 7}, "planned")):
        plan = PlannerBinding().search(SPEC, frozenset(gpus), version).plan
        job.store.add_plan(job_id="j", version=version, plan=plan_to_dict(plan), prediction={})
        if state == "ordered":
            _open_transition(job.store, "j", ["n1", "n2", "n3", "n4"], to_version=version)
        else:  # stored, not ordered: no order has left, no node can have loaded it
            job.store.add_transition(job_id="j", decision_id=None, from_version=1, to_version=version, dag={},
                                     bytes_moved=0, predicted_s=0.0, parts=["n1", "n2", "n3", "n4"])
    # n1 is the committed plan's, n3 the ordered v2's: both drain first; n4 is only a planned plan's
    assert job.ctl.drain(["n1", "n3", "n4"], "shrink") == ["n4"]
    assert job.ctl.urgent_reasons == ["drain n1", "drain n3"]


def _restarted_without_monitor_state(tmp_path: Path, planner: PlannerBinding) -> Job:
    """Plan v1 committed, and a store whose controller state has no monitor state (as an older daemon's):
    the controller of a restarted daemon on it, at step 7."""
    job = Job(tmp_path, PlannerBinding())
    job.store.save_controller_state("j", {"trigger": None, "signals": {}, "last_step": 7, "draining": {}})
    return Job(tmp_path, planner, store=job.store)


def test_a_restart_without_monitor_state_keeps_the_plan_predicts_it_and_rearms(tmp_path: Path) -> None:
    again = _restarted_without_monitor_state(tmp_path, PlannerBinding())
    assert again.ctl.plan is not None and again.ctl.trigger_state is None
    assert again.ctl.step() is None  # no decision: the plan stays
    assert len(again.store.decisions("j")) == 1 and again.orders == []
    assert again.ctl.prediction == PlannerBinding().predict(SPEC, frozenset({0, 1, 2, 3}), again.ctl.plan)
    state = again.ctl.trigger_state
    assert state is not None and state.start_step == 7 and state.gpu_pool == frozenset({0, 1, 2, 3})
    assert (again.store.controller_state("j") or {})["trigger"] is not None  # re-armed, and saved


def test_a_drain_before_the_first_pass_of_a_restart_without_monitor_state_is_replanned(tmp_path: Path) -> None:
    again = _restarted_without_monitor_state(tmp_path, PlannerBinding())
    assert again.ctl.drain(["n2"], "shrink") == []
    did = again.ctl.step()
    assert did is not None
    d = again.store.decision(did) or {}
    assert d["urgent"] and d["admitted"] and (d["from_version"], d["to_version"]) == (1, 2)
    assert d["inputs"]["trigger"]["reasons"] == ["drain n2"] and d["inputs"]["trigger"]["step"] == 7
    assert sorted(n for n, _ in again.orders) == ["n1", "n2"]  # n2 sends its state away


class PoolRecording(PlannerBinding):
    def __init__(self) -> None:
        super().__init__()
        self.pools: list[frozenset[int]] = []

    def predict(self, job: dict[str, Any], pool: frozenset[int], plan: Any) -> Any:
        self.pools.append(pool)
        return super().predict(job, pool, plan)


def test_a_plan_is_predicted_on_the_controllers_pool(tmp_path: Path) -> None:
    planner = PoolRecording()
    job = Job(tmp_path, planner)
    job.join("n3")
    job.ctl._refresh_pool()
    assert job.ctl.plan is not None and job.ctl._predict(job.ctl.plan) is not None
    assert planner.pools[-1] == frozenset(range(6))


class AskedForAlternatives(PlannerBinding):
    """The real binding, recording what its next plans are asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[int, Any, str]] = []

    def alternatives(self, job: dict[str, Any], pool: frozenset[int], version: int, best: Any,
                     error: InfeasibleError | None) -> Any:
        self.asked.append((version, best, str(error).splitlines()[0]))
        return super().alternatives(job, pool, version, best, error)


def test_the_next_plans_are_asked_for_with_the_version_the_best_plan_and_its_dag_error(tmp_path: Path) -> None:
    planner = AskedForAlternatives()
    job = Job(tmp_path, planner)
    job.ctl.on_measurement(protocol.Measurement(job_id="j", node="n1", step=5, plan_version=1, step_latency_s=0.25,
                                                response_tokens=64))  # step 5, the length as specified
    before = job.ctl.trigger_state
    assert before is not None and before.start_step == 0
    _lose_n2(job)
    job.ctl.step()
    best = PlannerBinding().search(SPEC, frozenset({0, 1}), 2).plan
    assert planner.asked == [(2, best, LOST)]
    # an unbuildable replan resets the monitor like any other: the pool it was made for, the same history
    after = job.ctl.trigger_state
    assert after is not None and after.gpu_pool == frozenset({0, 1}) and after.start_step == 0
    assert after.thresholds == before.thresholds and after.references == before.references
    assert (job.store.controller_state("j") or {})["trigger"]["gpu_pool"] == [0, 1]


class NoAlternatives(PlannerBinding):
    alternatives = None  # a port without next plans


def test_without_next_plans_a_lost_last_copy_is_unbuildable_all_the_same(tmp_path: Path) -> None:
    job = Job(tmp_path, NoAlternatives())
    _lose_n2(job)
    d = job.store.decision(job.ctl.step()) or {}  # type: ignore[arg-type]
    assert d["rule"] == "checkpoint-restart" and not d["admitted"]
    assert [p["rank"] for p in d["inputs"]["passed_over"]] == [1]


class SpecRefused(PlannerBinding):
    def search(self, job: dict[str, Any], pool: frozenset[int], version: int) -> Any:
        raise SpecError("workload.prompt_tokens", "longer than the model's context")


def test_a_spec_the_planner_refuses_is_a_decision_not_to_move(tmp_path: Path) -> None:
    store_job = Job(tmp_path, PlannerBinding())
    job = Job(tmp_path, SpecRefused(), store=store_job.store)
    _lose_n2(job)
    d = job.store.decision(job.ctl.step()) or {}  # type: ignore[arg-type]
    assert (d["rule"], d["admitted"], d["to_version"]) == ("checkpoint-restart", False, None)
    assert d["reason"] == ("no plan fits in memory on the available GPUs: fall back to checkpoint/restart (the job "
                           "spec cannot be planned: workload.prompt_tokens: longer than the model's context)")


def test_a_transition_ends_with_its_last_parts_time_when_that_part_was_the_slowest(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())  # the placement: 0.1 s measured
    assert job.ctl.drain(["n2"], "shrink") == [] and job.ctl.step() is not None
    tid = job.orders[0][1].transition_id
    job.ack(("n1",), measured_s=0.1)
    job.ack(("n2",), measured_s=0.4)  # the last part, and the slowest
    t = job.store.transition(tid) or {}
    assert (t["state"], t["measured_s"]) == ("done", 0.4)
    assert job.store.history("transition", str(tid))[-1]["reason"] == "every part done"
    assert job.ctl.metrics.transition_cost.labels("measured")._sum.get() == pytest.approx(0.1 + 0.4)
    # and each ordered transition's predicted L_tran is observed as predicted (the placement's is 0 s)
    assert t["predicted_s"] > 0
    assert job.ctl.metrics.transition_cost.labels("predicted")._sum.get() == pytest.approx(t["predicted_s"])


class Observed(PlannerBinding):
    """The real binding, recording the transitions it is fed back."""

    def __init__(self) -> None:
        super().__init__()
        self.observed: list[int] = []

    def observe_transition(self, job: dict[str, Any], transition: dict[str, Any]) -> None:
        self.observed.append(transition["id"])
        super().observe_transition(job, transition)


def test_a_restarted_controller_replays_settles_and_cancels_only_its_own_jobs_transitions(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())  # transition 1 (the placement) is done
    store = job.store
    store.add_job(job_id="k", user="alice", spec=SPEC)  # another job's rows, each of a kind j's restart acts on
    k_planned = store.add_transition(job_id="k", decision_id=None, from_version=0, to_version=1, dag={},
                                     bytes_moved=0, predicted_s=0.0, parts=["m1"])
    k_settled = _open_transition(store, "k", ["m1"])
    store.set_transition_state(k_settled["id"], "ordered", "m1 done", measured_s=0.2, parts_pending=[])
    k_done = _open_transition(store, "k", ["m1"])
    store.set_transition_state(k_done["id"], "done", "test", measured_s=0.2)
    mine_planned = store.add_transition(job_id="j", decision_id=None, from_version=1, to_version=9, dag={},
                                        bytes_moved=0, predicted_s=0.0, parts=["n1"])
    half = _open_transition(store, "j", ["n1", "n2"])  # one part reported (it has a time), one pending
    store.set_transition_state(half["id"], "ordered", "n1 done", measured_s=0.3, parts_pending=["n2"])
    empty = _open_transition(store, "j", [])  # ordered to no node, nothing measured: its order times out
    settled = _open_transition(store, "j", ["n1"])  # every part reported, the end lost
    store.set_transition_state(settled["id"], "ordered", "n1 done", measured_s=0.2, parts_pending=[])

    planner = Observed()
    Job(tmp_path, planner, store=store)
    state = {t["id"]: t["state"] for t in store.transitions("j") + store.transitions("k")}
    assert state == {1: "done", k_planned: "planned", k_settled["id"]: "ordered", k_done["id"]: "done",
                     mine_planned: "cancelled", half["id"]: "ordered", empty["id"]: "ordered",
                     settled["id"]: "done"}
    assert store.history("transition", str(mine_planned))[-1]["reason"] == "the daemon restarted before it was ordered"
    assert store.history("transition", str(settled["id"]))[-1]["reason"] == \
        "every part done (finished after a restart)"
    assert planner.observed == [1, settled["id"]]  # its own done transition replayed, then the one settled


def test_a_restart_takes_the_draining_nodes_and_defaults_for_what_a_snapshot_lacks(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())
    job.store.save_controller_state("j", {"draining": {"n2": "alloc --shrink"}})
    again = Job(tmp_path, PlannerBinding(), store=job.store)
    assert again.ctl.draining == {"n2": "alloc --shrink"}
    assert again.ctl.last_step == 0 and again.ctl.trigger_state is None
    assert again.ctl.signals == {admission.Signal.SEQUENCE_LENGTH: 32.0 + 64.0}  # the length specified
    job.store.save_controller_state("j", {})
    bare = Job(tmp_path, PlannerBinding(), store=job.store)
    assert bare.ctl.draining == {} and bare.ctl.last_step == 0


@pytest.mark.parametrize("workload", [{"prompt_tokens": 32}, {"response_tokens": 64}, {}])
def test_without_both_lengths_the_job_has_no_length_signal(tmp_path: Path, workload: dict[str, int]) -> None:
    store = Store(tmp_path / "s.db")
    store.add_job(job_id="j", user="alice", spec={**SPEC, "workload": workload})
    assert Job(tmp_path, None, store=store).ctl.signals == {}


def test_a_daemon_with_no_planner_resends_an_open_order_with_the_pool_map_of_now(tmp_path: Path) -> None:
    """Found by mutation testing: the pool was refreshed only where a planner could rebuild the DAG, so
    such an order went out with an empty pool map and one GPU per node (the driver could map no worker)."""
    job = Job(tmp_path, PlannerBinding())
    assert job.ctl.drain(["n2"], "test") == [] and job.ctl.step() is not None
    sent = dict(job.orders)
    resent: list[tuple[str, protocol.TransitionOrder]] = []
    bare = _controller(job.store, None, send=lambda node, order: resent.append((node, order)) is None)
    assert bare.resend_orders("n1") == 1
    [(node, order)] = resent
    assert node == "n1" and order.part == {
        "plan": sent["n1"].part["plan"], "pool": {"n1": [0, 1], "n2": [2, 3]}, "gpus_per_node": 2,
        "draining": ["n2"], "incarnations": {"n1": "n1", "n2": "n2"}}  # all but the DAG's part


def test_a_controller_of_a_job_gone_from_the_store_starts_and_says_so_when_asked(tmp_path: Path) -> None:
    ghost = _controller(Store(tmp_path / "s.db"), None)  # no job "j" in this store
    assert ghost.plan is None and ghost.signals == {} and ghost.trigger_state is None
    with pytest.raises(SpecError, match="job 'j' vanished from the store"):
        ghost.step()


class TransitionsRecorded(Recording):
    """The real binding, recording what each DAG build is asked for (and, as Recording, the predictions)."""

    def __init__(self) -> None:
        super().__init__()
        self.builds: list[tuple[dict[str, Any], Any, frozenset[int]]] = []

    def transition(self, job: dict[str, Any], old: Any, new: Any, pool: frozenset[int], node_of_gpu: Any) -> Any:
        self.builds.append((job, old, pool))
        return super().transition(job, old, new, pool, node_of_gpu)


def test_an_admitted_decision_is_recorded_and_ordered_field_by_field(tmp_path: Path, ticks: None) -> None:
    planner = TransitionsRecorded()
    job = Job(tmp_path, planner)
    spec_now = {**SPEC, "workload": {**SPEC["workload"], "max_response_tokens": 64}}
    assert planner.builds == [(spec_now, None, frozenset({0, 1, 2, 3}))]  # the placement's, on every GPU
    placement = job.store.transitions("j")[0]
    assert placement["decision_id"] == job.store.decisions("j")[0]["id"]

    assert job.ctl.drain(["n2"], "shrink") == []
    did = job.ctl.step()
    assert did is not None
    [t] = [t for t in job.store.transitions("j") if t["to_version"] == 2]
    assert t["decision_id"] == did and t["predicted_s"] > 0
    # v1 uses n2's GPUs, out of the pool now: the running plan is infeasible, the best plan taken as it is
    assert {k: v for k, v in _row(job.store.decision(did)).items() if k != "inputs"} == {
        "job_id": "j", "trigger": "urgent", "urgent": True, "admitted": True, "rule": "urgent-feasibility",
        "reason": "running plan is infeasible; the best feasible plan is taken without a payback check",
        "from_version": 1, "to_version": 2, "delta_l_s": None, "l_tran_s": t["predicted_s"], "h_x": 1.0,
        "gamma": 0.5, "decision_ms": 250.0}
    assert job.ctl.metrics.decision_time._sum.get() == pytest.approx(0.25 + 0.25)  # the placement's and this

    predicted = planner.predicted
    job.ack()
    stored = job.store.plan("j", 2) or {}
    assert job.ctl.plan is not None and job.ctl.plan.version == 2
    assert admission._plain(job.ctl.prediction) == stored["prediction"]  # the candidate's, kept
    assert planner.predicted == predicted  # not predicted again once the transition is done


def test_a_monitor_state_changed_without_a_trigger_is_saved(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())
    snapshot = job.store.controller_state("j") or {}
    snapshot["trigger"]["references"] = {}  # a monitor that has not seen the length yet
    job.store.save_controller_state("j", snapshot)
    again = Job(tmp_path, PlannerBinding(), store=job.store)
    assert again.ctl.step() is None  # a first sighting sets the reference and fires nothing
    saved = job.store.controller_state("j") or {}
    assert saved["trigger"]["references"] == {"sequence_length": 96.0}


def test_a_restarted_controller_whose_pool_a_resent_order_refreshed_decides_without_settling(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())
    assert job.ctl.drain(["n2"], "shrink") == [] and job.ctl.step() is not None  # v1 -> v2 ordered
    again = Job(tmp_path, PlannerBinding(), store=job.store)  # a restarted daemon; its agents register again
    assert again.ctl.resend_orders("n1") == 1 and again.ctl.resend_orders("n2") == 1
    assert not again.ctl.pool_dirty  # the order's rebuild refreshed the pool
    again.ack()
    assert again.ctl.plan is not None and again.ctl.plan.version == 2
    again.ctl.urgent_reasons.append("transition 9 failed: test")
    did = again.ctl.step()  # the pool has not moved since the controller started: no settle to wait for
    assert did is not None and again.store.decision(did)["urgent"]  # type: ignore[index]


def test_a_job_whose_every_node_is_lost_still_gives_back_the_nodes_it_was_draining(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())
    assert job.ctl.drain(["n2"], "shrink") == []  # plan v1 uses it: it drains first
    for node in ("n1", "n2"):
        job.store.set_node_state("j", node, "lost", "no heartbeat")
        job.ctl.on_node_lost(node, "no heartbeat")
    assert job.store.job("j")["state"] == "lost"  # type: ignore[index]
    assert job.ctl.step() is None  # no GPU left to plan for, but n2 holds no GPU of the job any more
    assert job.released == [["n2"]]


def test_the_pool_settles_from_its_last_change_not_from_its_last_refresh(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())  # placed at t = 100
    job.ctl.pool_settle_s = 5.0
    job.now = 200.0
    job.join("n3")
    job.now = 202.0
    assert job.ctl.step() is None and job.ctl.pool_changed_at == 202.0  # 4 -> 6 GPUs: settling
    job.now = 204.0
    job.ctl.on_node_joined("n3", "registered again")  # a refresh that changes nothing
    assert job.ctl.step() is None and job.ctl.pool_changed_at == 202.0
    job.now = 207.5
    did = job.ctl.step()  # 5.5 s after the change
    assert did is not None
    assert job.store.decision(did)["inputs"]["trigger"]["reasons"] == ["GPU pool changed: 4 -> 6 GPUs (-0 +2)"]  # type: ignore[index]


def test_a_drain_whose_node_a_finished_transition_freed_is_released_and_not_replanned(tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())  # plan v1 on n1 and n2
    on_n1 = PlannerBinding().search(SPEC, frozenset({0, 1}), 2).plan
    job.store.add_plan(job_id="j", version=2, plan=plan_to_dict(on_n1), prediction={})
    t = _open_transition(job.store, "j", ["n1", "n2"], to_version=2)  # v1 -> v2 (n1 only), ordered
    assert job.ctl.drain(["n2"], "shrink") == [] and job.ctl.urgent_reasons == ["drain n2"]  # v1 uses it
    for node in ("n1", "n2"):
        job.ctl.on_transition_report(protocol.TransitionReport(job_id="j", node=node, transition_id=t["id"],
                                                               ok=True, measured_s=0.1))
    assert job.ctl.plan == on_n1
    did = job.ctl.step()  # n2 is given back at once: no replan for its drain, only the pool's change
    assert job.released == [["n2"]] and job.ctl.draining == {"n2": "shrink"}  # until the source takes it
    assert did is not None
    assert job.store.decision(did)["inputs"]["trigger"]["reasons"] == ["GPU pool changed: 4 -> 2 GPUs (-2 +0)"]  # type: ignore[index]
    assert job.events("alloc-refused") == []


def test_a_replan_after_a_failed_transition_runs_once_its_back_off_is_over_and_the_state_is_logged(
        tmp_path: Path) -> None:
    job = Job(tmp_path, PlannerBinding())
    t = _open_transition(job.store, "j", ["n1"])
    job.now = 300.0
    job.ctl.check_order_timeouts(1.0, now=float(t["created_at"]) + 2.0)  # fails it: back off 1 s
    assert job.ctl.retry_at == 301.0
    job.now = 300.5
    assert job.ctl.step() is None
    job.now = 301.0  # the back-off is over
    with structlog.testing.capture_logs() as logs:
        did = job.ctl.step()
    assert did is not None
    assert job.store.decision(did)["inputs"]["trigger"]["reasons"] == [  # type: ignore[index]
        f"transition {t['id']} failed: node(s) n1 did not finish within 1 s"]
    # the replan is the running plan (nothing changed): no order, the job's state stays, nothing logged
    assert job.orders == [] and [e for e in logs if e["event"] == "job-state"] == []
    assert job.ctl.drain(["n2"], "shrink") == []
    with structlog.testing.capture_logs() as logs:
        did = job.ctl.step()
    tid = job.orders[0][1].transition_id
    assert [e for e in logs if e["event"] == "job-state"] == [
        {"event": "job-state", "log_level": "info", "role": "test", "job": "j", "state": "transitioning",
         "reason": f"transition {tid} ordered (v1 -> v2)"}]


def test_a_node_lost_before_a_live_one_leaves_the_live_ones_gpus_in_the_pool(tmp_path: Path) -> None:
    """GPU ids go by registration rank: n1 (rank 0) holds 0-1, n2 (rank 1) 2-3. With n1 lost the pool is
    n2's GPUs, still numbered from its rank (a lost node earlier in the order skips, not ends, the walk)."""
    job = Job(tmp_path, PlannerBinding())
    job.store.set_node_state("j", "n1", "lost", "no heartbeat")
    job.ctl._refresh_pool()
    assert job.ctl.pool == frozenset({2, 3})
    assert job.ctl.gpu_owner == {2: "n2", 3: "n2"}
