"""Fast path of ``build_transition``: the DAG planned over replica classes instead of units.

DP replicas of one model-stage undergo the same local sub-plan up to a renaming of GPUs and unit ids.
A *replica class* is every primitive of one model-stage and kind whose relative shape (each unit's
layout and GPUs relabelled by first appearance, as footprints.canonical_footprint does) is the same:
it holds one canonical footprint and an integer array of the GPU of each label per member. At 1,024
GPUs a plan change has thousands of unit-level primitives but a few dozen classes, so:

- the local plans (transitions.local_dag's rules: reuse, Split, Extend from overlapping replicas, Merge,
  Destroy) are computed with numpy over the plans' GPU arrays, once per relative shape of a pair of
  stage plans (the target's GPUs named by their place in the current plan): a candidate of a shape
  seen before gets that shape's classes mapped onto its own GPUs;
- the memory order is chosen over classes (release before acquire, gen -> inf -> train, longest path)
  and all members of a class run back to back. Each class is checked against capacity on every GPU at
  once with an upper bound (what is held before it, plus everything its members allocate there, plus
  the largest bucket buffer), exact when no two members share a GPU; a class that does not fit waits
  for a release on a GPU it is over on, and a blocked pass is retried with the per-unit greedy's other
  priorities (transitions.replica_order);
- after a loss each stage moves from its surviving replicas (the old plan less those touching a lost
  GPU, their uids kept), exactly the per-unit path's local plans;
- the schedule (transitions.cost) is evaluated per class with numpy over all its members.

The unit-level DAG (primitives, edges, footprints, per-GPU order and exact peaks) is expanded only
when someone reads it (``ReplicaPlan.expand``); what it holds is then the same as if it had been built
unit by unit with this order. ``plan_replicas`` returns None whenever the symmetry it relies on does
not hold (a weight-sync refresh, added or removed model-stages, a part nobody overlaps, a stage whose
every replica was lost, classes that no pass can order, a loss DAG small enough for the per-unit
path's duration-aware pass): the caller then takes the exact per-unit path, so correctness
never depends on this one. What it derives is memoised in the caller's PlanningCache
(transitions.planning_cache: per plan, per pair of stage plans, per relative shape), so a planner's
repeated builds cost lookups. Pure: no torch, no I/O (numpy).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from planner.hardware import ClusterSpec
from planner.plan import GlobalPlan, StagePlan
from transitions.emu import EMU, UnitState, rank_bytes, t_sub
from transitions.feasibility import TIMED_NODE_LIMIT
from transitions.local_dag import unit_uid
from transitions.planning_cache import PlanningCache
from transitions.replica_local import classes_of, gpu_array, local_plan, part_columns, stage_owners
from transitions.replica_order import batched, link, order_classes
from transitions.replica_plan import ReplicaClass, ReplicaPlan, ReplicaStage, ShapeEntry, StageClasses

__all__ = ["MIN_UNITS", "ReplicaClass", "ReplicaPlan", "plan_replicas"]

# With fewer units (old and new together) the exact path is as fast, and its per-unit order is finer
# (greedy vs optimum on <= 7-node instances: mean gap 2.5% per unit, 3.75% per class).
MIN_UNITS = 32


def _stage_classes(state: UnitState, cp: StagePlan, tp: StagePlan, n_gpus: int,
                   cache: PlanningCache, batch: bool) -> StageClasses | None:
    """The class-level local plan of one model-stage; memoised per pair of stage plans (by identity:
    a planner keeps proposing the same plans), None where it is not symmetric. ``batch``: classes whose
    members share a GPU are split into batches that share none (replica_order.batched)."""
    return cache.stage_pairs.get_or_make((id(cp), id(tp), state, n_gpus, batch), (cp, tp),
                                         lambda: _relabelled_stage(state, cp, tp, n_gpus, cache, batch))


def _relabelled_stage(state: UnitState, cp: StagePlan, tp: StagePlan, n_gpus: int,
                      cache: PlanningCache, batch: bool) -> StageClasses | None:
    """``_build_stage``'s plan, taken from ``cache.shape_stages`` when a pair of the same relative shape
    was built before. That key is the state, the layouts and the target GPUs as labels (a current GPU
    is labelled by its position in the current plan, a GPU only the target uses by its order of
    appearance). Everything ``_build_stage`` derives is equivariant under renaming GPUs (it only
    compares GPU ids for equality), so one entry serves every candidate of that shape."""
    cur, tgt = gpu_array(cp.gpu_sets, cache), gpu_array(tp.gpu_sets, cache)
    if cur.min() < 0 or cur.max() >= n_gpus:
        return None  # the exact path names the offending GPU
    if cp.layout == tp.layout and cp.gpu_sets == tp.gpu_sets:  # unchanged: every unit kept as it is
        return StageClasses(stage=ReplicaStage(name=state.model_stage, state=state, current=cp, target=tp, sub=cp.layout,
                                               nq=1, cur=cur, tgt=tgt, parts=tgt,
                                               renamed=list(zip(range(len(cur)), range(len(cur))))),
                            classes=[], edges=[], num_nodes=0)
    if tgt.min() < 0 or tgt.max() >= n_gpus:
        return None
    owner, rank = stage_owners(cp, n_gpus, cache)
    flat = tgt.ravel()
    own = owner[flat]
    label = own * cur.shape[1] + rank[flat]
    fresh = own < 0
    n_fresh = int(fresh.sum())
    if n_fresh:  # target GPUs are distinct (StagePlan), so appearance order is position order
        label[fresh] = cur.size + np.arange(n_fresh, dtype=np.int64)
        gpu_of = np.concatenate([cur.ravel(), flat[fresh]])
    else:
        gpu_of = cur.ravel()
    key = (state, cp.layout, tp.layout, cur.shape, tgt.shape, label.tobytes(), batch)
    entry = cache.shape_stages.get(key)  # least recently used evicted first: a planner's hot shapes stay
    if entry is None:
        built = _build_stage(state, cp, tp, n_gpus, cache, batch)
        cache.shape_stages.put(key, ShapeEntry(built=built, gpu_of=gpu_of, num_gpus=n_gpus))
        return built
    b = entry.built
    if b is None:
        return None
    st = b.stage
    labels, parts = entry.label_arrays(b)
    stage = ReplicaStage(name=st.name, state=state, current=cp, target=tp, sub=st.sub, nq=st.nq, cur=cur, tgt=tgt,
                         parts=gpu_of[parts], renamed=st.renamed)
    # on the very same GPUs the classes' durations (transitions.cost memo, per cluster) are the same too
    same_gpus = len(gpu_of) == len(entry.gpu_of) and bool((gpu_of == entry.gpu_of).all())
    classes = []
    for c, lab in zip(b.classes, labels, strict=True):
        gpus = c.gpus if same_gpus else gpu_of[lab]
        classes.append(ReplicaClass(kind=c.kind, stage=c.stage, stage_order=c.stage_order, canon=c.canon, gpus=gpus,
                                    unit=c.unit, refs=c.refs, touched=c.touched, first=c.first,
                                    g=c.g if same_gpus else gpus[:, c.touched], single=c.single, alloc=c.alloc,
                                    buf=c.buf, delta=c.delta, acquire=c.acquire, preds=c.preds,
                                    seconds=c.seconds if same_gpus else {}, shape=c.shape,
                                    g_t=c.g_t if same_gpus else None, preds_t=c.preds_t))
    return StageClasses(stage=stage, classes=classes, edges=b.edges, num_nodes=b.num_nodes)


def replica_stage(state: UnitState, cp: StagePlan, tp: StagePlan, cache: PlanningCache) -> ReplicaStage:
    """The stage pair as arrays: current and target GPU sequences, and the target's T_sub parts (a target
    unit's ``nq`` parts, or the units themselves where the target layout is T_sub)."""
    cur, tgt = gpu_array(cp.gpu_sets, cache), gpu_array(tp.gpu_sets, cache)
    sub = t_sub(cp.layout, tp.layout)
    if tp.layout == sub:
        parts, nq = tgt, 1
    else:
        cols = part_columns(tp.layout, sub)
        parts, nq = tgt[:, cols].reshape(-1, sub.size), len(cols)
    return ReplicaStage(name=state.model_stage, state=state, current=cp, target=tp, sub=sub, nq=nq, cur=cur,
                        tgt=tgt, parts=parts, renamed=[])


