"""The local transition plan of one model-stage: Split -> Destroy -> Extend -> Merge through T_sub.

T_sub is the largest layout both the current and the target layout split into. Every target unit is
seen as its T_sub parts (strided over its GPUs, transitions.emu.part_gpus):

- a target part whose GPUs equal an existing unit's (current layout == T_sub) reuses that unit, or,
  if a current unit splits into a part on exactly those GPUs, a Split of that unit delivers it;
- any other target part is Extended from existing replicas, first those sharing GPUs with it (their
  bytes on the same GPU are not copied), else one chosen round-robin so that sources share the load;
- current units nobody reuses are Destroyed once every reader (Split, Extend) is done, so the last
  replica is dropped only after it was copied; with no reader they are released first;
- a target made of several parts is Merged; parts delivered in final shape are only relabelled.

A model-stage without any intact replica (all lost, newly added, or marked stale for a weight sync)
is rebuilt from ``fallback`` units (the same role's training replicas hold its parameters); with none,
its state is gone and only a checkpoint can restore it (LastCopyLostError). Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.errors import InfeasibleError
from planner.plan import Layout, StagePlan
from transitions.emu import EMU, UnitState, part_gpus, part_indices, t_sub
from transitions.geometry import layouts_nest
from transitions.primitives import Destroy, Extend, Merge, Primitive, Split


class LastCopyLostError(InfeasibleError):
    """Every replica of a model-stage's state is gone: restore it through the checkpoint path."""

    def __init__(self, model_stages: tuple[str, ...], lost_gpus: tuple[int, ...]) -> None:
        self.model_stages = model_stages
        self.lost_gpus = lost_gpus
        super().__init__(
            "the last copy of some state was lost; the checkpoint path is needed",
            tuple(f"{ms}: no intact replica survives (lost GPUs {list(lost_gpus)}) and no other "
                  "model-stage holds its state" for ms in model_stages),
        )


def unit_uid(model_stage: str, version: int, index: int) -> str:
    return f"{model_stage}@v{version}#{index}"


def plan_units(state: UnitState, plan: StagePlan, version: int) -> list[EMU]:
    return [EMU(uid=unit_uid(state.model_stage, version, i), state=state, layout=plan.layout, gpus=tuple(g),
                version=version) for i, g in enumerate(plan.gpu_sets)]


@dataclass(kw_only=True, slots=True)
class StageTransition:
    """What one model-stage contributes to the global DAG."""

    model_stage: str
    primitives: list[Primitive] = field(default_factory=list)
    new_units: list[EMU] = field(default_factory=list)
    renamed: list[tuple[str, str]] = field(default_factory=list)  # (current uid, target uid): unchanged


def target_parts(unit: EMU, sub: Layout) -> list[EMU]:
    """The T_sub parts ``unit`` splits into (itself when its layout already is ``sub``)."""
    if unit.layout == sub:
        return [unit]
    return [EMU(uid=f"{unit.uid}.p{a}.{b}", state=unit.state, layout=sub,
                gpus=part_gpus(unit.layout, unit.gpus, sub, a, b), version=unit.version, final=unit)
            for a, b in part_indices(unit.layout, sub)]


def plan_stage(
    state: UnitState,
    current: list[EMU],
    target: list[EMU],
    fallback: list[EMU] | None = None,
    stale: list[EMU] | None = None,
) -> StageTransition:
    """Local plan of one model-stage from its intact ``current`` units to ``target`` units.

    ``stale`` units are dropped without being read (a weight sync refreshes them from ``fallback``).
    """
    out = StageTransition(model_stage=state.model_stage, new_units=list(target))
    for unit in stale or ():
        out.primitives.append(Destroy(unit=unit))
    if not target:
        out.primitives += [Destroy(unit=u) for u in current]
        return out
    sources_pool = current or list(fallback or ())
    if not sources_pool:
        raise LastCopyLostError((state.model_stage,), ())
    by_gpu: dict[int, EMU] = {}
    for u in sources_pool:
        for g in u.gpus:
            by_gpu.setdefault(g, u)

    sub = t_sub(current[0].layout, target[0].layout) if current else target[0].layout
    nest = layouts_nest(state.model, state.head, sub, target[0].layout) if target[0].layout != sub else True
    # every current unit as (unit, its T_sub part GPUs -> part index) to find exact placements
    reusable: dict[tuple[int, ...], EMU] = {}
    splittable: dict[tuple[int, ...], tuple[EMU, tuple[int, int]]] = {}
    for u in current:
        if u.layout == sub:
            reusable[u.gpus] = u
        else:
            for a, b in part_indices(u.layout, sub):
                splittable[part_gpus(u.layout, u.gpus, sub, a, b)] = (u, (a, b))

    split_parts: dict[str, list[EMU]] = {}  # current uid -> parts it splits into
    kept: set[str] = set()  # current units living on (renamed, or merged as a full part)
    rr = 0
    for unit in target:
        parts = target_parts(unit, sub)
        merge_inputs: list[EMU] = []
        for part in parts:
            same = reusable.get(part.gpus)
            if same is not None and same.uid not in kept and (part is unit or nest):
                kept.add(same.uid)
                if part is unit:
                    out.renamed.append((same.uid, unit.uid))
                else:
                    merge_inputs.append(same)
                continue
            whole = splittable.pop(part.gpus, None)
            if whole is not None:
                split_parts.setdefault(whole[0].uid, []).append(part)
                merge_inputs.append(part)
                continue
            overlap: dict[str, tuple[int, EMU]] = {}
            for g in part.gpus:
                holder = by_gpu.get(g)
                if holder is not None:
                    overlap[holder.uid] = (overlap.get(holder.uid, (0, holder))[0] + 1, holder)
            # most shared GPUs first; a tie in first-appearance order in the part (sorted is stable, the
            # dict keeps insertion order), as the replica-class path orders them: the same for every replica
            sources = [u for _, u in sorted(overlap.values(), key=lambda x: -x[0])]
            if not sources:
                sources = [sources_pool[rr % len(sources_pool)]]
                rr += 1
            out.primitives.append(Extend(sources=tuple(sources), target=part))
            merge_inputs.append(part)
        if len(parts) > 1:
            out.primitives.append(Merge(parts=tuple(merge_inputs), unit=unit))
    for u in current:
        if u.uid in split_parts:
            out.primitives.append(Split(unit=u, parts=tuple(split_parts[u.uid])))
        if u.uid not in kept:
            out.primitives.append(Destroy(unit=u))
    return out
