"""What admit and decide record, field by field: the inputs refused and how they are named, and the
decision's versions, predictions, rank and reason on every path (taken first, taken after plans
passed over, refused after a walk, checkpoint/restart). Found by mutation testing
(tests/mutate.py --module planner/admission.py): each test here killed survivors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from admission_stubs import Plan, Pred

from planner import admission
from planner.admission import Policy, Rule, Signal, Trigger, TriggerKind, admit
from planner.errors import InfeasibleError, SpecError


@dataclass(frozen=True)
class Bare:
    """A CandidateLike without a note (a search result is one)."""

    plan: Plan
    prediction: Pred


DRIFT = Trigger(kind=TriggerKind.OPPORTUNISTIC, step=7, reasons=("drift",), signals=(Signal.SEQUENCE_LENGTH,),
                h_steps=10.0)
RUNNING, NOW = Plan("running", 1), Pred(20.0)


def _decide(ranked: tuple[Any, ...], l_tran: dict[str, float | None], **kw: Any) -> admission.Decision:
    def transition_s(old: Any, new: Plan) -> float:
        s = l_tran[new.name]
        if s is None:
            raise InfeasibleError(f"transition infeasible: no room for {new.name}")
        return s

    args: dict[str, Any] = dict(trigger=DRIFT, current_plan=RUNNING, current_prediction=NOW)
    args.update(kw)
    return admission.decide(replan=lambda: ranked[0], transition_s=transition_s,
                            alternatives=lambda error: ranked[1:], **args)


def test_admit_names_what_it_refuses() -> None:
    with pytest.raises(SpecError) as err:
        admit(trigger=DRIFT, current_step_s=2, candidate_step_s=1, transition_s=0, gamma=-0.5)
    assert str(err.value) == "gamma: must be > 0, got -0.5 (allowed: 0.4-0.65 works best)"
    for transition, candidate in ((-1.0, 1.0), (1.0, 0.0), (1.0, -3.0)):
        with pytest.raises(SpecError) as err:
            admit(trigger=DRIFT, current_step_s=2, candidate_step_s=candidate, transition_s=transition)
        assert err.value.field == "admission"
        assert str(err.value) == "admission: transition_s must be >= 0 and candidate_step_s > 0"


def test_checkpoint_restart_decision_keeps_the_inputs_and_the_first_line_of_why() -> None:
    def replan() -> Any:
        raise InfeasibleError("no plan fits", ("actor-train: 3 GiB over on GPU 0",))

    d = admission.decide(trigger=DRIFT, current_plan=RUNNING, current_prediction=NOW, replan=replan,
                         transition_s=lambda old, new: 0.0, gamma=0.55)
    assert d.verdict.admitted is False and d.verdict.rule is Rule.CHECKPOINT_RESTART
    assert (d.verdict.h_steps, d.verdict.gamma) == (DRIFT.h_steps, 0.55)  # the record says what it was judged by
    assert d.verdict.saving_s_per_step is None and d.verdict.transition_s is None
    assert d.verdict.reason == ("no plan fits in memory on the available GPUs: fall back to "
                                "checkpoint/restart (no plan fits)")
    assert (d.step, d.trigger, d.current_plan_version, d.current_prediction) == (7, DRIFT, 1, NOW)
    assert d.candidate_plan_version is None and d.candidate_prediction is None


def test_a_decision_taken_first_records_both_versions_and_predictions() -> None:
    d = _decide((Bare(Plan("best"), Pred(10.0)),), {"best": 5.0})
    assert d.verdict.admitted and d.candidate_plan == Plan("best")
    assert (d.step, d.current_plan_version, d.candidate_plan_version) == (7, 1, 2)
    assert d.current_prediction == NOW and d.candidate_prediction == Pred(10.0)


def test_decide_passes_gamma_and_policy_on() -> None:
    best = (Bare(Plan("best"), Pred(10.0)),)
    # saves 10 s/step for 40 s: 4 steps; gamma*H = 0.5*10 = 5 admits, 0.3*10 = 3 does not
    assert _decide(best, {"best": 40.0}).verdict.admitted
    assert not _decide(best, {"best": 40.0}, gamma=0.3).verdict.admitted
    costly = _decide(best, {"best": 1e6}, policy=Policy.ANY_GAIN)
    assert costly.verdict.admitted and costly.verdict.rule is Rule.ANY_GAIN


def test_without_a_running_plan_the_transition_costs_nothing() -> None:
    urgent = Trigger(kind=TriggerKind.URGENT, step=3, reasons=("GPU pool changed",))
    d = _decide((Bare(Plan("best"), Pred(10.0)),), {}, trigger=urgent, current_plan=None, current_prediction=None)
    assert d.verdict.admitted and d.verdict.transition_s == 0.0 and d.current_plan_version is None


def test_a_plan_taken_after_others_is_labelled_with_its_rank_and_note_or_none() -> None:
    d = _decide((admission.Candidate(plan=Plan("best"), prediction=Pred(10.0), note="best's cap"),
                 Bare(Plan("second"), Pred(12.0))), {"best": None, "second": 3.0})
    assert d.verdict.reason.startswith("plan #2 taken, passed over #1 transition-infeasible: "
                                       "transition infeasible: no room for best; L_tran/dL")
    [p] = d.passed_over
    assert p.note == "best's cap" and p.rank == 1 and p.transition_s is None
    assert (d.current_plan_version, d.candidate_plan_version, d.current_prediction) == (1, 2, NOW)
    noted = _decide((Bare(Plan("best"), Pred(10.0)),
                     admission.Candidate(plan=Plan("second"), prediction=Pred(12.0))), {"best": None, "second": 3.0})
    assert noted.verdict.reason.startswith("plan #2 taken, passed over #1")  # an empty note is no label
    assert noted.passed_over[0].note == ""  # a candidate without a note: none recorded


def test_a_refused_walk_records_the_best_buildable_plan_and_what_else_was_tried() -> None:
    # best: DAG infeasible; second: pays back too slowly (refused); third: slower than running (ends the walk)
    d = _decide((Bare(Plan("best"), Pred(10.0)), Bare(Plan("second"), Pred(12.0)), Bare(Plan("third"), Pred(25.0))),
                {"best": None, "second": 500.0, "third": 1.0})
    assert not d.verdict.admitted and d.verdict.rule is Rule.PAYBACK and d.candidate_plan == Plan("second")
    assert d.verdict.reason.startswith("plan #2: L_tran/dL = 500 s / 8 s")
    assert d.verdict.reason.endswith("; also tried #1 transition-infeasible: transition infeasible: no room for best")
    assert (d.step, d.current_plan_version, d.candidate_plan_version, d.current_prediction) == (7, 1, 2, NOW)
    assert [(p.rank, p.why) for p in d.passed_over] == [(1, admission.PassOver.TRANSITION_INFEASIBLE),
                                                       (2, admission.PassOver.NO_PAYBACK)]


def test_a_refused_best_plan_alone_keeps_its_own_reason() -> None:
    d = _decide((Bare(Plan("best"), Pred(10.0)), Bare(Plan("second"), Pred(25.0))), {"best": 500.0, "second": 1.0})
    assert not d.verdict.admitted and d.verdict.reason.startswith("L_tran/dL = 500 s / 10 s = 50 steps > gamma*H_x")
    assert d.current_plan_version == 1 and d.current_prediction == NOW and d.candidate_plan_version == 2


def test_a_plan_without_a_version_is_recorded_without_one() -> None:
    d = admission.decide(trigger=DRIFT, current_plan={"stages": "running"}, current_prediction=NOW,
                         replan=lambda: Bare({"stages": "best"}, Pred(10.0)),  # type: ignore[arg-type]
                         transition_s=lambda old, new: 5.0)
    assert d.verdict.admitted and d.current_plan_version is None and d.candidate_plan_version is None
