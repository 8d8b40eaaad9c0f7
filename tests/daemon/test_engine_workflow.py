"""The planner prices the step Nereus's own engine runs: it keeps the rollout's log-probs as the old
policy's, so a job file's spec says ``old_logprob_pass = false`` and the actor's training is priced
without the recompute forward that verl / NeMo-RL run (which the what-if and the simulator keep)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereusd.jobfile import job_spec as file_spec
from nereusd.planning import cluster_for, job_spec
from nereusd.wire.job_models import JobSpecModel
from planner.cost import PRIORS
from planner.prediction import predict
from planner.search import search

ROOT = Path(__file__).resolve().parents[2]


def test_the_job_files_spec_prices_no_recompute_pass() -> None:
    spec = file_spec(ROOT / "etc" / "jobs" / "live.toml", anchor_job_id="local-j")
    assert spec["old_logprob_pass"] is False
    assert not job_spec(spec).workflow.stage("actor-train").old_logprob_pass
    assert job_spec({k: v for k, v in spec.items() if k != "old_logprob_pass"}).workflow.stage(
        "actor-train").old_logprob_pass  # the default: the systems the what-if and the simulator model


def test_without_the_pass_the_actors_training_is_priced_lower() -> None:
    spec = {"model": "tiny-3m", "algo": "grpo", "device": "cpu", "gpus_per_node": 2,
            "workload": {"prompts_per_step": 8, "samples_per_prompt": 2, "prompt_tokens": 16, "response_tokens": 16}}
    pool = frozenset(range(2))
    plan = search(job_spec(spec), cluster_for(spec, pool), pool=sorted(pool)).plan
    with_pass = predict(job_spec(spec), cluster_for(spec, pool), plan, PRIORS).stage_seconds["actor-train"]
    engine = {**spec, "old_logprob_pass": False}
    without = predict(job_spec(engine), cluster_for(engine, pool), plan, PRIORS).stage_seconds["actor-train"]
    assert without < with_pass
    # the other model-stages do not change
    assert predict(job_spec(engine), cluster_for(engine, pool), plan, PRIORS).stage_seconds["ref-inf"] == \
        predict(job_spec(spec), cluster_for(spec, pool), plan, PRIORS).stage_seconds["ref-inf"]


def test_the_wire_takes_a_bool_only() -> None:
    with pytest.raises(Exception, match="old_logprob_pass"):
        JobSpecModel.model_validate({"old_logprob_pass": "no"})
