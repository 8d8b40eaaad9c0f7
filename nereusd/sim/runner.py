"""Replay a trace through the real per-job controller on a virtual clock, against the ground truth.

    from nereusd.sim.runner import SimJob, simulate
    result = simulate(load_trace("etc/traces/drift_8_32.csv", gpus_per_node=8), SimJob(...), policy="nereus")

Only the allocation source and the agents are simulated. The controller (nereusd.controller.JobController),
its store (SQLite, in memory), the admission rule, the triggers, the planner binding and the transition
DAG builder are the daemon's own. Per trace row (one RL step):

1. the allocation: nodes join (registered, ``on_node_joined``), are released (a SHRUNK event) or are
   lost abruptly (``on_node_lost``; the step in progress is lost and paid for);
2. the safe point: ``JobController.step()``; an ordered transition is executed by the simulated agents in
   ground-truth time (TransitionTruth over the DAG the controller stored), each node reports its part;
3. the step runs in ground truth on the committed plan; its stage times go back as a Measurement (the
   controller calibrates from them); an out-of-memory step is reported (``on_step_failed``), its time
   is lost, the planner's memory capacity is derated from what the OOM needed, and the step is retried
   after the controller's urgent replan.

Policies: ``nereus`` (payback rule, gamma), ``any-gain`` (admit whenever dL > 0: gamma -> infinity),
``every:K`` (replan every K steps and switch on any predicted gain), ``static`` (the initial TP/PP layouts
kept, DP scaled to the pool; no controller), ``restart`` (best plan after each pool change, reached by
checkpoint/restart) and ``oracle`` (the planner's best plan for every step's true lengths, free
transitions: a lower bound for policies that use this planner, not for every possible plan).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from nereusd.controller import JobController
from nereusd.metrics import Metrics
from nereusd.planning import job_spec
from nereusd.sim.baselines import OOM_RETRIES, scale_plan, simulate_baseline
from nereusd.sim.port import SimPort
from nereusd.sim.results import RunResult, StepRecord, save_json
from nereusd.sim.trace import Trace, TraceRow
from nereusd.sim.truth import GroundTruth, OutOfMemory, TransitionTruth, restart_seconds
from nereusd.sim.world import (
    QuietLog,
    SimCluster,
    SimJob,
    VirtualClock,
    cluster_of,
    plan_gpus,
    workload_of,
)
from nereusd.store import Store
from nereusd.wire import protocol
from planner import admission
from planner.errors import SpecError
from planner.plan import GlobalPlan

__all__ = ["OOM_RETRIES", "POLICIES", "RunResult", "SimCluster", "SimJob", "SimPort", "StepRecord",
           "VirtualClock", "plan_gpus", "save_json", "scale_plan", "simulate"]

POLICIES = ("nereus", "any-gain", "every:K", "static", "restart", "oracle")


def simulate(trace: Trace, job: SimJob, *, policy: str = "nereus", gamma: float = 0.5, seed: int = 0,
             store_path: str | Path = ":memory:", progress: Callable[[int, int], None] | None = None,
             track_prediction_error: bool = False) -> RunResult:
    """One run of ``trace`` under ``policy``. Same seed, same trace, same policy -> same result."""
    if policy in ("static", "restart", "oracle"):
        return simulate_baseline(trace, job, policy=policy, seed=seed, progress=progress)
    run = _ControlledRun(trace, job, policy=policy, every=_every(policy), gamma=gamma, seed=seed,
                         store_path=store_path, track_prediction_error=track_prediction_error)
    return run.run(progress)


def _every(policy: str) -> int:
    """K of ``every:K`` (0 for the payback policies); a clear error for any other name."""
    if policy.startswith("every:"):
        try:
            every = int(policy.split(":", 1)[1])
        except ValueError:
            every = 0
        if every < 1:
            raise SpecError("policy", f"{policy!r}: K must be a positive integer", "every:3")
        return every
    if policy not in ("nereus", "any-gain"):
        raise SpecError("policy", f"unknown policy {policy!r}", ", ".join(POLICIES))
    return 0


class _ControlledRun:
    """One trace under the real controller: the simulated agents execute what it orders, the ground truth
    times steps and transitions, and the controller hears back what the daemon would tell it."""

    def __init__(self, trace: Trace, job: SimJob, *, policy: str, every: int, gamma: float, seed: int,
                 store_path: str | Path, track_prediction_error: bool) -> None:
        self.trace, self.every, self.track_prediction_error = trace, every, track_prediction_error
        self.clock = VirtualClock()
        self.store = Store(Path(store_path), clock=self.clock)
        self.job_id = "sim"
        spec0 = job.spec(trace.rows[0].mean_response_tokens)
        self.store.add_job(job_id=self.job_id, user="sim", spec=spec0)
        self.orders: list[tuple[str, protocol.TransitionOrder]] = []
        self.port = SimPort()
        thresholds = dict(admission.DEFAULT_THRESHOLDS)
        any_gain = policy == "any-gain" or every > 0
        if every:
            thresholds[admission.Signal.SEQUENCE_LENGTH] = 1e-12  # every pass that runs replans
        self.ctl = JobController(job_id=self.job_id, store=self.store, metrics=Metrics(), planner=self.port,
                                 # L_tran / dL <= gamma * H_x holds for any positive gain
                                 gamma=1e12 if any_gain else gamma,
                                 thresholds=thresholds, log=QuietLog(), send_order=self._send_order, clock=self.clock)
        self.cluster = cluster_of(job, trace)
        self.truth = GroundTruth(job_spec(spec0), self.cluster, seed=seed, steps=len(trace) + 1)
        self.ttruth = TransitionTruth()
        self.nodes = SimCluster(self.ctl, self.store, self.job_id, job.gpus_per_node, self.clock)
        self.result = RunResult(policy=policy, gamma=None if any_gain else gamma, trace=trace.name, steps=[])
        self.current_step = 0
        self.restarted_s = 0.0  # checkpoint/restart seconds paid at safe points of the current step (lost time)

    def _send_order(self, node: str, order: protocol.TransitionOrder) -> bool:
        self.orders.append((node, order))  # the simulated agent of ``node`` has it
        return True

    def run(self, progress: Callable[[int, int], None] | None) -> RunResult:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        for i, row in enumerate(self.trace.rows):
            self._row(row)
            if progress is not None:
                progress(i + 1, len(self.trace))
        result = self.result
        result.wall_s, result.cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
        result.port, result.truth = self.port, self.truth
        self.store.close()
        return result

    # --- the safe point ------------------------------------------------------------------------------

    def safe_point(self, force: bool) -> float:
        """One controller pass (if due); executes what it orders; returns ground-truth transition seconds."""
        ctl = self.ctl
        if not force and self.every and ctl.pool == frozenset(ctl.gpu_owner) and not ctl.pool_dirty \
                and not ctl.memory_violation:
            return 0.0
        self.result.controller_passes += 1
        old = ctl.plan
        did = ctl.step()
        if did is not None and self._note_decision(did):
            old = None
        if not self.orders:
            return 0.0
        return self._execute_orders(old)

    def _note_decision(self, did: int) -> bool:
        """Record decision ``did``; where it says no transition can keep the state, pay a checkpoint/restart
        and place from nothing. True when it did."""
        result, row = self.result, self.store.decision(did)
        result.decisions += 1
        if row is None:
            return False
        if row["decision_ms"] is not None:
            result.decision_ms.append(float(row["decision_ms"]))
        inputs = json.loads(row["inputs"]) if isinstance(row["inputs"], str) else row["inputs"]
        if inputs and inputs.get("passed_over"):  # the best plan was not taken: which, why
            result.passed_over.append({"step": self.current_step, "decision": did, "admitted": bool(row["admitted"]),
                                       "rule": row["rule"], "passed_over": inputs["passed_over"]})
        if row["rule"] != "checkpoint-restart" or not row["reason"].startswith("no transition"):
            return False
        # the last copy of some state is gone: restart from the checkpoint, then place from nothing
        restart_s = restart_seconds(self.truth.job, self.cluster, len(self.ctl.pool))
        self.clock.advance(restart_s)
        result.restarts.append({"step": self.current_step, "seconds": restart_s, "decision": did})
        self.ctl.on_restarted(f"decision {did}: {row['reason'][:120]}")
        self.ctl.step()
        self.restarted_s += restart_s
        return True

    def _execute_orders(self, old: GlobalPlan | None) -> float:
        """The simulated agents run the ordered transition in ground-truth time and report their parts."""
        ctl, first = self.ctl, self.orders[0][1]
        tid = first.transition_id
        t = self.store.transition(tid, detail=True) or {}
        new_gpus = set(first.part["plan"] and [g for s in first.part["plan"]["stages"]
                                               for gs in s["gpu_sets"] for g in gs])
        involved = len(new_gpus | (plan_gpus(old) if old else set()))
        seconds = self.ttruth.seconds(t.get("dag") or {}, self.cluster, involved) if old is not None else 0.0
        for node, _order in self.orders:
            ctl.on_transition_report(protocol.TransitionReport(job_id=self.job_id, node=node, transition_id=tid,
                                                               ok=True, measured_s=seconds,
                                                               bytes_moved=int(t.get("bytes_moved") or 0)))
        self.orders.clear()
        if old is not None:
            self.result.transitions.append({"step": self.current_step, "id": tid, "truth_s": seconds,
                                            "predicted_s": float(t.get("predicted_s") or 0.0),
                                            "bytes_moved": int(t.get("bytes_moved") or 0),
                                            "from_version": old.version,
                                            "to_version": ctl.plan.version if ctl.plan else None})
        self.clock.advance(seconds)
        return seconds

    # --- one trace row: one RL step ------------------------------------------------------------------

    def _row(self, row: TraceRow) -> None:
        ctl = self.ctl
        self.current_step = row.step
        self.nodes.resize(row.gpus)
        force = self.every == 0 or row.step % self.every == 0
        record = StepRecord(step=row.step, gpus=row.gpus, step_s=0.0, transition_s=self.safe_point(force or ctl.pool_dirty),
                            lost_s=0.0, response_tokens=row.mean_response_tokens,
                            plan_version=ctl.plan.version if ctl.plan else 0)
        lost = self._attempts(row, record)
        record.lost_s = lost + self.restarted_s
        self.restarted_s = 0.0
        self.result.steps.append(record)

    def _attempts(self, row: TraceRow, record: StepRecord) -> float:
        """Run the step until it succeeds (or OOM_RETRIES attempts): OOMs, a node loss and restarts each
        cost time and a controller pass. Returns the seconds lost."""
        ctl, clock, w = self.ctl, self.clock, workload_of(row)
        lost = 0.0
        loss_pending = row.node_loss
        for _attempt in range(OOM_RETRIES):
            plan = ctl.plan
            if plan is None or not plan_gpus(plan) <= ctl.pool:
                # nothing runnable (no feasible plan, or a checkpoint/restart verdict): restart from a checkpoint
                r = restart_seconds(self.truth.job, self.cluster, row.gpus)
                lost += r
                clock.advance(r)
                record.transition_s += self.safe_point(True)
                if ctl.plan is None or not plan_gpus(ctl.plan) <= ctl.pool:
                    break
                continue
            try:
                out = self.truth.run_step(plan, row.step, w)
            except OutOfMemory as oom:
                record.ooms += 1
                wasted = (ctl.prediction.step_latency_s if ctl.prediction is not None else 0.0) / 2
                lost += wasted
                clock.advance(wasted)
                self.port.learn_oom(ctl._spec_now(), ctl.pool, plan, oom)
                ctl.on_step_failed(node=self.nodes.alive[0], step=row.step, plan_version=plan.version, reason=str(oom))
                record.transition_s += self.safe_point(True)
                continue
            if self.track_prediction_error:  # the running plan under the efficiencies calibrated so far
                fresh = self.port.predict_seconds(ctl._spec_now(), ctl.pool, plan)
                if fresh > 0:
                    self.result.prediction_errors.append({"step": row.step, "predicted_s": fresh,
                                                          "truth_s": out.step_latency_s,
                                                          "truth_mean_s": self.truth.mean_latency(plan, row.step, w)})
            if loss_pending:  # the node dies during the step: its work is lost, the pool shrinks, try again
                loss_pending = False
                lost += out.step_latency_s
                clock.advance(out.step_latency_s)
                self.nodes.lose_one()
                record.transition_s += self.safe_point(True)
                continue
            record.step_s = out.step_latency_s
            record.plan_version = plan.version
            self.result.plans_run.setdefault(plan.version, plan)
            clock.advance(out.step_latency_s)
            ctl.on_measurement(protocol.Measurement(
                job_id=self.job_id, node=self.nodes.alive[0] if self.nodes.alive else "?", step=row.step,
                plan_version=ctl.plan.version if ctl.plan else 0, step_latency_s=out.step_latency_s,
                stage_times_s=out.stage_times_s, response_tokens=row.mean_response_tokens))
            break
        return lost
