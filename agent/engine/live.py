"""The RL engine on a worker's live EMU state: ONE copy of the weights and AdamW moments.

A worker (``agent.worker.WorkerContext``) holds its model-stages' state as EMU unit buffers,
``ctx.units`` (uid -> ``RankState``); the executor moves those buffers between layouts (``run_dag``).
Here the engine trains ON them: after ``bind``, every parameter of a live stage and every AdamW
``exp_avg``/``exp_avg_sq`` is a view into its unit's flat buffer (a DTensor's local shard included),
so there is nothing to pack before a transition nor to unpack after one. Live stages are those
whose state derives from no other stage (``live_placements``): the trainers (parameters and moments
in the engine's fp32) and the frozen inference stages (ref-inf; reward-inf with a reward model).
Generation and inference stages fed by a trainer (actor-gen, critic-inf, actor-gen-greedy) are
refreshed every step by one weight-sync DAG from the trainers' unit buffers (a ``refresh`` transition,
as the daemon's ``build_weight_sync``); their parameters are views of the units it delivers.

Gradients are transient: they exist only inside ``train_step`` and are dropped (None) at its end,
so at every safe point (between steps, where the driver runs DAGs, checkpoints or re-binds) the
whole training state is in the units. A unit's counters: [0] plan version, [1] optimizer steps
(AdamW's ``step``, restored from it on bind), [2] RL steps done, [3] the data position (prompts
consumed, so a resumed run reads on where the last step stopped); written after every step.

The driver calls, through the worker's ``Call(fn, kwargs)`` command, on every member of a generation
(the default process group IS the generation, ranks in ``spec.members`` order; plans name WORKER
ids, the daemon's global GPU ids, translated to ranks for the engine here):

    coordinator.call(bind, cfg=cfg, plan=a)      # (re)build the engine on plan a's units
    coordinator.call(train_step, step=s)         # one RL step on every member -> LiveStep
    coordinator.call(release)                    # drop the views before the executor moves the units
    coordinator.run_dag(live_dag(cfg, a, b), live_cluster(cfg, a, b))
    coordinator.call(bind, cfg=cfg, plan=b)

After any DAG run, checkpoint load or new generation the engine must be bound again (``train_step``
refuses a stale binding). CPU (gloo) only, as the engine.
"""

from __future__ import annotations

import gc
import hashlib
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from agent.engine.live_plan import (  # noqa: F401 (re-exported: callers import them from here)
    FROZEN_ROLES,
    TRAINER_OF,
    fed_placements,
    live_cluster,
    live_dag,
    live_placements,
    live_units,
    placed_plan,
    placed_units,
    rank_plan,
    stage_states,
)
from agent.engine.live_views import bind_views, fill_fresh
from agent.engine.loop import RLLoop, RunConfig
from agent.engine.step_stats import StepStats
from agent.engine.sync import SYNC_TIMEOUT_S, TRAINING_STATE, SyncReport
from planner.errors import SpecError
from planner.plan import GlobalPlan
from planner.workflow import StageKind
from transitions.channel import DataChannel
from transitions.cost import transition_cost
from transitions.dag_pieces import DagMemo
from transitions.emu import EMU
from transitions.executor import RankState, allocate_unit, background, run_dag
from transitions.global_dag import TransitionDAG, build_transition
from transitions.node_steps import dag_messages
from transitions.placement_dag import placement_cluster

# the unit counters (transitions.layout.COUNTERS): plan version, AdamW steps, RL steps done, and the
# data position (prompts consumed: agent.engine.data.DataPosition; steps x prompts per step for a
# synthetic task, whose prompts derive from the step)
VERSION, OPTIMIZER_STEPS, RL_STEPS, DATA_POSITION = 0, 1, 2, 3


