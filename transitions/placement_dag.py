"""Stage placements as plans: the TransitionDAG, and the initial units, for lists of placements.

A stage placement (``StagePlacement``: model-stage, model, head, state kinds, layout, one worker set
per DP replica) is how tests, benchmarks and local runs say where state lives. Every move of state
is a TransitionDAG, so this module turns old/new placement lists into what ``build_transition``
takes (a ``UnitState`` per model-stage, two ``GlobalPlan`` versions, a cluster with one device per
worker) and returns the checked DAG; ``placement_units`` gives the units a placement list starts
with (what ``LocalCoordinator.init_units`` fills). Pure: no torch; placements are duck-typed.

    dag = placement_dag(old, new)            # old at version 1, new at version 2
    coordinator.init_units(placement_units(old), seed=0)
    coordinator.run_dag(dag, placement_cluster(old, new))
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from planner.errors import SpecError
from planner.hardware import ClusterSpec, cluster_preset
from planner.models import Head
from planner.plan import GlobalPlan, StagePlan
from planner.workflow import Role, StageKind
from transitions.emu import EMU, UnitState
from transitions.geometry import StateKind
from transitions.global_dag import TransitionDAG, build_transition
from transitions.local_dag import plan_units

if TYPE_CHECKING:
    from transitions.layout import StagePlacement

Placements = Sequence["StagePlacement"]


def unit_state(placement: StagePlacement) -> UnitState:
    """What every unit of the placement's model-stage holds. Optimizer state makes it a training
    stage; the role follows the head (value: critic; LM: actor when training, else reference), so
    that only a training stage of the same role and model can stand in for a lost one."""
    training = bool(set(placement.kinds) - {StateKind.PARAM})
    if placement.head is Head.VALUE:
        role = Role.CRITIC
    else:
        role = Role.ACTOR if training else Role.REFERENCE
    return UnitState(model_stage=placement.model_stage,
                     stage_kind=StageKind.TRAINING if training else StageKind.INFERENCE,
                     role=role, model=placement.model, head=placement.head, kinds=tuple(placement.kinds))


def stage_plan(placement: StagePlacement) -> StagePlan:
    return StagePlan(model_stage=placement.model_stage, layout=placement.layout,
                     gpu_sets=tuple(placement.gpu_sets), micro_batch_size=1)


def placement_plan(placements: Iterable[StagePlacement], version: int) -> GlobalPlan:
    return GlobalPlan(version=version, stages=tuple(stage_plan(p) for p in placements))


def placement_cluster(*placement_lists: Placements) -> ClusterSpec:
    """One local node with a CPU device per worker, up to the highest worker any placement uses."""
    num = 1 + max(g for ps in placement_lists for p in ps for s in p.gpu_sets for g in s)
    return cluster_preset("cpu", num, gpus_per_node=num)


def placement_units(placements: Iterable[StagePlacement], version: int = 1) -> list[EMU]:
    """The units ``placements`` hold at plan ``version`` (one per DP replica, uids as the DAG names them)."""
    return [u for p in placements for u in plan_units(unit_state(p), stage_plan(p), version)]


def placement_dag(old: Placements, new: Placements, *, old_version: int = 1,
                  cluster: ClusterSpec | None = None, lost_workers: Iterable[int] = ()) -> TransitionDAG:
    """The checked DAG moving every model-stage from ``old`` (at ``old_version``) to ``new`` (the next
    version). Both lists place the same model-stages with the same state (model, head, kinds): a
    SpecError otherwise, before anything moves. ``lost_workers``: workers that died since ``old``."""
    old_by = {p.model_stage: p for p in old}
    new_by = {p.model_stage: p for p in new}
    if set(old_by) != set(new_by):
        raise SpecError("placements", f"old stages {sorted(old_by)} differ from new {sorted(new_by)}")
    states = {name: unit_state(p) for name, p in old_by.items()}
    for name, p in new_by.items():
        if unit_state(p) != states[name]:
            raise SpecError(f"{name}.model", "a transition keeps the model, head and state kinds")
    return build_transition(states, cluster or placement_cluster(old, new), placement_plan(old, old_version),
                            placement_plan(new, old_version + 1), lost_gpus=frozenset(lost_workers))
