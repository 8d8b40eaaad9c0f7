"""The global transition DAG across model-stages and models, and ``build_transition``.

Nodes are the local plans' primitives (transitions.local_dag). Data edges: a unit's producer before
its readers, and every reader of a unit before the node that frees it (so no byte is dropped before
it is copied, across model-stages too). The order is chosen greedily on a per-GPU memory timeline
(transitions.feasibility): rule 1 release before acquire, rule 2 ties broken gen -> inf -> train. An
acquisition that does not fit waits for a release on the GPU it is blocked on; the release that lets
it run becomes a resource edge (it was executed earlier in the order, so the edge never closes a cycle).
When nothing can run, the plan is infeasible and the error names the GPU and the bytes.

Execution rule (what the executor and the cost model both follow): each GPU runs the primitives that
touch it one at a time, in ``order``; hence its memory follows the checked timeline exactly.

How one worker runs its part (everything derived locally from the frozen DAG):
    for i in dag.nodes_on(gpu):
        prim = dag.nodes[i]
        allocate t.shards(gpu) for t in prim.targets (a Merge whose part on this GPU has
            ``final == prim.unit`` just renames that part's tensors);
        copy the local pieces (transitions.pieces.pieces(prim, gpu), ``is_local``);
        send / receive the messages of the rest (transitions.transfer_plan.messages: zero-copy runs
            and buckets, the bucketizer the memory check counts too), unpacking each piece;
        free u.shards(gpu) for u in prim.frees.
    Units in ``renamed`` keep their tensors under the new uid; ``lost_units`` are simply gone.
Plan changes without a weight sync, with the same model-stages before and after (after a loss:
from the surviving replicas) are planned over replica classes (transitions.replica_classes: DP replicas alike up to a renaming of
GPUs), which keeps the 1,024-GPU build near a millisecond; the unit-level DAG above is expanded from
them on first use, so consumers see the same attributes. Anything else, or ``exact=True``, is planned
unit by unit. What a build derives is memoised in the caller's PlanningCache (``cache=``; see
transitions.planning_cache for who owns one). Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from planner.errors import SpecError
from planner.hardware import ClusterSpec
from planner.plan import GlobalPlan
from planner.workflow import JobSpec, StageKind
from transitions.dag_record import (  # noqa: F401 (re-exported)
    DagBody,
    TransitionDAG,
    _expand,
    data_edges,
    gpu_index,
    held_bytes,
)
from transitions.emu import EMU, UnitState, job_states
from transitions.exact_order import EXACT_MAKESPAN_NODES, fastest_order, makespan
from transitions.feasibility import TIMED_NODE_LIMIT, MemoryOrder, order_by_memory, replay_order
from transitions.footprints import footprint
from transitions.local_dag import LastCopyLostError, plan_stage, plan_units
from transitions.planning_cache import DEFAULT_CACHE, PlanningCache
from transitions.primitives import Footprint, Primitive
from transitions.replica_classes import MIN_UNITS, plan_replicas


def _states(job_or_models: JobSpec | Mapping[str, UnitState]) -> Mapping[str, UnitState]:
    return job_states(job_or_models) if isinstance(job_or_models, JobSpec) else job_or_models


def _fallback_for(state: UnitState, states: Mapping[str, UnitState], old_units: dict[str, list[EMU]],
                  refresh_from: str | None) -> list[EMU]:
    """Intact units of another model-stage that hold all of ``state``'s state (same model and head)."""
    names = [refresh_from] if refresh_from else [
        n for n, s in states.items() if s.role is state.role and s.stage_kind is StageKind.TRAINING]
    out: list[EMU] = []
    for name in names:
        other = states[name]
        if name != state.model_stage and other.model == state.model and other.head is state.head \
                and set(state.kinds) <= set(other.kinds):
            out += old_units.get(name, [])
    return out