# --- the engine on a worker -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveStep:
    """One RL step as every member saw it (picklable: no tensors)."""

    step: int
    mean_score: float
    mean_accuracy: float  # NaN for a user's prompts (no task to be accurate at)
    mean_response_tokens: float
    actor_loss: float
    critic_loss: float | None
    seconds: float
    stage_seconds: dict[str, float]  # per model-stage (the planner's names), plus "weight-sync"
    peak_memory_bytes: int  # CPU: this process's resident set size after the step; GPU: peak allocated
    rollout_sha256: str  # of the step's rollout tokens (int64 bytes): reproducibility checks
    optimizer_steps: int  # after the step
    sync_sent_bytes: int  # this worker's share of the weight sync, bytes sent point-to-point
    stats: StepStats | None = None  # reward/length statistics and this worker's loss tallies
    data_position: int = 0  # prompts consumed after the step (the units' counter)


def torn(ctx: Any, step: int | None = None) -> bool:
    """Whether this worker's training state may be torn: its last step failed after the members began
    the optimizer updates (so the units hold some of that step's updates, not all), or (``step``: the
    step the driver saw fail) the units are not at that step: the step finished here while a peer died
    before it answered (a node killed in the step's last moments), so what the survivors hold is a step
    the driver never logged. The driver asks the survivors after a failed step; torn state is restored
    from the checkpoint instead of moved."""
    engine = ctx.engine
    if not isinstance(engine, LiveEngine):
        return False
    return bool(engine.loop.updating) or (step is not None and engine.rl_steps != step)