def _build_stage(state: UnitState, cp: StagePlan, tp: StagePlan, n_gpus: int,
                 cache: PlanningCache, batch: bool) -> StageClasses | None:
    """One model-stage's class-level plan built afresh; its only caller, ``_relabelled_stage``, has
    checked that every GPU is in the cluster."""
    st = replica_stage(state, cp, tp, cache)
    local = local_plan(st, n_gpus, cache)
    if local is None:
        return None
    mine = classes_of(st, local, state.stage_order, cache)
    if not mine and (len(local.destroys) or local.extends or local.splits or local.merges):
        return None
    if batch:
        mine = batched(mine)
    edges = link(st, mine)
    if edges is None:
        return None
    return StageClasses(stage=st, classes=mine, edges=edges, num_nodes=sum(c.size for c in mine))


def _initial(state: UnitState, cp: StagePlan, n_gpus: int, cache: PlanningCache) -> np.ndarray:
    """Bytes each GPU holds of one stage plan's units (memoised per plan, by identity)."""

    def make() -> np.ndarray:
        cur = gpu_array(cp.gpu_sets, cache)
        per_rank = np.array(rank_bytes(state, cp.layout), dtype=np.int64)
        out = np.zeros(n_gpus, dtype=np.int64)
        np.add.at(out, cur.ravel(), np.tile(per_rank, len(cur)))
        return out

    return cache.held_bytes.get_or_make((id(cp), state, n_gpus), (cp,), make)


