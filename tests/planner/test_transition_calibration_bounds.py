"""The L_tran correction at its edges: every setting's accepted boundary and refusal text, the samples it
keeps (window, settings carried, replays), when the line fit takes over from the factor, and the
figures explain shows. Found by mutation testing (tests/mutate.py --module
planner/transition_calibration.py: 47 of 250 mutants survived the behaviour tests)."""

from __future__ import annotations

import math

import pytest

from planner.errors import SpecError
from planner.transition_calibration import TransitionCalibrator, TransitionSample, _repeated_median_slope


def _refused(field: str, text: str, **kw: object) -> None:
    with pytest.raises(SpecError) as err:
        TransitionCalibrator(**kw)  # type: ignore[arg-type]
    assert (err.value.field, str(err.value)) == (f"transition_calibrator.{field}",
                                                  f"transition_calibrator.{field}: {text}")


def test_each_setting_names_its_fault_and_accepts_its_boundary() -> None:
    _refused("window", "must be an int >= 1, got 0", window=0)
    _refused("window", "must be an int >= 1, got 2.0", window=2.0)
    _refused("min_factor", "must be in (0, 1], got 0.0", min_factor=0.0)
    _refused("min_factor", "must be in (0, 1], got 1.5", min_factor=1.5)
    _refused("min_factor", "must be in (0, 1], got nan", min_factor=math.nan)
    _refused("max_factor", "must be finite and >= 1, got 0.99", max_factor=0.99)
    _refused("max_factor", "must be finite and >= 1, got inf", max_factor=math.inf)
    _refused("min_model_s", "must be finite and > 0, got 0.0", min_model_s=0.0)
    _refused("min_model_s", "must be finite and > 0, got inf", min_model_s=math.inf)
    _refused("min_affine_samples", "must be an int >= 3, got 2", min_affine_samples=2)
    _refused("min_affine_samples", "must be an int >= 3, got 4.0", min_affine_samples=4.0)
    _refused("affine_spread", "must be finite and > 1, got 1.0", affine_spread=1.0)
    _refused("affine_spread", "must be finite and > 1, got inf", affine_spread=math.inf)
    s = TransitionSample(model_s=0.1, measured_s=0.2, bytes_moved=0)
    _refused("samples", "holds 2 > window=1", window=1, samples=(s, s))
    edge = TransitionCalibrator(window=1, min_factor=1.0, max_factor=1.0, min_model_s=1e-9, min_affine_samples=3,
                                affine_spread=1.000001, samples=(s,))
    assert edge.factor == 1.0  # both bounds at 1: the measured 2x is clipped to neutral


@pytest.mark.parametrize(("kw", "field", "got"), [
    ({"model_s": math.inf}, "model_s", "inf"), ({"model_s": "0.1"}, "model_s", "'0.1'"),
    ({"measured_s": -0.5}, "measured_s", "-0.5"), ({"bytes_moved": 1.5}, "bytes_moved", "1.5"),
    ({"bytes_moved": -1}, "bytes_moved", "-1"),
])
def test_a_sample_names_its_field_and_value(kw: dict, field: str, got: str) -> None:
    args = {"model_s": 0.1, "measured_s": 0.2, "bytes_moved": 0, **kw}
    with pytest.raises(SpecError) as err:
        TransitionSample(**args)
    kind = "an int >= 0" if field == "bytes_moved" else "a finite number >= 0"
    assert str(err.value) == f"transition_sample.{field}: must be {kind}, got {got}"
    assert TransitionSample(model_s=0, measured_s=0.0, bytes_moved=0).model_s == 0  # zeros are measurements


def test_what_is_informative_and_what_is_kept() -> None:
    cal = TransitionCalibrator(window=3, min_factor=0.5, max_factor=4.0, min_model_s=0.01, min_affine_samples=5,
                               affine_spread=3.0)
    at_edge = TransitionSample(model_s=0.01, measured_s=0.02, bytes_moved=1)
    assert cal.informative(at_edge)  # exactly min_model_s counts
    assert not cal.informative(TransitionSample(model_s=0.0099, measured_s=0.02, bytes_moved=1))
    assert not cal.informative(TransitionSample(model_s=0.5, measured_s=0.0, bytes_moved=1))  # measured nothing
    fed = cal
    for i in range(5):
        fed = fed.observe(TransitionSample(model_s=0.1 * (i + 1), measured_s=0.2 * (i + 1), bytes_moved=i,
                                           transition_id=i))
    assert [s.transition_id for s in fed.samples] == [2, 3, 4]  # the last window, in order
    assert (fed.window, fed.min_factor, fed.max_factor, fed.min_model_s, fed.min_affine_samples,
            fed.affine_spread) == (3, 0.5, 4.0, 0.01, 5, 3.0)  # the settings travel with the samples
    assert fed.observe(TransitionSample(model_s=9.0, measured_s=1.0, bytes_moved=0, transition_id=3)) is fed
    anonymous = TransitionSample(model_s=0.1, measured_s=0.3, bytes_moved=0)
    assert len(cal.observe(anonymous).observe(anonymous).samples) == 2  # no id: nothing to tell them apart


