"""Per-job correction of the predicted transition time (L_tran) from measured transitions.

The transition cost model (transitions.cost) prices a DAG with the cluster spec's link bandwidths; on a
running job the data channel is often slower (gloo under load reached 0.3-0.5 GB/s against the 3 GB/s
the CPU preset assumes, and CPU transitions measured 2-2.5x their prediction). The payback rule (Eq. 2)
then admits moves that do not pay back. A :class:`TransitionCalibrator` keeps the last ``window``
completed transitions of a job as (model's L_tran, measured time, bytes moved) and fits

    corrected L_tran = fixed_s + factor x model's L_tran      (for a DAG that moves something)

- factor alone (fixed_s = 0) is the median of log(measured / predicted): a single stalled transition
  cannot flip it; bounded to [min_factor, max_factor]; 1.0 (neutral) until something informative was seen.
- once at least ``min_affine_samples`` transitions of sizes at least ``affine_spread`` apart were seen, a
  fixed part (communicator setup, packing, process wake-ups the model does not price) is separated from
  the bandwidth part by Siegel's repeated-median line (robust to just under half the samples being
  outliers), kept only when it finds a positive fixed part; otherwise the factor alone stands.
Pure: frozen state in, new state out; no torch, no I/O.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from planner.errors import SpecError


@dataclass(frozen=True, kw_only=True, slots=True)
class TransitionSample:
    """One completed transition: what the cost model predicted (uncorrected) and what it took."""

    model_s: float  # raw L_tran of the cost model, before any correction
    measured_s: float  # slowest part's measured wall time
    bytes_moved: int  # bytes the DAG moves (intra + inter node)
    transition_id: int | None = None  # store id: replaying the same transition twice counts it once

    def __post_init__(self) -> None:
        for name in ("model_s", "measured_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
                raise SpecError(f"transition_sample.{name}", f"must be a finite number >= 0, got {value!r}")
        if not isinstance(self.bytes_moved, int) or self.bytes_moved < 0:
            raise SpecError("transition_sample.bytes_moved", f"must be an int >= 0, got {self.bytes_moved!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TransitionCalibrator:
    """Last ``window`` informative samples; ``observe`` returns a new TransitionCalibrator."""

    window: int = 32
    min_factor: float = 0.25  # the model may be pessimistic, but not by more than 4x
    max_factor: float = 20.0  # gloo at 0.3 GB/s vs 3 GB/s assumed is 10x; leave room for setup costs
    # Predictions below this are latency noise (initial placement predicts 0 s): their ratio says nothing
    # about bandwidth, and a near-zero denominator would pin the factor to a bound.
    min_model_s: float = 1e-4
    min_affine_samples: int = 4  # a line through fewer points is at the mercy of one of them
    affine_spread: float = 2.0  # largest / smallest model L_tran needed to tell fixed from per-byte time
    samples: tuple[TransitionSample, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise SpecError("transition_calibrator.window", f"must be an int >= 1, got {self.window!r}")
        if not (math.isfinite(self.min_factor) and 0 < self.min_factor <= 1):
            raise SpecError("transition_calibrator.min_factor", f"must be in (0, 1], got {self.min_factor}")
        if not (math.isfinite(self.max_factor) and self.max_factor >= 1):
            raise SpecError("transition_calibrator.max_factor", f"must be finite and >= 1, got {self.max_factor}")
        if not (math.isfinite(self.min_model_s) and self.min_model_s > 0):
            raise SpecError("transition_calibrator.min_model_s", f"must be finite and > 0, got {self.min_model_s}")
        if not isinstance(self.min_affine_samples, int) or self.min_affine_samples < 3:
            raise SpecError("transition_calibrator.min_affine_samples",
                            f"must be an int >= 3, got {self.min_affine_samples!r}")
        if not (math.isfinite(self.affine_spread) and self.affine_spread > 1):
            raise SpecError("transition_calibrator.affine_spread", f"must be finite and > 1, got {self.affine_spread}")
        if len(self.samples) > self.window:
            raise SpecError("transition_calibrator.samples", f"holds {len(self.samples)} > window={self.window}")

    def informative(self, sample: TransitionSample) -> bool:
        return sample.model_s >= self.min_model_s and sample.measured_s > 0

    def observe(self, sample: TransitionSample) -> TransitionCalibrator:
        """Add one completed transition; uninformative or already-seen ones leave the state as it is."""
        if not self.informative(sample):
            return self
        if sample.transition_id is not None and any(s.transition_id == sample.transition_id for s in self.samples):
            return self
        kept = (*self.samples, sample)[-self.window:]
        return TransitionCalibrator(window=self.window, min_factor=self.min_factor, max_factor=self.max_factor,
                                    min_model_s=self.min_model_s, min_affine_samples=self.min_affine_samples,
                                    affine_spread=self.affine_spread, samples=kept)

    def fit(self) -> tuple[float, float]:
        """(fixed_s, factor): (0, 1) without samples; see the module docstring."""
        if not self.samples:
            return 0.0, 1.0
        log_ratio = statistics.median(math.log(s.measured_s / s.model_s) for s in self.samples)
        ratio_only = (0.0, self._bounded(math.exp(log_ratio)))
        xs = [s.model_s for s in self.samples]
        if len(xs) < self.min_affine_samples or max(xs) < self.affine_spread * min(xs):
            return ratio_only
        ys = [s.measured_s for s in self.samples]
        slope = self._bounded(_repeated_median_slope(xs, ys))
        fixed_s = statistics.median(y - slope * x for x, y in zip(xs, ys))
        return (fixed_s, slope) if fixed_s > 0 else ratio_only

    @property
    def factor(self) -> float:
        return self.fit()[1]

    @property
    def fixed_s(self) -> float:
        return self.fit()[0]

    def correct(self, model_s: float) -> float:
        """The corrected L_tran of a DAG the cost model priced at ``model_s`` (0 stays 0: nothing moves)."""
        return _apply(model_s, *self.fit())

    def _bounded(self, factor: float) -> float:
        return min(self.max_factor, max(self.min_factor, factor))

    def explain(self, model_s: float) -> dict[str, Any]:
        """What a transition summary shows: the model's figure, the factor, the corrected figure, and the
        effective bandwidth the samples imply (median bytes / measured second, None without bytes)."""
        rates = [s.bytes_moved / s.measured_s for s in self.samples if s.bytes_moved > 0]
        fixed_s, factor = self.fit()  # once: the line fit is O(window^2)
        return {"model_s": model_s, "fixed_s": fixed_s, "factor": factor,
                "corrected_s": _apply(model_s, fixed_s, factor),
                "samples": len(self.samples),
                "measured_bytes_per_s": statistics.median(rates) if rates else None}


def _apply(model_s: float, fixed_s: float, factor: float) -> float:
    if not (math.isfinite(model_s) and model_s >= 0):
        raise SpecError("model_s", f"must be a finite number >= 0, got {model_s!r}")
    return 0.0 if model_s == 0 else fixed_s + factor * model_s


def _repeated_median_slope(xs: list[float], ys: list[float]) -> float:
    """Siegel's estimator: the median over points of the median slope to every other point (pairs of
    nearly equal size carry no slope and are skipped). Breakdown point 50%; O(n^2) for n <= window."""
    per_point = []
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        slopes = [(yj - yi) / (xj - xi) for j, (xj, yj) in enumerate(zip(xs, ys))
                  if j != i and abs(xj - xi) > 0.05 * max(xj, xi)]
        if slopes:
            per_point.append(statistics.median(slopes))
    return statistics.median(per_point)
