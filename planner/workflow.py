"""RL algorithms as model-stages, and the workload they run on.

A model-stage is one model in one stage (actor-gen and actor-train are different model-stages).
Stages run in the synchronous order generation -> inference -> training each RL step.
"""

from __future__ import annotations

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

    @property
    def holds_optimizer(self) -> bool:
        return self.kind is StageKind.TRAINING


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
ACTOR_TRAIN = ModelStage("actor-train", Role.ACTOR, StageKind.TRAINING)
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
    max_response_tokens: int | None = None  # KV cache is sized for this; defaults to response_tokens
    train_mini_batches_per_step: int = 1  # optimizer steps per RL step (PPO mini-batches)

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "samples_per_prompt", "prompt_tokens", "response_tokens",
                     "train_mini_batches_per_step"):
            if getattr(self, name) < 1:
                raise SpecError(f"workload.{name}", f"must be >= 1, got {getattr(self, name)}")
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
