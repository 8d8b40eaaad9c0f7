"""planner/transition_calibration.py, what its other tests left open (mutation testing,
tests/mutate.py --module planner/transition_calibration.py: 1 of 250 mutants survived tests/planner):
a line whose fixed part comes out exactly 0 s is not kept (the factor alone stands)."""

from __future__ import annotations

import math

import pytest

from planner.transition_calibration import TransitionCalibrator, TransitionSample


def test_a_fixed_part_of_exactly_zero_leaves_the_factor_alone() -> None:
    # model 1, 2, 4, 8 s measured 4, 2, 6, 32 s. Repeated-median slope: per point the median slope to
    # the others is 2/3, 2, 2, 5, so 2; residuals y - 2x: 2, -2, -2, 16, median 0 -> no positive fixed
    # part; the factor is the median ratio instead: ratios 4, 1, 1.5, 4 -> sqrt(1.5 x 4) = sqrt(6)
    samples = tuple(TransitionSample(model_s=x, measured_s=y, bytes_moved=1)
                    for x, y in ((1.0, 4.0), (2.0, 2.0), (4.0, 6.0), (8.0, 32.0)))
    fixed_s, factor = TransitionCalibrator(samples=samples).fit()
    assert fixed_s == 0.0 and factor == pytest.approx(math.sqrt(6))
