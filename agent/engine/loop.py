"""Driver-side RL step loop (PPO, GRPO, ReMax) over per-model-stage engines, SPMD on every rank.

Each model-stage of the workflow runs under its own ``StagePlan`` (layout, GPU set, micro-batching);
the rollout batch and every stage's per-token outputs are handed to all ranks, so advantages are
computed identically everywhere. A step: actor-gen (and ReMax's greedy rollout) -> rewards (rule or
reward-inf) -> ref-inf, critic-inf -> actor-train, critic-train -> weight sync train -> gen/inf.

Prompts of step ``s`` derive from ``(seed, s)`` (a synthetic task, or a user's prompt file:
``agent.engine.data``), sampling noise from ``(seed, s, sequence index)`` and each DP replica takes
its rows by rank, so a run is reproducible across layouts; ``replan`` moves the live state (weights,
AdamW moments) onto new plans between steps. Scores come from a reward function
(``agent.engine.rewards``; the task's rule reward by default) or a learned reward model; a HF model
directory gives the model, weights and tokenizer (``agent.engine.jobfile``), and the actor is
exported as one every ``export.every_steps`` steps (``agent.engine.hf_io``).

Run locally: ``python -m agent.engine.loop --algo grpo --steps 5`` (one process; a progress line per
step on stderr, ``--json`` for the rows at the end), or on local gloo
ranks with every model-stage on one layout: ``python -m agent.engine.loop --world 2 --tp 2``; a job
file with the user's prompts, reward and model: ``python -m agent.engine.loop --job etc/jobs/grpo.toml``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from agent.engine.data import DataConfig, PromptDataset
from agent.engine.grpo import GRPOConfig, grpo_advantages
from agent.engine.hf_io import ExportConfig, export_actor
from agent.engine.losses import ActorLoss, CriticLoss, pack, token_logprobs
from agent.engine.measure import StageMeasurement, StageTimer
from agent.engine.model import load_safetensors
from agent.engine.parallel import PipelineRunner, StageEngine
from agent.engine.ppo import PPOConfig, ppo_advantages
from agent.engine.remax import ReMaxConfig, remax_advantages
from agent.engine.rewards import RewardConfig, RewardFn
from agent.engine.rollout import Rollout, SamplingParams, generate
from agent.engine.scoring import function_scores, model_scores
from agent.engine.step_stats import StepStats, rollout_stats
from agent.engine.sync import SyncReport, move_training_state, transfer
from agent.engine.tasks import ByteTokenizer, Problem, SortDigits, Task, accuracy, problems_for_step
from agent.engine.tokenizer import HFTokenizer, encode_prompt
from planner.errors import SpecError
from planner.models import TINY_BYTE, Head, ModelSpec
from planner.plan import GlobalPlan, Layout, StagePlan, batch_splits
from planner.workflow import Role, StageKind, Workflow, workflow_preset
from transitions.geometry import unit_shards


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    algo: str = "ppo"
    task: Task = field(default_factory=SortDigits)
    model: ModelSpec = TINY_BYTE  # actor and reference; the planner's preset "tiny-byte" by default
    critic_model: ModelSpec | None = None  # defaults to ``model``
    reward_model: ModelSpec | None = None  # a learned reward model (reward-inf); None = ``reward``
    # a reward function; None = the synthetic task's rule reward (agent.engine.tasks:rule_scores)
    reward: RewardConfig | None = None
    data: DataConfig | None = None  # a user's prompt file; None = prompts of the synthetic ``task``
    tokenizer: str | None = None  # a HF tokenizer.json or model directory; None = the byte tokenizer
    chat_template: bool = False  # wrap prompts in the tokenizer's chat template
    max_prompt_tokens: int | None = None  # left-padded prompt length; defaults to the task's (needed with data)
    export: ExportConfig | None = None  # periodic HF export of the actor
    # HF-layout safetensors files per role (random initialisation where empty); a critic or reward
    # model loaded from an LM checkpoint keeps the trunk and starts a fresh value head
    actor_weights: tuple[str, ...] = ()
    critic_weights: tuple[str, ...] = ()
    reward_weights: tuple[str, ...] = ()
    prompts_per_step: int = 16
    max_new_tokens: int | None = None  # defaults to the task's answer length + EOS
    temperature: float = 1.0
    top_p: float = 1.0
    actor_lr: float = 3e-3
    critic_lr: float = 3e-3
    train_mini_batches_per_step: int = 1
    seed: int = 0
    ppo: PPOConfig = field(default_factory=PPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    remax: ReMaxConfig = field(default_factory=ReMaxConfig)
    profile_ops: bool = False
    rollout_backend: str = "torch"  # or "vllm" (GPU, optional extra): actor-gen replicas of one GPU

    def __post_init__(self) -> None:
        if self.algo not in ("ppo", "grpo", "remax"):
            raise SpecError("algo", f"unknown {self.algo!r}", "ppo, grpo, remax")
        if self.rollout_backend not in ("torch", "vllm"):
            raise SpecError("rollout_backend", f"unknown {self.rollout_backend!r}", "torch, vllm")
        if self.prompts_per_step < 1:
            raise SpecError("prompts_per_step", f"must be >= 1, got {self.prompts_per_step}")
        if self.sequences_per_step % self.train_mini_batches_per_step:
            raise SpecError("train_mini_batches_per_step", f"{self.train_mini_batches_per_step} does not divide "
                            f"{self.sequences_per_step} sequences per step")
        if self.data is not None:
            for name in ("max_prompt_tokens", "max_new_tokens"):
                if getattr(self, name) is None:
                    raise SpecError(name, "is needed with a prompt file (the synthetic task sets it otherwise)")
            if self.reward is None and self.reward_model is None:
                raise SpecError("reward", "a prompt file needs a reward function or a reward model")
        if self.reward is not None and self.reward_model is not None:
            raise SpecError("reward", "give a reward function or a reward model, not both")

    @property
    def samples_per_prompt(self) -> int:
        return self.grpo.samples_per_prompt if self.algo == "grpo" else 1

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def workflow(self) -> Workflow:
        return workflow_preset(self.algo, learned_reward=self.reward_model is not None)

    @property
    def prompt_tokens(self) -> int:
        return self.max_prompt_tokens or self.task.max_prompt_chars + 1  # BOS

    @property
    def response_tokens(self) -> int:
        return self.max_new_tokens or self.task.max_answer_chars + 1  # EOS


def role_model(cfg: RunConfig, role: Role) -> tuple[ModelSpec, Head, int]:
    """The model, head and initialisation seed of a role's model-stages."""
    if role is Role.CRITIC:
        return cfg.critic_model or cfg.model, Head.VALUE, cfg.seed + 1
    if role is Role.REWARD:
        assert cfg.reward_model is not None
        return cfg.reward_model, Head.VALUE, cfg.seed + 2
    return cfg.model, Head.LM, cfg.seed  # actor and reference start from the same weights


