"""Calibration recovers hidden per-class efficiencies from noisy measurements; predictions improve."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from planner_jobs import h200, job

from planner.calibration import (
    Calibrator,
    OpMeasurement,
    fit_from_stage_times,
    huber_location,
    measurements_from_stage,
)
from planner.cost import PRIORS, Efficiencies, OpClass, OpTerm
from planner.prediction import predict
from planner.search import search

HIDDEN = Efficiencies({
    OpClass.GEMM: 0.71, OpClass.ATTENTION_PREFILL: 0.52, OpClass.ATTENTION_DECODE: 0.63,
    OpClass.MEMORY_BOUND: 0.82, OpClass.TP_ALLREDUCE_INTRA: 0.77, OpClass.TP_ALLREDUCE_INTER: 0.41,
    OpClass.PP_SEND_INTRA: 0.66, OpClass.PP_SEND_INTER: 0.58, OpClass.DP_ALLREDUCE_INTRA: 0.74,
    OpClass.DP_ALLREDUCE_INTER: 0.47, OpClass.WEIGHT_SYNC: 0.31, OpClass.STEP_OVERHEAD: 0.9,
    OpClass.DECODE_OVERHEAD: 0.8,
})


def _synthetic(rng: np.random.Generator, per_class: int, noise: float, outliers: float = 0.0) -> list[OpMeasurement]:
    """Spans of random size per class, timed with the hidden efficiency, lognormal noise, rare stalls."""
    out = []
    for cls in HIDDEN.learned:  # the classes a GPU job has (the CPU's launch classes are not hidden here)
        for _ in range(per_class):
            work, peak = float(rng.uniform(1e9, 1e13)), float(rng.choice([989e12, 4.8e12, 450e9, 50e9]))
            fixed = float(rng.uniform(0, 1e-4))
            t = work / (peak * HIDDEN[cls]) * float(np.exp(rng.normal(0, noise))) + fixed
            if rng.random() < outliers:
                t *= 5  # a straggler / one-off stall
            out.append(OpMeasurement(op_class=cls, work=work, peak_per_s=peak, measured_s=t, fixed_s=fixed))
    return out


def test_recovers_hidden_efficiencies_within_2_percent() -> None:
    rng = np.random.default_rng(7)
    cal = Calibrator(window=128).observe(_synthetic(rng, per_class=60, noise=0.05, outliers=0.05))
    fitted = cal.efficiencies()
    for cls in HIDDEN.learned:
        assert fitted[cls] == pytest.approx(HIDDEN[cls], rel=0.02), cls


def test_huber_ignores_outliers_the_mean_does_not() -> None:
    values = [0.0] * 18 + [3.0, 3.0]  # mean 0.3
    assert abs(huber_location(values)) < 0.05
    # without outliers (every residual within k MAD-scales) it is the mean, not the median (0.5)
    clean = [0.0, 0.1, 0.5, 0.6, 1.0]
    assert huber_location(clean) == pytest.approx(0.44, abs=1e-9)
    # a far point's influence is bounded: moving it 100x further moves the estimate by nothing
    # (the mean would move by 200), yet it is down-weighted, not dropped: the estimate stays above the
    # mean of the other four (0.3), which rejecting it outright would give
    far, farther = huber_location([*clean[:4], 11.0]), huber_location([*clean[:4], 1011.0])
    assert far == pytest.approx(farther, abs=1e-9) and 0.4 < far < 0.6
    assert huber_location([v + 2.0 for v in values]) == pytest.approx(2.0 + huber_location(values))


def test_unseen_classes_keep_their_priors_and_window_is_bounded() -> None:
    rng = np.random.default_rng(1)
    gemm_only = [m for m in _synthetic(rng, per_class=10, noise=0.01) if m.op_class is OpClass.GEMM]
    cal = Calibrator(window=4).observe(gemm_only)
    eff = cal.efficiencies()
    assert eff[OpClass.GEMM] == pytest.approx(HIDDEN[OpClass.GEMM], rel=0.03)
    assert eff[OpClass.PP_SEND_INTER] == PRIORS[OpClass.PP_SEND_INTER]
    assert cal.counts() == {"gemm": 4}


def test_prediction_error_falls_step_by_step() -> None:
    """A running job: each step measures every class once (25% noise); the planner's prediction of a fixed
    plan approaches the truth (the same cost model under the hidden efficiencies). Mean over 16 runs.
    No fixed per-step overhead: it is the same in truth and prediction and would only dilute the errors."""
    j = job("ppo", prompts=64, response_tokens=2048)
    cl = dataclasses.replace(h200(16), step_overhead_s=0.0)
    plan = search(j, cl).plan
    truth = predict(j, cl, plan, HIDDEN).step_latency_s
    curves = []
    for seed in range(16):
        rng = np.random.default_rng(seed)
        cal = Calibrator(window=64)
        errors = [abs(predict(j, cl, plan, cal.efficiencies()).step_latency_s - truth) / truth]
        for _ in range(16):
            cal = cal.observe(_synthetic(rng, per_class=1, noise=0.25))
            errors.append(abs(predict(j, cl, plan, cal.efficiencies()).step_latency_s - truth) / truth)
        curves.append(errors)
    mean = np.mean(curves, axis=0)
    assert mean[0] > 0.2  # the conservative priors are far off
    assert mean[0] > np.mean(mean[1:3]) > np.mean(mean[6:10]) > np.mean(mean[13:17])
    assert mean[16] < 0.03


def test_stage_times_become_per_class_records() -> None:
    j = job("ppo", prompts=64, response_tokens=2048)
    cl = h200(16)
    res = search(j, cl)
    pred = res.prediction
    truth = predict(j, cl, res.plan, HIDDEN)
    records = []
    for name in pred.stage_seconds:
        records += measurements_from_stage(pred.terms[name], PRIORS, truth.stage_seconds[name], source=name)
    assert {r.source for r in records} == set(pred.stage_seconds)
    # the records re-predict the measured stage times exactly under the efficiencies they imply
    for name in pred.stage_seconds:
        mine = [r for r in records if r.source == name]
        assert sum(r.measured_s for r in mine) == pytest.approx(truth.stage_seconds[name], rel=1e-9)
    refit = predict(j, cl, res.plan, Calibrator().observe(records).efficiencies())
    err_before = abs(pred.step_latency_s - truth.step_latency_s) / truth.step_latency_s
    err_after = abs(refit.step_latency_s - truth.step_latency_s) / truth.step_latency_s
    assert err_after < err_before / 2


def test_bad_measurements_name_the_field() -> None:
    with pytest.raises(ValueError, match="measurement.measured_s"):
        OpMeasurement(op_class=OpClass.GEMM, work=1.0, peak_per_s=1.0, measured_s=0.0)
    with pytest.raises(ValueError, match="measurement.fixed_s"):
        OpMeasurement(op_class=OpClass.GEMM, work=1.0, peak_per_s=1.0, measured_s=1.0, fixed_s=2.0)
    assert OpTerm(op_class=OpClass.GEMM, work=1.0, peak_per_s=1.0).seconds(PRIORS) > 0


def test_fit_from_stage_times_converges_on_the_running_plan() -> None:
    """What the daemon does each step: measured model-stage times in, efficiencies out (no fixed per-step
    overhead, which is exact in both and only dilutes the errors)."""
    j = job("ppo", prompts=64, response_tokens=2048)
    cl = dataclasses.replace(h200(16), step_overhead_s=0.0)
    plan = search(j, cl).plan
    truth = predict(j, cl, plan, HIDDEN)
    rng = np.random.default_rng(11)
    eff: Efficiencies = PRIORS
    errors = []
    for _ in range(8):
        errors.append(abs(predict(j, cl, plan, eff).step_latency_s - truth.step_latency_s) / truth.step_latency_s)
        measured = {k: v * float(np.exp(rng.normal(0, 0.03))) for k, v in truth.stage_seconds.items()}
        eff = fit_from_stage_times(j, plan, measured, eff, cluster=cl)
    assert errors[0] > 0.2 and errors[-1] < 0.05 and errors[-1] < errors[0] / 5
    assert fit_from_stage_times(j, plan, {"actor-gen": 1.0}, eff) is eff  # no cluster: nothing learned


def test_step_overhead_is_learned_from_the_step_latency() -> None:
    """The per-step overhead is what a step takes beyond its model-stages: a framework that pays 2.5 s
    where the cluster names 4 s is learned from the measured step latency, and is not without it."""
    j = job("ppo", prompts=64, response_tokens=2048)
    cl = h200(16)
    plan = search(j, cl).plan
    truth = predict(j, cl, plan, HIDDEN)
    stages_only = truth.step_latency_s - truth.overhead_s
    rng = np.random.default_rng(5)
    with_latency: Efficiencies = PRIORS
    without: Efficiencies = PRIORS
    for _ in range(10):
        noise = {k: float(np.exp(rng.normal(0, 0.03))) for k in truth.stage_seconds}
        measured = {k: v * noise[k] for k, v in truth.stage_seconds.items()}
        step = stages_only * float(np.mean(list(noise.values()))) + 2.5 * float(np.exp(rng.normal(0, 0.03)))
        with_latency = fit_from_stage_times(j, plan, measured, with_latency, cluster=cl, step_latency_s=step)
        without = fit_from_stage_times(j, plan, measured, without, cluster=cl)
    assert predict(j, cl, plan, with_latency).overhead_s == pytest.approx(2.5, rel=0.08)
    assert predict(j, cl, plan, without).overhead_s == pytest.approx(cl.step_overhead_s)


# Stage times (ms) of the live job's first 20 steps on this machine (2 shared CPU cores, 2 gloo workers):
# etc/jobs/live.toml (GRPO, tiny-byte, 8 prompts x 2 samples) on the plan the search picks for 2 CPU slots
# (every stage DP2; actor-gen and ref-inf one micro-batch of 8 per replica, actor-train 4), as the driver
# reports them (the slowest worker). Recorded with agent.engine.live; tests/engine/test_live_calibration.py
# runs the same live.
LIVE_SPEC = {"model": "tiny-byte", "algo": "grpo", "device": "cpu", "gpus_per_node": 2, "learned_reward": False,
             "workload": {"prompts_per_step": 8, "samples_per_prompt": 2, "prompt_tokens": 5, "response_tokens": 4,
                          "train_mini_batches_per_step": 2}}
LIVE_STEPS_MS = {
    "actor-gen": [21.6, 24.6, 25.4, 25.7, 22.9, 21.8, 24.0, 24.9, 36.4, 33.6, 29.1, 33.6, 29.9, 38.0, 36.5, 32.5,
                  26.0, 20.5, 18.7, 31.9],
    "ref-inf": [7.9, 7.5, 9.3, 9.0, 7.1, 7.1, 7.3, 6.5, 10.0, 10.6, 8.0, 11.1, 7.7, 10.3, 13.8, 9.6, 11.8, 6.5, 6.5,
                10.5],
    "actor-train": [40.1, 44.4, 44.9, 53.3, 37.8, 51.7, 99.8, 51.4, 54.3, 59.6, 50.4, 46.3, 56.3, 60.8, 62.5, 48.6,
                    38.1, 36.5, 34.2, 60.9],
}


def test_stage_fit_matches_recorded_live_cpu_steps_within_10_percent() -> None:
    """The joint fit on real stage times: every model-stage of the running plan within 10% of the median
    of the last 8 steps after 20 (the launch classes give each stage kind its own class; the priors alone
    are 50-80% off)."""
    from nereusd.planning import cluster_for, job_spec

    j, cl = job_spec(LIVE_SPEC), cluster_for(LIVE_SPEC, frozenset({0, 1}))
    plan = search(j, cl, pool=[0, 1]).plan
    assert {(sp.model_stage, sp.dp, sp.micro_batch_size) for sp in plan} == {
        ("actor-gen", 2, 8), ("ref-inf", 2, 8), ("actor-train", 2, 4)}
    eff: Efficiencies = PRIORS
    for step in range(20):
        eff = fit_from_stage_times(j, plan, {k: v[step] / 1e3 for k, v in LIVE_STEPS_MS.items()}, eff, cluster=cl)
    pred, priors = predict(j, cl, plan, eff), predict(j, cl, plan, PRIORS)
    for name, times in LIVE_STEPS_MS.items():
        median = float(np.median(times[-8:])) / 1e3
        assert abs(pred.stage_seconds[name] / median - 1) < 0.10, (name, pred.stage_seconds[name], median)
        assert abs(priors.stage_seconds[name] / median - 1) > 0.4
    assert {OpClass.LAUNCH_DECODE, OpClass.LAUNCH_FORWARD, OpClass.LAUNCH_BACKWARD} <= set(eff.learned)