class LiveLoop(RLLoop):
    """``RLLoop`` on a generation's ranks whose weight sync is one refresh DAG over the worker's unit
    buffers (worker ids, ``ctx.channel``), delivering the fed stages' units as their parameters."""

    def __init__(self, cfg: RunConfig, plan: GlobalPlan, *, worker_id: int, channel: DataChannel,
                 units: dict[str, RankState]) -> None:
        spec = channel.spec
        assert spec is not None
        super().__init__(cfg, rank_plan(plan, spec.members), rank=spec.rank_of(worker_id))
        # not the worker's context: no reference cycle, so dropping ``ctx.engine`` frees the views
        self.worker_id, self.channel, self.units, self.worker_plan = worker_id, channel, units, plan
        # set once every member finished the step's rollout and inference, cleared when the step is done:
        # a step that fails while it is set may have applied some optimizer updates (torn state)
        self.updating = False
        self.memo = DagMemo()
        self.fed: dict[str, RankState] = {}  # uid -> state backing a fed stage's parameters
        self._feed_dag, self._sources, self._feed_units, self._feed_predicted_s = self._feed_plan()
        self._feed_bytes = sum(m.num_bytes for m in dag_messages(self._feed_dag, DagMemo(), early=False)) \
            if self._feed_dag is not None else 0

    def _feed_plan(self) -> tuple[TransitionDAG | None, tuple[EMU, ...], tuple[EMU, ...], float]:
        """The weight-sync DAG (the same every step), the trainer units it reads, the units it makes."""
        fed = fed_placements(self.cfg, self.worker_plan)
        if not fed:
            return None, (), (), 0.0
        plan, version = self.worker_plan, self.worker_plan.version
        live = {p.model_stage: p for p in live_placements(self.cfg, plan)}
        trainers = tuple(live[name] for name in dict.fromkeys(t for _, t in fed))
        both = (*trainers, *(p for p, _ in fed))
        cluster = placement_cluster(both)
        dag = build_transition(stage_states(self.cfg, both), cluster, placed_plan(plan, trainers, version),
                               placed_plan(plan, both, version + 1), refresh={p.model_stage: t for p, t in fed})
        return (dag, placed_units(self.cfg, trainers, plan, version), placed_units(self.cfg, both[len(trainers):], plan, version + 1),
                transition_cost(dag, cluster).seconds)

    def _before_training(self) -> None:
        """Every member has finished the rollout phase before any updates its state: a member lost before
        this point leaves the training state untouched on all survivors; after it, ``updating`` says so."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(torch.zeros(1))  # bounded by the generation's timeout, as every collective
        self.updating = True

    def _sync_all(self) -> SyncReport | None:
        """The fed stages' parameters refreshed from the trainers' unit buffers, in one DAG (collective
        over the generation). The trainers' buffers are read, never built into (no in-place builds,
        no whole-buffer broadcasts), and stay in ``ctx.units`` under their own uids."""
        if self._feed_dag is None:
            return None
        start = time.perf_counter()
        wid = self.worker_id
        units = {u.uid: self.units[u.uid] for u in self._sources if u.holds(wid)}  # a copy: the DAG renames
        reports = run_dag(self._feed_dag, wid, units, self.channel, timeout_s=SYNC_TIMEOUT_S, in_place=False,
                          fan_out=False, memo=self.memo)
        measured = time.perf_counter() - start
        self.fed = {}
        for unit in self._feed_units:
            if unit.holds(wid):
                self.fed[unit.uid] = units[unit.uid]
                bind_views(self.engines[unit.model_stage], units[unit.uid])
        return SyncReport(bytes_sent=sum(r.bytes_sent for r in reports),
                          bytes_received=sum(r.bytes_received for r in reports),
                          bytes_copied_locally=sum(r.bytes_copied_locally for r in reports),
                          plan_bytes=self._feed_bytes, predicted_s=self._feed_predicted_s, measured_s=measured,
                          total_s=time.perf_counter() - start)


@dataclass(kw_only=True, slots=True)
class LiveEngine:
    """What ``bind`` leaves in ``ctx.engine``: the loop and the units it is bound to."""

    loop: LiveLoop
    plan: GlobalPlan  # worker ids
    generation: int
    bound: dict[str, RankState]  # uid -> the unit buffer the engine's tensors view
    rl_steps: int  # RL steps done: the next step to run


def _held_live(cfg: RunConfig, plan: GlobalPlan, worker: int) -> list[EMU]:
    return [u for u in live_units(cfg, plan) if u.holds(worker)]


def _stage_census(ctx: Any, cfg: RunConfig, plan: GlobalPlan, names: list[str]) -> torch.Tensor:
    """Per live stage, over the generation: [units held, units missing, stray units] (summed)."""
    mine = _held_live(cfg, plan, ctx.worker_id)
    expected = {u.uid for u in mine}
    counts = torch.zeros(len(names), 3, dtype=torch.int64)
    for u in mine:
        counts[names.index(u.model_stage), 0 if u.uid in ctx.units else 1] += 1
    for uid, state in ctx.units.items():
        if uid not in expected and state.placement.model_stage in names:
            counts[names.index(state.placement.model_stage), 2] += 1
    dist.all_reduce(counts)
    return counts


def _agreed(what: str, ctx: Any, states: list[RankState], counter: int) -> int:
    """The value of ``counter`` in ``states``, which must agree on every member that has any
    (collective; 0 where none has)."""
    values = {int(s.counters[counter]) for s in states}
    if len(values) > 1:
        raise SpecError("units.counters", f"worker {ctx.worker_id}'s units disagree on {what}: {sorted(values)}")
    mine = values.pop() if values else None
    none = -(2**62)
    t = torch.tensor([none if mine is None else mine, none if mine is None else -mine], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    hi, lo = int(t[0]), -int(t[1])
    if hi == none:
        return 0
    if lo != hi:
        raise SpecError("units.counters", f"members' units disagree on {what}: {lo} .. {hi}")
    return hi


def bind(ctx: Any, *, cfg: RunConfig, plan: GlobalPlan) -> dict[str, Any]:
    """(Re)build ``ctx.engine`` on ``plan`` (worker ids) over the generation's ranks; collective.

    For every live unit this worker holds: if ``ctx.units`` has it (moved there by a DAG, loaded from
    a checkpoint, or bound before) the engine's parameters and moments become views of it; if no
    member holds any unit of the stage (a fresh start), each allocates its units and the engine's
    initial weights are copied in once. A stage some members hold and others lack, or one with no
    unit of ``plan`` but units of another plan version, is refused (a SpecError): its state would
    silently restart from the initial weights. Units the plan no longer places here are dropped.
    AdamW's step, the RL step and the data position come from the counters; then the weight sync runs."""
    if ctx.device.type != "cpu":
        raise SpecError("device", f"the RL engine runs on CPU (gloo) here, the worker holds {ctx.device}", "cpu")
    if cfg.rollout_backend != "torch":
        raise SpecError("rollout_backend", "a bound engine generates with the torch backend", "torch")
    spec = ctx.channel.spec
    if spec is None or not ctx.channel.ready:
        raise SpecError("generation", f"worker {ctx.worker_id} must join a generation before bind")
    start = time.perf_counter()
    release(ctx)
    names = [p.model_stage for p in live_placements(cfg, plan)]
    census = _stage_census(ctx, cfg, plan, names)
    fresh_stages = set()
    for name, (held, missing, stray) in zip(names, census.tolist()):
        if held and missing:
            raise SpecError(f"{name}.units", f"{held} of the plan's unit shares are held and {missing} missing: "
                            "move them with a DAG or load them from a checkpoint before bind")
        if not held and stray:
            raise SpecError(f"{name}.units", f"no unit of plan version {plan.version} is held, but {stray} "
                            "of another plan are: bind the plan they were moved to")
        if not held:
            fresh_stages.add(name)
    mine = _held_live(cfg, plan, ctx.worker_id)
    keep = {u.uid for u in mine}
    for uid in [uid for uid in ctx.units if uid not in keep]:
        del ctx.units[uid]
    loop = LiveLoop(cfg, plan, worker_id=ctx.worker_id, channel=ctx.channel, units=ctx.units)
    fresh = []
    for unit in mine:
        stage = loop.engines[unit.model_stage]
        if unit.model_stage in fresh_stages:
            ctx.units[unit.uid] = allocate_unit(unit, ctx.worker_id, ctx.device)
            fill_fresh(stage, ctx.units[unit.uid])
            fresh.append(unit.uid)
        bind_views(stage, ctx.units[unit.uid])
    # the position of the run: the same on every member that holds a unit, then on all
    training = [u for u in mine if u.state.stage_kind is StageKind.TRAINING]
    loop.optimizer_steps = _agreed("optimizer steps", ctx, [ctx.units[u.uid] for u in training], OPTIMIZER_STEPS)
    rl_steps = _agreed("RL steps", ctx, [ctx.units[u.uid] for u in mine], RL_STEPS)
    position = _agreed("data position", ctx, [ctx.units[u.uid] for u in mine], DATA_POSITION)
    # units written before the position was counted hold 0 there: their position is the steps' (no resize then)
    loop.data_position = position if position or not rl_steps else rl_steps * cfg.prompts_per_step
    for eng in loop.engines.values():
        if eng.optimizer is not None and eng.is_member:
            eng.set_optimizer_steps(loop.optimizer_steps)
    live = LiveEngine(loop=loop, plan=plan, generation=spec.generation,
                      bound={u.uid: ctx.units[u.uid] for u in mine}, rl_steps=rl_steps)
    _write_counters(live)
    sync = loop._sync_all()
    ctx.engine = live
    return {"worker": ctx.worker_id, "rank": loop.rank, "generation": spec.generation, "version": plan.version,
            "units": sorted(live.bound), "fresh": fresh, "optimizer_steps": loop.optimizer_steps,
            "rl_steps": live.rl_steps, "data_position": loop.data_position,
            "sync_sent_bytes": sync.bytes_sent if sync else 0,
            "seconds": time.perf_counter() - start}