def uniform_plan(cfg: RunConfig, layout: Layout, ranks: tuple[int, ...], *, dp: int | None = None,
                 overrides: dict[str, tuple[Layout, tuple[tuple[int, ...], ...]]] | None = None) -> GlobalPlan:
    """Every model-stage on ``layout``, replicas over consecutive ``ranks`` (colocated), unless
    ``overrides`` names a (layout, gpu_sets) for a model-stage. Micro-batches: ``pp`` per replica."""
    stages = []
    for ms in cfg.workflow.model_stages:
        lay, gpu_sets = (overrides or {}).get(ms.name, (layout, ()))
        if not gpu_sets:
            n = dp or len(ranks) // lay.size
            gpu_sets = tuple(tuple(ranks[i * lay.size:(i + 1) * lay.size]) for i in range(n))
        rows = cfg.sequences_per_step if not ms.greedy else cfg.prompts_per_step
        if ms.kind is StageKind.TRAINING:
            rows //= cfg.train_mini_batches_per_step
        per_replica = rows // len(gpu_sets)
        accum = lay.pp if per_replica % lay.pp == 0 else 1
        stages.append(StagePlan(model_stage=ms.name, layout=lay, gpu_sets=gpu_sets,
                                micro_batch_size=per_replica // accum,
                                grad_accum=accum if ms.kind is StageKind.TRAINING else 1))
    return GlobalPlan(version=0, stages=tuple(stages))


