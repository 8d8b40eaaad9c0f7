"""The per-job controller: passive sync first, then active steps (DESIGN.md, "The control loop").

Passive (called as things arrive): allocation events from the allocation source, agents joining and
being lost, step measurements and transition reports. Each is stored before anything acts on it.
Active (``step``): calibrate -> triggers -> replan -> admit -> order the transition, and record
every decision, admitted or not, with its reasons (planner.admission makes the verdict).

The planner's search, prediction and calibration and the transition DAG/cost are reached through
``PlannerPort`` (nereusd/planning.py binds it to planner/ and transitions/), so this module never
imports the numerical code and tests can hand it a port of their own.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from nereusd.allocation import AllocationEvent, EventKind
from nereusd.controller_drain import Drains
from nereusd.controller_orders import TransitionOrders
from nereusd.metrics import Metrics
from nereusd.plan_records import (  # noqa: F401 (re-exported: the daemon, admin and tests import them here)
    PlannerPort,
    TransitionObserver,
    TransitionSketch,
    _latency,
    plan_from_dict,
    plan_to_dict,
    trigger_state_from_dict,
    trigger_state_to_dict,
)
from nereusd.store import Store
from nereusd.wire import protocol
from planner import admission
from planner.errors import InfeasibleError, NereusError, SpecError
from planner.plan import GlobalPlan

# the running plan is re-predicted with the calibrated efficiencies after measurements this many steps
# apart: one predict of one plan, ~5 ms at 32 GPUs and ~7 ms at 1,024 (as much as the calibration step
# itself), against RL steps of seconds to minutes
REPREDICT_EVERY_STEPS = 1
TRANSITIONS_REPLAYED = 64  # completed transitions fed back on restart (more than any calibration window)
_GONE = frozenset({EventKind.NODE_DOWN, EventKind.SHRUNK, EventKind.PREEMPTED})  # these nodes left the job
_ENDS = frozenset({EventKind.RELEASED, EventKind.COMPLETED, EventKind.CANCELLED, EventKind.FAILED,
                   EventKind.TIME_LIMIT})  # a Slurm job ended: the anchor's ends the job, a member's only its nodes


@lru_cache(maxsize=64)
def _device_indexes(devices_json: str) -> tuple[int, ...]:
    """The device indexes of a node's stored device list: nodes of one kind register the same list, so a
    pool of 1,024 nodes parses it once."""
    return tuple(int(d["index"]) for d in json.loads(devices_json))


@contextmanager
def _collector_paused() -> Iterator[None]:
    """A decision allocates tens of thousands of short-lived objects over a heap of long-lived planner
    caches: with the cyclic collector on, its full passes over that heap took more than half of a
    1,024-GPU decision. Paused for the decision (reference counting still frees its garbage at once);
    the collector runs again right after, on what is left."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class JobController(TransitionOrders, Drains):
    """One elastic job. Owns no socket: it orders transitions through ``send_order`` and gives drained
    nodes back through ``release_nodes`` (the allocation source's shrink, run by the daemon).

    Its transitions in flight are nereusd.controller_orders' (ordered, re-sent, reported, finished), its
    graceful releases nereusd.controller_drain's. A graceful release is a drain (``drain``): the node stays alive and takes part in the transition
    that moves its state away, but its GPUs leave the pool that plans are made for; once a committed
    plan no longer uses it, the node is given back. The draining nodes are kept with the monitor state
    (``save_controller_state``), so a restarted daemon goes on draining them.
    """

    def __init__(self, *, job_id: str, store: Store, metrics: Metrics, planner: PlannerPort | None,
                 gamma: float, thresholds: dict[admission.Signal, float], log: Any,
                 send_order: Callable[[str, protocol.TransitionOrder], bool], clock=time.monotonic,
                 pool_settle_s: float = 0.0,
                 release_nodes: Callable[[list[str]], None] | None = None, restore_by_order: bool = False) -> None:
        self.job_id = job_id
        # where no transition reaches the new plan (the last copy of some state died): order the plan
        # anyway as a restore, which the job's driver runs from its latest checkpoint (the live job); off,
        # the decision only records the checkpoint/restart fallback (the simulator plays the restart)
        self.restore_by_order = restore_by_order
        self.store = store
        self.metrics = metrics
        self.planner = planner
        self.gamma = gamma
        self.thresholds = thresholds
        self.log = log.bind(job=job_id)
        self.send_order = send_order
        self.release_nodes = release_nodes
        self.clock = clock
        self.pool_settle_s = pool_settle_s
        self.pool_changed_at = -float("inf")
        self.trigger_state: admission.TriggerState | None = None
        self.last_step = 0
        self.signals: dict[admission.Signal, float] = {}
        self.pool_dirty = True  # recompute the pool on the next step (membership or allocation changed)
        self.memory_violation = False  # a step of the running plan ran out of memory: replan urgently
        self.pool: frozenset[int] = frozenset()  # what plans are made for: alive GPUs minus draining nodes'
        self.gpu_owner: dict[int, str] = {}  # every alive GPU (draining nodes' too: they send state away)
        self.gpus_per_node = 1
        self.draining: dict[str, str] = {}  # node -> why it is being drained (released once no plan uses it)
        self._release_asked: set[str] = set()  # draining nodes the source was asked to give back
        self.urgent_reasons: list[str] = []  # replan urgently on the next pass, for these reasons
        # transitions that failed in a row, and when the next replan may run: a failure that repeats
        # (the same bug on every try) backs off exponentially instead of ordering one transition a second
        self.failed_in_row = 0
        self.retry_at = -float("inf")
        self._orders: dict[int, dict[str, protocol.TransitionOrder]] = {}  # open transition -> node -> order
        workload = (store.job(job_id) or {}).get("spec", {}).get("workload") or {}
        if "prompt_tokens" in workload and "response_tokens" in workload:
            # the length the job was specified for is the reference that drift is measured against
            self.signals[admission.Signal.SEQUENCE_LENGTH] = float(workload["prompt_tokens"]
                                                                   + workload["response_tokens"])
        row = store.plan(job_id)
        self.plan: GlobalPlan | None = plan_from_dict(row["plan"]) if row else None
        saved = store.controller_state(job_id)
        if saved is not None:  # a restarted daemon resumes the monitor where it was (H_x, references)
            self.trigger_state = trigger_state_from_dict(saved["trigger"]) if saved.get("trigger") else None
            self.signals.update({admission.Signal(k): float(v) for k, v in saved.get("signals", {}).items()})
            self.last_step = int(saved.get("last_step", 0))
            self.draining = {str(k): str(v) for k, v in saved.get("draining", {}).items()}
        self.prediction: Any = None
        self._predicted_once = False
        self._pending_prediction: Any = None  # the candidate's prediction, until its transition is done
        # The L_tran correction is not stored itself: it is a function of the completed transitions, which
        # are, so a restarted daemon replays them (the efficiencies, by contrast, restart from the priors).
        for t in store.open_transitions(job_id):  # stored by an older daemon that died before ordering it
            if t["state"] == "planned":
                store.set_transition_state(t["id"], "cancelled", "the daemon restarted before it was ordered")
        done = [t for t in store.transitions(job_id) if t["state"] == "done"]
        for t in done[-TRANSITIONS_REPLAYED:]:
            self._observe_transition(t)
        for t in store.open_transitions(job_id):  # every part reported, the end lost (a store of before 2026-12-02)
            if t["state"] == "ordered" and not t["parts_pending"] and t["measured_s"] is not None:
                self._finish_transition(t, ok=True, reason="every part done (finished after a restart)")

    # --- passive sync -------------------------------------------------------------------------------
    @property
    def job(self) -> dict[str, Any]:
        row = self.store.job(self.job_id)
        if row is None:
            raise SpecError("job_id", f"job {self.job_id!r} vanished from the store")
        return row

    def on_allocation(self, event: AllocationEvent) -> None:
        names = [n.node for n in event.nodes]
        self.store.add_allocation(job_id=self.job_id, gpus=event.num_gpus, nodes=names, source=event.kind.value,
                                  reason=event.reason or event.kind.value)
        self.store.add_event("allocation", event.to_dict(), job_id=self.job_id)
        job = self.job
        ends = event.kind in _ENDS
        anchor = event.slurm_job_id in (None, job["slurm_job_id"])
        # one path for every way a node leaves: DOWN, shrink, preemption, and a member job's end (cancelled,
        # time limit, failed) release its nodes at once from Slurm's state, not by a heartbeat time-out
        if event.kind in _GONE or (ends and not anchor):
            for name in names:
                if any(n["node"] == name for n in self.store.nodes(self.job_id)):
                    self.store.set_node_state(self.job_id, name, "released", f"{event.kind.value}: {event.reason}")
            if any(self.draining.pop(name, None) is not None for name in names):
                self._release_asked.difference_update(names)
                self._save()
        elif ends and anchor:
            final = {EventKind.COMPLETED: "finished", EventKind.RELEASED: "finished",
                     EventKind.CANCELLED: "cancelled"}.get(event.kind, "failed")
            self._set_state(final, f"{event.kind.value}: {event.reason}")
        self.pool_dirty = True

    def on_node_joined(self, node: str, how: str) -> None:
        self.pool_dirty = True
        if self.job["state"] in ("pending", "lost"):
            self._set_state("running", f"node {node} {how}")

    def on_node_lost(self, node: str, reason: str) -> None:
        self.pool_dirty = True
        # open transitions and a count only: a mass loss of 1,024 nodes must not parse every row per node
        for t in self.store.open_transitions(self.job_id):
            if t["state"] == "ordered" and node in t["parts_pending"]:
                self._finish_transition(t, ok=False, reason=f"node {node} lost mid-transition: {reason}")
        if self.store.count_nodes(self.job_id, "alive") == 0:
            self._set_state("lost", f"every node is lost (last: {node})")

    def on_measurement(self, msg: protocol.Measurement) -> None:
        predicted = _latency(self.prediction) if msg.plan_version == self.job["plan_version"] else None
        self.store.add_measurement(job_id=self.job_id, node=msg.node, step=msg.step, plan_version=msg.plan_version,
                                   step_latency_s=msg.step_latency_s, predicted_step_s=predicted,
                                   stage_times=msg.stage_times_s, peak_memory=msg.peak_memory_bytes,
                                   response_tokens=msg.response_tokens)
        self.metrics.step_latency.labels(self.job_id, "measured").set(msg.step_latency_s)
        self.last_step = max(self.last_step, msg.step)
        if msg.response_tokens:
            prompt = float(self.job["spec"].get("workload", {}).get("prompt_tokens", 0))
            self.signals[admission.Signal.SEQUENCE_LENGTH] = prompt + msg.response_tokens
        self._save()
        if self.planner is not None and self.plan is not None and msg.plan_version == self.plan.version:
            try:
                self.planner.calibrate(self._spec_now(), msg, self.plan)
            except NereusError as exc:
                self.log.warning("calibration-skipped", error=str(exc))
                return
            if msg.step - self._calibrated[1] >= REPREDICT_EVERY_STEPS or self._calibrated[0] != self.plan.version:
                # the running plan under the efficiencies just fitted: what job-plan shows beside the
                # measurements (one prediction of one plan; the decision paths predict for themselves)
                self._calibrated = (self.plan.version, msg.step, self._predict(self.plan))

    # (plan version, step, prediction) of the running plan's latest re-prediction after calibration
    _calibrated: tuple[int, int, Any] = (-1, -(2**62), None)

    def current_prediction(self) -> tuple[Any, int] | None:
        """The running plan's prediction under the calibrated efficiencies, and the step whose measurement
        it was re-predicted after; None before any calibration of this plan (or when it does not fit)."""
        version, step, pred = self._calibrated
        if self.plan is None or version != self.plan.version or pred is None:
            return None
        return pred, step

    def on_step_failed(self, *, node: str, step: int, plan_version: int, reason: str) -> None:
        """A step of the running plan failed for lack of memory (a worker's OOM): recorded, and the next
        pass replans urgently, as for a predicted memory violation."""
        self.store.add_event("step-failed", {"node": node, "step": step, "plan_version": plan_version,
                                             "reason": reason}, job_id=self.job_id)
        self.log.warning("step-failed", node=node, step=step, plan_version=plan_version, reason=reason)
        if self.plan is not None and plan_version == self.plan.version:
            self.memory_violation = True

    def on_restarted(self, reason: str) -> None:
        """The job was restarted from its checkpoint (the fallback when no transition can reach a plan):
        the running plan is gone, and the next pass places the job from nothing on the current pool."""
        self.store.add_event("restarted", {"reason": reason, "from_version": self.plan.version if self.plan else None},
                             job_id=self.job_id)
        self.log.warning("restarted", reason=reason)
        self.plan = self.prediction = self._pending_prediction = None
        self.trigger_state = None
        self.memory_violation = False
        self.pool_dirty = True
        self._save()

    # --- active steps -------------------------------------------------------------------------------
    def step(self) -> int | None:
        """One active pass; returns the id of a decision taken, if any."""
        job = self.job
        if job["state"] not in ("running", "lost"):
            return None  # pending: no agent yet; transitioning: wait for the parts; terminal: nothing
        if self.pool_dirty:
            before = self.pool
            self._refresh_pool()
            if self.pool != before:
                self.pool_changed_at = self.clock()
        self._release_drained()  # nodes no plan uses any more need no replan: they go now
        self.urgent_reasons = [r for r in self.urgent_reasons if r.removeprefix("drain ") not in self._release_asked]
        if not self.pool or self.clock() - self.pool_changed_at < self.pool_settle_s:
            return None  # no GPUs, or the pool is still moving: one replan after the burst, not one per join
        if self.clock() < self.retry_at:
            return None  # backing off after failed transitions
        if self.plan is not None and self.prediction is None and not self._predicted_once:
            self._predicted_once = True  # after a restart: the committed plan's prediction, once
            self.prediction = self._predict(self.plan)
        obs = admission.Observation(step=self.last_step, gpu_pool=self.pool, signals=dict(self.signals),
                                    memory_violation=self.memory_violation)
        draining = [r.removeprefix("drain ") for r in self.urgent_reasons if r.startswith("drain ")]
        if self.trigger_state is None:
            self.trigger_state = admission.initial_state(obs, self.thresholds)
            self.urgent_reasons = []
            self._save()
            if self.plan is not None and not draining:  # a store without monitor state: keep the plan, re-arm
                self.prediction = self._predict(self.plan)
                return None
            trigger = admission.Trigger(kind=admission.TriggerKind.URGENT, step=obs.step,
                                        reasons=(f"initial placement on {len(self.pool)} GPUs",) if self.plan is None
                                        else tuple(f"drain {n}" for n in draining))
        else:
            # No plan yet (the initial search failed): only a change of the pool retries, via observe(), or
            # an urgent reason (a drain, a failed transition).
            prev_state = self.trigger_state
            self.trigger_state, fired = admission.observe(self.trigger_state, obs)
            if self.urgent_reasons:
                reasons = tuple(dict.fromkeys([*self.urgent_reasons, *(fired.reasons if fired else ())]))
                fired = admission.Trigger(kind=admission.TriggerKind.URGENT, step=obs.step, reasons=reasons)
                self.urgent_reasons = []
            if fired is None:
                if self.trigger_state != prev_state:
                    self._save()
                return None
            trigger = fired
        with _collector_paused():
            did = self._decide(trigger, obs)
        if draining and self.job["state"] != "transitioning":
            self._refuse_drain([n for n in draining if n in self.draining], did)
        return did

    def _decide(self, trigger: admission.Trigger, obs: admission.Observation) -> int:
        self.memory_violation = False  # this replan answers it; a new failure sets it again
        spec = self._spec_now()
        version = self.store.max_plan_version(self.job_id) + 1
        current_pred = self._predict(self.plan) if self.plan is not None else None
        t0 = time.perf_counter()
        sketch: dict[str, TransitionSketch] = {}

        found: dict[str, admission.Candidate] = {}

        def replan() -> admission.Candidate:
            if self.planner is None:
                raise InfeasibleError("no planner is bound to the daemon (planner.search missing)")
            try:
                found["c"] = self.planner.search(spec, self.pool, version)
                return found["c"]
            except SpecError as exc:  # recorded as a decision like any other reason not to move
                raise InfeasibleError(f"the job spec cannot be planned: {exc}") from None

        def l_tran(old: Any, new: Any) -> float:
            assert self.planner is not None  # replan() succeeded, so a planner is bound
            sketch["s"] = self.planner.transition(spec, old, new, self._participants(), self._node_of_gpu)
            return sketch["s"].predicted_s

        port_alternatives = getattr(self.planner, "alternatives", None)

        def alternatives(error: InfeasibleError | None) -> Any:
            """The next reachable plans, when the best one's DAG cannot run or does not pay back."""
            assert port_alternatives is not None
            return port_alternatives(spec, self.pool, version, found["c"].plan, error)

        try:
            decision = admission.decide(trigger=trigger, current_plan=self.plan, current_prediction=current_pred,
                                        replan=replan, transition_s=l_tran, gamma=self.gamma,
                                        alternatives=alternatives if port_alternatives is not None else None)
        except InfeasibleError as exc:  # replan() is caught inside decide(): this is the DAG (last copy lost)
            self.trigger_state = admission.after_replan(self.trigger_state or admission.initial_state(obs), obs)
            self._save()
            restore = found.get("c") if self.restore_by_order else None
            did = self._record_unbuildable(trigger, exc, time.perf_counter() - t0, restore)
            if restore is not None:
                self._order_restore(did, restore, exc)
            return did
        decision_s = time.perf_counter() - t0
        self.trigger_state = admission.after_replan(self.trigger_state or admission.initial_state(obs), obs)
        self._save()
        v = decision.verdict
        inputs = decision.to_dict()
        # The model's L_tran and the correction applied to it, kept with the decision: a rejected one has no
        # transition row to show them.
        if "s" in sketch and "l_tran" in sketch["s"].dag:
            inputs["l_tran"] = sketch["s"].dag["l_tran"]
        did = self.store.add_decision(
            job_id=self.job_id, trigger=trigger.kind.value, urgent=trigger.kind is admission.TriggerKind.URGENT,
            admitted=v.admitted, rule=v.rule.value, reason=v.reason,
            from_version=self.plan.version if self.plan else None,
            to_version=version if decision.candidate_plan is not None else None,
            delta_l_s=v.saving_s_per_step, l_tran_s=v.transition_s, h_x=v.h_steps, gamma=v.gamma,
            decision_ms=decision_s * 1e3, inputs=inputs)
        self.metrics.decision_time.observe(decision_s)
        self.metrics.decisions.labels(self.job_id, str(v.admitted).lower()).inc()
        self.log.info("decision", id=did, trigger=trigger.kind.value, admitted=v.admitted, rule=v.rule.value,
                      reason=v.reason, decision_ms=round(decision_s * 1e3, 3))
        if v.admitted and decision.candidate_plan is not None:
            new_plan: GlobalPlan = decision.candidate_plan
            if self.plan is None:  # initial placement: the DAG was not built by admission (nothing to move)
                sketch["s"] = self.planner.transition(spec, None, new_plan, self._participants(), self._node_of_gpu) \
                    if self.planner else TransitionSketch(predicted_s=0.0, bytes_moved=0, dag={})
            self.store.add_plan(job_id=self.job_id, version=new_plan.version, plan=plan_to_dict(new_plan),
                                prediction=inputs["candidate_prediction"])  # to_dict's plain copy of it
            self._order(did, new_plan, decision.candidate_prediction, sketch.get("s"))
        return did

    def _record_unbuildable(self, trigger: admission.Trigger, exc: InfeasibleError, decision_s: float,
                            restore: admission.Candidate | None = None) -> int:
        if restore is None:
            reason = ("no transition can reach the new plan: fall back to checkpoint/restart ("
                      + str(exc).splitlines()[0] + ")")
        else:
            reason = (f"no transition can reach the new plan ({str(exc).splitlines()[0]}): restore plan "
                      f"v{restore.plan.version} from the job's latest checkpoint")
        did = self.store.add_decision(
            job_id=self.job_id, trigger=trigger.kind.value, urgent=trigger.kind is admission.TriggerKind.URGENT,
            admitted=restore is not None, rule=admission.Rule.CHECKPOINT_RESTART.value, reason=reason,
            from_version=self.plan.version if self.plan else None,
            to_version=restore.plan.version if restore is not None else None, delta_l_s=None, l_tran_s=None,
            h_x=trigger.h_steps, gamma=self.gamma, decision_ms=decision_s * 1e3,
            inputs={"trigger": admission._plain(trigger), "infeasible_reasons": list(exc.reasons) or [str(exc)],
                    "passed_over": admission._plain(getattr(exc, "passed_over", ()))})
        self.metrics.decisions.labels(self.job_id, str(restore is not None).lower()).inc()
        self.log.warning("decision", id=did, admitted=restore is not None, rule="checkpoint-restart", reason=reason)
        return did

    # --- helpers ------------------------------------------------------------------------------------
    def _set_state(self, state: str, reason: str) -> None:
        if self.store.set_job_state(self.job_id, state, reason):
            self.log.info("job-state", state=state, reason=reason)

    def _refresh_pool(self) -> None:
        """GPU ids: node rank (by registration) * gpus_per_node + device index, for alive nodes only; the
        pool leaves out draining nodes (gpu_owner keeps them: they take part in the transition)."""
        nodes = sorted(self.store.node_devices(self.job_id), key=lambda n: (n["registered_at"], n["node"]))
        indexes = [_device_indexes(n["devices_json"]) for n in nodes]
        per_node = int(self.job["spec"].get("gpus_per_node") or max(map(len, indexes), default=1))
        owner: dict[int, str] = {}
        for rank, (n, devices) in enumerate(zip(nodes, indexes)):
            if n["state"] != "alive":
                continue
            for index in devices[:per_node]:
                owner[rank * per_node + index % per_node] = n["node"]
        self.gpu_owner = owner
        self.gpus_per_node = per_node
        self.pool = frozenset(g for g, n in owner.items() if n not in self.draining)
        self.pool_dirty = False
        self.metrics.gpus_held.labels(self.job_id).set(len(self.pool))

    def _save(self) -> None:
        self.store.save_controller_state(self.job_id, {
            "trigger": trigger_state_to_dict(self.trigger_state) if self.trigger_state else None,
            "signals": {k.value: v for k, v in self.signals.items()}, "last_step": self.last_step,
            "draining": dict(self.draining)})

    def _participants(self) -> frozenset[int]:
        """Every alive GPU: the pool plus the draining nodes', which a transition still reads state from."""
        return frozenset(self.gpu_owner) | self.pool

    def _spec_now(self) -> dict[str, Any]:
        """The job spec with the workload as measured now (the planner plans for today's lengths)."""
        spec = dict(self.job["spec"])
        seq = self.signals.get(admission.Signal.SEQUENCE_LENGTH)
        workload = spec.get("workload")
        if seq is not None and isinstance(workload, dict) and "prompt_tokens" in workload:
            response = max(1, round(seq - float(workload["prompt_tokens"])))
            spec["workload"] = {**workload, "response_tokens": response,
                                "max_response_tokens": max(response, int(workload.get("max_response_tokens") or 0))}
        return spec

    def _node_of_gpu(self, gpu: int) -> str:
        return self.gpu_owner.get(gpu, "?")

    def _predict(self, plan: GlobalPlan) -> Any | None:
        if self.planner is None or not plan.gpus <= self.pool:
            return None  # the plan uses GPUs that are gone: infeasible on this pool
        try:
            return self.planner.predict(self._spec_now(), self.pool, plan)
        except (InfeasibleError, SpecError):
            return None
