"""Admission tries the next reachable plan before it gives up (planner.admission.decide with alternatives,
planner.alternatives.next_plans): a best plan whose DAG does not fit, or does not pay back, is passed over
and recorded with why; checkpoint/restart only when no plan can be reached."""

from __future__ import annotations

from typing import Any

import pytest
from admission_stubs import Plan, Pred

from nereusd.planning import PlannerBinding
from planner import admission
from planner.alternatives import next_plans, same_placement, with_room
from planner.errors import InfeasibleError
from planner.hardware import cluster_preset
from planner.models import model_preset
from planner.prediction import predict
from planner.search import search, usable_bytes
from planner.workflow import Workload, same_model_job, workflow_preset


def cand(name: str, seconds: float) -> admission.Candidate:
    return admission.Candidate(plan=Plan(name), prediction=Pred(seconds), note=f"{name}'s cap")


URGENT = admission.Trigger(kind=admission.TriggerKind.URGENT, step=7, reasons=("GPU pool changed: 8 -> 16 GPUs",))
DRIFT = admission.Trigger(kind=admission.TriggerKind.OPPORTUNISTIC, step=7, reasons=("sequence_length drifted",),
                          signals=(admission.Signal.SEQUENCE_LENGTH,), h_steps=10.0)


def decide(trigger: admission.Trigger, l_tran: dict[str, float | None], asked: list[Any],
           ranked: tuple[admission.Candidate, ...]) -> admission.Decision:
    """``l_tran``: plan name -> L_tran, None: its DAG does not fit."""

    def transition_s(old: Any, new: Plan) -> float:
        s = l_tran[new.name]
        if s is None:
            raise InfeasibleError(f"transition infeasible: GPU 0 needs 56 GB for {new.name} but has 45.7 GB free")
        return s

    def alternatives(error: InfeasibleError | None) -> tuple[admission.Candidate, ...]:
        asked.append(error)
        return ranked[1:]

    return admission.decide(trigger=trigger, current_plan=Plan("running", 1), current_prediction=Pred(20.0),
                            replan=lambda: ranked[0], transition_s=transition_s, alternatives=alternatives)


def test_best_plan_whose_dag_does_not_fit_is_passed_over_for_the_next() -> None:
    asked: list[Any] = []
    d = decide(URGENT, {"best": None, "second": 3.0}, asked, (cand("best", 10.0), cand("second", 11.0)))
    assert d.verdict.admitted and d.candidate_plan == Plan("second") and d.candidate_prediction == Pred(11.0)
    assert len(asked) == 1 and "needs 56 GB for best" in str(asked[0])  # the best plan's error is handed on
    [p] = d.passed_over
    assert (p.rank, p.why, p.predicted_step_s, p.transition_s) == (1, admission.PassOver.TRANSITION_INFEASIBLE,
                                                                   10.0, None)
    assert "needs 56 GB for best" in p.reason
    assert d.verdict.reason.startswith("plan #2 (second's cap) taken, passed over #1 transition-infeasible")
    assert d.to_dict()["passed_over"][0]["why"] == "transition-infeasible"


def test_best_plan_that_does_not_pay_back_is_passed_over_for_one_that_does() -> None:
    asked: list[Any] = []
    # best saves 10 s/step for 500 s (50 steps > gamma*H = 5); second saves 8 s/step for 24 s (3 steps)
    d = decide(DRIFT, {"best": 500.0, "second": 24.0, "third": 1.0}, asked,
               (cand("best", 10.0), cand("second", 12.0), cand("third", 13.0)))
    assert d.verdict.admitted and d.verdict.rule is admission.Rule.PAYBACK and d.candidate_plan == Plan("second")
    assert asked == [None]  # its DAG ran: no error to hand on
    [p] = d.passed_over
    assert p.why is admission.PassOver.NO_PAYBACK and p.transition_s == 500.0 and "50 steps" in p.reason


def test_the_walk_stops_at_a_plan_no_faster_than_the_running_one() -> None:
    d = decide(DRIFT, {"best": 500.0, "second": 1.0}, [], (cand("best", 10.0), cand("second", 25.0)))
    assert not d.verdict.admitted and d.verdict.rule is admission.Rule.PAYBACK
    assert d.candidate_plan == Plan("best") and [p.rank for p in d.passed_over] == [1]


def test_alternatives_are_not_asked_for_when_the_best_plan_is_taken() -> None:
    asked: list[Any] = []
    d = decide(URGENT, {"best": 2.0}, asked, (cand("best", 10.0), cand("second", 11.0)))
    assert d.verdict.admitted and d.candidate_plan == Plan("best") and asked == [] and d.passed_over == ()