def rebatched(sp: StagePlan, gpu_sets: tuple[tuple[int, ...], ...]) -> StagePlan:
    """``sp`` on new replicas with the same global batch: the largest micro-batch no bigger than the
    current one for which ``dp * micro_batch_size * grad_accum`` stays ``sp.sequences_per_batch``."""
    splits = batch_splits(sp.sequences_per_batch, len(gpu_sets), max_micro_batch=sp.micro_batch_size)
    if not splits:
        raise SpecError(f"{sp.model_stage}.dp", f"{len(gpu_sets)} replicas cannot share a batch of "
                        f"{sp.sequences_per_batch} sequences")
    mbs, accum = max(splits)
    return StagePlan(model_stage=sp.model_stage, layout=sp.layout, gpu_sets=gpu_sets, micro_batch_size=mbs,
                     grad_accum=accum, recompute=sp.recompute)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    step: int
    mean_score: float
    mean_accuracy: float  # the task part of the score (answer characters in place), without format
    mean_response_tokens: float
    actor_loss: float
    critic_loss: float | None
    seconds: float
    stage_seconds: dict[str, float]  # per model-stage, plus "weight-sync" (train -> gen/inf)
    tokens: torch.Tensor = field(repr=False)  # the step's rollout, for reproducibility checks
    # samples whose reward failed and got the error score (reward.on_error = "score"): (index, reason);
    # ReMax's greedy rollout's failures say so in the reason
    reward_errors: tuple[tuple[int, str], ...] = ()
    # the prompt file's position after this step (agent.engine.data.DataPosition): what a resumed run
    # passes back; 0 for synthetic tasks, whose prompts derive from the step alone
    prompts_consumed: int = 0
    # the weight sync (one executor transition): bytes this rank sent point-to-point (local copies
    # excluded), the executor's predicted time for the whole plan, this rank's measured run
    sync_sent_bytes: int = 0
    sync_predicted_s: float = 0.0
    sync_measured_s: float = 0.0
    stats: StepStats | None = None  # reward/length statistics, and this rank's loss tallies


