"""The calibration's parts with values worked out by hand (planner/calibration.py): a measurement's
checks and implied efficiency, the Huber location's fixed point, the per-class window, per-class
records from a stage time, a stage observation's sums, the joint stage fit (exact recovery from
noise-free stages of different mixes, the efficiency bounds, recent steps outweighing old ones), and
one calibration step's bookkeeping and per-step overhead. Found by mutation testing
(tests/mutate.py --module planner/calibration.py: the fit was tested by convergence on presets)."""

from __future__ import annotations

import math

import pytest
from planner_jobs import h200, job

from planner.calibration import (
    HUBER_K,
    MIN_EFFICIENCY,
    MIN_SCALE,
    CalibratedEfficiencies,
    Calibrator,
    OpMeasurement,
    StageFit,
    StageObservation,
    _overhead_observation,
    fit_from_stage_times,
    huber_location,
    measurements_from_stage,
    stage_observation,
)
from planner.cost import PRIORS, Efficiencies, OpClass, OpTerm
from planner.errors import SpecError
from planner.prediction import predict, schedule
from planner.search import search

G, M = OpClass.GEMM, OpClass.MEMORY_BOUND


def test_a_measurement_implies_work_over_peak_times_the_variable_time() -> None:
    m = OpMeasurement(op_class=G, work=6.0, peak_per_s=2.0, measured_s=5.0, fixed_s=2.0)
    assert m.implied_efficiency == pytest.approx(1.0)
    assert OpMeasurement(op_class=G, work=6.0, peak_per_s=2.0, measured_s=5.0).implied_efficiency == 0.6


@pytest.mark.parametrize("kw,text", [
    ({"op_class": "gemm"}, "measurement.op_class: unknown op class 'gemm' (allowed: "
                           + ", ".join(c.value for c in OpClass) + ")"),
    ({"work": 0.0}, "measurement.work: must be finite and > 0, got 0.0"),
    ({"peak_per_s": math.inf}, "measurement.peak_per_s: must be finite and > 0, got inf"),
    ({"measured_s": -1.0}, "measurement.measured_s: must be finite and > 0, got -1.0"),
    ({"fixed_s": 5.0}, "measurement.fixed_s: must be in [0, measured_s=5.0), got 5.0"),
    ({"fixed_s": -0.1}, "measurement.fixed_s: must be in [0, measured_s=5.0), got -0.1"),
    ({"fixed_s": math.nan}, "measurement.fixed_s: must be in [0, measured_s=5.0), got nan"),
])
def test_a_bad_measurement_names_its_field(kw: dict[str, object], text: str) -> None:
    args: dict[str, object] = {"op_class": G, "work": 6.0, "peak_per_s": 2.0, "measured_s": 5.0, **kw}
    with pytest.raises(SpecError) as info:
        OpMeasurement(**args)  # type: ignore[arg-type]
    assert str(info.value).startswith(text)


def test_the_huber_location_is_the_fixed_point_of_its_clipped_score() -> None:
    # inside the threshold every point weighs 1: the mean (median 2, MAD scale 1.4826, |r| <= 0.68)
    assert huber_location([1.0, 2.0, 3.0]) == pytest.approx(2.0)
    assert huber_location([1.0, 2.0, 6.0]) == pytest.approx(
        # 6 is |6 - mu| / 1.4826 > k away: it pulls with k x scale, so 2 (1 + 2 - 2 mu) ... solved below
        _huber_by_bisection([1.0, 2.0, 6.0], 1.4826), abs=1e-7)
    # four zeros and an outlier, scale at its floor: 4 (-mu / s) + k = 0, so mu = k s / 4
    assert huber_location([0.0, 0.0, 0.0, 0.0, 10.0]) == pytest.approx(HUBER_K * MIN_SCALE / 4, abs=1e-9)
    # one iteration: the first reweighted mean, not yet the fixed point
    w = HUBER_K / (10.0 / MIN_SCALE)
    assert huber_location([0.0, 0.0, 0.0, 0.0, 10.0], iterations=1) == pytest.approx(10 * w / (4 + w), rel=1e-9)
    # a threshold below 1 scale: the clipped points' weights k / |r| with |r| between k and 1
    y = [0.0, 0.0, 0.3, 1.2, 1.25, 5.0]
    assert huber_location(y, k=0.5) == pytest.approx(_huber_irls_scale(y, k=0.5), abs=1e-7)
    assert huber_location([0.0, 0.0, 0.0, 0.0, 10.0], k=100.0) == pytest.approx(
        _huber_by_bisection([0.0, 0.0, 0.0, 0.0, 10.0], MIN_SCALE, k=100.0), abs=1e-9)