def build_transition(
    job_or_models: JobSpec | Mapping[str, UnitState],
    cluster: ClusterSpec,
    old: GlobalPlan | None,
    new: GlobalPlan,
    *,
    lost_gpus: frozenset[int] = frozenset(),
    refresh: Mapping[str, str] | None = None,
    capacity_bytes: int | None = None,
    policy: str = "global",
    exact: bool | None = None,
    cache: PlanningCache | None = None,
) -> TransitionDAG:
    """The checked DAG moving every model-stage's state from ``old`` to ``new``.

    ``lost_gpus``: GPUs that died; units touching them are gone and are rebuilt from surviving
    replicas (LastCopyLostError if none holds the state). ``refresh``: model-stage -> source stage
    whose replicas overwrite it (the per-step actor-train -> actor-gen weight sync: {"actor-gen":
    "actor-train"}). ``capacity_bytes`` defaults to the device memory. ``policy="per_stage"`` is the
    naive per-model-stage order (for comparison only). Raises InfeasibleError naming GPU and bytes.

    ``exact``: None (default) plans plain plan changes of at least replica_classes.MIN_UNITS
    units over replica classes (expanded to units on first use), anything else unit by unit;
    True always unit by unit; False over replica classes whenever they apply, however small.

    ``cache``: the caller's transitions.planning_cache.PlanningCache, whose memos (footprints, plans,
    replica classes) make repeated builds cheap; whoever builds repeatedly owns one and passes it
    (the daemon's planner binding does). None: DEFAULT_CACHE, the process's documented default.
    The DAG is the same whatever the cache holds.
    """
    cache = DEFAULT_CACHE if cache is None else cache
    states = _states(job_or_models)
    refresh = _checked_refresh(states, refresh)
    old_version = old.version if old is not None else -1
    if new.version <= old_version:
        raise SpecError("new.version", f"{new.version} must exceed the old plan's {old_version}")
    capacity = cluster.device.memory_bytes if capacity_bytes is None else capacity_bytes
    if exact is not True and old is not None and not refresh and policy == "global" \
            and all(sp.model_stage in states for sp in (*old, *new)):
        fast = plan_replicas(states, cluster, old, new, capacity, min_units=0 if exact is False else MIN_UNITS,
                             lost_gpus=lost_gpus, cache=cache)
        if fast is not None:
            return TransitionDAG(old_version=old_version, new_version=new.version, capacity_bytes=capacity,
                                 replicas=fast)
    _check_gpus(states, cluster, old, new, lost_gpus)
    intact, lost = _old_units(states, old, old_version, lost_gpus)
    local = _stage_transitions(states, old, new, intact, refresh, lost_gpus)
    body = _ordered(states, local, intact, lost, capacity, policy, cache, cluster)
    return TransitionDAG(old_version=old_version, new_version=new.version, capacity_bytes=capacity, body_=body)


def primitive_count(job_or_models: JobSpec | Mapping[str, UnitState], old: GlobalPlan | None, new: GlobalPlan,
                    lost_gpus: frozenset[int] = frozenset()) -> int:
    """How many nodes ``build_transition`` plans unit by unit for this change (local plans only: no
    footprint, no order; what a caller sizing the DAG asks before building it)."""
    states = _states(job_or_models)
    intact, _ = _old_units(states, old, old.version if old is not None else -1, lost_gpus)
    return len(_stage_transitions(states, old, new, intact, {}, lost_gpus).nodes)


def _check_gpus(states: Mapping[str, UnitState], cluster: ClusterSpec, old: GlobalPlan | None, new: GlobalPlan,
                lost_gpus: frozenset[int]) -> None:
    """Every stage described, every GPU in the cluster, nothing new placed on a lost GPU."""
    for sp in (*(old or ()), *new):
        if sp.model_stage not in states:
            raise SpecError("plan.model_stage", f"{sp.model_stage!r} has no state description",
                            ", ".join(states))
        gpus = sp.gpus
        if gpus and min(gpus) >= 0 and max(gpus) < cluster.num_gpus:
            continue  # all inside: no need to find the first one outside
        for g in gpus:
            if not 0 <= g < cluster.num_gpus:
                raise SpecError(f"{sp.model_stage}.gpu_sets", f"GPU {g} outside the cluster",
                                f"0..{cluster.num_gpus - 1}")
    on_lost = sorted(lost_gpus & new.gpus)
    if on_lost:
        raise SpecError("new.gpu_sets", f"the new plan places units on lost GPUs {on_lost}",
                        "GPUs outside lost_gpus")


def _old_units(states: Mapping[str, UnitState], old: GlobalPlan | None, old_version: int,
               lost_gpus: frozenset[int]) -> tuple[dict[str, list[EMU]], list[EMU]]:
    """The old plan's units by model-stage that survive, and those that touched a lost GPU."""
    intact: dict[str, list[EMU]] = {}
    lost: list[EMU] = []
    for sp in old or ():
        for u in plan_units(states[sp.model_stage], sp, old_version):
            if not lost_gpus.isdisjoint(u.gpus):
                lost.append(u)
            else:
                intact.setdefault(sp.model_stage, []).append(u)
    return intact, lost


@dataclass(kw_only=True, slots=True)
class _Local:
    """Every model-stage's local plan, concatenated."""

    nodes: list[Primitive] = field(default_factory=list)
    new_units: list[EMU] = field(default_factory=list)
    renamed: list[tuple[str, str]] = field(default_factory=list)
    stale_uids: list[str] = field(default_factory=list)


def _checked_refresh(states: Mapping[str, UnitState], refresh: Mapping[str, str] | None) -> dict[str, str]:
    """``refresh`` as given, once each target is a model-stage refreshed from a training stage of its own
    role (the weight sync); anything else is refused here, not met as a broken DAG later."""
    out = dict(refresh or {})
    for target, source in out.items():
        for name in (target, source):
            if name not in states:
                raise SpecError("refresh", f"unknown model-stage {name!r}", ", ".join(states))
        src, dst = states[source], states[target]
        if src.stage_kind is not StageKind.TRAINING or src.role is not dst.role or source == target:
            raise SpecError(f"refresh.{target}", f"refreshes from {source!r}: only a training stage of the same "
                                                 f"role ({dst.role.value}) holds weights to sync from")
    return out


