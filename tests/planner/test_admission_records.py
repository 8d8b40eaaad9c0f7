"""The monitor (observe, H_x, references) and the records admission keeps, field by field: what
nereusctl shows and the store keeps must name the right input, step and signals. Found by mutation
testing (tests/mutate.py --module planner/admission.py): each test here killed survivors."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import NamedTuple

import pytest

from planner.admission import (
    Candidate,
    Decision,
    NoReachablePlan,
    Observation,
    PassedOver,
    PassOver,
    Rule,
    Signal,
    Trigger,
    TriggerKind,
    TriggerState,
    Verdict,
    _plain,
    after_replan,
    initial_state,
    observe,
)
from planner.errors import InfeasibleError, SpecError

SEQ, COMP, COMM = Signal.SEQUENCE_LENGTH, Signal.COMPUTE_EFFICIENCY, Signal.COMMUNICATION_EFFICIENCY
POOL = frozenset(range(4))


def obs(step: int, signals: dict[Signal, float], pool: frozenset[int] = POOL, memory: bool = False) -> Observation:
    return Observation(step=step, gpu_pool=pool, signals=signals, memory_violation=memory)


# --- validation: the field named, the value said ----------------------------------------------------


def test_observation_refuses_a_negative_step_naming_it() -> None:
    with pytest.raises(SpecError) as err:
        obs(-2, {SEQ: 1.0})
    assert err.value.field == "observation.step" and str(err.value) == "observation.step: must be >= 0, got -2"


def test_observation_refuses_unknown_signals_listing_the_known_ones() -> None:
    with pytest.raises(SpecError) as err:
        Observation(step=0, gpu_pool=POOL, signals={"seq": 1.0})  # type: ignore[dict-item]
    assert err.value.field == "observation.signals"
    assert str(err.value).startswith("observation.signals: unknown signal 'seq'")
    assert err.value.allowed == "sequence_length, compute_efficiency, communication_efficiency"


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_observation_refuses_a_signal_that_is_not_finite_and_positive(value: float) -> None:
    with pytest.raises(SpecError) as err:
        obs(0, {COMP: value})
    assert err.value.field == "observation.signals.compute_efficiency"
    assert f"must be finite and > 0, got {value}" in str(err.value)


def test_thresholds_must_be_positive_naming_the_signal() -> None:
    with pytest.raises(SpecError) as err:
        TriggerState(gpu_pool=POOL, references={}, thresholds={COMM: 0.0})
    assert err.value.field == "thresholds.communication_efficiency"
    assert str(err.value) == "thresholds.communication_efficiency: must be > 0, got 0.0"


# --- observe: references, crossings, H_x, the trigger's fields ----------------------------------------


def test_initial_state_keeps_the_thresholds_and_start_step_it_is_given() -> None:
    state = initial_state(obs(5, {SEQ: 100.0}), thresholds={SEQ: 0.05})
    assert state.thresholds == {SEQ: 0.05} and state.start_step == 5 and state.references == {SEQ: 100.0}
    _, trig = observe(state, obs(6, {SEQ: 106.0}))  # 6% drift: over 5%, under the default 30%
    assert trig is not None and trig.kind is TriggerKind.OPPORTUNISTIC and trig.signals == (SEQ,)


def test_drift_exactly_at_the_threshold_does_not_fire() -> None:
    state = initial_state(obs(0, {SEQ: 4.0}), thresholds={SEQ: 0.25})
    assert observe(state, obs(1, {SEQ: 5.0}))[1] is None  # drift 1/4 == 0.25: not over it
    assert observe(state, obs(1, {SEQ: 5.01}))[1] is not None


def test_a_signal_seen_first_becomes_its_reference_and_later_signals_are_still_judged() -> None:
    state = initial_state(obs(0, {SEQ: 100.0}))
    new, trig = observe(state, obs(3, {COMP: 0.5, SEQ: 200.0}))  # COMP first seen, listed first
    assert new.references == {SEQ: 100.0, COMP: 0.5}
    assert trig is not None and trig.signals == (SEQ,) and trig.step == 3
    # the reference holds: COMP drifting 40% from 0.5 fires on the next step
    _, trig2 = observe(new, obs(4, {COMP: 0.7, SEQ: 100.0}))
    assert trig2 is not None and trig2.signals == (COMP,)


def test_a_signal_without_threshold_is_skipped_and_the_rest_judged() -> None:
    state = initial_state(obs(0, {COMM: 1.0, SEQ: 100.0}), thresholds={SEQ: 0.3})
    _, trig = observe(state, obs(2, {COMM: 9.0, SEQ: 150.0}))
    assert trig is not None and trig.signals == (SEQ,)
    assert trig.reasons == ("sequence_length drifted 50% (> 30%) from 100 to 150",)


def test_h_of_a_crossing_on_the_next_step_is_one() -> None:
    state = initial_state(obs(0, {SEQ: 100.0}))
    new, trig = observe(state, obs(1, {SEQ: 200.0}))
    assert trig is not None and trig.h_steps == 1.0 and new.h_steps == {SEQ: 1.0}
    assert new.last_crossing_step == {SEQ: 1}


def test_urgent_trigger_fields_without_and_with_crossings() -> None:
    state = initial_state(obs(0, {SEQ: 100.0}))
    _, memory = observe(state, obs(7, {SEQ: 100.0}, memory=True))
    assert memory is not None and memory.kind is TriggerKind.URGENT and memory.step == 7
    assert memory.reasons == ("predicted memory violation of the running plan",)
    assert memory.signals == () and memory.h_steps == 1.0  # no crossing: H defaults to one step
    # a pool change together with a drift: urgent, and it carries the crossing and its H
    _, both = observe(state, obs(4, {SEQ: 300.0}, pool=frozenset(range(2))))
    assert both is not None and both.kind is TriggerKind.URGENT and both.step == 4
    assert both.signals == (SEQ,) and both.h_steps == 4.0
    assert both.reasons[0] == "GPU pool changed: 4 -> 2 GPUs (-2 +0)"


def test_after_replan_takes_the_new_pool_and_values_as_references() -> None:
    state = initial_state(obs(0, {SEQ: 100.0}))
    later = obs(3, {SEQ: 200.0}, pool=frozenset(range(6)))
    reset = after_replan(state, later)
    assert reset.gpu_pool == frozenset(range(6)) and reset.references == {SEQ: 200.0}
    assert observe(reset, obs(4, {SEQ: 200.0}, pool=frozenset(range(6))))[1] is None  # nothing changed since


# --- records ------------------------------------------------------------------------------------------


def _verdict(**kw: object) -> Verdict:
    base: dict[str, object] = dict(admitted=True, rule=Rule.PAYBACK, reason="r", saving_s_per_step=2.0,
                                   transition_s=3.0, h_steps=4.0, gamma=0.5)
    return Verdict(**{**base, **kw})  # type: ignore[arg-type]


def test_decision_record_has_every_field_under_its_name() -> None:
    trig = Trigger(kind=TriggerKind.OPPORTUNISTIC, step=9, reasons=("drift",), signals=(SEQ,), h_steps=4.0)
    over = PassedOver(rank=1, why=PassOver.NO_PAYBACK, reason="slow", predicted_step_s=1.5, transition_s=9.0)
    d = Decision(step=9, trigger=trig, current_plan_version=3, candidate_plan_version=4,
                 current_prediction={"s": 10.0}, candidate_prediction={"s": 8.0}, verdict=_verdict(),
                 candidate_plan={"v": 4}, infeasible_reasons=("a", "b"), passed_over=(over,))
    rec = d.to_dict()
    assert rec == {
        "step": 9,
        "trigger": {"kind": "opportunistic", "step": 9, "reasons": ["drift"], "signals": ["sequence_length"],
                    "h_steps": 4.0},
        "current_plan_version": 3, "candidate_plan_version": 4,
        "current_prediction": {"s": 10.0}, "candidate_prediction": {"s": 8.0},
        "verdict": {"admitted": True, "rule": "payback", "reason": "r", "saving_s_per_step": 2.0,
                    "transition_s": 3.0, "h_steps": 4.0, "gamma": 0.5},
        "payback_ratio": 1.5, "candidate_plan": {"v": 4}, "infeasible_reasons": ["a", "b"],
        "passed_over": [{"rank": 1, "why": "no-payback", "reason": "slow", "predicted_step_s": 1.5,
                         "transition_s": 9.0, "note": ""}],
    }


class _Colour(str, Enum):
    RED = "red"


@dataclass
class _WithToDict:
    x: int

    def to_dict(self) -> dict[str, int]:
        return {"doubled": 2 * self.x}


def test_plain_data_uses_to_dict_enum_values_sorted_sets_and_none_for_non_finite() -> None:
    assert _plain(_WithToDict(3)) == {"doubled": 6}
    assert _plain({_Colour.RED: 1, 2: _Colour.RED}) == {"red": 1, "2": "red"}
    assert list({8, 1}) == [8, 1]  # a set's own order is not sorted here
    assert _plain({8, 1}) == [1, 8] and _plain(frozenset({8, 1, 3})) == [1, 3, 8]
    assert _plain((3, 1)) == [3, 1]  # a tuple keeps its order
    assert _plain([math.inf, -math.inf, math.nan, 1.5]) == [None, None, None, 1.5]


class _Level(IntEnum):
    HIGH = 7


class _Ratio(float, Enum):
    HALF = 0.5


def test_plain_leaves_inside_lists_and_mappings_are_those_and_only_those_kept_as_they_are() -> None:
    """Ints, strings, bools and None inside a list or a mapping are kept without a call each (a plan's
    GPU sets); their subclasses (an IntEnum, a float enum) and floats still go the whole way."""
    import numpy as np

    got = _plain([1, "a", True, None, _Level.HIGH, _Ratio.HALF, math.nan, np.float64(math.inf), np.float64(2.5),
                  (2, (3, _Level.HIGH)), {"k": _Level.HIGH, "n": math.inf, "b": False, 3: None}])
    assert got == [1, "a", True, None, 7, 0.5, None, None, 2.5, [2, [3, 7]], {"k": 7, "n": None, "b": False, "3": None}]
    assert [type(v) for v in got[:6]] == [int, str, bool, type(None), int, float]
    assert type(got[8]) is np.float64  # a finite numpy float is kept as it is
    assert _plain(math.inf) is None and _plain(-0.25) == -0.25 and _plain(_Level.HIGH) == 7
    assert _plain({"x": {"y": [math.nan]}}) == {"x": {"y": [None]}}


class _Shape(Enum):
    SQUARE = "square"


@dataclass(frozen=True)
class _Shown:
    x: int

    def to_dict(self) -> dict[str, int]:
        return {"shown": self.x}


@dataclass(frozen=True)
class _Holder:
    inner: frozenset[_Shown]


class _Pair(NamedTuple):
    a: int
    b: int


def test_plain_items_of_sets_and_tuple_subclasses_go_the_whole_way() -> None:
    """Sets, frozensets and list or tuple subclasses take the general path: their items are made plain
    (a plain Enum becomes its value), keep by_fields (inside a record converted field by field, an item
    with a to_dict is converted by its fields too), and only sets are sorted."""
    got = _plain({_Shape.SQUARE})
    assert got == ["square"] and type(got[0]) is str
    assert _plain(_Holder(frozenset({_Shown(3)}))) == {"inner": [{"x": 3}]}
    assert _plain(frozenset({_Shown(3)})) == [{"shown": 3}]  # at the top: its to_dict
    assert _plain(_Pair(3, 1)) == [3, 1] and _plain([_Pair(2, 1)]) == [[2, 1]]
    assert _plain({_Pair(9, 1), _Pair(2, 5)}) == [[2, 5], [9, 1]]


def test_no_reachable_plan_keeps_its_cause_and_counts_the_plans_tried() -> None:
    cause = InfeasibleError("GPU 3 lost the last copy\nmore", ("stage actor-train",))
    over = PassedOver(rank=1, why=PassOver.TRANSITION_INFEASIBLE, reason="x", predicted_step_s=1.0,
                      transition_s=None)
    one = NoReachablePlan(cause, (over,))
    assert one.cause is cause and one.passed_over == (over,) and one.reasons == ("stage actor-train",)
    assert str(one).splitlines()[0] == "GPU 3 lost the last copy"
    two = NoReachablePlan(cause, (over, over))
    assert str(two).splitlines()[0] == "GPU 3 lost the last copy (2 plans tried)"
    assert Candidate(plan=None, prediction=None).note == ""  # type: ignore[arg-type]
