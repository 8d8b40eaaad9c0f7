"""Online calibration: one efficiency per operation class, learned from measured times.

The RL engine (and the simulator) report :class:`OpMeasurement` records: the work the cost model
predicts for a measured span (FLOPs or bytes, planner.cost units), the peak of the device or link it
ran on, and the time it took. Each record implies an efficiency work / (peak x (measured - fixed));
a :class:`Calibrator` keeps the last ``window`` of them per class and fits one value per class with a
Huber M-estimator on their logarithms (robust to stragglers and one-off stalls). Efficiencies are per
class, not per operator or model, so a new model reuses what an earlier one taught.

Where only whole model-stages are timed (what the live engine reports), ``fit_from_stage_times`` fits
the classes to the stage times jointly (:class:`StageFit`): a stage's predicted time is linear in the
inverse efficiencies, t = sum_c A_c / e_c + fixed (A_c: the stage's class-c seconds at efficiency 1),
so the efficiencies are the robust least-squares solution over a window of stage observations (log
residuals, Huber weights, recent steps weighted more), anchored weakly to the priors so that classes
the observations cannot tell apart stay where they were. Splitting each stage's time among its classes
in proportion to their predicted seconds (``measurements_from_stage``) cannot do this: every class of
a stage moves by the stage's ratio, and a class shared by stages settles on a compromise that leaves
each stage 30-60% off (the live job on CPU workers, before the fit was joint).
Pure: frozen state in, new state out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from planner.cost import PRIORS, Efficiencies, OpClass, OpTerm
from planner.errors import SpecError
from planner.hardware import ClusterSpec
from planner.plan import GlobalPlan
from planner.prediction import Prediction, predict, schedule
from planner.workflow import JobSpec

HUBER_K = 1.345  # 95% efficiency under Gaussian noise
MIN_SCALE = 1e-3  # log-space floor of the noise scale (0.1%): identical samples do not divide by zero


@dataclass(frozen=True, kw_only=True, slots=True)
class OpMeasurement:
    """One measured span of one operation class."""

    op_class: OpClass
    work: float  # FLOPs or bytes, as the cost model counts them for this span
    peak_per_s: float  # FLOP/s of the device, or bytes/s of HBM or the link
    measured_s: float
    fixed_s: float = 0.0  # latency part (messages x link latency) that efficiency does not scale
    source: str = ""  # e.g. "actor-train@step12", for explanations

    def __post_init__(self) -> None:
        if not isinstance(self.op_class, OpClass):
            raise SpecError("measurement.op_class", f"unknown op class {self.op_class!r}",
                            ", ".join(c.value for c in OpClass))
        for name in ("work", "peak_per_s", "measured_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise SpecError(f"measurement.{name}", f"must be finite and > 0, got {value}")
        if not (math.isfinite(self.fixed_s) and 0 <= self.fixed_s < self.measured_s):
            raise SpecError("measurement.fixed_s", f"must be in [0, measured_s={self.measured_s}), got {self.fixed_s}")

    @property
    def implied_efficiency(self) -> float:
        return self.work / (self.peak_per_s * (self.measured_s - self.fixed_s))


def huber_location(values: Sequence[float], k: float = HUBER_K, iterations: int = 30) -> float:
    """Huber M-estimate of location by iteratively reweighted least squares, MAD scale."""
    y = np.asarray(values, dtype=float)
    mu = float(np.median(y))
    scale = max(1.4826 * float(np.median(np.abs(y - mu))), MIN_SCALE)
    for _ in range(iterations):
        r = np.abs(y - mu) / scale
        w = np.where(r <= k, 1.0, k / np.maximum(r, 1e-12))
        new = float(np.sum(w * y) / np.sum(w))
        if abs(new - mu) < 1e-9:
            return new
        mu = new
    return mu


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibrator:
    """Last ``window`` log-efficiencies per class; ``observe`` returns a new Calibrator."""

    window: int = 64
    samples: Mapping[OpClass, tuple[float, ...]] = field(default_factory=lambda: MappingProxyType({}))
    min_samples: int = 1  # classes with fewer samples keep their prior

    def __post_init__(self) -> None:
        if self.window < 1:
            raise SpecError("calibrator.window", f"must be >= 1, got {self.window}")
        if self.min_samples < 1:
            raise SpecError("calibrator.min_samples", f"must be >= 1, got {self.min_samples}")

    def observe(self, measurements: Iterable[OpMeasurement]) -> Calibrator:
        new = {c: list(v) for c, v in self.samples.items()}
        for m in measurements:
            new.setdefault(m.op_class, []).append(math.log(m.implied_efficiency))
        trimmed = {c: tuple(v[-self.window:]) for c, v in new.items()}
        return Calibrator(window=self.window, samples=MappingProxyType(trimmed), min_samples=self.min_samples)

    def efficiencies(self, base: Efficiencies = PRIORS) -> Efficiencies:
        """Fitted classes override ``base``; unseen classes keep it (conservative priors by default)."""
        fitted = {c: min(1.5, math.exp(huber_location(v))) for c, v in self.samples.items()
                  if len(v) >= self.min_samples}
        return base.updated(fitted)

    def counts(self) -> dict[str, int]:
        return {c.value: len(v) for c, v in self.samples.items()}


def measurements_from_stage(terms: Sequence[OpTerm], eff: Mapping[OpClass, float], measured_s: float,
                            source: str = "") -> list[OpMeasurement]:
    """Per-class records from one model-stage's measured time, when only the whole stage was timed.

    ``terms`` are the stage's predicted terms (Prediction.terms[model_stage]) under ``eff``; the measured
    time is shared among classes in proportion to their predicted seconds, so each class's implied
    efficiency moves by the stage's overall error. This identifies classes only across stages with
    different mixes; per-operator timings (one record per class) are preferred where the engine has them.
    """
    if not (math.isfinite(measured_s) and measured_s > 0):
        raise SpecError("measured_s", f"must be finite and > 0, got {measured_s}")
    fixed = [t.repeat * t.messages * t.latency_s for t in terms]
    variable = [t.seconds(eff) - f for t, f in zip(terms, fixed)]
    left = measured_s - sum(fixed)  # what bandwidth/compute took, once latencies are paid
    total = sum(variable)
    if total <= 0 or left <= 0:
        return []  # latency-bound stage: nothing to learn about efficiencies
    out: list[OpMeasurement] = []
    for t, f, v in zip(terms, fixed, variable):
        if v <= 0:
            continue
        out.append(OpMeasurement(op_class=t.op_class, work=t.work * t.repeat, peak_per_s=t.peak_per_s,
                                 measured_s=left * v / total + f, fixed_s=f, source=source))
    return out


# The joint fit of stage times (StageFit).
STAGE_WINDOW = 64  # stage observations kept (about 20 RL steps of a 3-stage workflow)
HALF_LIFE_STEPS = 4.0  # an observation's weight halves every 4 steps: the fit follows drifting load
# pull toward the prior per class, in squared log-efficiency per unit of observation weight: it settles
# what the observations leave open. At 1e-5 a class the window cannot tell apart from another wandered
# to absurd values (the TP all-reduce's bandwidth efficiency to 0.0008 to explain gloo's per-call cost
# in decode, which then priced inference's TP all-reduces 8x slow: bench/cost_model_cpu.py leave-one-out,
# TP2 held out, before the distributed host work had its own class). At 1e-3 the pull held identified
# classes too: the simulator's calibration stalled 5-13% off its truth (tests/sim/test_simulation.py),
# while the CPU leave-one-out error was the same at 1e-4 (16.6/32.6% mean/max against 17.5/30.5%, one set
# of interleaved rows at load 1-2, 2026-12-02). At 1e-4 a factor e from the prior weighs as a 1% residual.
PRIOR_WEIGHT = 1e-4
FIT_ITERATIONS = 40
# Huber threshold in noise scales: near a median (stage times on shared CPUs swing by 30% step to step)
STAGE_HUBER_K = 0.3
MIN_EFFICIENCY = 1e-6


@dataclass(frozen=True, kw_only=True, slots=True)
class StageObservation:
    """One measured model-stage: its predicted seconds per class at efficiency 1, the latency part no
    efficiency scales, and the measured time."""

    ideal_s: Mapping[OpClass, float]  # class -> work / peak summed over the stage's terms
    fixed_s: float
    measured_s: float
    step: int  # calibration step (one per fit_from_stage_times call) it was measured at
    source: str = ""


def stage_observation(terms: Sequence[OpTerm], measured_s: float, step: int, source: str = "") -> StageObservation:
    ideal: dict[OpClass, float] = {}
    for t in terms:
        ideal[t.op_class] = ideal.get(t.op_class, 0.0) + t.repeat * t.work / t.peak_per_s
    return StageObservation(ideal_s=MappingProxyType(ideal), fixed_s=sum(t.repeat * t.messages * t.latency_s
                                                                          for t in terms),
                            measured_s=measured_s, step=step, source=source)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageFit:
    """A window of stage observations; ``efficiencies`` fits every observed class to all of them."""

    window: int = STAGE_WINDOW
    half_life_steps: float = HALF_LIFE_STEPS
    observations: tuple[StageObservation, ...] = ()
    steps: int = 0  # calibration steps seen

    def __post_init__(self) -> None:
        if self.window < 1:
            raise SpecError("stage_fit.window", f"must be >= 1, got {self.window}")
        if not self.half_life_steps > 0:
            raise SpecError("stage_fit.half_life_steps", f"must be > 0, got {self.half_life_steps}")

    def observe(self, observations: Iterable[StageObservation]) -> StageFit:
        """The next calibration step's observations (their ``step`` is this fit's ``steps``)."""
        kept = (*self.observations, *observations)[-self.window:]
        return StageFit(window=self.window, half_life_steps=self.half_life_steps, observations=kept,
                        steps=self.steps + 1)

    def efficiencies(self, base: Efficiencies = PRIORS) -> Efficiencies:
        """Observed classes fitted (Gauss-Newton on log efficiencies, Huber-reweighted); others keep ``base``."""
        obs = [o for o in self.observations if o.measured_s > o.fixed_s]
        classes = sorted({c for o in obs for c, a in o.ideal_s.items() if a > 0}, key=lambda c: c.value)
        if not classes:
            return base
        a = np.array([[o.ideal_s.get(c, 0.0) for c in classes] for o in obs])
        fixed = np.array([o.fixed_s for o in obs])
        measured = np.array([o.measured_s for o in obs])
        latest = max(o.step for o in obs)
        decay = 0.5 ** ((latest - np.array([o.step for o in obs], dtype=float)) / self.half_life_steps)
        z0 = np.array([-math.log(base[c]) for c in classes])  # z = log(1 / efficiency)
        z = _gauss_newton(a, fixed, measured, decay, z0)
        return base.updated({c: float(min(1.5, max(MIN_EFFICIENCY, math.exp(-v)))) for c, v in zip(classes, z)})

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.observations:
            for c in o.ideal_s:
                out[c.value] = out.get(c.value, 0) + 1
        return out


def _gauss_newton(a: np.ndarray, fixed: np.ndarray, measured: np.ndarray, decay: np.ndarray,
                  z0: np.ndarray) -> np.ndarray:
    """argmin_z sum_i w_i rho(log(pred_i / measured_i)) + PRIOR_WEIGHT * sum_w * |z - z0|^2, with
    pred_i = a_i . exp(z) + fixed_i; rho Huber (IRLS weights w_i = decay_i * huber_i). Levenberg damped."""
    z = z0.copy()
    lam = PRIOR_WEIGHT * float(decay.sum())
    damping = 1e-3
    z_lo, z_hi = -math.log(1.5), -math.log(MIN_EFFICIENCY)

    def objective(zz: np.ndarray, w: np.ndarray) -> float:
        r = np.log((a @ np.exp(zz) + fixed) / measured)
        return float(np.sum(w * r * r) + lam * np.sum((zz - z0) ** 2))

    for _ in range(FIT_ITERATIONS):
        x = np.exp(z)
        pred = a @ x + fixed
        r = np.log(pred / measured)
        scale = max(1.4826 * float(np.median(np.abs(r - np.median(r)))), 0.02)
        u = np.abs(r) / scale
        w = decay * np.where(u <= STAGE_HUBER_K, 1.0, STAGE_HUBER_K / np.maximum(u, 1e-12))
        jac = a * x[None, :] / pred[:, None]  # d r_i / d z_c
        grad = jac.T @ (w * r) + lam * (z - z0)
        hess = jac.T @ (jac * w[:, None]) + lam * np.eye(len(z))
        before = objective(z, w)
        while True:
            step = np.linalg.solve(hess + damping * np.diag(np.diag(hess) + 1e-12), -grad)
            cand = np.clip(z + step, z_lo, z_hi)
            if objective(cand, w) <= before or damping > 1e6:
                break
            damping *= 10
        damping = max(damping / 10, 1e-6)
        moved = float(np.max(np.abs(cand - z)))
        z = cand
        if moved < 1e-6:
            break
    return z


class CalibratedEfficiencies(Efficiencies):
    """Efficiencies that carry the fit state they came from, so the next calibration step continues it."""

    __slots__ = ("calibrator", "stage_fit")

    def __init__(self, learned: Mapping[OpClass, float], calibrator: Calibrator | None = None,
                 stage_fit: StageFit | None = None) -> None:
        super().__init__(learned)
        self.calibrator = calibrator if calibrator is not None else Calibrator()
        self.stage_fit = stage_fit if stage_fit is not None else StageFit()


def fit_from_stage_times(job: JobSpec, plan: GlobalPlan, stage_times_s: Mapping[str, float],
                         previous: Efficiencies | None = None, cluster: ClusterSpec | None = None,
                         window: int = STAGE_WINDOW, step_latency_s: float | None = None,
                         predicted: Prediction | None = None) -> Efficiencies:
    """One calibration step from a step's measured model-stage times (what agents report).

    Predicts the plan's terms (the class mix of each model-stage on its slowest replica), adds one
    StageObservation per measured model-stage to the window and refits every observed class jointly
    (StageFit). Observations of earlier plans stay in the window: stages of other shapes are what tell
    classes apart. ``step_latency_s`` (the whole step, if known) also teaches the fixed per-step
    overhead: what the step took beyond its model-stages. ``cluster`` is needed to rebuild the terms;
    without it nothing is learned and ``previous`` (or the priors) is returned. ``predicted``: the plan's
    prediction under ``previous`` on ``cluster`` where the caller has it (the daemon's memo); the plan is
    predicted only when some model-stage of it was measured (~1 ms at 1,024 GPUs).
    """
    base = previous if previous is not None else PRIORS
    if cluster is None:
        return base
    fit = previous.stage_fit if isinstance(previous, CalibratedEfficiencies) \
        else StageFit(window=window, half_life_steps=HALF_LIFE_STEPS)
    stages = {sp.model_stage for sp in plan}  # what a prediction of the plan has terms of
    measured = [(name, seconds) for name, seconds in stage_times_s.items()
                if name in stages and math.isfinite(seconds) and seconds > 0]
    observed: list[StageObservation] = []
    if measured:
        terms = (predicted if predicted is not None else predict(job, cluster, plan, base)).terms
        observed = [stage_observation(terms[name], seconds, fit.steps, source=name) for name, seconds in measured]
    overhead = _overhead_observation(job, plan, stage_times_s, step_latency_s, cluster, fit.steps)
    fit = fit.observe(observed + ([overhead] if overhead is not None else []))
    return CalibratedEfficiencies(fit.efficiencies(PRIORS).learned, stage_fit=fit)


def _overhead_observation(job: JobSpec, plan: GlobalPlan, stage_times_s: Mapping[str, float],
                          step_latency_s: float | None, cluster: ClusterSpec, step: int) -> StageObservation | None:
    """The per-step overhead (STEP_OVERHEAD) as measured: the step's latency less the schedule of its
    measured model-stages (every model-stage of the plan measured; the cluster names an overhead).
    A step with no time left over reads as a tenth of the named overhead (the class's floor is set by
    its efficiency bound, so it settles at the bound)."""
    if step_latency_s is None or not math.isfinite(step_latency_s) or cluster.step_overhead_s <= 0:
        return None
    seconds = {sp.model_stage: stage_times_s.get(sp.model_stage, math.nan) for sp in plan}
    if not all(math.isfinite(v) and v > 0 for v in seconds.values()):
        return None
    left = step_latency_s - schedule(job, plan, seconds)[0]
    return StageObservation(ideal_s=MappingProxyType({OpClass.STEP_OVERHEAD: cluster.step_overhead_s}), fixed_s=0.0,
                            measured_s=max(left, 0.1 * cluster.step_overhead_s), step=step, source="step-overhead")