def test_no_reachable_plan_raises_with_every_plan_tried() -> None:
    with pytest.raises(admission.NoReachablePlan) as err:
        decide(URGENT, {"best": None, "second": None}, [], (cand("best", 10.0), cand("second", 11.0)))
    assert "needs 56 GB for best" in str(err.value) and "2 plans tried" in str(err.value)
    assert isinstance(err.value, InfeasibleError)  # the caller's checkpoint/restart path
    assert [p.rank for p in err.value.passed_over] == [1, 2]


def test_next_plans_are_distinct_slower_and_leave_room() -> None:
    j = same_model_job(workflow_preset("grpo"), model_preset("llama-3.1-8b"),
                       Workload(prompts_per_step=512, prompt_tokens=512, response_tokens=1000, max_response_tokens=6000))
    cl = cluster_preset("a100", 16, gpus_per_node=4)
    best = search(j, cl)
    alts = list(next_plans(j, cl, None, version=1, offered=(best.plan,)))
    assert alts
    seen = [best.plan]
    for a, f in zip(alts, (0.85, 0.7, 0.55)):
        assert not any(same_placement(a.plan, p) for p in seen)
        seen.append(a.plan)
        assert a.prediction.step_latency_s >= best.prediction.step_latency_s * (1 - 1e-9)
        assert a.prediction.feasible  # predicted on the real cluster
        tight = predict(j, with_room(cl, f), a.plan)
        assert tight.feasible and usable_bytes(with_room(cl, f)) == pytest.approx(f * usable_bytes(cl))


def test_real_dag_best_plan_does_not_fit_the_next_one_does() -> None:
    """The real planner and transition DAG (nereusd.planning.PlannerBinding): Llama-3.1-8B GRPO on 16
    A100-64GB; the tail grows from 2,000 to 6,000 tokens, so the best plan packs the GPUs and the DAG's
    transient state does not fit next to the running plan's state; the next plan leaves room."""
    b = PlannerBinding()
    w = {"prompts_per_step": 512, "prompt_tokens": 512, "response_tokens": 1000}
    old_spec = {"model": "llama-3.1-8b", "algo": "grpo", "device": "a100", "gpus_per_node": 4,
                "workload": {**w, "max_response_tokens": 2000}}
    spec = {**old_spec, "workload": {**w, "max_response_tokens": 6000}}
    pool = frozenset(range(16))
    old = b.search(old_spec, pool, 1).plan
    best = b.search(spec, pool, 2)

    def node(g: int) -> str:
        return f"n{g // 4}"

    d = admission.decide(trigger=URGENT, current_plan=old, current_prediction=None, replan=lambda: best,
                         transition_s=lambda o, n: b.transition(spec, o, n, pool, node).predicted_s,
                         alternatives=lambda e: b.alternatives(spec, pool, 2, best.plan, e))
    assert d.verdict.admitted and d.candidate_plan is not None
    assert not same_placement(d.candidate_plan, best.plan)
    [p] = d.passed_over
    assert p.rank == 1 and p.why is admission.PassOver.TRANSITION_INFEASIBLE
    assert p.reason.startswith("transition infeasible: GPU") and "free" in p.reason
    assert "plan #2 (within 85% of each GPU's usable memory) taken" in d.verdict.reason
    b.transition(spec, old, d.candidate_plan, pool, node)  # the chosen plan's DAG builds


def test_a_cap_that_finds_a_plan_already_offered_is_skipped_and_the_walk_goes_on() -> None:
    """(mutmut on planner/alternatives.py: the skip, the default version, the pool and the
    efficiencies each survived the walk-level tests)"""
    from planner.cost import PRIORS, OpClass

    j = same_model_job(workflow_preset("grpo"), model_preset("llama-3.1-8b"),
                       Workload(prompts_per_step=512, prompt_tokens=512, response_tokens=1000, max_response_tokens=6000))
    cl = cluster_preset("a100", 16, gpus_per_node=4)
    pool = list(range(4, 16))
    eff = PRIORS.updated({OpClass.GEMM: 0.6})
    best = search(j, cl, pool, eff)
    alts = list(next_plans(j, cl, pool, eff, offered=(best.plan,), fractions=(0.85, 0.85, 0.7)))
    assert [a.note for a in alts] == ["within 85% of each GPU's usable memory", "within 70% of each GPU's usable memory"]
    for a in alts:
        assert a.plan.version == 1 and a.plan.gpus <= set(pool)
        assert a.prediction == predict(j, cl, a.plan, eff)  # on the real cluster, under the job's efficiencies
