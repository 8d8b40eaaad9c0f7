"""planner/workflow.py, what its other tests left open (mutation testing, tests/mutate.py --module
planner/workflow.py: 10 of 153 mutants survived tests/planner): the presets' learned reward by
default, the workflow without the old-log-prob pass keeps its name and equals one built so, and a
sleeping training stage's refusal word for word."""

from __future__ import annotations

import dataclasses

import pytest

from planner.errors import SpecError
from planner.workflow import ModelStage, Role, StageKind, grpo, ppo, remax, without_old_logprob_pass


def test_the_presets_have_a_learned_reward_model_by_default() -> None:
    assert [ms.name for ms in ppo().model_stages] == [
        "actor-gen", "ref-inf", "critic-inf", "reward-inf", "actor-train", "critic-train"]
    assert [ms.name for ms in grpo().model_stages] == ["actor-gen", "ref-inf", "reward-inf", "actor-train"]
    assert [ms.name for ms in remax().model_stages] == [
        "actor-gen", "actor-gen-greedy", "ref-inf", "reward-inf", "actor-train"]


def test_without_the_old_logprob_pass_the_workflow_keeps_its_name_and_stages() -> None:
    wf = without_old_logprob_pass(ppo())
    assert wf.name == "ppo"
    assert wf.model_stages == tuple(dataclasses.replace(ms, old_logprob_pass=False) for ms in ppo().model_stages)
    assert [ms.old_logprob_pass for ms in wf.model_stages] == [False] * 6


def test_a_sleeping_training_stage_is_refused_word_for_word() -> None:
    with pytest.raises(SpecError) as err:
        ModelStage("actor-train", Role.ACTOR, StageKind.TRAINING, sleeps=True)
    assert str(err.value) == ("actor-train.sleeps: only generation and inference model-stages sleep "
                              "(no optimizer offload is priced)")
