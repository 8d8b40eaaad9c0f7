"""What ``job-add`` stores: a job's spec as the admin endpoint validates it (nereusd.wire.protocol's
JobAddArgs carries it). The planner and the allocation check the relations between the fields when
the job is planned; here each field is bounded on its own, and a planned job gives all of model,
algo and workload.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, Strict, StringConstraints, model_validator

from nereusd.wire.fields import Args, Key, Name, Positive, SlurmJobId, Text


class WorkloadSpec(Args):
    """The workload of a job spec (planner.workflow.Workload checks the relations between the fields)."""

    prompts_per_step: Positive
    samples_per_prompt: Positive = 1
    prompt_tokens: Positive
    response_tokens: Positive
    max_response_tokens: Positive | None = None
    train_mini_batches_per_step: Positive = 1


class RopeScalingSpec(Args):
    """Llama 3.1's rope scaling (planner.models.RopeScaling checks the relations)."""

    rope_type: Literal["llama3"] = "llama3"
    factor: Annotated[float, Strict(), Field(ge=1, le=1e4, allow_inf_nan=False)]
    low_freq_factor: Annotated[float, Strict(), Field(gt=0, le=1e4, allow_inf_nan=False)]
    high_freq_factor: Annotated[float, Strict(), Field(gt=0, le=1e4, allow_inf_nan=False)]
    original_max_position_embeddings: Positive


class ArchitectureSpec(Args):
    """A model given by its architecture (a job whose model is a HF directory: planner.hf_config reads its
    config.json) instead of a preset name; planner.models.ModelSpec checks the relations (heads, TP)."""

    name: Annotated[str, Strict(), StringConstraints(min_length=1, max_length=128)]
    num_layers: Positive
    hidden_size: Positive
    num_attention_heads: Positive
    num_kv_heads: Positive
    head_dim: Positive
    ffn_hidden_size: Positive
    vocab_size: Positive
    tie_word_embeddings: Annotated[bool, Strict()] = False
    qk_norm: Annotated[bool, Strict()] = False
    qkv_bias: Annotated[bool, Strict()] = False
    rope_theta: Annotated[float, Strict(), Field(gt=0, le=1e12, allow_inf_nan=False)] = 500_000.0
    rope_scaling: RopeScalingSpec | None = None
    rms_norm_eps: Annotated[float, Strict(), Field(gt=0, lt=1, allow_inf_nan=False)] = 1e-5
    bytes_per_param: Literal[2, 4] = 2
    grad_bytes_per_param: Literal[2, 4] = 2


class ElasticSpec(Args):
    """An elastic job's allocation (nereusd.allocation.ElasticJob checks the relations)."""

    job_id: Name | None = None  # the daemon sets it to the job's name
    anchor_job_id: Annotated[str, Strict(), StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")]
    min_gpus: int = Field(ge=1, le=1 << 20, strict=True)
    max_gpus: int = Field(ge=1, le=1 << 20, strict=True)
    gpus_per_node: int = Field(ge=1, le=1024, strict=True)
    slurm_user: Name | None = None  # defaults to the job's user; must equal it
    member_job_ids: tuple[SlurmJobId, ...] = Field(default=(), max_length=4096)
    partition: Name | None = None
    submitted_at_s: float | None = Field(default=None, ge=0, le=1e11, allow_inf_nan=False)
    extra: dict[Key, Text] = Field(default_factory=dict, max_length=32)  # folder, endpoint, keys_dir ...


class JobSpecModel(Args):
    """What ``job-add`` stores. Planned jobs give model, algo and workload (the planner resolves the
    presets before the job is stored); a job without them is only tracked (tests, agents-only runs)."""

    model: Name | ArchitectureSpec | None = None  # a planner preset, or the architecture of a HF directory
    algo: Name | None = None
    device: Name | None = None
    gpus_per_node: int | None = Field(default=None, ge=1, le=1024, strict=True)
    workload: WorkloadSpec | None = None
    learned_reward: Annotated[bool, Strict()] | None = None
    # false: the engine keeps the rollout's log-probs as the old policy's (no recompute pass is priced)
    old_logprob_pass: Annotated[bool, Strict()] | None = None
    elastic: ElasticSpec | None = None

    @model_validator(mode="after")
    def _all_or_none(self) -> JobSpecModel:
        given = [k for k in ("model", "algo", "workload") if getattr(self, k) is not None]
        if given and len(given) != 3:
            missing = sorted({"model", "algo", "workload"} - set(given))
            raise ValueError(f"a planned job needs model, algo and workload; missing {', '.join(missing)}")
        if self.elastic is not None and self.gpus_per_node not in (None, self.elastic.gpus_per_node):
            raise ValueError(f"gpus_per_node {self.gpus_per_node} differs from elastic.gpus_per_node "
                             f"{self.elastic.gpus_per_node}")
        return self

    def stored(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)