def _stage_transitions(states: Mapping[str, UnitState], old: GlobalPlan | None, new: GlobalPlan,
                       intact: dict[str, list[EMU]], refresh: Mapping[str, str],
                       lost_gpus: frozenset[int]) -> _Local:
    """Each model-stage's local plan (transitions.local_dag), old stages first, in plan order.
    Raises LastCopyLostError naming every stage whose state no surviving unit holds."""
    old_names = [sp.model_stage for sp in old or ()]
    names = old_names + [sp.model_stage for sp in new if sp.model_stage not in old_names]
    new_names = {sp.model_stage for sp in new}
    out = _Local()
    missing: list[str] = []
    for name in names:
        state = states[name]
        target = plan_units(state, new.stage(name), new.version) if name in new_names else []
        current, stale = intact.get(name, []), []
        if name in refresh:
            current, stale = [], current
            out.stale_uids += [u.uid for u in stale]
        fallback = _fallback_for(state, states, intact, refresh.get(name)) if not current and target else []
        try:
            local = plan_stage(state, current, target, fallback, stale)
        except LastCopyLostError:
            missing.append(name)
            continue
        out.nodes += local.primitives
        out.new_units += local.new_units
        out.renamed += local.renamed
    if missing:
        raise LastCopyLostError(tuple(missing), tuple(sorted(lost_gpus)))
    return out


def _ordered(states: Mapping[str, UnitState], local: _Local, intact: dict[str, list[EMU]], lost: list[EMU],
             capacity: int, policy: str, cache: PlanningCache, cluster: ClusterSpec) -> DagBody:
    """The unit-level DAG: edges, footprints and the order checked on every GPU's memory timeline (on a
    DAG of at most EXACT_MAKESPAN_NODES nodes, the fastest such order: transitions.exact_order)."""
    nodes = local.nodes
    edges = data_edges(nodes)
    fps = [footprint(p, cache) for p in nodes]
    initial = held_bytes([u for units in intact.values() for u in units])
    stage_order = [_stage_of(p, states) for p in nodes]
    # durations as transition_cost prices them, for the greedy's duration-aware pass and the exact search
    # (only DAGs small enough for either: a larger one's greedy is memory-only)
    durations = _durations(fps, cluster) if policy == "global" and len(nodes) <= TIMED_NODE_LIMIT else None
    result: MemoryOrder = order_by_memory(fps, edges, stage_order, initial, capacity, policy=policy,
                                          durations=durations)
    if durations is not None and 1 < len(nodes) <= EXACT_MAKESPAN_NODES:
        result = _fastest(fps, edges, initial, capacity, durations, result)
    return DagBody(
        nodes=tuple(nodes), stage_order=tuple(stage_order),
        data_edges=tuple(edges), resource_edges=tuple(result.resource_edges), order=tuple(result.order),
        old_units=tuple(u for us in intact.values() for u in us), lost_units=tuple(lost),
        new_units=tuple(local.new_units), renamed=tuple(local.renamed), stale_units=tuple(local.stale_uids),
        peak_bytes=result.peak_bytes, footprints=tuple(fps), gpu_nodes=gpu_index(fps, result.order),
    )


def _durations(fps: list[Footprint], cluster: ClusterSpec) -> list[float]:
    """Each node's seconds as transition_cost prices them by default."""
    from transitions.cost import DEFAULT_COMMUNICATOR_SETUP_S, primitive_seconds  # cost imports this module

    return [primitive_seconds(fp, cluster, DEFAULT_COMMUNICATOR_SETUP_S) for fp in fps]


def _fastest(fps: list[Footprint], edges: list[tuple[int, int]], initial: dict[int, int], capacity: int,
             durations: list[float], greedy: MemoryOrder) -> MemoryOrder:
    """The greedy order, or a strictly faster memory-feasible one."""
    order = fastest_order(fps, edges, initial, capacity, durations, makespan(fps, edges, greedy.order, durations))
    return greedy if order is None else replay_order(fps, list(order), initial, capacity)


def _stage_of(prim: Primitive, states: Mapping[str, UnitState]) -> int:
    units = (*prim.targets, *prim.frees, *prim.sources)
    return states[units[0].model_stage].stage_order


def build_weight_sync(
    job_or_models: JobSpec | Mapping[str, UnitState],
    cluster: ClusterSpec,
    plan: GlobalPlan,
    *,
    train_stage: str = "actor-train",
    gen_stage: str = "actor-gen",
    capacity_bytes: int | None = None,
    cache: PlanningCache | None = None,
) -> TransitionDAG:
    """The per-step weight sync as a transition: the generation replicas are destroyed (stale) and
    Extended again from the training replicas' parameters, layouts reshaped on the way. ``cache``: as
    for build_transition."""
    new = GlobalPlan(version=plan.version + 1, stages=plan.stages)
    return build_transition(job_or_models, cluster, plan, new, refresh={gen_stage: train_stage},
                            capacity_bytes=capacity_bytes, cache=cache)