def _survivors(state: UnitState, cp: StagePlan, lost: np.ndarray, version: int, cache: PlanningCache
               ) -> tuple[StagePlan, np.ndarray | None, list[EMU]] | None:
    """The stage plan of ``cp``'s replicas that touch no lost GPU (``lost``: a mask over the cluster's
    GPUs), the old index of each (None: all survive) and the units that were lost; None if none
    survives or a GPU is outside the cluster (the per-unit path rebuilds it from another stage, or names
    the fault)."""
    cur = gpu_array(cp.gpu_sets, cache)
    if cur.min() < 0 or cur.max() >= len(lost):
        return None
    hit = lost[cur].any(axis=1)
    if not hit.any():
        return cp, None, []
    if hit.all():
        return None
    kept = np.flatnonzero(~hit)
    gone = [EMU(uid=unit_uid(state.model_stage, version, i), state=state, layout=cp.layout,
                gpus=tuple(cp.gpu_sets[i]), version=version) for i in np.flatnonzero(hit).tolist()]
    return replace(cp, gpu_sets=tuple(cp.gpu_sets[i] for i in kept.tolist())), kept, gone


def plan_replicas(states: Mapping[str, UnitState], cluster: ClusterSpec, old: GlobalPlan, new: GlobalPlan,
                  capacity: int, min_units: int = 0, *, lost_gpus: frozenset[int] = frozenset(),
                  cache: PlanningCache) -> ReplicaPlan | None:
    """The class-level plan of a transition, or None where the exact per-unit path must be used
    (also with fewer than ``min_units`` units, where that one is as fast and orders finer). ``cache``
    (the builder's) memoises plans, pairs and shapes across calls, and serves the plan's expansion.
    ``lost_gpus``: the replicas touching them are gone; each stage moves from its survivors (their
    uids kept; classes whose members share a GPU run in batches that share none), None where a stage
    has none left or the new plan places anything on a lost GPU, and, with ``min_units``, where such a
    DAG has at most TIMED_NODE_LIMIT nodes (the per-unit path's duration-aware pass orders those)."""
    if sum(len(sp.gpu_sets) for sp in (*old, *new)) < min_units:
        return None
    n_gpus = cluster.num_gpus
    old_names = [sp.model_stage for sp in old]
    if sorted(old_names) != sorted(sp.model_stage for sp in new):
        return None
    lost = np.isin(np.arange(n_gpus), sorted(lost_gpus)) if lost_gpus else None  # a GPU outside is nobody's
    stages: list[StageClasses] = []
    survivors: list[np.ndarray | None] = []
    lost_units: list[EMU] = []
    initial = np.zeros(n_gpus, dtype=np.int64)
    for name in old_names:
        cp, kept = old.stage(name), None
        if lost is not None:
            left = _survivors(states[name], cp, lost, old.version, cache)
            if left is None:
                return None
            cp, kept, gone = left
            survivors.append(kept)
            lost_units += gone
        sc = _stage_classes(states[name], cp, new.stage(name), n_gpus, cache, kept is not None)
        if sc is None or (lost is not None and lost[sc.stage.tgt].any()):
            return None
        stages.append(sc)
        initial += _initial(states[name], cp, n_gpus, cache)
    if (initial > capacity).any():
        return None
    classes: list[ReplicaClass] = []
    class_stage: list[int] = []
    first: list[int] = []
    stage_base: list[int] = []
    edges: list[tuple[int, int]] = []
    base = 0
    for k, sc in enumerate(stages):
        offset = len(classes)
        edges += [(x + offset, y + offset) for x, y in sc.edges]
        stage_base.append(base)
        for c in sc.classes:
            classes.append(c)
            class_stage.append(k)
            first.append(base + c.first)
        base += sc.num_nodes
    if lost_units and min_units and base <= TIMED_NODE_LIMIT:
        return None  # the per-unit path times a DAG this small (feasibility's duration-aware pass): faster orders
    found = order_classes(classes, edges, initial, capacity, first)
    if found is None:
        return None
    return ReplicaPlan(old_version=old.version, new_version=new.version, stages=stages, classes=classes,
                       class_stage=class_stage, first=first, stage_base=stage_base, class_order=found.order,
                       resource_edges=found.resource_edges, num_nodes=base, initial=initial,
                       survivors=survivors, lost_units=tuple(lost_units), cache=cache)
