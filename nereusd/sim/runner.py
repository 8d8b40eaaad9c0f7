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

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nereusd.allocation import AllocationEvent, EventKind, NodeAllocation
from nereusd.controller import JobController
from nereusd.metrics import Metrics
from nereusd.planning import PlannerBinding, cluster_for, job_spec
from nereusd.sim.trace import Trace, TraceRow
from nereusd.sim.truth import GroundTruth, OutOfMemory, StepWorkload, TransitionTruth, restart_seconds
from nereusd.store import Store
from nereusd.wire import protocol
from planner import admission
from planner.errors import InfeasibleError, SpecError
from planner.hardware import ClusterSpec
from planner.plan import GlobalPlan, StagePlan

POLICIES = ("nereus", "any-gain", "every:K", "static", "restart", "oracle")
OOM_RETRIES = 4  # attempts of one step before the run gives up on it (counted as failed)


class _QuietLog:
    """The controller's logger in a simulation: decisions are in the store; nothing is printed."""

    def bind(self, **_: Any) -> _QuietLog:
        return self

    def __getattr__(self, _name: str) -> Callable[..., None]:
        return lambda *a, **k: None


class VirtualClock:
    def __init__(self, start_s: float = 1_000_000.0) -> None:
        self.now = start_s

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, seconds
        self.now += seconds


@dataclass(frozen=True, kw_only=True, slots=True)
class SimJob:
    """The simulated job: presets and the workload (the response length comes from the trace)."""

    model: str = "llama-3.1-8b"
    algo: str = "ppo"
    device: str = "h200"
    gpus_per_node: int = 8
    prompts_per_step: int = 1024
    samples_per_prompt: int = 1
    prompt_tokens: int = 512
    max_response_tokens: int | None = None  # the generation cap (vLLM max_tokens); None: uncapped
    train_mini_batches_per_step: int = 1

    def spec(self, response_tokens: float) -> dict[str, Any]:
        workload: dict[str, Any] = {"prompts_per_step": self.prompts_per_step,
                                    "samples_per_prompt": self.samples_per_prompt,
                                    "prompt_tokens": self.prompt_tokens,
                                    "response_tokens": max(1, round(response_tokens)),
                                    "train_mini_batches_per_step": self.train_mini_batches_per_step}
        if self.max_response_tokens:
            workload["max_response_tokens"] = self.max_response_tokens
        return {"model": self.model, "algo": self.algo, "device": self.device,
                "gpus_per_node": self.gpus_per_node, "workload": workload}


