"""The algorithms as model-stages and the workload they run on (planner/workflow.py): each preset's
stages in order with their roles, kinds and flags; every workload field's refusal, naming the field
and value; derived sizes. Found by mutation testing (tests/mutate.py --module planner/workflow.py:
65 of 153 mutants killed before)."""

from __future__ import annotations

import pytest

from planner.errors import SpecError
from planner.models import Head, model_preset
from planner.workflow import (
    JobSpec,
    ModelStage,
    Role,
    StageKind,
    Workload,
    same_model_job,
    without_old_logprob_pass,
    workflow_preset,
)

G, INF, T = StageKind.GENERATION, StageKind.INFERENCE, StageKind.TRAINING


def _shape(name: str, learned: bool = True) -> list[tuple[str, str, StageKind, bool, bool]]:
    return [(ms.name, ms.role.value, ms.kind, ms.greedy, ms.old_logprob_pass)
            for ms in workflow_preset(name, learned).model_stages]


def test_each_algorithm_is_its_model_stages_in_order() -> None:
    assert _shape("ppo") == [("actor-gen", "actor", G, False, False), ("ref-inf", "reference", INF, False, False),
                             ("critic-inf", "critic", INF, False, False), ("reward-inf", "reward", INF, False, False),
                             ("actor-train", "actor", T, False, True), ("critic-train", "critic", T, False, False)]
    assert [s[0] for s in _shape("ppo", False)] == ["actor-gen", "ref-inf", "critic-inf", "actor-train", "critic-train"]
    assert _shape("grpo") == [("actor-gen", "actor", G, False, False), ("ref-inf", "reference", INF, False, False),
                              ("reward-inf", "reward", INF, False, False), ("actor-train", "actor", T, False, True)]
    assert [s[0] for s in _shape("GRPO", False)] == ["actor-gen", "ref-inf", "actor-train"]  # names any case
    assert _shape("remax") == [("actor-gen", "actor", G, False, False),
                               ("actor-gen-greedy", "actor", G, True, False),
                               ("ref-inf", "reference", INF, False, False), ("reward-inf", "reward", INF, False, False),
                               ("actor-train", "actor", T, False, True)]
    assert [s[0] for s in _shape("remax", False)] == ["actor-gen", "actor-gen-greedy", "ref-inf", "actor-train"]
    assert {wf: workflow_preset(wf).name for wf in ("ppo", "grpo", "remax")} == {"ppo": "ppo", "grpo": "grpo",
                                                                                "remax": "remax"}
    assert not any(ms.old_logprob_pass for ms in without_old_logprob_pass(workflow_preset("ppo")).model_stages)


def test_an_unknown_algorithm_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(SpecError) as err:
        workflow_preset("dpo")
    assert str(err.value) == "algo: unknown preset 'dpo' (allowed: grpo, ppo, remax)"


def test_stages_roles_and_heads() -> None:
    wf = workflow_preset("ppo")
    assert wf.stage("critic-inf").role is Role.CRITIC and wf.stage("actor-train").holds_optimizer
    assert not wf.stage("ref-inf").holds_optimizer
    with pytest.raises(SpecError) as err:
        wf.stage("actor")
    assert str(err.value) == ("model_stage: 'actor' is not part of ppo (allowed: actor-gen, ref-inf, critic-inf, "
                              "reward-inf, actor-train, critic-train)")
    assert [r.head for r in Role] == [Head.LM, Head.VALUE, Head.LM, Head.VALUE]
    assert [k.order for k in (G, INF, T)] == [0, 1, 2]
    with pytest.raises(SpecError) as err:
        ModelStage("actor-train", Role.ACTOR, T, sleeps=True)
    assert err.value.field == "actor-train.sleeps"
    assert ModelStage("ref-inf", Role.REFERENCE, INF, sleeps=True).sleeps  # inference may sleep


@pytest.mark.parametrize("name", ["prompts_per_step", "samples_per_prompt", "prompt_tokens", "response_tokens",
                                  "train_mini_batches_per_step"])
def test_every_workload_count_must_be_at_least_one(name: str) -> None:
    args = dict(prompts_per_step=4, samples_per_prompt=2, prompt_tokens=8, response_tokens=16)
    args[name] = 0
    with pytest.raises(SpecError) as err:
        Workload(**args)
    assert str(err.value) == f"workload.{name}: must be >= 1, got 0"
    args[name] = 1
    assert getattr(Workload(**args), name) == 1  # one is allowed


def test_the_workload_refuses_a_tail_below_the_mean_a_bad_spread_and_an_uneven_split() -> None:
    with pytest.raises(SpecError) as err:
        Workload(prompts_per_step=4, prompt_tokens=8, response_tokens=16, max_response_tokens=15)
    assert str(err.value) == "workload.max_response_tokens: 15 is below the mean response_tokens=16"
    assert Workload(prompts_per_step=4, prompt_tokens=8, response_tokens=16, max_response_tokens=16).tail_response_tokens == 0
    for std in (-1.0, float("nan")):
        with pytest.raises(SpecError) as err:
            Workload(prompts_per_step=4, prompt_tokens=8, response_tokens=16, response_tokens_std=std)
        assert str(err.value) == f"workload.response_tokens_std: must be >= 0, got {std}"
    with pytest.raises(SpecError) as err:
        Workload(prompts_per_step=3, samples_per_prompt=2, prompt_tokens=8, response_tokens=16,
                 train_mini_batches_per_step=4)
    assert str(err.value) == "workload.train_mini_batches_per_step: 4 does not divide 6 sequences per step"


def test_derived_sizes() -> None:
    w = Workload(prompts_per_step=4, samples_per_prompt=3, prompt_tokens=10, response_tokens=20,
                 max_response_tokens=50, response_tokens_std=5.0, train_mini_batches_per_step=2)
    assert (w.sequences_per_step, w.sequences_per_mini_batch, w.max_tokens_per_sequence,
            w.tail_response_tokens, w.tokens_per_sequence) == (12, 6, 60, 30, 30)
    assert w.response_tokens_second_moment == 425.0
    plain = Workload(prompts_per_step=4, prompt_tokens=10, response_tokens=20)
    assert (plain.max_tokens_per_sequence, plain.tail_response_tokens, plain.response_tokens_second_moment) == (
        30, 0, 400.0)


def test_a_job_names_the_roles_without_a_model() -> None:
    wf, tiny = workflow_preset("ppo"), model_preset("tiny-3m")
    w = Workload(prompts_per_step=4, prompt_tokens=8, response_tokens=16)
    with pytest.raises(SpecError) as err:
        JobSpec(workflow=wf, models={Role.ACTOR: tiny, Role.REFERENCE: tiny}, workload=w)
    assert str(err.value) == ("models: no model given for roles ['critic', 'reward'] "
                              "(allowed: actor, reference, critic, reward)")
    job = same_model_job(wf, tiny, w)
    assert set(job.models) == set(Role) and job.model_of(wf.stage("critic-train")) is tiny
