"""Which of a job's state is live under a plan, and the DAG that moves it. Pure (no tensors touched).

The live stages are those whose state derives from no other stage: the trainers (parameters and
AdamW moments in the engine's fp32) and the frozen inference stages (ref-inf; reward-inf with a reward
model); the stages a trainer feeds (actor-gen, critic-inf, ...) are refreshed from it every step
(``fed_placements``). agent.engine.live trains on these units' buffers and re-exports these names.
"""

from __future__ import annotations

import dataclasses

from agent.engine.loop import RunConfig, role_model
from agent.engine.sync import PARAMS, TRAINING_STATE, plan_placement
from planner.errors import SpecError
from planner.hardware import ClusterSpec
from planner.plan import GlobalPlan
from planner.workflow import Role, StageKind
from transitions.emu import EMU, UnitState
from transitions.global_dag import TransitionDAG, build_transition
from transitions.layout import StagePlacement
from transitions.local_dag import plan_units
from transitions.placement_dag import placement_cluster

# which trainer's parameters refresh a generation/inference stage of a role
TRAINER_OF = {Role.ACTOR: "actor-train", Role.CRITIC: "critic-train"}
FROZEN_ROLES = (Role.REFERENCE, Role.REWARD)


def live_placements(cfg: RunConfig, plan: GlobalPlan) -> tuple[StagePlacement, ...]:
    """The model-stages whose state derives from no other stage, in workflow order: training stages
    (parameters, exp_avg, exp_avg_sq in the engine's fp32) and frozen inference stages (parameters)."""
    out = []
    for ms in cfg.workflow.model_stages:
        if ms.kind is StageKind.TRAINING:
            kinds = TRAINING_STATE
        elif ms.role in FROZEN_ROLES:
            kinds = PARAMS
        else:
            continue  # refreshed from its trainer every step
        spec, head, _ = role_model(cfg, ms.role)
        out.append(plan_placement(spec, head, plan.stage(ms.name), ms.name, kinds))
    return tuple(out)


def fed_placements(cfg: RunConfig, plan: GlobalPlan) -> tuple[tuple[StagePlacement, str], ...]:
    """(placement, trainer) of every stage the weight sync refreshes from a trainer's parameters."""
    out = []
    for ms in cfg.workflow.model_stages:
        trainer = TRAINER_OF.get(ms.role)
        if ms.kind is StageKind.TRAINING or trainer is None:
            continue
        spec, head, _ = role_model(cfg, ms.role)
        out.append((plan_placement(spec, head, plan.stage(ms.name), ms.name, PARAMS), trainer))
    return tuple(out)


def stage_states(cfg: RunConfig, placements: tuple[StagePlacement, ...]) -> dict[str, UnitState]:
    """What every unit of each placed model-stage holds, with the workflow's own role and kind (a
    reward model is no critic: no transition may rebuild one from the other's replicas)."""
    out = {}
    for p in placements:
        ms = cfg.workflow.stage(p.model_stage)
        out[p.model_stage] = UnitState(model_stage=p.model_stage, stage_kind=ms.kind, role=ms.role, model=p.model,
                                       head=p.head, kinds=p.kinds)
    return out


def placed_units(cfg: RunConfig, placements: tuple[StagePlacement, ...], plan: GlobalPlan,
                 version: int) -> tuple[EMU, ...]:
    """The units of the ``placements``' model-stages under ``plan``, with uids at ``version``."""
    states = stage_states(cfg, placements)
    return tuple(u for p in placements for u in plan_units(states[p.model_stage], plan.stage(p.model_stage), version))


def placed_plan(plan: GlobalPlan, placements: tuple[StagePlacement, ...], version: int) -> GlobalPlan:
    """``plan`` restricted to the ``placements``' model-stages, as version ``version``."""
    names = {p.model_stage for p in placements}
    return GlobalPlan(version=version, stages=tuple(sp for sp in plan if sp.model_stage in names))


def live_units(cfg: RunConfig, plan: GlobalPlan) -> tuple[EMU, ...]:
    """The units of the live stages under ``plan`` (uids at ``plan.version``): what a worker's
    ``ctx.units`` holds between steps, what a checkpoint of the job saves and loads."""
    return placed_units(cfg, live_placements(cfg, plan), plan, plan.version)


def live_cluster(cfg: RunConfig, *plans: GlobalPlan) -> ClusterSpec:
    """One local node with a device per worker id up to the highest any plan uses (as the executor
    tests); the daemon passes its own cluster instead."""
    return placement_cluster(*(live_placements(cfg, p) for p in plans))


def live_dag(cfg: RunConfig, old: GlobalPlan, new: GlobalPlan, *, cluster: ClusterSpec | None = None,
             lost: frozenset[int] = frozenset()) -> TransitionDAG:
    """The DAG moving every live stage's units from ``old`` to ``new`` (``new.version`` > ``old.version``;
    the units it leaves are ``live_units(cfg, new)``). ``lost``: workers that died since ``old`` (their
    units are gone; LastCopyLostError when one held the last copy of something)."""
    before, after = live_placements(cfg, old), live_placements(cfg, new)
    return build_transition(stage_states(cfg, before), cluster or placement_cluster(before, after),
                            placed_plan(old, before, old.version), placed_plan(new, after, new.version),
                            lost_gpus=frozenset(lost))


def rank_plan(plan: GlobalPlan, members: tuple[int, ...]) -> GlobalPlan:
    """``plan`` with worker ids replaced by their ranks in a generation of ``members`` (rank order)."""
    rank = {w: r for r, w in enumerate(members)}
    outside = sorted(plan.gpus - set(rank))
    if outside:
        raise SpecError("plan.gpu_sets", f"workers {outside} are not members of the generation",
                        ", ".join(map(str, members)))
    return dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(sp, gpu_sets=tuple(tuple(rank[w] for w in gpus) for gpus in sp.gpu_sets))
        for sp in plan))