def release(ctx: Any) -> int:
    """Drop the bound engine, and with it its references to unit buffers, so that a DAG's Destroy
    frees a buffer when the DAG's memory plan says (a driver calls it before ``run_dag`` or a
    checkpoint load; ``bind`` calls it first). Returns the number of units it was bound to.

    The engine's device meshes and replica groups belong to a generation already re-formed: their
    teardown (gloo joining its threads and closing its pairs: 20-40 ms of waiting, not CPU, per
    stage here) runs on the release thread (``transitions.executor.background.RELEASES``, started
    once: a thread started per release cost its start, 0.2-6.3 ms at load, inside the transition), so
    the transition waiting for ``release`` does not."""
    engine, ctx.engine = ctx.engine, None
    bound = len(engine.bound) if isinstance(engine, LiveEngine) else 0
    groups = _take_groups(engine) if isinstance(engine, LiveEngine) else []
    del engine
    gc.collect()  # pipeline schedules and meshes may hold cycles
    if groups:
        background.RELEASES.submit(groups.clear)
    return bound


def _take_groups(engine: LiveEngine) -> list[Any]:
    """The engine's meshes and replica groups, taken out of its stage engines."""
    out: list[Any] = []
    for eng in engine.loop.engines.values():
        out.append(eng.mesh)
        out.extend(g for g in eng.replica_groups if g is not None)
        eng.mesh, eng.replica_groups = None, []
    return out