class RLLoop:
    """All model-stages of one RL job on this rank; every rank of the world runs the same calls."""

    def __init__(self, cfg: RunConfig, plan: GlobalPlan, *, rank: int = 0) -> None:
        self.cfg, self.plan, self.rank = cfg, plan, rank
        self.tok: ByteTokenizer | HFTokenizer = ByteTokenizer()
        if cfg.tokenizer is not None:
            self.tok = HFTokenizer(cfg.tokenizer, chat_template=cfg.chat_template)
            if self.tok.vocab_size > cfg.model.vocab_size:
                raise SpecError("tokenizer", f"{self.tok.vocab_size} tokens do not fit the model's vocab_size="
                                f"{cfg.model.vocab_size}")
        elif cfg.model.vocab_size < self.tok.min_vocab_size:
            raise SpecError("model.vocab_size", f"the byte tokenizer needs >= {self.tok.min_vocab_size}")
        self.prompts = PromptDataset(cfg.data, seed=cfg.seed) if cfg.data is not None else None
        self.reward: RewardFn | None = None
        if cfg.reward_model is None:
            self.reward = RewardFn(cfg.reward or RewardConfig(function="agent.engine.tasks:rule_scores"))
        self._reward_errors: list[tuple[int, str]] = []
        # prompts consumed so far (agent.engine.data.DataPosition; the live engine keeps it in the unit
        # counters, so a transition or restore reads on exactly there); None: derived from the step
        self.data_position: int | None = None
        self.timer = StageTimer(rank=rank, profile_ops=cfg.profile_ops)
        self.optimizer_steps = 0
        self.engines = {ms.name: self._build(ms.name, plan.stage(ms.name)) for ms in cfg.workflow.model_stages}
        self.vllm: Any = None
        if cfg.rollout_backend == "vllm":
            self.vllm = self._start_vllm()

    def _start_vllm(self) -> Any:
        """A vLLM engine on each actor-gen replica (one GPU each), fed from the torch copy of actor-gen."""
        import tempfile

        from agent.engine.vllm_backend import VLLMBackend, write_model_dir

        eng = self.engines["actor-gen"]
        if eng.plan.layout.size != 1:
            raise SpecError("actor-gen.layout", "the vLLM backend runs one GPU per actor-gen replica here", "TP1xPP1")
        if eng.module is None:
            return None
        colocated = bool(eng.plan.gpus & self.plan.stage("actor-train").gpus)
        state = {n: t.detach() for n, t in eng.local_tensors()}
        path = write_model_dir(self.cfg.model, tempfile.mkdtemp(prefix="nereus-vllm-"), state)
        return VLLMBackend(self.cfg.model, path, seed=self.cfg.seed, colocated=colocated)

    # --- construction -------------------------------------------------------------------------
    def _model_of(self, role: Role) -> tuple[ModelSpec, Head, int]:
        return role_model(self.cfg, role)

    def _build(self, name: str, sp: StagePlan) -> StageEngine:
        ms = self.cfg.workflow.stage(name)
        spec, head, seed = self._model_of(ms.role)
        lr = None
        if ms.kind is StageKind.TRAINING:
            lr = self.cfg.actor_lr if ms.role is Role.ACTOR else self.cfg.critic_lr
        files = {Role.ACTOR: self.cfg.actor_weights, Role.REFERENCE: self.cfg.actor_weights,
                 Role.CRITIC: self.cfg.critic_weights, Role.REWARD: self.cfg.reward_weights}[ms.role]
        weights = None
        if files:
            # each rank reads only the tensors of its own pipeline stage
            mine = {t for u, r in enumerate(g for gs in sp.gpu_sets for g in gs) if r == self.rank
                    for t in (sh.tensor for sh in unit_shards(spec, head, sp.layout, u % sp.layout.size))}
            weights = load_safetensors(files, mine)
        return StageEngine(name, spec, head, sp, seed=seed, lr=lr, weights=weights)

    def replan(self, plan: GlobalPlan) -> None:
        """Move to ``plan`` between steps: changed model-stages get new engines; training state moves
        (parameters and AdamW moments), generation/inference weights sync from their trainer."""
        old = self.engines
        self.engines = dict(old)
        for ms in self.cfg.workflow.model_stages:
            if plan.stage(ms.name) != self.plan.stage(ms.name):
                self.engines[ms.name] = self._build(ms.name, plan.stage(ms.name))
                if ms.kind is StageKind.TRAINING:
                    move_training_state(old[ms.name], self.engines[ms.name], self.optimizer_steps)
        self.plan = plan
        self._sync_all()

    def _sync_all(self) -> SyncReport | None:
        """Every generation/inference stage fed by a trainer, in one executor transition."""
        pairs = []
        for ms in self.cfg.workflow.model_stages:
            if ms.kind is StageKind.TRAINING:
                continue
            trainer = {Role.ACTOR: "actor-train", Role.CRITIC: "critic-train"}.get(ms.role)
            if trainer is not None and trainer in self.engines:
                pairs.append((self.engines[trainer], self.engines[ms.name]))
        return transfer(pairs) if pairs else None

    # --- one RL step ---------------------------------------------------------------------------
    def _seeds(self, step: int, n: int, salt: int = 0) -> list[int]:
        return [((self.cfg.seed * 1_000_003 + step) * 1_000_003 + i) * 4 + salt for i in range(n)]

    def _generate(self, name: str, prompts: list[list[int]], seeds: list[int], greedy: bool) -> Rollout:
        eng, c = self.engines[name], self.cfg
        params = SamplingParams(max_new_tokens=c.response_tokens, temperature=c.temperature, top_p=c.top_p,
                                greedy=greedy, stop_ids=self.tok.stop_ids)
        b, p = len(prompts), c.prompt_tokens
        t = p + params.max_new_tokens
        tokens, attn, logp = torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t)
        if eng.coord is not None:
            rows = eng.replica_rows(b, eng.coord.replica)
            if self.vllm is not None and name == "actor-gen":
                roll = self.vllm.generate(prompts[rows], seeds[rows], params, prompt_tokens=p,
                                          pad_id=self.tok.pad_id)
            else:
                roll = generate(PipelineRunner(eng), prompts[rows], seeds[rows], params, prompt_tokens=p,
                                pad_id=self.tok.pad_id)
            if eng.is_owner:
                tokens[rows], attn[rows], logp[rows] = roll.tokens, roll.attention_mask, roll.logprobs
        tokens, attn, logp = eng.gather(tokens), eng.gather(attn), eng.gather(logp)
        action = torch.zeros(b, t)
        action[:, p - 1:-1] = attn[:, p:].float()
        return Rollout(tokens=tokens, attention_mask=attn, action_mask=action, logprobs=logp, prompt_tokens=p)

    def _scores(self, step: int, roll: Rollout, problems: list[Problem], rollout: str = "sampled") -> torch.Tensor:
        if self.reward is None:
            return model_scores(self.engines["reward-inf"], roll)
        scores, errors = function_scores(roll, problems, self.reward, self.tok, rollout)
        self._reward_errors += errors
        return scores

    def _data_start(self, step: int) -> int:
        return self.data_position if self.data_position is not None else step * self.cfg.prompts_per_step

    def _problems(self, step: int) -> list[Problem]:
        c = self.cfg
        if self.prompts is None:
            return problems_for_step(c.task, c.seed, step, c.prompts_per_step)
        return self.prompts.rows(self._data_start(step), c.prompts_per_step)

    def _encode(self, step: int, base: list[Problem]) -> list[list[int]]:
        c, out = self.cfg, []
        for i, pr in enumerate(base):
            ids = encode_prompt(self.tok, pr.prompt)
            if len(ids) > c.prompt_tokens:
                where = f"prompt {i} of step {step}"
                if self.prompts is not None:
                    row = self.prompts.source_rows[self.prompts.indices(self._data_start(step), len(base))[i]]
                    where = f"{self.prompts.cfg.path}, row {row}"
                raise SpecError("max_prompt_tokens", f"{where} has {len(ids)} tokens > {c.prompt_tokens}")
            out.append(ids)
        return out

    def step(self, step: int) -> StepResult:
        c, t0 = self.cfg, time.perf_counter()
        timer, sp = self.timer, self.plan.stage
        consumed = self._data_start(step) + c.prompts_per_step
        base = self._problems(step)
        problems = [pr for pr in base for _ in range(c.samples_per_prompt)]  # GRPO groups are consecutive
        prompts = [ids for ids in self._encode(step, base) for _ in range(c.samples_per_prompt)]
        self._reward_errors = []
        with timer.stage(step, sp("actor-gen")) as tally:
            roll = self._generate("actor-gen", prompts, self._seeds(step, len(prompts)), greedy=False)
            tally.attention_mask = roll.attention_mask
        with timer.stage(step, sp("reward-inf") if c.reward_model else None) as tally:
            scores = self._scores(step, roll, problems)
            tally.attention_mask = roll.attention_mask
        temp = c.temperature
        with timer.stage(step, sp("ref-inf")) as tally:
            ref_logp = self.engines["ref-inf"].forward(roll.tokens, roll.attention_mask, roll.next_tokens,
                                                       lambda y, e: token_logprobs(y, e, temp))
            tally.attention_mask = roll.attention_mask
        mask = roll.action_mask
        critic_loss = None
        if c.algo == "ppo":
            with timer.stage(step, sp("critic-inf")) as tally:
                values = self.engines["critic-inf"].forward(roll.tokens, roll.attention_mask, roll.next_tokens,
                                                            lambda y, e: y)
                tally.attention_mask = roll.attention_mask
            adv, returns = ppo_advantages(scores, mask, roll.logprobs, ref_logp, values, c.ppo)
            actor_loss = ActorLoss(clip=c.ppo.clip, kl_coef=0.0, temperature=temp)
        elif c.algo == "grpo":
            adv = grpo_advantages(scores, mask, c.grpo)
            actor_loss = ActorLoss(clip=c.grpo.clip, kl_coef=c.grpo.kl_coef, temperature=temp)
        else:
            with timer.stage(step, sp("actor-gen-greedy")) as tally:
                greedy = self._generate("actor-gen-greedy", prompts, self._seeds(step, len(prompts), 1), greedy=True)
                tally.attention_mask = greedy.attention_mask
            adv = remax_advantages(scores, self._scores(step, greedy, problems, "greedy"), mask)
            actor_loss = ActorLoss(clip=c.remax.clip, kl_coef=c.remax.kl_coef, temperature=temp)
        if self.vllm is not None:
            self.vllm.release()  # colocated: hand the engine's memory to training
        self._before_training()
        n_mb = c.train_mini_batches_per_step
        rows_per_mb = roll.tokens.shape[0] // n_mb
        losses = []
        with timer.stage(step, sp("actor-train")) as tally:
            for k in range(n_mb):
                r = slice(k * rows_per_mb, (k + 1) * rows_per_mb)
                weight = mask[r] / mask[r].sum().clamp(min=1)
                target = pack(roll.next_tokens[r], roll.logprobs[r], adv[r], ref_logp[r], weight)
                losses.append(self.engines["actor-train"].train_step(roll.tokens[r], roll.attention_mask[r],
                                                                     target, actor_loss)["loss"])
            tally.attention_mask = roll.attention_mask
        critic_fn = None
        if c.algo == "ppo":
            closs = []
            critic_fn = CriticLoss(clip=c.ppo.value_clip)
            with timer.stage(step, sp("critic-train")) as tally:
                for k in range(n_mb):
                    r = slice(k * rows_per_mb, (k + 1) * rows_per_mb)
                    weight = mask[r] / mask[r].sum().clamp(min=1)
                    target = pack(values[r], returns[r], weight)
                    closs.append(self.engines["critic-train"].train_step(
                        roll.tokens[r], roll.attention_mask[r], target, critic_fn)["loss"])
                tally.attention_mask = roll.attention_mask
            critic_loss = sum(closs) / n_mb
        self.optimizer_steps += n_mb
        t_sync = time.perf_counter()
        sync = self._sync_all()
        if self.vllm is not None:
            self.vllm.push_weights(self.engines["actor-gen"].local_tensors())
        stage_seconds = {m.model_stage: m.seconds for m in timer.of_step(step).values()}
        stage_seconds["weight-sync"] = time.perf_counter() - t_sync  # not a model-stage: the hand-over
        acc = float("nan")  # a user's prompts have no task to be accurate at; their reward says it all
        if self.prompts is None and isinstance(self.tok, ByteTokenizer):
            acc = sum(accuracy(pr, r, self.tok) for pr, r in zip(problems, roll.responses())) / len(problems)
        export_actor(c.export, step, c.model, self.engines["actor-train"], self.tok)
        if self.data_position is not None:
            self.data_position = consumed
        return StepResult(step=step, mean_score=float(scores.mean()), mean_accuracy=acc,
                          mean_response_tokens=float(mask.sum(1).mean()), actor_loss=sum(losses) / n_mb,
                          critic_loss=critic_loss, seconds=time.perf_counter() - t0, stage_seconds=stage_seconds,
                          tokens=roll.tokens, reward_errors=tuple(self._reward_errors),
                          prompts_consumed=consumed if self.prompts is not None else 0,
                          sync_sent_bytes=sync.bytes_sent if sync else 0,
                          sync_predicted_s=sync.predicted_s if sync else 0.0,
                          sync_measured_s=sync.measured_s if sync else 0.0,
                          stats=rollout_stats(scores, mask, actor=actor_loss.stats.as_dict(),
                                              critic=critic_fn.stats.as_dict() if critic_fn else None))

    def _before_training(self) -> None:
        """Called once per step between the rollout/inference phase and the first optimizer update
        (``agent.engine.live`` marks there whether a failed step may have changed the training state)."""

    def measurements(self, step: int) -> dict[str, StageMeasurement]:
        return self.timer.of_step(step)


def main() -> None:
    """``python -m agent.engine.loop``: the engine's CLI (agent.engine.loop_cli)."""
    from agent.engine.loop_cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
