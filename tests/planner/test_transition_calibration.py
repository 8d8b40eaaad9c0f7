"""The L_tran correction: converges to the true slow-down under noise, ignores stalls, stays bounded,
is neutral without data, and rejects bad measurements naming the field."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.errors import SpecError
from planner.transition_calibration import TransitionCalibrator, TransitionSample


def _fed(rng: np.random.Generator, true_factor: float, n: int, noise: float,
         cal: TransitionCalibrator | None = None) -> TransitionCalibrator:
    """Transitions of random size (1 ms - 2 s predicted), measured at ``true_factor`` x lognormal noise."""
    cal = cal or TransitionCalibrator()
    for _ in range(n):
        model_s = float(10 ** rng.uniform(-3, 0.3))
        measured = model_s * true_factor * float(rng.lognormal(0.0, noise))
        cal = cal.observe(TransitionSample(model_s=model_s, measured_s=measured,
                                           bytes_moved=int(model_s * 3e9)))
    return cal


@pytest.mark.parametrize("true_factor", [0.6, 2.5, 7.0])
def test_factor_converges_to_the_true_slow_down_under_noise(true_factor: float) -> None:
    rng = np.random.default_rng(7)
    few = _fed(rng, true_factor, 3, noise=0.2)
    many = _fed(rng, true_factor, 32, noise=0.2)
    assert many.factor == pytest.approx(true_factor, rel=0.1)
    assert abs(math.log(many.factor / true_factor)) <= abs(math.log(few.factor / true_factor)) + 0.05
    # no fixed cost in the truth: the line through the samples finds (almost) none
    assert 0 <= many.fixed_s < 0.01 * true_factor
    assert many.correct(0.2) == pytest.approx(many.fixed_s + 0.2 * many.factor)
    assert len(many.samples) == 32


def test_one_stalled_transition_does_not_flip_the_factor() -> None:
    rng = np.random.default_rng(11)
    cal = _fed(rng, 2.5, 9, noise=0.1)
    before = cal.factor
    stalled = cal.observe(TransitionSample(model_s=0.1, measured_s=0.1 * 400, bytes_moved=3 * 10**8))
    assert stalled.factor == pytest.approx(before, rel=0.15)
    fast = cal.observe(TransitionSample(model_s=0.1, measured_s=0.1 / 400, bytes_moved=3 * 10**8))
    assert fast.factor == pytest.approx(before, rel=0.15)
    # and the window forgets: after many fast transitions the old slow-down is gone
    recovered = _fed(rng, 1.0, 40, noise=0.05, cal=stalled)
    assert recovered.factor == pytest.approx(1.0, rel=0.1) and len(recovered.samples) == recovered.window


def _affine(rng: np.random.Generator, fixed_s: float, factor: float, n: int, noise: float,
            cal: TransitionCalibrator | None = None) -> TransitionCalibrator:
    """Transitions of 10 ms - 2 s predicted that really take fixed_s + factor x prediction, with noise."""
    cal = cal or TransitionCalibrator()
    for _ in range(n):
        model_s = float(10 ** rng.uniform(-2, 0.3))
        measured = (fixed_s + factor * model_s) * float(rng.lognormal(0.0, noise))
        cal = cal.observe(TransitionSample(model_s=model_s, measured_s=measured, bytes_moved=int(model_s * 3e9)))
    return cal


def test_a_fixed_part_is_separated_from_the_bandwidth_part() -> None:
    rng = np.random.default_rng(5)
    cal = _affine(rng, fixed_s=0.1, factor=1.5, n=32, noise=0.05)
    assert cal.fixed_s == pytest.approx(0.1, abs=0.02) and cal.factor == pytest.approx(1.5, rel=0.1)
    # a small and a large move are both priced right, which no single factor can do
    assert cal.correct(0.02) == pytest.approx(0.1 + 1.5 * 0.02, rel=0.15)
    assert cal.correct(2.0) == pytest.approx(0.1 + 1.5 * 2.0, rel=0.1)
    # stalls in a quarter of the transitions move neither part much
    stalled = cal
    for model_s in (0.05, 0.3, 1.0, 1.7, 0.02, 0.6, 0.1, 1.2):
        stalled = stalled.observe(TransitionSample(model_s=model_s, measured_s=40 * model_s + 2, bytes_moved=1))
    assert stalled.fixed_s == pytest.approx(0.1, abs=0.04) and stalled.factor == pytest.approx(1.5, rel=0.2)


def test_too_few_or_too_similar_sizes_fit_a_factor_only() -> None:
    # bench/executor.py on the CPU box: TP1xDP2->TP2xDP2 0.109 -> 0.274 s, DP2->DP4 0.147 -> 0.331 s
    pairs = [(0.109, 0.274), (0.147, 0.331), (0.109, 0.281), (0.147, 0.322), (0.12, 0.29)]
    cal = TransitionCalibrator()
    for model_s, measured_s in pairs:
        cal = cal.observe(TransitionSample(model_s=model_s, measured_s=measured_s, bytes_moved=1))
    assert cal.fixed_s == 0.0 and cal.factor == pytest.approx(0.29 / 0.12, rel=0.02)
    rng = np.random.default_rng(3)
    three = _affine(rng, fixed_s=0.1, factor=1.5, n=3, noise=0.0)
    assert three.fixed_s == 0.0  # three points are not enough to trust a line


def test_factor_is_bounded() -> None:
    slow = TransitionCalibrator(max_factor=10.0).observe(TransitionSample(model_s=0.01, measured_s=5.0,
                                                                         bytes_moved=1))
    assert slow.factor == 10.0
    quick = TransitionCalibrator(min_factor=0.5).observe(TransitionSample(model_s=1.0, measured_s=0.01,
                                                                          bytes_moved=1))
    assert quick.factor == 0.5


@given(st.lists(st.tuples(st.floats(1e-4, 1e3), st.floats(1e-6, 1e6)), max_size=40))
def test_factor_stays_in_bounds_for_any_history(pairs: list[tuple[float, float]]) -> None:
    cal = TransitionCalibrator()
    for model_s, measured_s in pairs:
        cal = cal.observe(TransitionSample(model_s=model_s, measured_s=measured_s, bytes_moved=0))
    assert cal.min_factor <= cal.factor <= cal.max_factor and cal.fixed_s >= 0
    assert cal.correct(1.0) >= cal.min_factor
    assert len(cal.samples) <= cal.window


def test_neutral_without_informative_data() -> None:
    cal = TransitionCalibrator()
    assert cal.factor == 1.0 and cal.correct(0.3) == 0.3
    # initial placement predicts 0 s and measured 0.5 s (units built from weights): nothing to learn
    placed = cal.observe(TransitionSample(model_s=0.0, measured_s=0.5, bytes_moved=0))
    assert placed is cal and placed.factor == 1.0
    explained = cal.explain(0.3)
    assert explained == {"model_s": 0.3, "fixed_s": 0.0, "factor": 1.0, "corrected_s": 0.3, "samples": 0,
                         "measured_bytes_per_s": None}


def test_the_same_transition_counts_once_and_explain_reports_bandwidth() -> None:
    cal = TransitionCalibrator()
    sample = TransitionSample(model_s=0.1, measured_s=0.25, bytes_moved=10**8, transition_id=4)
    cal = cal.observe(sample).observe(sample)  # a replay after restart, say
    assert len(cal.samples) == 1 and cal.factor == pytest.approx(2.5)
    explained = cal.explain(0.2)
    assert explained["corrected_s"] == pytest.approx(0.5) and explained["samples"] == 1
    assert explained["measured_bytes_per_s"] == pytest.approx(4e8)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"model_s": -0.1, "measured_s": 1.0, "bytes_moved": 0}, "transition_sample.model_s"),
    ({"model_s": 0.1, "measured_s": float("nan"), "bytes_moved": 0}, "transition_sample.measured_s"),
    ({"model_s": 0.1, "measured_s": float("inf"), "bytes_moved": 0}, "transition_sample.measured_s"),
    ({"model_s": 0.1, "measured_s": -1.0, "bytes_moved": 0}, "transition_sample.measured_s"),
    ({"model_s": 0.1, "measured_s": 1.0, "bytes_moved": -5}, "transition_sample.bytes_moved"),
])
def test_bad_samples_are_rejected_naming_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(SpecError, match=field) as err:
        TransitionSample(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"window": 0}, "window"), ({"min_factor": 0.0}, "min_factor"), ({"min_factor": 2.0}, "min_factor"),
    ({"max_factor": 0.5}, "max_factor"), ({"max_factor": float("nan")}, "max_factor"),
    ({"min_model_s": 0.0}, "min_model_s"), ({"min_affine_samples": 2}, "min_affine_samples"),
    ({"affine_spread": 1.0}, "affine_spread"),
])
def test_bad_settings_are_rejected_naming_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(SpecError, match=f"transition_calibrator.{field}"):
        TransitionCalibrator(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="model_s"):
        TransitionCalibrator().correct(float("nan"))
