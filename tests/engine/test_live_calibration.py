"""Calibration on the live engine's own measurements: after N steps the planner predicts every model-stage
of the running plan within 10% of what this machine measures.

Real spawned workers (agent.coordinator.LocalCoordinator, 2 CPU workers over gloo) run the engine
(agent.engine.live bind/train_step) on etc/jobs/live.toml's RunConfig (GRPO, tiny-byte, 8 prompts x 2
samples), on the plan the planner's search picks for a 2-GPU pool of the job file's spec, passed through
the daemon's plan form (nereusd.controller.plan_to_dict, agent.driver.plan_from_part). Each step's stage
times are reported as the driver does (per model-stage, the slowest worker; weight-sync is no
model-stage) and fed through PlannerBinding.calibrate with the spec the controller would use
(_spec_now: the measured response length); then PlannerBinding.predict, as the controller's
re-prediction does.

N = 20 steps; the reference is the median of the last 8 measured steps (a single step on 2 shared cores
swings by 30% or more, and other sessions' load shifts the level by 2x within a few steps: where the
last 8 straddle such a shift at step 20, the check is repeated after each further step, up to 30).
Measured on this machine: before (one GEMM-like efficiency per class, each stage's time split among its
classes in proportion) -48%, +35%, +6% (actor-gen, ref-inf, actor-train) after 20 steps, 30-60% after
80 in the daemon; now -1..+6%, +2..+8%, -4..+8% over five runs (the priors alone: -47..-85%).

Transfer to a second layout (the same classes on other shapes) is checked loosely: after calibrating on
the running plan, a plan whose actor-train runs 4x the micro-batches (a quarter the size) is predicted
within a factor of 2.5 of its measurement (measured 0.86-2.2x), once the machine's drift between the two
runs is taken out (actor-gen and ref-inf, unchanged, measure it: other sessions' load on the shared
cores moves stage times by up to 2.7x between runs here). Not within 10%: each stage's results are
handed to every rank (an all-reduce over the job's workers that also waits for the slowest replica,
~5 ms under load, once per stage or training mini-batch) and the cost model has no term for that
hand-off, so its fixed time is learned as per-pass launch cost and scales with micro-batches.

Takes 25-50 s (one spawn of 2 torch workers, 32 steps). Marked multiprocess.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.coordinator import LocalCoordinator
from agent.driver import plan_from_part
from agent.engine.jobfile import load_job
from agent.engine.live import LiveStep, bind, train_step
from nereusd.controller import plan_to_dict
from nereusd.jobfile import job_spec
from nereusd.planning import PlannerBinding
from nereusd.wire import protocol
from planner.plan import GlobalPlan, StagePlan

pytestmark = pytest.mark.multiprocess

JOB_FILE = "etc/jobs/live.toml"
POOL = frozenset({0, 1})  # one local node of 2 CPU slots: GPU ids are worker ids
STEPS = 20  # N: calibration steps on the running plan
MAX_STEPS = 30  # where the last RECENT steps straddle a shift of the machine's load, a few more steps
RECENT = 8  # the reference: median of the last RECENT measured steps
BOUND = 0.10
TRANSFER_STEPS = 12
TRANSFER_FACTOR = 2.5


def forget(ctx: Any) -> int:
    """Drop the engine and every unit: the next bind is a fresh start (another plan's units)."""
    ctx.engine = None
    ctx.units.clear()
    return 0


@pytest.fixture(scope="module")
def workers() -> Iterator[LocalCoordinator]:
    with LocalCoordinator(2, timeout_s=120) as coord:
        coord.form_generation(tuple(sorted(POOL)))
        yield coord


def _spec_now(spec: dict[str, Any], response_tokens: float) -> dict[str, Any]:
    """The controller's _spec_now: the job spec with the measured response length."""
    response = max(1, round(response_tokens))
    workload = spec["workload"]
    return {**spec, "workload": {**workload, "response_tokens": response,
                                 "max_response_tokens": max(response, int(workload.get("max_response_tokens") or 0))}}


def _measurement(step: int, plan: GlobalPlan, results: dict[int, LiveStep]) -> protocol.Measurement:
    """What agent.driver.JobDriver._measure reports for one step."""
    stages: dict[str, float] = {}
    for r in results.values():
        for name, s in r.stage_seconds.items():
            stages[name] = max(stages.get(name, 0.0), float(s))
    r0 = results[min(results)]
    return protocol.Measurement(job_id="live", node="local-x", step=step, plan_version=plan.version,
                                step_latency_s=max(float(r.seconds) for r in results.values()),
                                stage_times_s={k: v for k, v in stages.items() if k != "weight-sync"},
                                peak_memory_bytes={f"worker{w}": int(r.peak_memory_bytes) for w, r in results.items()},
                                response_tokens=float(r0.mean_response_tokens))


def _run(coord: LocalCoordinator, cfg: Any, spec: dict[str, Any], plan: GlobalPlan, steps: int,
         binding: PlannerBinding | None, first: int = 0) -> tuple[list[protocol.Measurement], dict[str, Any]]:
    """``steps`` RL steps of ``plan`` from step ``first`` (0: from fresh units); each measurement
    calibrates ``binding`` (if given)."""
    if first == 0:
        coord.call(forget)
        coord.call(bind, cfg=cfg, plan=plan, collective=True)
    out, now = [], spec
    for s in range(first, first + steps):
        msg = _measurement(s, plan, coord.call(train_step, step=s, collective=True))
        now = _spec_now(spec, msg.response_tokens or 0.0)
        if binding is not None:
            binding.calibrate(now, msg, plan)
        out.append(msg)
    return out, now


def _errors(binding: PlannerBinding, spec: dict[str, Any], plan: GlobalPlan,
            measured: list[protocol.Measurement]) -> dict[str, tuple[float, float, float]]:
    """model-stage -> (predicted s, median measured s of the last RECENT steps, relative error)."""
    pred = binding.predict(spec, POOL, plan)
    assert pred is not None
    out = {}
    for name, predicted in pred.stage_seconds.items():
        median = _median(measured, name)
        out[name] = (predicted, median, predicted / median - 1)
    return out


def test_calibrated_prediction_of_the_running_plan_is_within_10_percent(workers: LocalCoordinator) -> None:
    t0 = time.perf_counter()
    cfg, _ = load_job(JOB_FILE)
    spec = job_spec(JOB_FILE, anchor_job_id="local-x")
    binding = PlannerBinding()
    chosen = binding.search(spec, POOL, version=1).plan
    plan = plan_from_part(plan_to_dict(chosen))  # what the order carries to the driver
    assert plan == chosen and {sp.model_stage for sp in plan} == {"actor-gen", "ref-inf", "actor-train"}
    uncalibrated = binding.predict(spec, POOL, plan)
    assert uncalibrated is not None

    measured, now = _run(workers, cfg, spec, plan, STEPS, binding)
    errors = _errors(binding, now, plan, measured)
    while not _within(errors) and len(measured) < MAX_STEPS:  # a load shift inside the window: step on
        more, now = _run(workers, cfg, spec, plan, 1, binding, first=len(measured))
        measured += more
        errors = _errors(binding, now, plan, measured)
    before = {k: uncalibrated.stage_seconds[k] / m - 1 for k, (_, m, _) in errors.items()}
    report = ", ".join(f"{k}: {1e3 * p:.1f} vs {1e3 * m:.1f} ms ({100 * e:+.0f}%; priors {100 * before[k]:+.0f}%)"
                       for k, (p, m, e) in errors.items())
    print(f"after {len(measured)} steps on {[(sp.model_stage, str(sp.layout), sp.dp) for sp in plan]}: {report}; "
          f"{time.perf_counter() - t0:.0f} s")
    assert _within(errors), report + "; measured (ms): " + str(
        {k: [round(1e3 * m.stage_times_s[k], 1) for m in measured] for k in errors})

    # transfer: the same efficiencies on other shapes (actor-train in 4x the micro-batches)
    other = GlobalPlan(version=2, stages=tuple(
        StagePlan(model_stage=sp.model_stage, layout=sp.layout, gpu_sets=sp.gpu_sets,
                  micro_batch_size=sp.micro_batch_size // 4, grad_accum=sp.grad_accum * 4)
        if sp.model_stage == "actor-train" else sp for sp in plan))
    predicted_other = binding.predict(now, POOL, other)
    assert predicted_other is not None
    measured_other, _ = _run(workers, cfg, spec, other, TRANSFER_STEPS, None)
    # actor-gen and ref-inf run the same plan in both runs: their measured ratio is the machine's drift in
    # between (other sessions' load on the shared cores), which no cost model predicts
    drift = statistics.geometric_mean(_median(measured_other, k) / _median(measured, k)
                                      for k in ("actor-gen", "ref-inf"))
    transfer = {k: v * drift / _median(measured_other, k) for k, v in predicted_other.stage_seconds.items()}
    print(f"second plan, predicted x drift {drift:.2f} / measured:", {k: round(v, 2) for k, v in transfer.items()},
          f"{time.perf_counter() - t0:.0f} s")
    assert all(1 / TRANSFER_FACTOR <= v <= TRANSFER_FACTOR for v in transfer.values()), transfer


def _within(errors: dict[str, tuple[float, float, float]]) -> bool:
    return all(abs(e) <= BOUND for _, _, e in errors.values())


def _median(measured: list[protocol.Measurement], stage: str) -> float:
    return statistics.median(m.stage_times_s[stage] for m in measured[-RECENT:])
