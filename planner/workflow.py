"""RL algorithms as model-stages, and the workload they run on.

A model-stage is one model in one stage (actor-gen and actor-train are different model-stages).
Stages run in the synchronous order generation -> inference -> training each RL step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

from planner.errors import SpecError, unknown_preset
from planner.models import Head, ModelSpec


class Role(str, Enum):
    ACTOR = "actor"
    CRITIC = "critic"
    REFERENCE = "reference"
    REWARD = "reward"

    @property
    def head(self) -> Head:
        return Head.LM if self in (Role.ACTOR, Role.REFERENCE) else Head.VALUE


class StageKind(str, Enum):
    GENERATION = "generation"
    INFERENCE = "inference"
    TRAINING = "training"

    @property
    def order(self) -> int:
        return _STAGE_ORDER[self]


_STAGE_ORDER = {StageKind.GENERATION: 0, StageKind.INFERENCE: 1, StageKind.TRAINING: 2}


@dataclass(frozen=True, slots=True)
class ModelStage:
    name: str  # e.g. "actor-gen"
    role: Role
    kind: StageKind
    greedy: bool = False  # ReMax's greedy baseline rollout
    # PPO/GRPO systems (verl's compute_log_prob, NeMo-RL's "policy logprobs", OpenRLHF) recompute the
    # rollout's log-probs under the training weights, on the training layout, before the update: one
    # extra forward pass over every sequence of the step, priced inside the training model-stage.
    old_logprob_pass: bool = False
    # sleep mode (vLLM's sleep level 1, verl/NeMo-RL colocation): the model-stage's weights go to host
    # memory while other model-stages run and its KV cache is dropped; they come back before it runs.
    # Its weights then count as transient memory, and each step pays the two host copies.
    sleeps: bool = False

    @property
    def holds_optimizer(self) -> bool:
        return self.kind is StageKind.TRAINING

    def __post_init__(self) -> None:
        if self.sleeps and self.kind is StageKind.TRAINING:
            raise SpecError(f"{self.name}.sleeps", "only generation and inference model-stages sleep (no optimizer "
                            "offload is priced)")


@dataclass(frozen=True, slots=True)
class Workflow:
    name: str
    model_stages: tuple[ModelStage, ...]

    def stage(self, name: str) -> ModelStage:
        for ms in self.model_stages:
            if ms.name == name:
                return ms
        raise SpecError("model_stage", f"{name!r} is not part of {self.name}",
                        ", ".join(ms.name for ms in self.model_stages))

    @property
    def roles(self) -> tuple[Role, ...]:
        seen: list[Role] = []
        for ms in self.model_stages:
            if ms.role not in seen:
                seen.append(ms.role)
        return tuple(seen)

    def by_kind(self, kind: StageKind) -> tuple[ModelStage, ...]:
        return tuple(ms for ms in self.model_stages if ms.kind is kind)


ACTOR_GEN = ModelStage("actor-gen", Role.ACTOR, StageKind.GENERATION)
ACTOR_GEN_GREEDY = ModelStage("actor-gen-greedy", Role.ACTOR, StageKind.GENERATION, greedy=True)
REF_INF = ModelStage("ref-inf", Role.REFERENCE, StageKind.INFERENCE)
CRITIC_INF = ModelStage("critic-inf", Role.CRITIC, StageKind.INFERENCE)
REWARD_INF = ModelStage("reward-inf", Role.REWARD, StageKind.INFERENCE)
ACTOR_TRAIN = ModelStage("actor-train", Role.ACTOR, StageKind.TRAINING, old_logprob_pass=True)
CRITIC_TRAIN = ModelStage("critic-train", Role.CRITIC, StageKind.TRAINING)


def ppo(learned_reward: bool = True) -> Workflow:
    stages = [ACTOR_GEN, REF_INF, CRITIC_INF] + ([REWARD_INF] if learned_reward else [])
    return Workflow("ppo", tuple(stages + [ACTOR_TRAIN, CRITIC_TRAIN]))


def grpo(learned_reward: bool = True) -> Workflow:
    stages = [ACTOR_GEN, REF_INF] + ([REWARD_INF] if learned_reward else [])
    return Workflow("grpo", tuple(stages + [ACTOR_TRAIN]))


def remax(learned_reward: bool = True) -> Workflow:
    stages = [ACTOR_GEN, ACTOR_GEN_GREEDY, REF_INF] + ([REWARD_INF] if learned_reward else [])
    return Workflow("remax", tuple(stages + [ACTOR_TRAIN]))


WORKFLOWS = {"ppo": ppo, "grpo": grpo, "remax": remax}


def without_old_logprob_pass(wf: Workflow) -> Workflow:
    """``wf`` for an engine that keeps the rollout's behaviour log-probs as the old policy's (Nereus's own
    engine: agent/engine/loop.py) instead of recomputing them under the training weights."""
    return Workflow(wf.name, tuple(dataclasses.replace(ms, old_logprob_pass=False) for ms in wf.model_stages))


def workflow_preset(name: str, learned_reward: bool = True) -> Workflow:
    key = name.lower()
    if key not in WORKFLOWS:
        raise unknown_preset("algo", name, list(WORKFLOWS))
    return WORKFLOWS[key](learned_reward)


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """What one RL step processes. Sizes are global (whole job) unless named per replica."""

    prompts_per_step: int
    samples_per_prompt: int = 1
    prompt_tokens: int  # mean prompt length
    response_tokens: int  # mean generated length
    # the longest response of a step (the generation tail) and the KV budget's worst sequence; defaults to
    # response_tokens (every response of the mean length: no tail)
    max_response_tokens: int | None = None
    response_tokens_std: float = 0.0  # spread of response lengths (KV reads grow with the second moment)
    train_mini_batches_per_step: int = 1  # optimizer steps per RL step (PPO mini-batches)

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "samples_per_prompt", "prompt_tokens", "response_tokens",
                     "train_mini_batches_per_step"):
            if getattr(self, name) < 1:
                raise SpecError(f"workload.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.max_response_tokens is not None and self.max_response_tokens < self.response_tokens:
            raise SpecError("workload.max_response_tokens",
                            f"{self.max_response_tokens} is below the mean response_tokens={self.response_tokens}")
        if not (self.response_tokens_std >= 0):
            raise SpecError("workload.response_tokens_std", f"must be >= 0, got {self.response_tokens_std}")
        if self.sequences_per_step % self.train_mini_batches_per_step:
            raise SpecError("workload.train_mini_batches_per_step",
                            f"{self.train_mini_batches_per_step} does not divide "
                            f"{self.sequences_per_step} sequences per step")

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def sequences_per_mini_batch(self) -> int:
        return self.sequences_per_step // self.train_mini_batches_per_step

    @property
    def max_tokens_per_sequence(self) -> int:
        return self.prompt_tokens + (self.max_response_tokens or self.response_tokens)

    @property
    def tail_response_tokens(self) -> int:
        """Decode iterations the longest response runs past the mean one (the low-concurrency tail)."""
        return (self.max_response_tokens or self.response_tokens) - self.response_tokens

    @property
    def response_tokens_second_moment(self) -> float:
        """E[len^2] of response lengths: what the KV reads of a decode add up to (sum of context lengths)."""
        return float(self.response_tokens) ** 2 + self.response_tokens_std ** 2

    @property
    def tokens_per_sequence(self) -> int:
        return self.prompt_tokens + self.response_tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    """An RL post-training job: the algorithm, one model per role, and the workload."""

    workflow: Workflow
    models: dict[Role, ModelSpec] = field(hash=False)
    workload: Workload

    def __post_init__(self) -> None:
        missing = [r.value for r in self.workflow.roles if r not in self.models]
        if missing:
            raise SpecError("models", f"no model given for roles {missing}",
                            ", ".join(r.value for r in self.workflow.roles))

    def model_of(self, model_stage: ModelStage) -> ModelSpec:
        return self.models[model_stage.role]


def same_model_job(workflow: Workflow, model: ModelSpec, workload: Workload) -> JobSpec:
    """The paper's default: actor, critic, reference and reward of equal size."""
    return JobSpec(workflow=workflow, models={r: model for r in workflow.roles}, workload=workload)
