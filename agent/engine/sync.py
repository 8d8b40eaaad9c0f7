"""Weight sync between model-stages of one role (actor-train -> actor-gen, critic-train -> critic-inf)
and the replan of a training model-stage, run by the executor of ``transitions/``.

The engine plans and moves nothing itself: each member rank packs its module's local shards into the
executor's ``RankState`` (the flat buffer of its EMU unit rank; DTensor local shards equal
``transitions.geometry.tp_slice``), ``transitions.executor.plan_transition`` plans the change from the
source placement to the destination's (computed identically on every rank: local pieces plus bucketed
messages), ``run_transition`` runs it over the engine's own world (a ``DataChannel`` bound to the
process group already formed), and the received state is unpacked into the destination module. A rank
that holds the same unit rank of the same layout on both sides keeps the packed buffer as is, and a
piece the rank already holds is a local copy, so only what must move crosses the wire.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from agent.engine.parallel import StageEngine
from planner.errors import SpecError
from planner.models import Head, ModelSpec
from planner.plan import StagePlan
from transitions.channel import DataChannel, GenerationSpec, InFlight, P2POp
from transitions.executor import RankState, StagePlacement, TransitionPlan, plan_transition, run_transition
from transitions.geometry import StateKind

PARAMS: tuple[StateKind, ...] = (StateKind.PARAM,)
# the engine keeps no separate fp32 master copy: its parameters are the master weights
TRAINING_STATE: tuple[StateKind, ...] = (StateKind.PARAM, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
STEP_COUNTER = 1  # executor counters: version, optimizer step, minibatch position, spare
BYTES_PER_DTYPE = {torch.bfloat16: 2, torch.float32: 4}
# StageEngine builds its modules in float32 on every rank; every rank must plan with the same dtype,
# including ranks outside a stage, so it is a constant here and pack() checks it against the module
ENGINE_DTYPE = torch.float32
SYNC_TIMEOUT_S = 300.0  # one bound for every wait of a sync; the engine's world has no other


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncReport:
    """This rank's part of one sync, and the executor's plan totals (the same on every rank)."""

    bytes_sent: int
    bytes_received: int
    bytes_copied_locally: int
    plan_bytes: int  # every message of the plan, all ranks together
    predicted_s: float  # the executor's prediction for the whole plan
    measured_s: float  # this rank's run_transition, barrier included; pack/unpack excluded
    total_s: float  # pack + run + unpack on this rank


def placement(engine: StageEngine, model_stage: str, kinds: tuple[StateKind, ...],
              dtype: torch.dtype = ENGINE_DTYPE) -> StagePlacement:
    """The executor's view of an engine: its layout and GPU sets, parameters stored as ``dtype``."""
    return plan_placement(engine.spec, engine.head, engine.plan, model_stage, kinds, dtype)


def plan_placement(spec: ModelSpec, head: Head, plan: StagePlan, model_stage: str,
                   kinds: tuple[StateKind, ...], dtype: torch.dtype = ENGINE_DTYPE) -> StagePlacement:
    """The executor's placement of a model-stage under ``plan`` (pure: no engine needed)."""
    if dtype not in BYTES_PER_DTYPE:
        raise SpecError(f"{model_stage}.dtype", f"{dtype} has no executor state kind",
                        ", ".join(map(str, BYTES_PER_DTYPE)))
    model = dataclasses.replace(spec, bytes_per_param=BYTES_PER_DTYPE[dtype])
    return StagePlacement(model_stage=model_stage, model=model, head=head, kinds=kinds, layout=plan.layout,
                          gpu_sets=plan.gpu_sets)


@lru_cache(maxsize=64)
def _plan(old: tuple[StagePlacement, ...], new: tuple[StagePlacement, ...]) -> TransitionPlan:
    return plan_transition(old, new)


class _SoloChannel(DataChannel):
    """One process, no process group: every piece is local, so nothing is posted or awaited."""

    def barrier(self, timeout_s: float | None = None) -> None:
        return None

    def start(self, ops: list[P2POp]) -> InFlight:
        if ops:
            raise SpecError("world", "a single-process sync has no peer to exchange with")
        return InFlight(channel=self, works=[], generation=0)