class SimPort(PlannerBinding):
    """The daemon's planner binding plus what a job learns from its OOMs (a worker's OOM report says which
    model-stage failed, the bytes it needed and the longest sequence in the failing batch):

    - the planner is asked to size memory for the tail: ``max_response_tokens`` of the spec it plans is
      the mean times the worst longest/mean ratio an OOM has shown (the cost model plans for mean lengths
      and the tail is what overflows; as a ratio it follows lengths that grow);
    - if the plan still looks feasible with that, the usable memory is derated by predicted/needed.

    The planner's memory model itself is left as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.memory_derate = 1.0
        self.tail_ratio = 0.0  # longest / mean response of the worst OOM seen, with 10% margin

    def _job(self, job: dict[str, Any]) -> dict[str, Any]:
        w = job.get("workload") or {}
        tail = math.ceil(self.tail_ratio * float(w.get("response_tokens") or 0))
        if tail <= int(w.get("max_response_tokens") or 0):
            return job
        return {**job, "workload": {**w, "max_response_tokens": tail}}

    def _cluster(self, job: dict[str, Any], pool: frozenset[int]) -> ClusterSpec:
        c = cluster_for(job, pool)
        if self.memory_derate >= 1.0:
            return c
        dev = dataclasses.replace(c.device, memory_bytes=int(c.device.memory_bytes * self.memory_derate))
        return dataclasses.replace(c, device=dev)

    def search(self, job: dict[str, Any], pool: frozenset[int], version: int) -> admission.Candidate:
        from planner.search import search

        job = self._job(job)
        res = search(job_spec(job), self._cluster(job, pool), pool=sorted(pool), eff=self._eff(job), version=version)
        return admission.Candidate(plan=res.plan, prediction=res.prediction)

    def alternatives(self, job: dict[str, Any], pool: frozenset[int], version: int, best: GlobalPlan,
                     error: InfeasibleError | None) -> Iterator[admission.Candidate]:
        job = self._job(job)
        return self._alternatives(job_spec(job), self._cluster(job, pool), pool, self._eff(job), version, best, error)

    def predict(self, job: dict[str, Any], pool: frozenset[int], plan: GlobalPlan) -> Any | None:
        from planner.prediction import predict

        job = self._job(job)
        pred = predict(job_spec(job), self._cluster(job, pool), plan, self._eff(job))
        return pred if pred.feasible else None

    def calibrate(self, job: dict[str, Any], measurement: protocol.Measurement, plan: GlobalPlan) -> None:
        """Calibrate against the workload the predictions use (the tail an OOM taught included): fitted
        without it, the tail's decode time is learned into the generation classes and then counted twice."""
        super().calibrate(self._job(job), measurement, plan)

    def predict_seconds(self, job: dict[str, Any], pool: frozenset[int], plan: GlobalPlan) -> float:
        """The predicted step latency of ``plan`` whether or not the planner thinks it fits (time is what
        the calibration figures compare; memory is judged by the truth's OOMs)."""
        from planner.prediction import predict

        job = self._job(job)
        return float(predict(job_spec(job), cluster_for(job, pool), plan, self._eff(job)).step_latency_s)

    def learn_oom(self, job: dict[str, Any], pool: frozenset[int], plan: GlobalPlan, oom: OutOfMemory) -> None:
        from planner.prediction import predict

        mean = float((job.get("workload") or {}).get("response_tokens") or 1)
        self.tail_ratio = max(self.tail_ratio, 1.1 * oom.longest_response_tokens / mean)
        job = self._job(job)
        pred = predict(job_spec(job), cluster_for(job, pool), plan, self._eff(job))
        predicted = pred.memory[oom.model_stage].total_bytes
        if predicted < oom.need_bytes:
            self.memory_derate = min(self.memory_derate, 0.95 * predicted / oom.need_bytes)


@dataclass(kw_only=True, slots=True)
class StepRecord:
    step: int
    gpus: int
    step_s: float  # the RL step itself (0 when it failed every attempt)
    transition_s: float  # transitions executed at this step's safe point (ground truth)
    lost_s: float  # time lost to OOMs, node losses and restarts at this step
    response_tokens: float
    plan_version: int
    ooms: int = 0


@dataclass(kw_only=True)
class RunResult:
    policy: str
    gamma: float | None
    trace: str
    steps: list[StepRecord]
    transitions: list[dict[str, Any]] = field(default_factory=list)  # executed (not the initial placement)
    restarts: list[dict[str, Any]] = field(default_factory=list)  # checkpoint/restarts the controller fell back to
    decisions: int = 0
    decision_ms: list[float] = field(default_factory=list)
    controller_passes: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0  # process CPU time of the run (the fairer figure on a shared machine)
    prediction_errors: list[dict[str, float]] = field(default_factory=list)
    passed_over: list[dict[str, Any]] = field(default_factory=list)  # decisions that took a later plan, or none
    plans_run: dict[int, GlobalPlan] = field(default_factory=dict, repr=False)  # version -> plan stepped on
    port: Any = field(default=None, repr=False)  # the planner binding as the run left it (not serialised)
    truth: Any = field(default=None, repr=False)  # the ground truth of the run (not serialised)

    @property
    def run_s(self) -> float:
        return sum(r.step_s + r.transition_s + r.lost_s for r in self.steps)

    @property
    def transition_time_s(self) -> float:
        return sum(r.transition_s for r in self.steps)

    @property
    def ooms(self) -> int:
        return sum(r.ooms for r in self.steps)

    def summary(self) -> dict[str, Any]:
        done = [r for r in self.steps if r.step_s > 0]
        tokens = sum(r.response_tokens for r in done)
        n = max(1, len(self.steps))
        return {
            "policy": self.policy, "gamma": self.gamma, "trace": self.trace, "steps": len(self.steps),
            "mean_step_s": self.run_s / n,  # transitions and lost time included: what a user waits for
            "mean_step_compute_s": sum(r.step_s for r in done) / max(1, len(done)),
            "run_s": self.run_s, "transitions": len(self.transitions),
            "transition_s": self.transition_time_s,
            "transition_share": self.transition_time_s / self.run_s if self.run_s else 0.0,
            "ooms": self.ooms, "lost_s": sum(r.lost_s for r in self.steps), "restarts": len(self.restarts),
            "response_tokens_per_s": tokens / self.run_s if self.run_s else 0.0,
            "decisions": self.decisions, "controller_passes": self.controller_passes,
            "decision_ms_mean": sum(self.decision_ms) / len(self.decision_ms) if self.decision_ms else None,
            "decision_ms_max": max(self.decision_ms) if self.decision_ms else None,
            "wall_s": self.wall_s, "cpu_s": self.cpu_s,
            "controller_passes_per_s": self.controller_passes / self.wall_s if self.wall_s else None,
            "controller_passes_per_cpu_s": self.controller_passes / self.cpu_s if self.cpu_s else None,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "steps": [dataclasses.asdict(r) for r in self.steps],
                "transitions": self.transitions, "restarts": self.restarts, "prediction_errors": self.prediction_errors,
                "passed_over": self.passed_over}


