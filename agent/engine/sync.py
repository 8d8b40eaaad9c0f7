"""Weight sync between model-stages of one role (actor-train -> actor-gen, critic-train -> critic-inf)
and the replan of a training model-stage: each is a TransitionDAG run by ``transitions.executor.run_dag``.

The engine plans and moves nothing itself. Every member rank packs its module's local shards into the
executor's ``RankState`` of its EMU unit (DTensor local shards equal ``transitions.geometry.tp_slice``);
``sync_plan`` builds the DAG (pure, identical on every rank): a weight sync refreshes the destination
stage's units from the source stage's (``refresh``, as ``transitions.global_dag.build_weight_sync``),
a replan moves one stage's units to a new layout. ``run_dag`` runs it over the engine's own world (a
``DataChannel`` bound to the process group already formed), and the new units are unpacked into the
destination module. A destination unit on the GPUs of a source unit of the same layout is a local
copy, so only what must move crosses the wire.

This is the engine's own-world path (``RLLoop`` on its ranks). An engine bound to a worker's units
(``agent.engine.live``) packs nothing: its parameters and moments ARE the unit buffers.
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
from planner.hardware import ClusterSpec
from planner.models import Head, ModelSpec
from planner.plan import StagePlan
from transitions.channel import DataChannel, GenerationSpec, InFlight, P2POp
from transitions.cost import transition_cost
from transitions.dag_pieces import DagMemo
from transitions.emu import EMU
from transitions.executor import IN_PLACE, RankState, allocate_unit, run_dag
from transitions.geometry import StateKind
from transitions.global_dag import TransitionDAG
from transitions.layout import StagePlacement
from transitions.node_steps import dag_messages
from transitions.placement_dag import placement_cluster, placement_dag, placement_units

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
    plan_bytes: int  # every message of the DAG as the runner sends it, all ranks together
    predicted_s: float  # the transition cost model's L_tran of the DAG
    measured_s: float  # this rank's run_dag, barrier included; pack/unpack excluded
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


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncPlan:
    """A sync's DAG and what it costs; the same on every rank (pure)."""

    dag: TransitionDAG
    old_units: tuple[EMU, ...]  # packed from the source engines
    new_units: tuple[EMU, ...]  # unpacked into the destination engines after the run
    plan_bytes: int  # every message of the run, to the byte
    predicted_s: float
    in_place: bool  # units may be built inside their donors' buffers (no packed buffer is shared)


@lru_cache(maxsize=64)
def sync_plan(old: tuple[StagePlacement, ...], new: tuple[StagePlacement, ...], shared: bool = False) -> SyncPlan:
    """The DAG moving each destination model-stage from ``old`` (its source's layout and GPUs, under
    the destination's name) to ``new``. ``shared``: two old units share one packed buffer (a source
    feeding two destinations), so none may be compacted in place."""
    dag = placement_dag(old, new)
    cluster: ClusterSpec = placement_cluster(old, new)
    in_place = IN_PLACE and not shared
    return SyncPlan(dag=dag, old_units=tuple(placement_units(old, 1)), new_units=tuple(placement_units(new, 2)),
                    plan_bytes=sum(m.num_bytes for m in dag_messages(dag, DagMemo(), early=in_place)),
                    predicted_s=transition_cost(dag, cluster).seconds, in_place=in_place)


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


def pack(engine: StageEngine, unit: EMU, rank: int, optimizer_steps: int = 0) -> RankState:
    """This rank's shards of ``engine`` as the executor's state of ``unit`` (which it holds)."""
    state = allocate_unit(unit, rank, torch.device("cpu"))
    filled = 0
    for kind in unit.state.kinds:
        for name, local in engine.local_tensors(kind.value):
            view = state.view(name, kind.value)
            if local.dtype != view.dtype:  # copy_ would cast silently: the sync must be exact
                raise SpecError(f"{engine.name}.dtype", f"{name}/{kind.value} is {local.dtype}, the plan "
                                f"stores {view.dtype}")
            view.copy_(local)
            filled += 1
    if filled != len(state.slots) - 1:  # every slot but the counters
        raise SpecError(f"{engine.name}.module", f"holds {filled} of the {len(state.slots) - 1} shards "
                        f"its unit rank has in {engine.plan.layout}")
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
    """Move ``kinds`` of every (source, destination) pair's state in one DAG run (every rank calls,
    with the same pairs). Each destination model-stage moves from its source's layout to its own; a
    source feeding several destinations is packed once. Destination optimizers take the carried step."""
    start = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    old = tuple(placement(src, dst.name, kinds) for src, dst in pairs)
    new = tuple(placement(dst, dst.name, kinds) for _, dst in pairs)
    sources = [id(src) for src, _ in pairs]
    plan = sync_plan(old, new, shared=len(set(sources)) < len(sources))
    source_of = {dst.name: src for src, dst in pairs}
    packed: dict[tuple[int, int], RankState] = {}  # (source engine, unit rank) -> its packed buffer
    units: dict[str, RankState] = {}
    for unit in plan.old_units:
        if unit.holds(rank):
            src = source_of[unit.model_stage]
            key = (id(src), unit.gpus.index(rank))
            if key not in packed:
                packed[key] = pack(src, unit, rank, optimizer_steps)
            base = packed[key]  # same slots whatever the stage's name: share the packed buffer
            units[unit.uid] = dataclasses.replace(base, placement=dataclasses.replace(
                base.placement, model_stage=unit.model_stage))
    t_run = time.perf_counter()
    reports = run_dag(plan.dag, rank, units, engine_channel(), timeout_s=SYNC_TIMEOUT_S, in_place=plan.in_place)
    measured = time.perf_counter() - t_run
    engines = {dst.name: dst for _, dst in pairs}
    for unit in plan.new_units:
        dst = engines[unit.model_stage]
        if unit.holds(rank) and dst.is_member:
            steps = unpack(units[unit.uid], dst)
            if dst.optimizer is not None:
                dst.set_optimizer_steps(steps)
    return SyncReport(bytes_sent=sum(r.bytes_sent for r in reports),
                      bytes_received=sum(r.bytes_received for r in reports),
                      bytes_copied_locally=sum(r.bytes_copied_locally for r in reports),
                      plan_bytes=plan.plan_bytes, predicted_s=plan.predicted_s,
                      measured_s=measured, total_s=time.perf_counter() - start)


def sync_weights(src: StageEngine, dst: StageEngine) -> SyncReport:
    """Parameters of a training model-stage onto a generation/inference stage of the same role."""
    return transfer([(src, dst)])


def move_training_state(src: StageEngine, dst: StageEngine, optimizer_steps: int) -> SyncReport:
    """Parameters and AdamW moments of a training model-stage onto a new layout or DP degree (a
    replan), so training continues as if the layout had never changed; the optimizer step count
    travels in the executor's unit counters."""
    return transfer([(src, dst)], TRAINING_STATE, optimizer_steps)
