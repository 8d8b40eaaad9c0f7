"""Online calibration: one efficiency per operation class, learned from measured times.

The RL engine (and the simulator) report :class:`OpMeasurement` records: the work the cost model
predicts for a measured span (FLOPs or bytes, planner.cost units), the peak of the device or link it
ran on, and the time it took. Each record implies an efficiency work / (peak x (measured - fixed));
a :class:`Calibrator` keeps the last ``window`` of them per class and fits one value per class with a
Huber M-estimator on their logarithms (robust to stragglers and one-off stalls). Efficiencies are per
class, not per operator or model, so a new model reuses what an earlier one taught.
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
from planner.prediction import predict
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


class CalibratedEfficiencies(Efficiencies):
    """Efficiencies that carry the Calibrator they were fitted with, so the next fit continues it."""

    __slots__ = ("calibrator",)

    def __init__(self, learned: Mapping[OpClass, float], calibrator: Calibrator) -> None:
        super().__init__(learned)
        self.calibrator = calibrator


def fit_from_stage_times(job: JobSpec, plan: GlobalPlan, stage_times_s: Mapping[str, float],
                         previous: Efficiencies | None = None, cluster: ClusterSpec | None = None,
                         window: int = 64) -> Efficiencies:
    """One calibration step from a step's measured model-stage times (what agents report).

    Predicts the plan under ``previous`` (priors at first), turns each measured stage time into
    per-class records (measurements_from_stage) and refits. ``cluster`` is needed to rebuild the
    predicted terms; without it nothing is learned and ``previous`` (or the priors) is returned.
    """
    base = previous if previous is not None else PRIORS
    if cluster is None:
        return base
    cal = previous.calibrator if isinstance(previous, CalibratedEfficiencies) else Calibrator(window=window)
    pred = predict(job, cluster, plan, base)
    records: list[OpMeasurement] = []
    for name, seconds in stage_times_s.items():
        if name in pred.terms and math.isfinite(seconds) and seconds > 0:
            records += measurements_from_stage(pred.terms[name], base, seconds, source=name)
    cal = cal.observe(records)
    return CalibratedEfficiencies(cal.efficiencies(PRIORS).learned, cal)