def engine_channel() -> DataChannel:
    """The data channel over the engine's world: the default group, ranks as worker ids. The store
    address is never dialled (the group exists already; ``join`` is never called)."""
    spec = GenerationSpec(generation=0, members=(0,), store_host="127.0.0.1", store_port=1,
                          timeout_s=SYNC_TIMEOUT_S)
    if not dist.is_initialized():
        return _SoloChannel(worker_id=0, device=torch.device("cpu"), spec=spec)
    spec = dataclasses.replace(spec, members=tuple(range(dist.get_world_size())))
    return DataChannel(worker_id=dist.get_rank(), device=torch.device("cpu"), spec=spec)


def pack(engine: StageEngine, where: StagePlacement, optimizer_steps: int = 0) -> RankState | None:
    """This rank's shards of ``engine`` as the executor's state of ``where`` (None off the stage)."""
    if engine.coord is None:
        return None
    lay, c = engine.plan.layout, engine.coord
    state = RankState.allocate(where, c.replica, lay.rank_of(c.tp_rank, c.pp_rank), torch.device("cpu"))
    filled = 0
    for kind in where.kinds:
        for name, local in engine.local_tensors(kind.value):
            view = state.view(name, kind.value)
            if local.dtype != view.dtype:  # copy_ would cast silently: the sync must be exact
                raise SpecError(f"{engine.name}.dtype", f"{name}/{kind.value} is {local.dtype}, the plan "
                                f"stores {view.dtype}")
            view.copy_(local)
            filled += 1
    if filled != len(state.slots) - 1:  # every slot but the counters
        raise SpecError(f"{engine.name}.module", f"holds {filled} of the {len(state.slots) - 1} shards "
                        f"its unit rank has in {lay}")
    state.counters.zero_()
    state.counters[STEP_COUNTER] = optimizer_steps
    return state


def unpack(state: RankState, engine: StageEngine) -> int:
    """Write ``state`` into ``engine``'s module (and optimizer); returns the optimizer step it carries."""
    for kind in state.placement.kinds:
        for name, local in engine.local_tensors(kind.value):
            local.copy_(state.view(name, kind.value))
    return int(state.counters[STEP_COUNTER])


@torch.no_grad()
def transfer(pairs: list[tuple[StageEngine, StageEngine]], kinds: tuple[StateKind, ...] = PARAMS,
             optimizer_steps: int = 0) -> SyncReport:
    """Move ``kinds`` of every (source, destination) pair's state in one executor run (every rank
    calls, with the same pairs). Each destination's step is named after it; a source feeding several
    destinations is packed once. Destination optimizers take the carried optimizer step."""
    start = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    old, new = [], []
    states: dict[str, RankState] = {}
    packed: dict[int, RankState | None] = {}
    for src, dst in pairs:
        old.append(placement(src, dst.name, kinds))
        new.append(placement(dst, dst.name, kinds))
        if id(src) not in packed:
            packed[id(src)] = pack(src, old[-1], optimizer_steps)
        base = packed[id(src)]
        if base is not None:  # same slots whatever the stage's name: share the packed buffer
            states[dst.name] = dataclasses.replace(base, placement=old[-1])
    plan = _plan(tuple(old), tuple(new))
    t_run = time.perf_counter()
    pending = run_transition(plan, rank, states, engine_channel(), timeout_s=SYNC_TIMEOUT_S)
    measured = time.perf_counter() - t_run
    for _, dst in pairs:
        got = pending.new_states.get(dst.name)
        if got is not None and dst.is_member:
            steps = unpack(got, dst)
            if dst.optimizer is not None:
                dst.set_optimizer_steps(steps)
    reports = pending.reports
    return SyncReport(bytes_sent=sum(r.bytes_sent for r in reports),
                      bytes_received=sum(r.bytes_received for r in reports),
                      bytes_copied_locally=sum(r.bytes_copied_locally for r in reports),
                      plan_bytes=sum(s.bytes_moved for s in plan.steps), predicted_s=plan.predicted_s,
                      measured_s=measured, total_s=time.perf_counter() - start)


def sync_weights(src: StageEngine, dst: StageEngine) -> SyncReport:
    """Parameters of a training model-stage onto a generation/inference stage of the same role."""
    return transfer([(src, dst)])


def move_training_state(src: StageEngine, dst: StageEngine, optimizer_steps: int) -> SyncReport:
    """Parameters and AdamW moments of a training model-stage onto a new layout or DP degree (a
    replan), so training continues as if the layout had never changed; the optimizer step count
    travels in the executor's unit counters."""
    return transfer([(src, dst)], TRAINING_STATE, optimizer_steps)