def _write_counters(engine: LiveEngine) -> None:
    for state in engine.bound.values():
        c = state.counters
        c[VERSION] = engine.plan.version
        c[OPTIMIZER_STEPS] = engine.loop.optimizer_steps if state.placement.kinds == TRAINING_STATE else 0
        c[RL_STEPS] = engine.rl_steps
        c[DATA_POSITION] = engine.loop.data_position or 0


def _check_bound(ctx: Any) -> LiveEngine:
    engine = ctx.engine
    if not isinstance(engine, LiveEngine):
        raise SpecError("engine", f"worker {ctx.worker_id} has no bound engine: call bind first")
    spec = ctx.channel.spec
    if spec is None or spec.generation != engine.generation:
        raise SpecError("engine", f"bound in generation {engine.generation}, the worker is in "
                        f"{spec.generation if spec else 'none'}: bind again")
    moved = sorted(uid for uid, state in engine.bound.items() if ctx.units.get(uid) is not state)
    if moved or len(ctx.units) != len(engine.bound):
        raise SpecError("engine", f"the units changed since bind ({moved or sorted(ctx.units)}): bind again")
    return engine


def train_step(ctx: Any, *, step: int) -> LiveStep:
    """One RL step on every member (collective); ``step`` must be the RL steps done so far (the data
    position the units carry). Gradients are dropped at the end; the counters are written."""
    engine = _check_bound(ctx)
    if step != engine.rl_steps:
        raise SpecError("step", f"the units are at RL step {engine.rl_steps}, asked for {step}",
                        str(engine.rl_steps))
    loop = engine.loop
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    res = loop.step(step)
    for eng in loop.engines.values():  # transient: the training state is the units alone
        if eng.module is not None:
            for p in eng.module.parameters():
                p.grad = None
    engine.rl_steps = step + 1
    _write_counters(engine)
    loop.updating = False  # the step's updates are all in, and the counters say so
    if cuda:
        peak = int(torch.cuda.max_memory_allocated(ctx.device))
    else:
        import psutil

        peak = int(psutil.Process().memory_info().rss)
    return LiveStep(step=step, mean_score=res.mean_score, mean_accuracy=res.mean_accuracy,
                    mean_response_tokens=res.mean_response_tokens, actor_loss=res.actor_loss,
                    critic_loss=res.critic_loss, seconds=res.seconds, stage_seconds=dict(res.stage_seconds),
                    peak_memory_bytes=peak, rollout_sha256=hashlib.sha256(
                        res.tokens.to(torch.int64).contiguous().numpy().tobytes()).hexdigest(),
                    optimizer_steps=loop.optimizer_steps, sync_sent_bytes=res.sync_sent_bytes, stats=res.stats,
                    data_position=loop.data_position or 0)


def state_digest(ctx: Any) -> dict[str, str]:
    """sha256 of every shard this worker holds (its logical row-major bytes, whatever the storage
    order), keyed "stage/tensor/kind/offsets" (offsets comma-separated; counters included)."""
    out: dict[str, str] = {}
    for state in ctx.units.values():
        for slot, view in state.shards():
            key = f"{state.placement.model_stage}/{slot.tensor}/{slot.kind}/{','.join(map(str, slot.offsets))}"
            if key in out:
                raise SpecError("units", f"{key} is held twice on worker {ctx.worker_id}")
            out[key] = hashlib.sha256(view.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    return out