def _line(xs: list[float], fixed: float, slope: float, **kw: object) -> TransitionCalibrator:
    cal = TransitionCalibrator(**kw)  # type: ignore[arg-type]
    for x in xs:
        cal = cal.observe(TransitionSample(model_s=x, measured_s=fixed + slope * x, bytes_moved=0))
    return cal


def test_the_line_fit_takes_over_at_exactly_the_sample_count_and_spread() -> None:
    xs = [0.25, 0.5, 0.625, 0.75]  # spread exactly 3.0 (binary fractions: no rounding at the edge), four samples
    fitted = _line(xs, 0.05, 2.0, min_affine_samples=4, affine_spread=3.0)
    assert fitted.fit() == pytest.approx((0.05, 2.0))
    assert _line(xs, 0.05, 2.0, min_affine_samples=5, affine_spread=3.0).fixed_s == 0.0  # one sample short
    assert _line(xs, 0.05, 2.0, min_affine_samples=4, affine_spread=3.01).fixed_s == 0.0  # spread just short
    # a line through the origin has no positive fixed part: the factor alone, the samples' median ratio
    through_zero = _line(xs, 0.0, 2.0, min_affine_samples=4, affine_spread=3.0)
    assert through_zero.fit() == (0.0, pytest.approx(2.0))
    assert through_zero.correct(0.0) == 0.0 and fitted.correct(0.0) == 0.0  # nothing moved: no fixed part either
    assert fitted.correct(1.0) == pytest.approx(2.05)
    with pytest.raises(SpecError) as err:
        fitted.correct(-1.0)
    assert str(err.value) == "model_s: must be a finite number >= 0, got -1.0"


def test_nearly_equal_sizes_carry_no_slope() -> None:
    # two points 4% apart would give slope 50; only the pairs at least 5% apart are used
    xs, ys = [1.0, 1.04, 2.0, 3.0], [2.0, 4.0, 4.0, 6.0]
    assert _repeated_median_slope(xs, ys) == pytest.approx(2.0)


def test_explain_shows_the_median_rate_of_the_samples_that_moved_bytes() -> None:
    cal = TransitionCalibrator()
    for model_s, measured, moved in ((0.1, 0.2, 0), (0.1, 0.25, 10**8), (0.1, 0.5, 4 * 10**8), (0.1, 1.0, 10**9)):
        cal = cal.observe(TransitionSample(model_s=model_s, measured_s=measured, bytes_moved=moved))
    shown = cal.explain(0.4)
    assert shown["samples"] == 4 and shown["measured_bytes_per_s"] == pytest.approx(8e8)  # of 4e8, 8e8, 1e9
    assert shown["factor"] == pytest.approx(math.exp((math.log(2.5) + math.log(5)) / 2))
    assert shown["corrected_s"] == pytest.approx(shown["factor"] * 0.4) and shown["fixed_s"] == 0.0


def test_a_line_with_a_negative_fixed_part_falls_back_to_the_factor() -> None:
    xs = [0.25, 0.5, 0.625, 0.75]
    below = _line(xs, -0.05, 2.0, min_affine_samples=4, affine_spread=3.0)
    ratios = sorted((-0.05 + 2.0 * x) / x for x in xs)
    assert below.fit() == (0.0, pytest.approx(math.exp((math.log(ratios[1]) + math.log(ratios[2])) / 2)))


def test_sizes_exactly_five_percent_apart_carry_no_slope_either() -> None:
    # 19 and 20 are 5% of 20 apart: skipped; with them the slope would be 21
    assert _repeated_median_slope([19.0, 20.0, 40.0], [19.0, 40.0, 40.0]) == pytest.approx(0.5)


def test_one_byte_moved_is_a_rate() -> None:
    cal = TransitionCalibrator().observe(TransitionSample(model_s=0.1, measured_s=0.5, bytes_moved=1))
    assert cal.explain(0.1)["measured_bytes_per_s"] == pytest.approx(2.0)
