"""The payback rule (PAPER.md Eq. 2) at its boundaries: a transition that pays back in exactly
gamma * H_x steps is admitted, one that takes a hair longer is not; a candidate no faster than the
running plan is no gain, never a division by zero."""

from __future__ import annotations

import pytest

from planner.admission import Rule, Signal, Trigger, TriggerKind, admit


def opportunistic(h: float) -> Trigger:
    return Trigger(kind=TriggerKind.OPPORTUNISTIC, step=10, reasons=("drift",),
                   signals=(Signal.SEQUENCE_LENGTH,), h_steps=h)


@pytest.mark.parametrize("gamma,h,saving,transition", [(0.5, 10.0, 10.0, 50.0), (0.25, 8.0, 4.0, 8.0),
                                                       (1.0, 3.0, 2.0, 6.0)])
def test_pays_back_in_exactly_gamma_h_steps_is_admitted(gamma: float, h: float, saving: float,
                                                        transition: float) -> None:
    """L_tran / dL == gamma * H_x (exact in binary floating point for these values): '<=' admits."""
    assert transition / saving == gamma * h  # the case really sits on the boundary
    v = admit(trigger=opportunistic(h), current_step_s=100.0, candidate_step_s=100.0 - saving,
              transition_s=transition, gamma=gamma)
    assert v.admitted and v.rule is Rule.PAYBACK
    assert f"= {gamma * h:.3g} steps" in v.reason and " <= gamma*H_x" in v.reason
    # the next float up is refused
    later = admit(trigger=opportunistic(h), current_step_s=100.0, candidate_step_s=100.0 - saving,
                  transition_s=transition * (1 + 1e-12), gamma=gamma)
    assert not later.admitted and later.rule is Rule.PAYBACK and " > gamma*H_x" in later.reason


def test_a_free_transition_to_a_faster_plan_is_admitted() -> None:
    v = admit(trigger=opportunistic(1.0), current_step_s=10.0, candidate_step_s=9.0, transition_s=0.0)
    assert v.admitted and v.rule is Rule.PAYBACK and v.payback_ratio == 0.0


def test_an_equally_fast_candidate_is_no_gain() -> None:
    """dL == 0: refused as no gain (the payback ratio would divide by zero)."""
    v = admit(trigger=opportunistic(5.0), current_step_s=10.0, candidate_step_s=10.0, transition_s=0.0)
    assert not v.admitted and v.rule is Rule.NO_GAIN
    assert v.saving_s_per_step == 0.0 and v.payback_ratio is None
