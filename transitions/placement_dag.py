"""Transition DAGs between placements given as ``StagePlacement`` lists (what the engine and tests hold).

A ``StagePlacement`` names a model-stage's model, head, state kinds, layout and GPU sets; the DAG
builder wants the same as a ``UnitState`` per stage and ``GlobalPlan``s. This is that translation,
so that every move of state, including the engine's weight sync and a replan of its training state,
is a ``TransitionDAG`` run by ``transitions.executor.run_dag``. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from planner.errors import SpecError
from planner.hardware import ClusterSpec, cluster_preset
from planner.plan import GlobalPlan, StagePlan
from planner.workflow import Role, StageKind
from transitions.emu import EMU, UnitState
from transitions.geometry import StateKind
from transitions.global_dag import TransitionDAG, build_transition
from transitions.layout import StagePlacement
from transitions.local_dag import plan_units


def unit_state(p: StagePlacement) -> UnitState:
    """The state description of ``p``'s units: training if it holds optimizer state."""
    kind = StageKind.TRAINING if StateKind.EXP_AVG in p.kinds else StageKind.INFERENCE
    role = Role.ACTOR if p.head is Role.ACTOR.head else Role.CRITIC
    return UnitState(model_stage=p.model_stage, stage_kind=kind, role=role, model=p.model, head=p.head,
                     kinds=p.kinds)


def global_plan(placements: Iterable[StagePlacement], version: int) -> GlobalPlan:
    return GlobalPlan(version=version, stages=tuple(
        StagePlan(model_stage=p.model_stage, layout=p.layout, gpu_sets=p.gpu_sets, micro_batch_size=1)
        for p in placements))


def states_of(*placement_lists: Iterable[StagePlacement]) -> dict[str, UnitState]:
    """One UnitState per model-stage across ``placement_lists``; a stage described twice must agree."""
    out: dict[str, UnitState] = {}
    for placements in placement_lists:
        for p in placements:
            state = unit_state(p)
            if out.setdefault(p.model_stage, state) != state:
                raise SpecError(f"{p.model_stage}.model", "a transition keeps each stage's model, head and "
                                "state kinds")
    return out


def units_of(placements: Sequence[StagePlacement], version: int = 0) -> list[EMU]:
    """The units ``placements`` hold at plan ``version`` (what a worker initialises or restores)."""
    states = states_of(placements)
    plan = global_plan(placements, version)
    return [u for sp in plan for u in plan_units(states[sp.model_stage], sp, version)]


def cluster_for(placements: Iterable[StagePlacement], device: str = "cpu") -> ClusterSpec:
    """The smallest cluster of ``device`` holding every GPU the placements use, one node."""
    gpus = max((g for p in placements for g in p.workers), default=0) + 1
    return cluster_preset(device, gpus, gpus_per_node=gpus)


def placement_dag(old: Sequence[StagePlacement], new: Sequence[StagePlacement], *, old_version: int = 0,
                  cluster: ClusterSpec | None = None, refresh: Mapping[str, str] | None = None,
                  capacity_bytes: int | None = None, exact: bool | None = None) -> TransitionDAG:
    """The checked DAG moving ``old`` to ``new`` (plan versions ``old_version`` -> ``old_version + 1``).
    ``refresh``: stage -> source stage whose units overwrite it (a weight sync)."""
    states = states_of(old, new)
    cluster = cluster if cluster is not None else cluster_for((*old, *new))
    return build_transition(states, cluster, global_plan(old, old_version), global_plan(new, old_version + 1),
                            refresh=refresh, capacity_bytes=capacity_bytes, exact=exact)