class SimStore(Store):
    """The daemon's store (same schema, same methods) with one read made cheap: a transition's DAG,
    megabytes of JSON at 1,024 GPUs and never changed once stored, is decoded once instead of on every
    node's report (the controller reads the transition row per report: O(nodes x DAG) per transition)."""

    def __init__(self, path: Path, clock: Callable[[], float]) -> None:
        super().__init__(path, clock=clock)
        cols = [r["name"] for r in self.db.execute("PRAGMA table_info(transitions)").fetchall()]
        self._light = ", ".join("NULL AS dag" if c == "dag" else c for c in cols)
        self._dags: dict[int, Any] = {}

    def transition(self, transition_id: int) -> dict[str, Any] | None:
        row = self._one(f"SELECT {self._light} FROM transitions WHERE id=?", transition_id)
        if row is None:
            return None
        if transition_id not in self._dags:
            if len(self._dags) >= 4:  # only the transition in flight is read per report; keep a few
                self._dags.pop(next(iter(self._dags)))
            raw = self.db.execute("SELECT dag FROM transitions WHERE id=?", (transition_id,)).fetchone()
            self._dags[transition_id] = raw["dag"]
        row["dag"] = self._dags[transition_id]
        return row


_GPUS: dict[int, tuple[GlobalPlan, frozenset[int]]] = {}


def plan_gpus(plan: GlobalPlan) -> frozenset[int]:
    """``plan.gpus``, computed once per plan object (it is rebuilt on every access, ~ms at 1,024 GPUs)."""
    hit = _GPUS.get(id(plan))
    if hit is None or hit[0] is not plan:
        if len(_GPUS) > 64:
            _GPUS.clear()
        hit = _GPUS[id(plan)] = (plan, plan.gpus)
    return hit[1]


# --- simulated agents ---------------------------------------------------------------------------------


def _devices(n: int) -> list[dict[str, Any]]:
    return [{"index": i, "kind": "gpu", "name": "sim", "memory_bytes": 0} for i in range(n)]


class SimCluster:
    """The nodes of one job: joins, releases and losses, told to the controller as the daemon would."""

    def __init__(self, ctl: JobController, store: Store, job_id: str, gpus_per_node: int,
                 clock: VirtualClock) -> None:
        self.ctl, self.store, self.job_id, self.per_node, self.clock = ctl, store, job_id, gpus_per_node, clock
        self.alive: list[str] = []
        self.counter = 0

    def resize(self, gpus: int) -> None:
        want = gpus // self.per_node
        if want > len(self.alive):
            added = []
            for _ in range(want - len(self.alive)):
                name = f"sim{self.counter:05d}"
                self.counter += 1
                self.store.register_node(job_id=self.job_id, node=name, devices=_devices(self.per_node),
                                         slurm_job_id=None, host=name, incarnation=name)
                added.append(name)
            self.alive += added
            self.ctl.on_allocation(self._event(EventKind.GROWN, added, "trace: nodes granted"))
            for name in added:
                self.ctl.on_node_joined(name, "new")
        elif want < len(self.alive):
            gone, self.alive = self.alive[want:], self.alive[:want]
            self.ctl.on_allocation(self._event(EventKind.SHRUNK, gone, "trace: nodes taken back"))

    def lose_one(self) -> str:
        name = self.alive.pop()
        self.store.set_node_state(self.job_id, name, "lost", "trace: node lost")
        self.ctl.on_node_lost(name, "trace: node lost")
        return name

    def _event(self, kind: EventKind, names: list[str], reason: str) -> AllocationEvent:
        return AllocationEvent(kind=kind, job_id=self.job_id, slurm_job_id=None, reason=reason,
                               nodes=tuple(NodeAllocation(node=n, gpu_indices=tuple(range(self.per_node)), holder_job_id=n)
                                           for n in names),
                               time_s=self.clock())