def _huber_irls_scale(y: list[float], k: float) -> float:
    """The Huber root by bisection at the scale the estimator uses (1.4826 x the MAD about the median)."""
    import statistics

    med = statistics.median(y)
    scale = max(1.4826 * statistics.median(abs(v - med) for v in y), MIN_SCALE)
    return _huber_by_bisection(y, scale, k=k)


def _huber_by_bisection(y: list[float], scale: float, k: float = HUBER_K) -> float:
    """The root of sum psi((y - mu) / scale), psi clipped at k, by bisection."""
    def score(mu: float) -> float:
        return sum(max(-k, min(k, (v - mu) / scale)) for v in y)
    lo, hi = min(y), max(y)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if score(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


def _m(cls: OpClass, eff: float) -> OpMeasurement:
    return OpMeasurement(op_class=cls, work=eff, peak_per_s=1.0, measured_s=1.0)


def test_the_calibrator_keeps_the_last_window_per_class_and_fits_each_class() -> None:
    c = Calibrator(window=2).observe([_m(G, 0.1), _m(G, 0.2), _m(M, 0.4)]).observe([_m(G, 0.3)])
    assert c.samples[G] == pytest.approx((math.log(0.2), math.log(0.3)))
    assert c.samples[M] == pytest.approx((math.log(0.4),))
    assert c.counts() == {"gemm": 2, "memory_bound": 1}
    eff = c.efficiencies()
    assert eff[G] == pytest.approx(math.sqrt(0.2 * 0.3))  # two points: the log-mean
    assert eff[M] == pytest.approx(0.4)
    assert eff[OpClass.ATTENTION_DECODE] == PRIORS[OpClass.ATTENTION_DECODE]
    # a class with fewer samples than asked keeps the base; a fit is capped at 1.5
    two = Calibrator(min_samples=2).observe([_m(G, 3.0), _m(G, 4.0), _m(M, 0.4)])
    assert two.window == 64 and two.min_samples == 2
    assert two.efficiencies()[G] == 1.5
    assert two.efficiencies()[M] == PRIORS[M]
    base = Efficiencies({M: 0.33})
    assert two.efficiencies(base)[M] == 0.33


def test_windows_of_one_and_the_fit_state_a_calibration_carries() -> None:
    assert Calibrator(window=1).observe([_m(G, 0.1), _m(G, 0.2)]).samples[G] == pytest.approx((math.log(0.2),))
    assert StageFit(window=1).observe([_obs({G: 1.0}, {G: 0.2}, 0), _obs({G: 1.0}, {G: 0.8}, 0)]).efficiencies()[G] == (
        pytest.approx(0.8, rel=1e-3))
    cal, fit = Calibrator(window=3), StageFit(window=5)
    carried = CalibratedEfficiencies({G: 0.3}, calibrator=cal, stage_fit=fit)
    assert carried.calibrator is cal and carried.stage_fit is fit and carried[G] == 0.3
    fresh = CalibratedEfficiencies({})
    assert fresh.calibrator == Calibrator() and fresh.stage_fit == StageFit()


@pytest.mark.parametrize("kw,text", [({"window": 0}, "calibrator.window: must be >= 1, got 0"),
                                     ({"min_samples": 0}, "calibrator.min_samples: must be >= 1, got 0")])
def test_a_bad_calibrator_names_its_field(kw: dict[str, int], text: str) -> None:
    with pytest.raises(SpecError) as info:
        Calibrator(**kw)  # type: ignore[arg-type]
    assert str(info.value) == text


def test_stage_time_is_shared_among_classes_by_their_predicted_seconds() -> None:
    eff = {G: 0.5, M: 0.25, OpClass.TP_ALLREDUCE_INTRA: 1.0}
    terms = [OpTerm(op_class=G, work=4.0, peak_per_s=2.0, repeat=2.0),  # 2 x 4 s
             OpTerm(op_class=M, work=1.0, peak_per_s=1.0),  # 4 s
             OpTerm(op_class=OpClass.TP_ALLREDUCE_INTRA, work=1.0, peak_per_s=1.0, messages=2.0, latency_s=0.5,
                    repeat=2.0)]  # 2 x (1 + 1) s, of which 2 s latency
    # predicted 16 s, of which 2 s latency; measured 30 s: 28 s shared 8 : 4 : 2
    out = measurements_from_stage(terms, eff, 30.0, source="s")
    assert [(o.op_class, o.work, o.peak_per_s, o.source) for o in out] == [
        (G, 8.0, 2.0, "s"), (M, 1.0, 1.0, "s"), (OpClass.TP_ALLREDUCE_INTRA, 2.0, 1.0, "s")]
    assert [o.measured_s for o in out] == pytest.approx([16.0, 8.0, 4.0 + 2.0])
    assert [o.fixed_s for o in out] == pytest.approx([0.0, 0.0, 2.0])
    assert measurements_from_stage(terms, eff, 2.0) == []  # the latencies take it all
    # a variable part lost next to the latency (1 + 2e-30 - 1 = 0): latency-bound, nothing to learn
    latency_only = [OpTerm(op_class=G, work=1e-30, peak_per_s=1.0, messages=1.0, latency_s=1.0)]
    assert measurements_from_stage(latency_only, eff, 5.0) == []
    assert measurements_from_stage([], eff, 5.0) == []
    assert {o.source for o in measurements_from_stage(terms, eff, 30.0)} == {""}  # no source given
    # a term with no work learns nothing and does not stop the terms after it
    idle = OpTerm(op_class=OpClass.ATTENTION_DECODE, work=0.0, peak_per_s=1.0)
    eff[OpClass.ATTENTION_DECODE] = 0.5
    assert [o.op_class for o in measurements_from_stage([idle, *terms], eff, 30.0)] == [
        G, M, OpClass.TP_ALLREDUCE_INTRA]
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(SpecError, match="measured_s: must be finite and > 0"):
            measurements_from_stage(terms, eff, bad)


def test_a_stage_observation_sums_ideal_seconds_per_class_and_latencies() -> None:
    terms = [OpTerm(op_class=G, work=6.0, peak_per_s=2.0, repeat=3.0),
             OpTerm(op_class=G, work=1.0, peak_per_s=4.0),
             OpTerm(op_class=M, work=2.0, peak_per_s=1.0, messages=3.0, latency_s=0.25, repeat=2.0)]
    o = stage_observation(terms, 40.0, 7, source="x")
    assert dict(o.ideal_s) == pytest.approx({G: 9.25, M: 4.0})
    assert o.fixed_s == pytest.approx(1.5)
    assert (o.measured_s, o.step, o.source) == (40.0, 7, "x")
    assert stage_observation(terms, 40.0, 7).source == ""


def _obs(a: dict[OpClass, float], eff: dict[OpClass, float], step: int, fixed: float = 0.0) -> StageObservation:
    """A stage timed exactly with efficiencies ``eff``."""
    return StageObservation(ideal_s=a, fixed_s=fixed, measured_s=sum(v / eff[c] for c, v in a.items()) + fixed,
                            step=step)


def test_the_stage_fit_recovers_efficiencies_from_stages_of_different_mixes() -> None:
    truth = {G: 0.3, M: 0.7}
    fit = StageFit().observe([_obs({G: 1.0, M: 2.0}, truth, 0), _obs({G: 3.0, M: 0.5}, truth, 0, fixed=0.5),
                              _obs({G: 0.2}, truth, 0)])
    eff = fit.efficiencies()
    assert eff[G] == pytest.approx(0.3, rel=1e-3) and eff[M] == pytest.approx(0.7, rel=1e-3)
    assert eff[OpClass.ATTENTION_DECODE] == PRIORS[OpClass.ATTENTION_DECODE]
    assert fit.counts() == {"gemm": 3, "memory_bound": 2}
    # a stage all latency teaches nothing; nothing to fit returns the base itself
    assert StageFit().observe([StageObservation(ideal_s={G: 1.0}, fixed_s=2.0, measured_s=2.0, step=0)]
                              ).efficiencies() is PRIORS
    # a class with zero ideal time in every stage is not fitted
    zero = StageFit().observe([_obs({G: 1.0, M: 0.0}, truth, 0)]).efficiencies()
    assert zero[M] == PRIORS[M] and zero[G] == pytest.approx(0.3, rel=1e-3)


def test_the_stage_fit_keeps_efficiencies_within_their_bounds() -> None:
    fast = StageFit().observe([StageObservation(ideal_s={G: 1.0}, fixed_s=0.0, measured_s=1e-6, step=0)])
    assert fast.efficiencies()[G] == 1.5
    slow = StageFit().observe([StageObservation(ideal_s={G: 1.0}, fixed_s=0.0, measured_s=1e12, step=0)])
    assert slow.efficiencies()[G] == pytest.approx(MIN_EFFICIENCY)


def test_recent_steps_outweigh_old_ones() -> None:
    old = [_obs({G: 1.0}, {G: 0.2}, 0)] * 4
    new = [_obs({G: 1.0}, {G: 0.8}, 9)] * 4  # measured 9 calibration steps later
    fits = {}
    for half_life in (1.0, 4.0):
        fit = StageFit(half_life_steps=half_life).observe(old).observe(new)
        assert fit.steps == 2 and len(fit.observations) == 8
        fits[half_life] = fit.efficiencies()[G]
    # half-life 1: the old ones weigh 2^-9 each, the fit sits at the new 0.8; half-life 4: 2^-2.25 = 0.21,
    # a weighted log-mean of exp((0.21 log 0.2 + log 0.8) / 1.21) = 0.63 before the Huber weights
    assert 0.79 < fits[1.0] < 0.8
    assert 0.55 < fits[4.0] < 0.75
    even = StageFit(half_life_steps=1e9, observations=(*old, *new), steps=2).efficiencies()[G]
    # equal weights, every residual past the Huber threshold: the loss is flat anywhere between the two
    # clusters (each side pulls with k), so the prior's pull settles it at the prior
    assert 0.2 < PRIORS[G] < 0.8
    assert even == pytest.approx(PRIORS[G], rel=1e-6)
    # the window keeps the last observations only
    assert StageFit(window=3).observe(old).observe(new).observations == tuple(new[-3:])


@pytest.mark.parametrize("kw,text", [({"window": 0}, "stage_fit.window: must be >= 1, got 0"),
                                     ({"half_life_steps": 0.0}, "stage_fit.half_life_steps: must be > 0, got 0.0")])
def test_a_bad_stage_fit_names_its_field(kw: dict[str, float], text: str) -> None:
    with pytest.raises(SpecError) as info:
        StageFit(**kw)  # type: ignore[arg-type]
    assert str(info.value) == text


def test_one_calibration_step_observes_the_measured_stages_of_the_plan() -> None:
    j = job("ppo", model="tiny-25m", prompts=16, response_tokens=256)
    cl = h200(8)
    plan = search(j, cl).plan
    prev = Efficiencies({G: 0.2})
    assert fit_from_stage_times(j, plan, {"actor-gen": 1.0}, prev) is prev  # no cluster: nothing learned
    assert fit_from_stage_times(j, plan, {"actor-gen": 1.0}) is PRIORS
    times = {"actor-gen": 2.0, "ref-inf": math.nan, "critic-inf": 0.0, "no-such-stage": 1.0, "actor-train": 3.0}
    one = fit_from_stage_times(j, plan, times, prev, cluster=cl, window=5)
    assert isinstance(one, CalibratedEfficiencies)
    assert one.stage_fit.steps == 1 and one.stage_fit.window == 5
    assert [o.source for o in one.stage_fit.observations] == ["actor-gen", "actor-train"]
    pred = predict(j, cl, plan, prev)  # the observations are priced under the efficiencies in use
    assert one.stage_fit.observations[0] == stage_observation(pred.terms["actor-gen"], 2.0, 0, source="actor-gen")
    two = fit_from_stage_times(j, plan, times, one, cluster=cl)
    assert isinstance(two, CalibratedEfficiencies)
    assert two.stage_fit.steps == 2 and len(two.stage_fit.observations) == 4  # the fit state carries on
    assert two.stage_fit.observations[2].step == 1


def test_a_calibration_step_predicts_the_plan_only_when_a_stage_of_it_was_measured(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The plan's terms come from ``predicted`` where the caller has it, else from one predict; a step
    measuring none of the plan's model-stages (no stage times, or only unknown, zero or NaN ones) needs
    none. Either way the fit is the one a fresh prediction gives."""
    import planner.calibration as calibration

    j = job("ppo", model="tiny-25m", prompts=16, response_tokens=256)
    cl = h200(8)
    plan = search(j, cl).plan
    prev = Efficiencies({G: 0.2})
    times = {"actor-gen": 2.0, "no-such-stage": 1.0, "actor-train": 3.0}
    fresh = fit_from_stage_times(j, plan, times, prev, cluster=cl)
    calls: list[object] = []
    monkeypatch.setattr(calibration, "predict", lambda *a: calls.append(a) or predict(*a))
    given = fit_from_stage_times(j, plan, times, prev, cluster=cl, predicted=predict(j, cl, plan, prev))
    assert calls == [] and isinstance(given, CalibratedEfficiencies) and isinstance(fresh, CalibratedEfficiencies)
    assert given.stage_fit.observations == fresh.stage_fit.observations and dict(given) == dict(fresh)
    for nothing in ({}, {"no-such-stage": 1.0, "actor-gen": 0.0, "actor-train": math.nan}):
        none = fit_from_stage_times(j, plan, nothing, prev, cluster=cl)
        assert calls == [] and isinstance(none, CalibratedEfficiencies)
        assert none.stage_fit.steps == 1 and none.stage_fit.observations == ()
    again = fit_from_stage_times(j, plan, {"ref-inf": 1.5}, prev, cluster=cl)
    assert len(calls) == 1 and isinstance(again, CalibratedEfficiencies)
    assert again.stage_fit.observations[0] == stage_observation(predict(j, cl, plan, prev).terms["ref-inf"], 1.5, 0,
                                                                source="ref-inf")


def test_a_calibration_step_prices_the_slowest_replica_under_the_efficiencies_in_use() -> None:
    """Replicas on different links: which one is slowest, so whose terms a stage time is read against,
    depends on the efficiencies, and the fit reads them under the ones in use (not the priors)."""
    from planner.plan import GlobalPlan, Layout, StagePlan

    j = job("ppo", model="tiny-25m", prompts=16, response_tokens=256)
    cl = h200(16)
    found = search(j, cl).plan
    split = StagePlan(model_stage="actor-train", layout=Layout(2, 1), gpu_sets=((0, 1), (7, 8)), micro_batch_size=8)
    plan = GlobalPlan(version=1, stages=tuple(split if s.model_stage == "actor-train" else s for s in found.stages))
    prev = Efficiencies({OpClass.TP_ALLREDUCE_INTER: 1.5, OpClass.TP_ALLREDUCE_INTRA: 0.01})
    under_prev, under_priors = (predict(j, cl, plan, e).terms["actor-train"] for e in (prev, PRIORS))
    assert under_prev != under_priors  # the intra-node replica is the slow one only under ``prev``
    step = fit_from_stage_times(j, plan, {"actor-train": 1.0}, prev, cluster=cl)
    assert isinstance(step, CalibratedEfficiencies)
    assert step.stage_fit.observations[0] == stage_observation(under_prev, 1.0, 0, source="actor-train")


def test_the_step_overhead_observation_is_the_step_beyond_its_model_stages() -> None:
    j = job("ppo", model="tiny-25m", prompts=16, response_tokens=256)
    cl = h200(8)
    plan = search(j, cl).plan
    seconds = {sp.model_stage: 1.0 + 0.1 * i for i, sp in enumerate(plan)}
    stages = schedule(j, plan, seconds)[0]
    o = _overhead_observation(j, plan, seconds, stages + 3.0, cl, 4)
    assert o is not None
    assert dict(o.ideal_s) == {OpClass.STEP_OVERHEAD: cl.step_overhead_s}
    assert (o.fixed_s, o.measured_s, o.step, o.source) == (0.0, pytest.approx(3.0), 4, "step-overhead")
    # no time left over reads as a tenth of the named overhead
    low = _overhead_observation(j, plan, seconds, stages - 1.0, cl, 4)
    assert low is not None and low.measured_s == pytest.approx(0.1 * cl.step_overhead_s)
    missing = {k: v for k, v in list(seconds.items())[1:]}
    assert _overhead_observation(j, plan, missing, stages + 3.0, cl, 4) is None
    assert _overhead_observation(j, plan, {**seconds, plan.stages[0].model_stage: 0.0}, stages + 3.0, cl, 4) is None
    assert _overhead_observation(j, plan, seconds, None, cl, 4) is None
    assert _overhead_observation(j, plan, seconds, math.nan, cl, 4) is None
    import dataclasses

    none = dataclasses.replace(cl, step_overhead_s=0.0)
    assert _overhead_observation(j, plan, seconds, stages + 3.0, none, 4) is None
    half = _overhead_observation(j, plan, seconds, stages + 3.0, dataclasses.replace(cl, step_overhead_s=0.5), 4)
    assert half is not None and dict(half.ideal_s) == {OpClass.STEP_OVERHEAD: 0.5}  # below a second is an overhead
    # through one calibration step: the overhead joins the stage observations
    step = fit_from_stage_times(j, plan, seconds, None, cluster=cl, step_latency_s=stages + 3.0)
    assert isinstance(step, CalibratedEfficiencies)
    assert step.stage_fit.observations[-1].source == "step-overhead"
    assert len(step.stage_fit.observations) == len(seconds) + 1


def test_the_stage_fit_lands_on_the_root_of_its_reweighted_score() -> None:
    """One class, noisy stages with latencies, an outlier and old steps: the fit's efficiency is where the
    Huber-reweighted score of the log residuals plus the prior's pull is zero (found here by bisection,
    independently of the Gauss-Newton steps and their damping)."""
    import numpy as np

    from planner.calibration import PRIOR_WEIGHT, STAGE_HUBER_K

    a = np.array([1.0, 2.0, 0.5, 3.0, 1.5, 2.5])
    fixed = np.array([0.0, 0.3, 0.1, 0.0, 0.2, 0.0])
    noise = np.array([1.05, 0.97, 1.02, 0.94, 1.08, 3.0])  # the last one a stall
    measured = (a / 0.05 + fixed) * noise
    steps = np.array([0, 1, 2, 3, 4, 5])
    obs = [StageObservation(ideal_s={G: float(x)}, fixed_s=float(f), measured_s=float(m), step=int(s))
           for x, f, m, s in zip(a, fixed, measured, steps)]
    got = StageFit().observe(obs).efficiencies()[G]
    decay = 0.5 ** ((steps.max() - steps) / 4.0)
    lam = PRIOR_WEIGHT * decay.sum()
    z0 = -math.log(PRIORS[G])

    def score(z: float) -> float:
        pred = a * math.exp(z) + fixed
        r = np.log(pred / measured)
        scale = max(1.4826 * float(np.median(np.abs(r - np.median(r)))), 0.02)
        u = np.abs(r) / scale
        w = decay * np.where(u <= STAGE_HUBER_K, 1.0, STAGE_HUBER_K / u)
        return float(np.sum(w * r * a * math.exp(z) / pred) + lam * (z - z0))

    lo, hi = -math.log(1.5), -math.log(1e-3)
    assert score(lo) < 0 < score(hi)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if score(mid) < 0 else (lo, mid)
    assert got == pytest.approx(math.exp(-lo), rel=1e-5)
    assert 0.046 < got < 0.053  # near the truth, 0.05: the stall is down-weighted
    # the prior's pull is visible at this precision: without it the root moves
    lam_saved = lam
    lam = 0.0
    lo2, hi2 = -math.log(1.5), -math.log(1e-3)
    for _ in range(100):
        mid = (lo2 + hi2) / 2
        lo2, hi2 = (mid, hi2) if score(mid) < 0 else (lo2, mid)
    assert abs(math.exp(-lo2) / got - 1) > 1e-3  # 0.2%: a hundred times the tolerance above
    del lam_saved


def test_a_stage_dominated_by_fixed_time_still_moves_its_efficiency_to_the_measurement() -> None:
    """One observation whose fixed part (50 s) dwarfs the class's ideal time (0.5 s): the measured
    62.5 s leave 12.5 s to the class, efficiency 0.5 / 12.5 = 0.04 (z = log 25), far from the prior
    0.23. The prior's pull (weight 1e-4) shifts it by well under 1%; a step rule that judged steps by
    anything but the fitted score would stay at the prior."""
    import numpy as np

    from planner.calibration import _gauss_newton

    z = _gauss_newton(np.array([[0.5]]), np.array([50.0]), np.array([62.5]), np.array([0.4]),
                      np.array([-math.log(0.23)]))
    assert z[0] == pytest.approx(math.log(25.0), abs=0.01)
    assert z[0] < math.log(25.0)  # pulled toward the prior (z0 = 1.47), not away from it


def test_one_observation_of_two_classes_is_split_as_close_to_the_prior_as_it_allows() -> None:
    """e^z1 + e^z2 = 10 s measured, priors 0.5 and 0.25 (2 s + 4 s ideal): the data fix only the sum,
    so the fit is the point of that curve nearest the prior in z (the prior term), found here by a
    ternary search along the curve, independently of the Gauss-Newton steps."""
    import numpy as np

    from planner.calibration import _gauss_newton

    z0 = np.array([-math.log(0.5), -math.log(0.25)])
    z = _gauss_newton(np.array([[1.0, 1.0]]), np.array([0.0]), np.array([10.0]), np.array([1.0]), z0)

    def other(z1: float) -> float:  # z2 on the curve e^z1 + e^z2 = 10
        return math.log(10.0 - math.exp(z1))

    lo, hi = -0.4, math.log(10.0) - 1e-9
    for _ in range(200):
        m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if (m1 - z0[0]) ** 2 + (other(m1) - z0[1]) ** 2 < (m2 - z0[0]) ** 2 + (other(m2) - z0[1]) ** 2:
            hi = m2
        else:
            lo = m1
    assert z.tolist() == pytest.approx([lo, other(lo)], abs=1e-3)
