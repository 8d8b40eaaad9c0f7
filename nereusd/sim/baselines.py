"""The baselines that run without the controller: ``static`` (the initial TP/PP layouts kept, DP scaled to
the pool), ``restart`` (the best plan after each pool change, reached by checkpoint/restart) and ``oracle``
(the planner's best plan for every step's true lengths, free transitions). Plans are made here with the
planner's search and DAG and timed by the same ground truth as the controller's runs."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from nereusd.planning import job_spec
from nereusd.sim.port import SimPort
from nereusd.sim.results import RunResult, StepRecord
from nereusd.sim.trace import Trace
from nereusd.sim.truth import GroundTruth, OutOfMemory, TransitionTruth, restart_seconds
from nereusd.sim.world import SimJob, cluster_of, workload_of
from nereusd.wire import protocol
from planner.errors import InfeasibleError
from planner.plan import GlobalPlan, StagePlan

OOM_RETRIES = 4  # attempts of one step before the run gives up on it (counted as failed)


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


def simulate_baseline(trace: Trace, job: SimJob, *, policy: str, seed: int,
                       progress: Callable[[int, int], None] | None) -> RunResult:
    """static / restart / oracle: plans made here (the planner's search and DAG), timed by the same truth."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    port = SimPort()
    cluster = cluster_of(job, trace)
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
        w = workload_of(row)
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