# --- the controller-driven run ------------------------------------------------------------------------


def _workload(row: TraceRow) -> StepWorkload:
    return StepWorkload(mean_response_tokens=row.mean_response_tokens, p95_response_tokens=row.p95_response_tokens,
                        compute_factor=row.compute_factor, network_factor=row.network_factor)


def _cluster(job: SimJob, trace: Trace) -> ClusterSpec:
    # GPU ids grow with every node ever registered (ranks are kept); the truth is sized for all of them
    spec = job.spec(trace.rows[0].mean_response_tokens)
    grown = sum(max(0, b.gpus - a.gpus) for a, b in zip(trace.rows, trace.rows[1:])) + trace.rows[0].gpus
    return cluster_for(spec, frozenset({grown - 1}))


def simulate(trace: Trace, job: SimJob, *, policy: str = "nereus", gamma: float = 0.5, seed: int = 0,
             store_path: str | Path = ":memory:", progress: Callable[[int, int], None] | None = None,
             track_prediction_error: bool = False) -> RunResult:
    """One run of ``trace`` under ``policy``. Same seed, same trace, same policy -> same result."""
    if policy in ("static", "restart", "oracle"):
        return _simulate_baseline(trace, job, policy=policy, seed=seed, progress=progress)
    every = 0
    if policy.startswith("every:"):
        try:
            every = int(policy.split(":", 1)[1])
        except ValueError:
            every = 0
        if every < 1:
            raise SpecError("policy", f"{policy!r}: K must be a positive integer", "every:3")
    elif policy not in ("nereus", "any-gain"):
        raise SpecError("policy", f"unknown policy {policy!r}", ", ".join(POLICIES))
    wall0, cpu0 = time.perf_counter(), time.process_time()
    clock = VirtualClock()
    store = SimStore(Path(store_path), clock=clock)
    job_id = "sim"
    spec0 = job.spec(trace.rows[0].mean_response_tokens)
    store.add_job(job_id=job_id, user="sim", spec=spec0)
    orders: list[tuple[str, protocol.TransitionOrder]] = []

    def send_order(node: str, order: protocol.TransitionOrder) -> bool:
        orders.append((node, order))  # the simulated agent of ``node`` has it
        return True

    port = SimPort()
    thresholds = dict(admission.DEFAULT_THRESHOLDS)
    eff_gamma = gamma
    if policy == "any-gain" or every:
        eff_gamma = 1e12  # L_tran / dL <= gamma * H_x holds for any positive gain
    if every:
        thresholds[admission.Signal.SEQUENCE_LENGTH] = 1e-12  # every pass that runs replans
    ctl = JobController(job_id=job_id, store=store, metrics=Metrics(), planner=port, gamma=eff_gamma,
                        thresholds=thresholds, log=_QuietLog(),
                        send_order=send_order, clock=clock)
    cluster = _cluster(job, trace)
    truth = GroundTruth(job_spec(spec0), cluster, seed=seed, steps=len(trace) + 1)
    ttruth = TransitionTruth()
    nodes = SimCluster(ctl, store, job_id, job.gpus_per_node, clock)
    result = RunResult(policy=policy, gamma=None if policy == "any-gain" or every else gamma, trace=trace.name,
                       steps=[])

    def safe_point(force: bool) -> float:
        """One controller pass (if due); executes what it orders; returns ground-truth transition seconds."""
        if not force and every and ctl.pool == frozenset(ctl.gpu_owner) and not ctl.pool_dirty \
                and not ctl.memory_violation:
            return 0.0
        result.controller_passes += 1
        old = ctl.plan
        did = ctl.step()
        restart_s = 0.0
        if did is not None:
            result.decisions += 1
            row = store.decision(did)
            if row is not None and row["decision_ms"] is not None:
                result.decision_ms.append(float(row["decision_ms"]))
            inputs = (json.loads(row["inputs"]) if isinstance(row["inputs"], str) else row["inputs"]) if row else None
            if row is not None and inputs and inputs.get("passed_over"):  # the best plan was not taken: which, why
                result.passed_over.append({"step": current_step, "decision": did, "admitted": bool(row["admitted"]),
                                           "rule": row["rule"], "passed_over": inputs["passed_over"]})
            if row is not None and row["rule"] == "checkpoint-restart" and row["reason"].startswith("no transition"):
                # the last copy of some state is gone: restart from the checkpoint, then place from nothing
                restart_s = restart_seconds(truth.job, cluster, len(ctl.pool))
                clock.advance(restart_s)
                result.restarts.append({"step": current_step, "seconds": restart_s, "decision": did})
                ctl.on_restarted(f"decision {did}: {row['reason'][:120]}")
                ctl.step()
                old = None
        restarted[0] += restart_s
        if not orders:
            return 0.0
        tid = orders[0][1].transition_id
        t = store.transition(tid) or {}
        dag = t.get("dag") or {}
        new_gpus = set(orders[0][1].part["plan"] and [g for s in orders[0][1].part["plan"]["stages"]
                                                       for gs in s["gpu_sets"] for g in gs])
        involved = len(new_gpus | (plan_gpus(old) if old else set()))
        seconds = ttruth.seconds(dag, cluster, involved) if old is not None else 0.0
        for node, _order in orders:
            ctl.on_transition_report(protocol.TransitionReport(job_id=job_id, node=node, transition_id=tid,
                                                               ok=True, measured_s=seconds,
                                                               bytes_moved=int(t.get("bytes_moved") or 0)))
        orders.clear()
        if old is not None:
            result.transitions.append({"step": current_step, "id": tid, "truth_s": seconds,
                                       "predicted_s": float(t.get("predicted_s") or 0.0),
                                       "bytes_moved": int(t.get("bytes_moved") or 0),
                                       "from_version": old.version, "to_version": ctl.plan.version if ctl.plan else None})
        clock.advance(seconds)
        return seconds

    current_step = 0
    restarted = [0.0]  # checkpoint/restart seconds paid at safe points of the current step (lost time)
    for i, row in enumerate(trace.rows):
        current_step = row.step
        lost = 0.0
        nodes.resize(row.gpus)
        force = every == 0 or row.step % every == 0
        trans = safe_point(force or ctl.pool_dirty)
        w = _workload(row)
        record = StepRecord(step=row.step, gpus=row.gpus, step_s=0.0, transition_s=trans, lost_s=0.0,
                            response_tokens=row.mean_response_tokens, plan_version=ctl.plan.version if ctl.plan else 0)
        loss_pending = row.node_loss
        for _attempt in range(OOM_RETRIES):
            plan = ctl.plan
            if plan is None or not plan_gpus(plan) <= ctl.pool:
                # nothing runnable (no feasible plan, or a checkpoint/restart verdict): restart from a checkpoint
                r = restart_seconds(truth.job, cluster, row.gpus)
                lost += r
                clock.advance(r)
                record.transition_s += safe_point(True)
                if ctl.plan is None or not plan_gpus(ctl.plan) <= ctl.pool:
                    break
                continue
            try:
                out = truth.run_step(plan, row.step, w)
            except OutOfMemory as oom:
                record.ooms += 1
                wasted = (ctl.prediction.step_latency_s if ctl.prediction is not None else 0.0) / 2
                lost += wasted
                clock.advance(wasted)
                port.learn_oom(ctl._spec_now(), ctl.pool, plan, oom)
                ctl.on_step_failed(node=nodes.alive[0], step=row.step, plan_version=plan.version, reason=str(oom))
                record.transition_s += safe_point(True)
                continue
            if track_prediction_error:  # the running plan under the efficiencies calibrated so far
                fresh = port.predict_seconds(ctl._spec_now(), ctl.pool, plan)
                if fresh > 0:
                    result.prediction_errors.append({"step": row.step, "predicted_s": fresh,
                                                     "truth_s": out.step_latency_s,
                                                     "truth_mean_s": truth.mean_latency(plan, row.step, w)})
            if loss_pending:  # the node dies during the step: its work is lost, the pool shrinks, try again
                loss_pending = False
                lost += out.step_latency_s
                clock.advance(out.step_latency_s)
                nodes.lose_one()
                record.transition_s += safe_point(True)
                continue
            record.step_s = out.step_latency_s
            record.plan_version = plan.version
            result.plans_run.setdefault(plan.version, plan)
            clock.advance(out.step_latency_s)
            ctl.on_measurement(protocol.Measurement(
                job_id=job_id, node=nodes.alive[0] if nodes.alive else "?", step=row.step,
                plan_version=ctl.plan.version if ctl.plan else 0, step_latency_s=out.step_latency_s,
                stage_times_s=out.stage_times_s, response_tokens=row.mean_response_tokens))
            break
        record.lost_s = lost + restarted[0]
        restarted[0] = 0.0
        result.steps.append(record)
        if progress is not None:
            progress(i + 1, len(trace))
    result.wall_s, result.cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
    result.port, result.truth = port, truth
    store.close()
    return result


