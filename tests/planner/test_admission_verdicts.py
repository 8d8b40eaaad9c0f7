"""Every field of admit's verdict on every rule path, and the plain-data form of nested records: what
the store keeps and nereusctl prints. The expected values are worked out by hand from the inputs (Eq. 2:
admit iff L_tran / dL <= gamma * H_x). Found by mutation testing (tests/mutate.py --module
planner/admission.py): the looser checks elsewhere (``not admitted``, ``startswith``) let 39 mutants
of admit and 10 of _plain survive."""

from __future__ import annotations

import dataclasses
import enum

import pytest
from admission_stubs import Plan, Pred

from planner import admission
from planner.admission import Policy, Rule, Signal, Trigger, TriggerKind, Verdict, _plain, admit

DRIFT = Trigger(kind=TriggerKind.OPPORTUNISTIC, step=7, reasons=("drift",), signals=(Signal.SEQUENCE_LENGTH,),
                h_steps=10.0)
URGENT = Trigger(kind=TriggerKind.URGENT, step=8, reasons=("node n2 lost", "memory"), h_steps=1.0)


@pytest.mark.parametrize(("kw", "expected"), [
    (dict(trigger=DRIFT, current_step_s=20.0, candidate_step_s=10.0, transition_s=3.0, same_plan=True),
     Verdict(admitted=False, rule=Rule.SAME_PLAN, reason="the best plan is the running plan",
             saving_s_per_step=0.0, transition_s=0.0, h_steps=10.0, gamma=0.5)),
    (dict(trigger=DRIFT, current_step_s=None, candidate_step_s=10.0, transition_s=3.0),
     Verdict(admitted=True, rule=Rule.URGENT_FEASIBILITY,
             reason="running plan is infeasible; the best feasible plan is taken without a payback check",
             saving_s_per_step=None, transition_s=3.0, h_steps=10.0, gamma=0.5)),
    (dict(trigger=URGENT, current_step_s=20.0, candidate_step_s=25.0, transition_s=3.0),
     Verdict(admitted=True, rule=Rule.URGENT_FEASIBILITY,
             reason="urgent trigger (node n2 lost; memory): feasibility only",
             saving_s_per_step=-5.0, transition_s=3.0, h_steps=1.0, gamma=0.5)),
    (dict(trigger=DRIFT, current_step_s=20.0, candidate_step_s=20.0, transition_s=3.0),
     Verdict(admitted=False, rule=Rule.NO_GAIN, reason="candidate is not faster (20 s vs 20 s)",
             saving_s_per_step=0.0, transition_s=3.0, h_steps=10.0, gamma=0.5)),
    (dict(trigger=DRIFT, current_step_s=20.0, candidate_step_s=12.5, transition_s=900.0, policy=Policy.ANY_GAIN),
     Verdict(admitted=True, rule=Rule.ANY_GAIN, reason="saves 7.5 s/step",
             saving_s_per_step=7.5, transition_s=900.0, h_steps=10.0, gamma=0.5)),
    (dict(trigger=DRIFT, current_step_s=20.0, candidate_step_s=16.0, transition_s=8.0, gamma=0.25),
     Verdict(admitted=True, rule=Rule.PAYBACK,
             reason="L_tran/dL = 8 s / 4 s = 2 steps <= gamma*H_x = 0.25*10 = 2.5 steps",
             saving_s_per_step=4.0, transition_s=8.0, h_steps=10.0, gamma=0.25)),
    (dict(trigger=DRIFT, current_step_s=20.0, candidate_step_s=16.0, transition_s=24.0),
     Verdict(admitted=False, rule=Rule.PAYBACK,
             reason="L_tran/dL = 24 s / 4 s = 6 steps > gamma*H_x = 0.5*10 = 5 steps",
             saving_s_per_step=4.0, transition_s=24.0, h_steps=10.0, gamma=0.5)),
], ids=["same-plan", "running-infeasible", "urgent", "no-gain", "any-gain", "pays-back", "does-not-pay-back"])
def test_every_rule_path_sets_every_field(kw: dict, expected: Verdict) -> None:
    got = admit(**kw)
    assert got == expected
    assert type(got.admitted) is bool  # stored as 0/1 and shown as yes/no: never None


def test_a_walk_names_each_plan_passed_over_in_rank_order() -> None:
    ranked = (admission.Candidate(plan=Plan("a"), prediction=Pred(10.0)),
              admission.Candidate(plan=Plan("b"), prediction=Pred(11.0)),
              admission.Candidate(plan=Plan("c"), prediction=Pred(12.0)))
    l_tran = {"a": 500.0, "b": 400.0, "c": 2.0}
    d = admission.decide(trigger=DRIFT, current_plan=Plan("running", 1), current_prediction=Pred(20.0),
                         replan=lambda: ranked[0], transition_s=lambda old, new: l_tran[new.name],
                         alternatives=lambda error: ranked[1:])
    assert d.verdict.admitted and d.candidate_plan == Plan("c")
    assert d.verdict.reason == (
        "plan #3 taken, passed over #1 no-payback: L_tran/dL = 500 s / 10 s = 50 steps > gamma*H_x = 0.5*10 = 5 "
        "steps; #2 no-payback: L_tran/dL = 400 s / 9 s = 44.4 steps > gamma*H_x = 0.5*10 = 5 steps; "
        "L_tran/dL = 2 s / 8 s = 0.25 steps <= gamma*H_x = 0.5*10 = 5 steps")


class _Colour(enum.Enum):
    RED = "red"


@dataclasses.dataclass(frozen=True)
class _Inner:
    n: int

    def to_dict(self) -> dict:
        return {"inner-as-dict": self.n}


@dataclasses.dataclass(frozen=True)
class _Outer:
    inner: _Inner
    by_name: dict
    listed: list
    pool: frozenset


def test_plain_uses_a_records_to_dict_at_the_top_and_its_fields_inside_as_asdict_does() -> None:
    outer = _Outer(inner=_Inner(1), by_name={"k": _Inner(2), _Colour.RED: 3}, listed=[_Inner(4), (5, 6.5)],
                   pool=frozenset({3, 1, 2}))
    expected = {"inner": {"n": 1}, "by_name": {"k": {"n": 2}, "red": 3}, "listed": [{"n": 4}, [5, 6.5]],
                "pool": [1, 2, 3]}
    assert _plain(outer) == expected
    assert _plain(dataclasses.asdict(outer)) == expected  # the form it replaced (without asdict's deep copy)
    assert _plain(_Inner(7)) == {"inner-as-dict": 7}  # a record that has to_dict, given itself
    assert _plain([_Inner(8)]) == [{"inner-as-dict": 8}]  # ... or in a plain list
    assert _plain({"x": float("inf"), "y": True, "z": None, "s": "t"}) == {"x": None, "y": True, "z": None, "s": "t"}
