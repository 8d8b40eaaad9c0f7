"""Triggers, H_x and the payback rule (PAPER.md Eq. 2)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.admission import (
    Candidate,
    Observation,
    Policy,
    Rule,
    Signal,
    Trigger,
    TriggerKind,
    admit,
    after_replan,
    decide,
    initial_state,
    observe,
)
from planner.errors import InfeasibleError, SpecError
from planner.plan import GlobalPlan, Layout, StagePlan

POOL = frozenset(range(8))
SEQ = Signal.SEQUENCE_LENGTH


def obs(step: int, seq: float, pool: frozenset[int] = POOL, memory_violation: bool = False) -> Observation:
    return Observation(step=step, gpu_pool=pool, signals={SEQ: seq}, memory_violation=memory_violation)


def opportunistic(h: float = 1.0) -> Trigger:
    return Trigger(kind=TriggerKind.OPPORTUNISTIC, step=10, reasons=("drift",), signals=(SEQ,), h_steps=h)


def test_sequence_drift_under_threshold_does_not_fire() -> None:
    state = initial_state(obs(0, 1000.0))
    state, trig = observe(state, obs(1, 1290.0))
    assert trig is None


def test_sequence_drift_over_30_percent_fires_opportunistic() -> None:
    state = initial_state(obs(0, 1000.0))
    state, trig = observe(state, obs(5, 1310.0))
    assert trig is not None and trig.kind is TriggerKind.OPPORTUNISTIC
    assert trig.signals == (SEQ,)
    assert "31%" in trig.reasons[0]


def test_reference_resets_after_replan_even_if_rejected() -> None:
    state = initial_state(obs(0, 1000.0))
    o = obs(5, 1400.0)
    state, trig = observe(state, o)
    assert trig is not None
    state = after_replan(state, o)  # rejected or admitted: the reference moves to 1400
    state, trig = observe(state, obs(6, 1500.0))
    assert trig is None  # 7% from the new reference
    state, trig = observe(state, obs(7, 1900.0))
    assert trig is not None  # 36% from 1400


def test_without_reset_the_old_reference_keeps_firing() -> None:
    state = initial_state(obs(0, 1000.0))
    state, _ = observe(state, obs(5, 1400.0))
    state, trig = observe(state, obs(6, 1500.0))
    assert trig is not None  # still measured against 1000: the reset is what stops it


def test_h_is_an_ema_of_steps_between_crossings() -> None:
    state = initial_state(obs(0, 1000.0))
    steps_and_values = [(10, 1400.0), (30, 2000.0), (40, 2800.0)]
    for step, value in steps_and_values:
        o = obs(step, value)
        state, trig = observe(state, o)
        assert trig is not None
        state = after_replan(state, o)
    # intervals 10, 20, 10 -> EMA(0.5): 10, 15, 12.5
    assert state.h(SEQ) == pytest.approx(12.5)
    assert trig.h_steps == pytest.approx(12.5)


def test_h_starts_at_one_for_unseen_signal() -> None:
    state = initial_state(obs(0, 1000.0))
    assert state.h(Signal.COMPUTE_EFFICIENCY) == 1.0


def test_several_signals_take_the_smallest_h() -> None:
    base = Observation(step=0, gpu_pool=POOL, signals={SEQ: 1000.0, Signal.COMPUTE_EFFICIENCY: 0.5})
    state = initial_state(base)
    o1 = Observation(step=20, gpu_pool=POOL, signals={SEQ: 1500.0, Signal.COMPUTE_EFFICIENCY: 0.5})
    state, _ = observe(state, o1)
    state = after_replan(state, o1)
    o2 = Observation(step=24, gpu_pool=POOL, signals={SEQ: 1500.0, Signal.COMPUTE_EFFICIENCY: 0.3})
    state, _ = observe(state, o2)
    state = after_replan(state, o2)
    o3 = Observation(step=30, gpu_pool=POOL, signals={SEQ: 2500.0, Signal.COMPUTE_EFFICIENCY: 0.2})
    state, trig = observe(state, o3)
    assert trig is not None and set(trig.signals) == {SEQ, Signal.COMPUTE_EFFICIENCY}
    assert trig.h_steps == min(state.h(SEQ), state.h(Signal.COMPUTE_EFFICIENCY))
    assert trig.h_steps == pytest.approx(0.5 * 6 + 0.5 * 24)  # compute: intervals 24 then 6


def test_pool_change_and_memory_violation_are_urgent() -> None:
    state = initial_state(obs(0, 1000.0))
    _, trig = observe(state, obs(1, 1000.0, pool=frozenset(range(4))))
    assert trig is not None and trig.kind is TriggerKind.URGENT
    assert "8 -> 4 GPUs" in trig.reasons[0]
    _, trig = observe(state, obs(1, 1000.0, memory_violation=True))
    assert trig is not None and trig.kind is TriggerKind.URGENT


def test_bad_observation_names_the_field() -> None:
    with pytest.raises(SpecError, match="sequence_length"):
        obs(0, -5.0)
    with pytest.raises(SpecError, match="observation.step"):
        obs(-1, 10.0)


def test_payback_admits_when_transition_pays_back_in_time() -> None:
    # dL = 10 s/step, L_tran = 40 s -> 4 steps; gamma*H = 0.5*10 = 5 -> admit
    v = admit(trigger=opportunistic(h=10), current_step_s=100, candidate_step_s=90, transition_s=40)
    assert v.admitted and v.rule is Rule.PAYBACK
    assert v.payback_ratio == pytest.approx(4.0)
    # L_tran = 60 s -> 6 steps > 5 -> reject
    v = admit(trigger=opportunistic(h=10), current_step_s=100, candidate_step_s=90, transition_s=60)
    assert not v.admitted and v.rule is Rule.PAYBACK
    assert "6 steps > gamma*H_x" in v.reason


def test_no_gain_is_rejected_and_any_gain_policy_admits_costly_moves() -> None:
    v = admit(trigger=opportunistic(), current_step_s=100, candidate_step_s=100.5, transition_s=1)
    assert not v.admitted and v.rule is Rule.NO_GAIN
    v = admit(trigger=opportunistic(h=1), current_step_s=100, candidate_step_s=99, transition_s=1e4,
              policy=Policy.ANY_GAIN)
    assert v.admitted and v.rule is Rule.ANY_GAIN


def test_urgent_skips_profitability() -> None:
    urgent = Trigger(kind=TriggerKind.URGENT, step=3, reasons=("GPU pool changed",))
    v = admit(trigger=urgent, current_step_s=50, candidate_step_s=80, transition_s=1e6)
    assert v.admitted and v.rule is Rule.URGENT_FEASIBILITY
    v = admit(trigger=urgent, current_step_s=None, candidate_step_s=80, transition_s=1e6)
    assert v.admitted and v.saving_s_per_step is None


def test_gamma_must_be_positive() -> None:
    with pytest.raises(SpecError, match="gamma"):
        admit(trigger=opportunistic(), current_step_s=1, candidate_step_s=1, transition_s=0, gamma=0)


@given(cur=st.floats(1, 1e4), cand=st.floats(1, 1e4), tran=st.floats(0, 1e5), h=st.floats(1, 1e3),
       gamma=st.floats(0.05, 2))
def test_payback_rule_matches_equation_2(cur: float, cand: float, tran: float, h: float, gamma: float) -> None:
    v = admit(trigger=opportunistic(h=h), current_step_s=cur, candidate_step_s=cand, transition_s=tran,
              gamma=gamma)
    d_l = cur - cand
    assert v.admitted == (d_l > 0 and tran / d_l <= gamma * h)


# --- decide() -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FakePrediction:
    step_latency_s: float


def plan(version: int, tp: int) -> GlobalPlan:
    gpus = tuple(range(tp))
    return GlobalPlan(version=version, stages=(StagePlan(model_stage="actor-train", layout=Layout(tp, 1),
                                                         gpu_sets=(gpus,), micro_batch_size=1),))


def test_decide_records_inputs_and_verdict() -> None:
    d = decide(trigger=opportunistic(h=4), current_plan=plan(1, 2), current_prediction=FakePrediction(10.0),
               replan=lambda: Candidate(plan=plan(2, 4), prediction=FakePrediction(8.0)),
               transition_s=lambda old, new: 3.0)
    assert d.verdict.admitted  # 3/2 = 1.5 <= 0.5*4
    rec = d.to_dict()
    assert rec["verdict"]["rule"] == "payback" and rec["payback_ratio"] == pytest.approx(1.5)
    assert rec["candidate_plan"]["stages"][0]["layout"] == {"tp": 4, "pp": 1}
    assert rec["trigger"]["kind"] == "opportunistic"


def test_decide_same_plan_is_not_a_transition() -> None:
    calls = []
    d = decide(trigger=opportunistic(), current_plan=plan(1, 2), current_prediction=FakePrediction(10.0),
               replan=lambda: Candidate(plan=plan(2, 2), prediction=FakePrediction(10.0)),
               transition_s=lambda old, new: calls.append(1) or 1.0)
    assert not d.verdict.admitted and d.verdict.rule is Rule.SAME_PLAN and not calls


def test_decide_falls_back_to_checkpoint_restart_when_nothing_fits() -> None:
    def replan() -> Candidate:
        raise InfeasibleError("no plan fits", ("actor-train: 3.2 GiB over on GPU 0",))

    urgent = Trigger(kind=TriggerKind.URGENT, step=7, reasons=("GPU pool changed",))
    d = decide(trigger=urgent, current_plan=plan(1, 2), current_prediction=None, replan=replan,
               transition_s=lambda old, new: 0.0)
    assert not d.verdict.admitted and d.verdict.rule is Rule.CHECKPOINT_RESTART
    assert d.infeasible_reasons == ("actor-train: 3.2 GiB over on GPU 0",)
    assert "checkpoint/restart" in d.verdict.reason