# --- baselines without the controller -------------------------------------------------------------------


def scale_plan(initial: GlobalPlan, initial_pool: int, pool: list[int], job: Any, version: int) -> GlobalPlan:
    """The static baseline's plan on ``pool``: every model-stage keeps its TP/PP layout and its share of
    the pool; its DP degree scales with the pool (the largest that divides its batch), micro-batch kept
    where it still divides."""
    from planner.options import batch_sequences

    n = len(pool)
    stages: list[StagePlan] = []
    for sp in initial.stages:
        ms = job.workflow.stage(sp.model_stage)
        size = sp.layout.size
        if size > n:
            raise InfeasibleError(f"{sp.model_stage}: its fixed layout {sp.layout} needs {size} GPUs, the pool has {n}")
        batch = batch_sequences(job, ms)
        share = len(sp.gpus) / initial_pool
        units = max(1, min(n // size, int(share * n // size)))
        while units > 1 and batch % units:
            units -= 1
        per_replica = batch // units
        mbs = sp.micro_batch_size
        while per_replica % mbs:
            mbs -= 1
        first = sorted(sp.gpus)[0]
        offset = int(round(first / initial_pool * n / size)) * size
        if offset + units * size > n:
            offset = max(0, n - units * size)
        gpus = pool[offset:offset + units * size]
        sets = tuple(tuple(gpus[u * size:(u + 1) * size]) for u in range(units))
        stages.append(StagePlan(model_stage=sp.model_stage, layout=sp.layout, gpu_sets=sets, micro_batch_size=mbs,
                                grad_accum=per_replica // mbs, recompute=sp.recompute))
    return GlobalPlan(version=version, stages=tuple(stages))


def _recompute(plan: GlobalPlan, model_stage: str) -> GlobalPlan:
    return GlobalPlan(version=plan.version, stages=tuple(
        dataclasses.replace(s, recompute=True) if s.model_stage == model_stage else s for s in plan.stages))


def _simulate_baseline(trace: Trace, job: SimJob, *, policy: str, seed: int,
                       progress: Callable[[int, int], None] | None) -> RunResult:
    """static / restart / oracle: plans made here (the planner's search and DAG), timed by the same truth."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    port = SimPort()
    cluster = _cluster(job, trace)
    spec0 = job.spec(trace.rows[0].mean_response_tokens)
    truth = GroundTruth(job_spec(spec0), cluster, seed=seed, steps=len(trace) + 1)
    ttruth = TransitionTruth()
    result = RunResult(policy=policy, gamma=None, trace=trace.name, steps=[])
    plan: GlobalPlan | None = None
    plan0: GlobalPlan | None = None  # static: the plan whose layouts are kept
    initial_pool = 0
    version = 0
    oracle_cache: dict[tuple[int, int], GlobalPlan] = {}
    for i, row in enumerate(trace.rows):
        pool = list(range(row.gpus))
        w = _workload(row)
        trans = lost = 0.0
        changed = plan is None or len(plan.gpus | set(pool)) > row.gpus or (i and trace.rows[i - 1].gpus != row.gpus)
        if policy == "oracle":
            # this step's true lengths, calibrated efficiencies, no transition paid
            key = (row.gpus, int(round(math.log(row.mean_response_tokens) * 20)))
            if key not in oracle_cache:
                spec = job.spec(row.mean_response_tokens)
                version += 1
                oracle_cache[key] = port.search(spec, frozenset(pool), version).plan
            plan = oracle_cache[key]
        elif changed:
            version += 1
            spec = job.spec(row.mean_response_tokens)
            if plan is None or policy == "restart":
                new = port.search(spec, frozenset(pool), version).plan
                if plan is not None:
                    lost += restart_seconds(truth.job, cluster, row.gpus)
            else:
                assert plan0 is not None  # set at the first row
                try:
                    new = scale_plan(plan0, initial_pool, pool, job_spec(spec), version)
                except InfeasibleError:  # the fixed layouts no longer fit the pool: restart on a new plan
                    new = plan0 = port.search(spec, frozenset(pool), version).plan
                    initial_pool = row.gpus
                    lost += restart_seconds(truth.job, cluster, row.gpus)
                    plan = None
                try:
                    if plan is None:
                        raise InfeasibleError("restarted")
                    sketch = port.transition(spec, plan, new, frozenset(pool), lambda g: f"n{g // job.gpus_per_node}")
                    involved = len(plan.gpus | new.gpus)
                    trans = ttruth.seconds(sketch.dag, cluster, involved)
                    result.transitions.append({"step": row.step, "truth_s": trans, "predicted_s": sketch.predicted_s,
                                               "bytes_moved": sketch.bytes_moved})
                except InfeasibleError as exc:
                    if str(exc) != "restarted":
                        lost += restart_seconds(truth.job, cluster, row.gpus)
            if i == 0:
                plan0, initial_pool = new, row.gpus
            plan = new
        assert plan is not None and plan0 is not None or policy == "oracle"
        assert plan is not None
        record = StepRecord(step=row.step, gpus=row.gpus, step_s=0.0, transition_s=trans, lost_s=0.0,
                            response_tokens=row.mean_response_tokens, plan_version=plan.version)
        for _attempt in range(OOM_RETRIES):
            try:
                out = truth.run_step(plan, row.step, w)
            except OutOfMemory as oom:
                record.ooms += 1
                spec = job.spec(row.mean_response_tokens)
                if policy == "oracle":  # it knows the tail: plan again for it, for free
                    record.ooms -= 1
                    port.learn_oom(spec, frozenset(pool), plan, oom)
                    oracle_cache.clear()
                    version += 1
                    plan = oracle_cache[key] = port.search(spec, frozenset(pool), version).plan
                    continue
                lost += restart_seconds(truth.job, cluster, row.gpus)
                if policy == "restart":  # the job crashed: restarted on a plan sized for what failed
                    port.learn_oom(spec, frozenset(pool), plan, oom)
                    version += 1
                    plan = port.search(spec, frozenset(pool), version).plan
                    continue
                # static: the job crashed and is restarted by hand, that model-stage with recomputation
                if plan.stage(oom.model_stage).recompute:  # recomputation was not enough: replan by hand
                    port.learn_oom(spec, frozenset(pool), plan, oom)
                    version += 1
                    plan = plan0 = port.search(spec, frozenset(pool), version).plan
                    initial_pool = row.gpus
                else:
                    assert plan0 is not None
                    plan, plan0 = _recompute(plan, oom.model_stage), _recompute(plan0, oom.model_stage)
                continue
            record.step_s = out.step_latency_s
            # every baseline's later searches use efficiencies calibrated the same way as the controller's
            port.calibrate(job.spec(row.mean_response_tokens), protocol.Measurement(
                job_id="sim", node="sim", step=row.step, plan_version=max(plan.version, 0),
                step_latency_s=out.step_latency_s, stage_times_s=out.stage_times_s), plan)
            if row.node_loss:
                lost += out.step_latency_s
                if policy != "oracle":
                    lost += restart_seconds(truth.job, cluster, row.gpus) if policy == "restart" else 0.0
            break
        record.lost_s = lost
        result.steps.append(record)
        if progress is not None:
            progress(i + 1, len(trace))
    result.wall_s, result.cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
    return result


def save_json(path: str | Path, data: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(p)
