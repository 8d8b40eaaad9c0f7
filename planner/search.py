"""Plan search (paper Eq. 1): the fastest plan whose every GPU fits in memory.

1. Per model-stage, candidates (planner.options) reduced to a latency/resource frontier.
2. Inside a stage (generation, inference, training) model-stages run in *waves*: members of a wave run
   concurrently on disjoint GPUs (together at most |pool|), waves run one after another. Each way of
   splitting a stage's model-stages into waves is tried.
3. Memory couples the stages: a GPU holds the resident state of one model-stage per wave and peaks
   while the largest transient runs, so peak <= sum over waves of the resident cap R_w + the transient
   cap T. For a cap T, a wave's best time as a function of R_w (min-max over members under the GPU
   budget, read off per-member (T, R, GPU count) least-seconds cubes for every R at once) gives
   (R, time) points; merging waves and stages as arrays keeps the Pareto points and takes the fastest
   that fits.
4. Caps T are tried best lower bound first and a cap is dropped, even halfway through its stages, once
   its bound cannot beat the best plan (up to TIE_TOLERANCE): exact. The bound of every cap comes at
   once from the cubes: each stage's exact best time when each of its waves may use all the resident
   room the other stages leave, so most caps are never solved and a 1,024-GPU replan takes a few
   tens of milliseconds of CPU or less. Only above MAX_TRANSIENT_LEVELS distinct transient sizes are
   they rounded up (never unsafe: a rounded plan needs less memory than assumed).
5. GPU sets are assigned from the pool (whole nodes first, larger units first so TP stays in a node),
   and the plan is scored with planner.prediction.predict.
Urgent path: when nothing fits, recomputation, then TP across nodes are allowed.
planner.exhaustive tries every combination; bench/decisions.py compares the two.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from planner.cost import PRIORS, OpClass
from planner.errors import SpecError
from planner.hardware import ClusterSpec
from planner.infeasible import explain_infeasible
from planner.memory import HEADROOM_FRACTION, WORKSPACE_BYTES
from planner.options import OptionRules, OptionTable, StageOption, frontier, option_table
from planner.plan import GlobalPlan, StagePlan
from planner.prediction import Prediction, predict, step_overhead_seconds
from planner.waves import Pick, WaveRef, WaveSolver, front, kind_points, wave_picks
from planner.workflow import JobSpec, StageKind

__all__ = ["SearchResult", "predict", "search", "assign", "order_pool", "URGENT_RULES"]

# Tried in order; the first that yields a feasible plan wins (recomputation and cross-node TP are the
# urgent options: slower, so only taken when nothing else fits).
URGENT_RULES = (
    OptionRules(),
    OptionRules(allow_recompute=True),
    OptionRules(allow_recompute=True, allow_cross_node_tp=True),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    plan: GlobalPlan
    prediction: Prediction
    objective_s: float  # the search's own estimate (sum over waves of the slowest member, plus the step overhead)
    candidates_considered: int
    frontier_sizes: Mapping[str, int]
    urgent_options: bool  # recomputation or cross-node TP were needed


# A transient cap whose lower bound is within this fraction of the best plan found is not explored:
# the plan returned is then within PRUNE_TOLERANCE / (1 - PRUNE_TOLERANCE) of the optimum.
PRUNE_TOLERANCE = 0.0
# Bounds equal to the best plan up to float rounding (a cap whose relaxed stage times add up to the
# optimum itself) cannot improve it by more than this: pruned too, or ties would all be solved in full.
TIE_TOLERANCE = 1e-9
_KEEP = 1 - PRUNE_TOLERANCE - TIE_TOLERANCE
MAX_TRANSIENT_LEVELS = 256  # beyond this many distinct transient sizes they are rounded up (see _quantize_transients)

Choice = tuple[tuple[StageOption, ...], ...]  # waves of one stage, each a tuple of member options


def order_pool(pool: Sequence[int], cluster: ClusterSpec) -> tuple[int, ...]:
    """GPUs of whole nodes first (node order), then partial nodes, largest first; unique ids."""
    ids = sorted(set(pool))
    if not ids:
        return ()
    if ids[0] < 0 or ids[-1] >= cluster.num_gpus:
        bad = next(g for g in ids if g < 0 or g >= cluster.num_gpus)
        raise SpecError("pool", f"GPU {bad} is not in the cluster", f"0..{cluster.num_gpus - 1}")
    # node runs of the sorted ids, as arrays: a 4,096-GPU pool is one pass, not a loop per GPU
    nodes = np.asarray(ids, dtype=np.int64) // cluster.gpus_per_node
    starts = np.flatnonzero(np.concatenate([[True], nodes[1:] != nodes[:-1]]))
    counts = np.diff(np.append(starts, len(ids)))
    if (counts == counts[0]).all():
        return tuple(ids)  # equal runs: node order is id order
    order = np.lexsort((nodes[starts], -counts)).tolist()
    return tuple(g for i in order for g in ids[int(starts[i]):int(starts[i] + counts[i])])


def usable_bytes(cluster: ClusterSpec) -> float:
    """Bytes per GPU for resident + transient state (capacity less headroom and workspace)."""
    return cluster.device.memory_bytes / (1 + HEADROOM_FRACTION) - WORKSPACE_BYTES


def _quantize_transients(fronts: Mapping[str, OptionTable]) -> dict[str, OptionTable]:
    """Round transient bytes up to at most MAX_TRANSIENT_LEVELS levels (quantiles of the values seen).

    The solver enumerates transient caps, so fewer levels mean fewer passes; rounding up keeps every
    plan it returns feasible. With few distinct values nothing changes (the small settings where the
    exhaustive search checks optimality)."""
    values = np.unique(np.concatenate([t.transient for t in fronts.values()]))
    if values.size <= MAX_TRANSIENT_LEVELS:
        return dict(fronts)
    levels = np.unique(np.quantile(values, np.linspace(0, 1, MAX_TRANSIENT_LEVELS), method="higher"))
    out = {}
    for m, t in fronts.items():
        q = levels[np.searchsorted(levels, t.transient, side="left")]
        out[m] = frontier(OptionTable(model_stage=t.model_stage, tp=t.tp, pp=t.pp, dp=t.dp, b=t.b, g=t.g,
                                      recompute=t.recompute, seconds=t.seconds, gpus=t.gpus,
                                      resident=t.resident, transient=q))
    return out


def _solve(job: JobSpec, fronts: Mapping[str, OptionTable], budget: int,
           usable: float) -> tuple[float, dict[str, tuple[Pick, ...]]] | None:
    """Every transient cap T, best lower bound first; stop when no remaining cap can beat the best plan.

    Lower bound at T, per stage: its exact best time (every split into waves) when each wave may hold
    the whole resident room the other stages leave at the least (each holds at least its members'
    smallest resident state), for every cap at once (WaveSolver.floors). Within a cap, stages are
    solved in full one by one and the cap is dropped once the stages solved plus the bounds of the
    rest cannot beat the best plan."""
    kinds = [k for k in sorted(StageKind, key=lambda k: k.order) if job.workflow.by_kind(k)]
    names = {k: [ms.name for ms in job.workflow.by_kind(k)] for k in kinds}
    solver = WaveSolver(fronts, budget)
    min_res = {k: max(solver.r_sorted[m][0] for m in names[k]) for k in kinds}
    total_min_res = sum(min_res.values())
    caps = np.unique(np.concatenate([t.transient for t in fronts.values()])).astype(float)
    per_kind_lb = {k: solver.floors(names[k], usable - caps - (total_min_res - min_res[k]), caps) for k in kinds}
    lbs = np.sum([per_kind_lb[k] for k in kinds], axis=0)
    # cheap stages first, so a cap is abandoned before its costly stages when it cannot win
    order = sorted(kinds, key=lambda k: len(names[k]))
    # per position in that order: least resident state and bound of the stages still to come
    rest_res = [sum(min_res[x] for x in order[n:]) for n in range(1, len(order) + 1)]
    rest_lb = [np.sum([per_kind_lb[x] for x in order[n:]], axis=0) if order[n:] else np.zeros(caps.size)
               for n in range(1, len(order) + 1)]
    best: tuple[float, float, dict[str, tuple[WaveRef, ...]]] | None = None  # seconds, T cap, waves
    live = np.flatnonzero(np.isfinite(lbs))
    last = len(order) - 1
    for i in live[np.lexsort((-caps[live], lbs[live]))].tolist():
        if best is not None and lbs[i] >= best[0] * _KEEP:
            break  # bounds are sorted: no remaining cap can beat the best by more than the tolerance
        t_cap = float(caps[i])
        room = usable - t_cap
        # every stage's Pareto points, merged with arrays; a partial sum survives only if the stages still
        # to come fit in the room at their least resident state and can still beat the best plan
        r_sum: np.ndarray = np.zeros(0)
        s_sum: np.ndarray = np.zeros(0)
        which: np.ndarray = np.zeros((0, 0), dtype=np.int64)
        stage_pts = []
        for n, k in enumerate(order):
            pts = kind_points(names[k], solver, t_cap)
            stage_pts.append(pts)
            if n == 0:  # a stage's points are already a Pareto front
                r, secs = pts[0], pts[1]
            else:
                r = (r_sum[:, None] + pts[0][None, :]).ravel()
                secs = (s_sum[:, None] + pts[1][None, :]).ravel()
            ok = r + rest_res[n] <= room
            if best is not None:
                ok &= secs + rest_lb[n][i] < best[0] * _KEEP
            sel = np.flatnonzero(ok)
            if sel.size == 0:
                break
            if n == last:  # only the fastest complete plan matters
                sel = sel[[int(np.argmin(secs[sel]))]]
            elif n > 0:
                sel = sel[front(r[sel], secs[sel])]
            size = pts[0].size
            which = sel[:, None] if n == 0 else np.column_stack([which[sel // size], sel % size])
            r_sum, s_sum = r[sel], secs[sel]
        else:
            if best is None or s_sum[0] < best[0]:
                best = (float(s_sum[0]), t_cap, {k.value: stage_pts[j][2][which[0, j]] for j, k in enumerate(order)})
    if best is None:
        return None
    sec, t_cap, refs = best
    return sec, {k: wave_picks(solver, waves, t_cap) for k, waves in refs.items()}


def _choices(fronts: Mapping[str, OptionTable], picks: Mapping[str, tuple[Pick, ...]]) -> dict[str, Choice]:
    return {k: tuple(tuple(fronts[m].option(i) for m, i in wave) for wave in waves)
            for k, waves in picks.items()}


def assign(job: JobSpec, pool: tuple[int, ...], choices: Mapping[str, Choice], version: int,
           gpus_per_node: int) -> GlobalPlan:
    """GPU sets from the ordered pool. Every wave starts again from the whole pool; larger units go first,
    and each TP group takes GPUs of one node (first node with room, the unit's own node preferred), so
    TP stays on the intra-node link even when nodes are partial."""
    stages: list[StagePlan] = []
    del job
    whole = len(pool) % gpus_per_node == 0 and gpus_per_node & (gpus_per_node - 1) == 0 and all(
        pool[i] // gpus_per_node == pool[i + gpus_per_node - 1] // gpus_per_node
        for i in range(0, len(pool), gpus_per_node))
    for kind in sorted(StageKind, key=lambda k: k.order):
        for wave in choices.get(kind.value, ()):
            free: dict[int, list[int]] = {}
            for g in () if whole else pool:  # pool order: whole nodes first
                free.setdefault(g // gpus_per_node, []).append(g)
            nodes = list(free)
            offset = 0
            for o in sorted(wave, key=lambda o: (-o.layout.size, o.model_stage)):
                sets = []
                if whole:  # whole nodes, power-of-two units largest first: contiguous slices stay aligned
                    size = o.layout.size
                    sets = [pool[offset + i * size: offset + (i + 1) * size] for i in range(o.dp)]
                    offset += o.num_gpus
                for _ in range(0 if whole else o.dp):
                    unit: list[int] = []
                    for _r in range(o.layout.pp):
                        unit += _take(free, nodes, o.layout.tp, unit[-1] // gpus_per_node if unit else None)
                    sets.append(tuple(unit))
                stages.append(StagePlan(model_stage=o.model_stage, layout=o.layout, gpu_sets=tuple(sets),
                                        micro_batch_size=o.micro_batch_size, grad_accum=o.grad_accum,
                                        recompute=o.recompute))
    return GlobalPlan(version=version, stages=tuple(stages))


def _take(free: dict[int, list[int]], nodes: list[int], n: int, prefer: int | None) -> list[int]:
    """``n`` free GPUs from one node if any node has room (``prefer`` first), else the first free ones."""
    while nodes and not free[nodes[0]]:  # drop exhausted nodes so a 1,024-GPU wave stays linear
        nodes.pop(0)
    for node in ([prefer] if prefer is not None else []) + nodes:
        if len(free[node]) >= n:
            taken, free[node] = free[node][:n], free[node][n:]
            return taken
    taken = []
    for node in nodes:  # fragmented pool: TP has to cross nodes
        k = min(n - len(taken), len(free[node]))
        taken += free[node][:k]
        free[node] = free[node][k:]
        if len(taken) == n:
            return taken
    raise AssertionError("a wave asked for more GPUs than the pool has")  # the search bounds each wave


def check_pool(cluster: ClusterSpec, pool: Sequence[int] | None) -> tuple[int, ...]:
    ordered = order_pool(cluster.all_gpus() if pool is None else pool, cluster)
    if not ordered:
        raise SpecError("pool", "no GPUs to plan on", ">= 1 GPU")
    return ordered


def search(job: JobSpec, cluster: ClusterSpec, pool: Sequence[int] | None = None,
           eff: Mapping[OpClass, float] = PRIORS, version: int = 1) -> SearchResult:
    """The fastest memory-feasible plan on ``pool`` (default: every GPU of the cluster)."""
    ordered = check_pool(cluster, pool)
    n = len(ordered)
    usable = usable_bytes(cluster)
    considered = 0
    for i, rules in enumerate(URGENT_RULES):
        fronts: dict[str, OptionTable] = {}
        shared: dict[tuple[object, ...], tuple[OptionTable, int]] = {}
        for ms in job.workflow.model_stages:
            # model-stages with the same model, head and kind (critic-inf, reward-inf) share one table
            key = (id(job.model_of(ms)), ms.role.head, ms.kind, ms.greedy, ms.sleeps, ms.old_logprob_pass)
            if key in shared:
                table, raw = replace(shared[key][0], model_stage=ms.name), shared[key][1]
            else:
                full = option_table(job, ms, cluster, n, eff, rules)
                table, raw = frontier(full), len(full)
                shared[key] = (table, raw)
            considered += raw
            fronts[ms.name] = table
        if not all(len(t) for t in fronts.values()):
            continue
        fronts = _quantize_transients(fronts)
        best = _solve(job, fronts, n, usable)
        if best is None:
            continue
        plan = assign(job, ordered, _choices(fronts, best[1]), version, cluster.gpus_per_node)
        return SearchResult(plan=plan, prediction=predict(job, cluster, plan, eff), objective_s=best[0] + step_overhead_seconds(cluster, eff),
                            candidates_considered=considered,
                            frontier_sizes={k: len(v) for k, v in fronts.items()}, urgent_options=i > 0)
    raise explain_infeasible(job, cluster, n)


