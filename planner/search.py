"""Plan search (paper Eq. 1): the fastest plan whose every GPU fits in memory.

1. Per model-stage, candidates (planner.options) reduced to a latency/resource frontier.
2. Inside a stage (generation, inference, training) model-stages run in *waves*: members of a wave run
   concurrently on disjoint GPUs (together at most |pool|), waves run one after another. Each way of
   splitting a stage's model-stages into waves is tried.
3. Memory couples the stages: a GPU holds the resident state of one model-stage per wave and peaks
   while the largest transient runs, so peak <= sum over waves of the resident cap R_w + the transient
   cap T. For a cap T, a wave's best time as a function of R_w (min-max over members under the GPU
   budget, found with step functions over GPU counts) gives (R, time) points; dynamic programming over
   waves and stages keeps the Pareto points and takes the fastest that fits.
4. Caps T are tried best lower bound first (slowest member, and GPU-seconds over the pool) and a cap is
   dropped, even halfway through its stages, once its bound cannot beat the best plan: exact, and a
   1,024-GPU replan stays in tens of milliseconds. Only above MAX_TRANSIENT_LEVELS distinct transient
   sizes are they rounded up (never unsafe: a rounded plan needs less memory than assumed).
5. GPU sets are assigned from the pool (whole nodes first, larger units first so TP stays in a node),
   and the plan is scored with planner.prediction.predict.
Urgent path: when nothing fits, recomputation, then TP across nodes are allowed.
:func:`exhaustive_search` tries every combination; bench/planner.py compares the two.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from planner.cost import PRIORS, OpClass
from planner.errors import SpecError
from planner.hardware import ClusterSpec
from planner.infeasible import explain_infeasible
from planner.memory import HEADROOM_FRACTION, WORKSPACE_BYTES
from planner.options import DEFAULT_RULES, OptionRules, OptionTable, StageOption, frontier, option_table
from planner.plan import GlobalPlan, StagePlan
from planner.prediction import Prediction, predict
from planner.workflow import JobSpec, StageKind

__all__ = ["SearchResult", "predict", "search", "exhaustive_search", "order_pool", "URGENT_RULES"]

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
    objective_s: float  # the search's own estimate (sum over waves of the slowest member)
    candidates_considered: int
    frontier_sizes: Mapping[str, int]
    urgent_options: bool  # recomputation or cross-node TP were needed


# A transient cap whose lower bound is within this fraction of the best plan found is not explored:
# the plan returned is then within PRUNE_TOLERANCE / (1 - PRUNE_TOLERANCE) of the optimum.
PRUNE_TOLERANCE = 0.0
MAX_TRANSIENT_LEVELS = 256  # beyond this many distinct transient sizes they are rounded up (see _quantize_transients)

Choice = tuple[tuple[StageOption, ...], ...]  # waves of one stage, each a tuple of member options
_Pick = tuple[tuple[str, int], ...]  # (model-stage, row of its table) per member of a wave
_Point = tuple[float, float, tuple[_Pick, ...]]  # (sum of resident caps, seconds, waves)


def order_pool(pool: Sequence[int], cluster: ClusterSpec) -> tuple[int, ...]:
    """GPUs of whole nodes first (node order), then partial nodes, largest first; unique ids."""
    by_node: dict[int, list[int]] = {}
    for g in sorted(set(pool)):
        if g < 0 or g >= cluster.num_gpus:
            raise SpecError("pool", f"GPU {g} is not in the cluster", f"0..{cluster.num_gpus - 1}")
        by_node.setdefault(cluster.node_of(g), []).append(g)
    nodes = sorted(by_node, key=lambda n: (-len(by_node[n]), n))
    return tuple(g for n in nodes for g in by_node[n])


def _partitions(items: list[str]) -> Iterator[list[list[str]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


def _usable(cluster: ClusterSpec) -> float:
    """Bytes per GPU for resident + transient state (capacity less headroom and workspace)."""
    return cluster.device.memory_bytes / (1 + HEADROOM_FRACTION) - WORKSPACE_BYTES


def _pareto(points: list[_Point]) -> list[_Point]:
    """Keep the (R, seconds) points that no other point beats in both."""
    out: list[_Point] = []
    best = float("inf")
    for p in sorted(points, key=lambda p: (p[0], p[1])):
        if p[1] < best:
            out.append(p)
            best = p[1]
    return out


class _WaveSolver:
    """Best seconds of a wave (members on disjoint GPUs, at most ``budget`` together) under a resident
    cap R and a transient cap T, memoised on the rows those caps admit."""

    def __init__(self, fronts: Mapping[str, OptionTable], budget: int) -> None:
        self.fronts = fronts
        self.budget = budget
        # Python lists: scalar bisect is far cheaper than numpy's searchsorted on the hot path
        self.t_sorted = {m: np.unique(t.transient).tolist() for m, t in fronts.items()}
        self.r_sorted = {m: np.unique(t.resident).tolist() for m, t in fronts.items()}
        self.memo: dict[tuple[object, ...], tuple[float, _Pick] | None] = {}
        self.alone = {m: _alone_table(t, budget) for m, t in fronts.items()}
        # least GPU-seconds per (R, T): a stage needs at least sum(GPU-seconds) / budget (work conservation)
        self.gpu_seconds = {m: _alone_table(t, budget, t.seconds * t.gpus) for m, t in fronts.items()}

        self.steps_memo: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # rows within the budget sorted by (GPUs, seconds): a step function is then one running minimum
        self.by_gpus = {}
        for m, t in fronts.items():
            idx = np.flatnonzero(t.gpus <= budget)
            order = idx[np.lexsort((t.seconds[idx], t.gpus[idx]))]
            self.by_gpus[m] = (t.gpus[order], t.seconds[order], t.resident[order], t.transient[order], order)

    def least_many(self, member: str, r_caps: np.ndarray, t_caps: np.ndarray,
                   gpu_seconds: bool = False) -> np.ndarray:
        """:meth:`least` for arrays of caps at once (the lower bounds of every transient cap)."""
        r_levels, t_levels, vals, _rows = (self.gpu_seconds if gpu_seconds else self.alone)[member]
        table = np.asarray(vals, dtype=float)
        i = np.searchsorted(np.asarray(r_levels, dtype=float), r_caps, side="right") - 1
        j = np.searchsorted(np.asarray(t_levels, dtype=float), t_caps, side="right") - 1
        ok = (i >= 0) & (j >= 0)
        return np.where(ok, table[np.maximum(i, 0), np.maximum(j, 0)], np.inf)

    def least(self, member: str, r_cap: float, t_cap: float, gpu_seconds: bool = False) -> float:
        """Least seconds (or GPU-seconds) of a member's rows within the caps; inf if none."""
        r_levels, t_levels, vals, _rows = (self.gpu_seconds if gpu_seconds else self.alone)[member]
        i = bisect.bisect_right(r_levels, r_cap) - 1
        j = bisect.bisect_right(t_levels, t_cap) - 1
        return vals[i][j] if i >= 0 and j >= 0 else float("inf")

    def t_index(self, member: str, t_cap: float) -> int:
        return bisect.bisect_right(self.t_sorted[member], t_cap)

    def solve(self, members: tuple[str, ...], r_cap: float, t_cap: float) -> tuple[float, _Pick] | None:
        if len(members) == 1:  # a lookup in the member's (R, T) -> fastest row table
            r_levels, t_levels, secs, rows = self.alone[members[0]]
            i = bisect.bisect_right(r_levels, r_cap) - 1
            j = bisect.bisect_right(t_levels, t_cap) - 1
            if i < 0 or j < 0 or rows[i][j] < 0:
                return None
            return secs[i][j], ((members[0], rows[i][j]),)
        idx = tuple((bisect.bisect_right(self.r_sorted[m], r_cap), self.t_index(m, t_cap)) for m in members)
        key = (members, idx)
        if key in self.memo:
            return self.memo[key]
        steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for m, (ri, ti) in zip(members, idx):
            st: tuple[np.ndarray, np.ndarray, np.ndarray] | None = self.steps_memo.get((m, ri, ti))
            if st is None:
                g_col, s_col, r_col, t_col, order = self.by_gpus[m]
                ok = (r_col <= r_cap) & (t_col <= t_cap)
                masked = np.where(ok, s_col, np.inf)
                best = np.minimum.accumulate(masked)
                keep = ok.copy()
                keep[1:] &= masked[1:] < best[:-1]
                st = (g_col[keep], s_col[keep], order[keep])
                self.steps_memo[(m, ri, ti)] = st
            if st[0].size == 0:
                self.memo[key] = None
                return None
            steps.append(st)
        result = _min_max(members, steps, self.budget)
        self.memo[key] = result
        return result


def _alone_table(tab: OptionTable, budget: int, value: np.ndarray | None = None
                 ) -> tuple[list[int], list[int], list[list[float]], list[list[int]]]:
    """(R levels, T levels, least ``value`` (default: seconds) and its row with resident <= R and
    transient <= T)."""
    value = tab.seconds if value is None else value
    r_levels = np.unique(tab.resident)
    t_levels = np.unique(tab.transient)
    secs = np.full((r_levels.size, t_levels.size), np.inf)
    rows = np.full((r_levels.size, t_levels.size), -1, dtype=np.int64)
    ok = np.flatnonzero(tab.gpus <= budget)
    # fastest row per cell (later, faster writes win), then a running minimum over growing R and T
    order = ok[np.argsort(-value[ok], kind="stable")]
    cell_r = np.searchsorted(r_levels, tab.resident[order])
    cell_t = np.searchsorted(t_levels, tab.transient[order])
    secs[cell_r, cell_t] = value[order]
    rows[cell_r, cell_t] = order
    for axis in (0, 1):
        run = np.minimum.accumulate(secs, axis=axis)
        shape = [1, 1]
        shape[axis] = secs.shape[axis]
        pos = np.arange(secs.shape[axis]).reshape(shape) * np.ones_like(rows)
        pos = np.maximum.accumulate(np.where((secs == run) & np.isfinite(secs), pos, 0), axis=axis)
        rows = np.take_along_axis(rows, pos, axis=axis)
        secs = run
    return r_levels.tolist(), t_levels.tolist(), secs.tolist(), rows.tolist()


def _min_max(members: tuple[str, ...], steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
             budget: int) -> tuple[float, _Pick] | None:
    """Min over choices of the slowest member with the members' GPUs summing to at most ``budget``."""
    if len(steps) == 1:
        g, s, rows = steps[0]
        i = int(np.searchsorted(g, budget, side="right")) - 1  # seconds fall as GPUs grow
        return None if i < 0 else (float(s[i]), ((members[0], int(rows[i])),))
    if len(steps) == 2:
        (g1, s1, r1), (g2, s2, r2) = steps
        j = np.searchsorted(g2, budget - g1, side="right") - 1
        ok = j >= 0
        if not ok.any():
            return None
        t = np.where(ok, np.maximum(s1, s2[np.maximum(j, 0)]), np.inf)
        i = int(np.argmin(t))
        return float(t[i]), ((members[0], int(r1[i])), (members[1], int(r2[j[i]])))
    if len(steps) == 3:  # every (first, second) pair at once; the third takes what GPUs are left
        (g1, s1, r1), (g2, s2, r2), (g3, s3, r3) = steps
        left = budget - g1[:, None] - g2[None, :]
        k = np.searchsorted(g3, left, side="right") - 1
        t = np.where(k >= 0, np.maximum(np.maximum(s1[:, None], s2[None, :]), s3[np.maximum(k, 0)]), np.inf)
        a, b = np.unravel_index(int(np.argmin(t)), t.shape)
        if not np.isfinite(t[a, b]):
            return None
        return float(t[a, b]), ((members[0], int(r1[a])), (members[1], int(r2[b])), (members[2], int(r3[k[a, b]])))
    best: tuple[float, _Pick] | None = None
    g1, s1, r1 = steps[0]
    for i in range(g1.size):
        rest = _min_max(members[1:], steps[1:], budget - int(g1[i]))
        if rest is None:
            continue
        slowest = max(float(s1[i]), rest[0])
        if best is None or slowest < best[0]:
            best = (slowest, ((members[0], int(r1[i])),) + rest[1])
    return best


def _wave_curve(solver: _WaveSolver, members: tuple[str, ...], levels: list[float],
                t_cap: float) -> list[_Point]:
    """The wave's best seconds as a function of its resident cap, at the caps where it changes.

    Seconds never rise with a larger cap, so a span whose ends agree is flat and is not probed inside
    (bisection: a few solves per breakpoint instead of one per level)."""
    cache: dict[int, tuple[float, _Pick] | None] = {}

    def at(i: int) -> tuple[float, _Pick] | None:
        if i not in cache:
            cache[i] = solver.solve(members, levels[i], t_cap)
        return cache[i]

    def same(a: tuple[float, _Pick] | None, b: tuple[float, _Pick] | None) -> bool:
        return (a is None and b is None) or (a is not None and b is not None and a[0] == b[0])

    def probe(lo: int, hi: int) -> None:
        if hi - lo <= 1 or same(at(lo), at(hi)):
            return
        mid = (lo + hi) // 2
        at(mid)
        probe(lo, mid)
        probe(mid, hi)

    probe(0, len(levels) - 1)
    at(len(levels) - 1)
    pts: list[_Point] = []
    for i in sorted(cache):
        res = cache[i]
        if res is not None:
            pts.append((levels[i], res[0], (res[1],)))
    return pts


def _kind_points(names: list[str], solver: _WaveSolver, t_cap: float,
                 r_levels: Mapping[str, list[float]]) -> list[_Point]:
    """(sum of wave resident caps, stage seconds, waves) Pareto points of one stage under cap T."""
    key = ("kind", tuple(names), tuple(solver.t_index(m, t_cap) for m in names))
    if key in solver.memo:
        return solver.memo[key]  # type: ignore[return-value]
    points: list[_Point] = []
    for part in _partitions(names):
        combined: list[_Point] = [(0.0, 0.0, ())]
        for wave in part:
            members = tuple(wave)
            levels = sorted({r for m in members for r in r_levels[m]})
            wave_pts = _wave_curve(solver, members, levels, t_cap)
            combined = _pareto([(a[0] + b[0], a[1] + b[1], a[2] + b[2]) for a in combined for b in _pareto(wave_pts)])
            if not combined:
                break
        points += combined
    result = _pareto(points)
    solver.memo[key] = result  # type: ignore[assignment]
    return result


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
           usable: float) -> tuple[float, dict[str, tuple[_Pick, ...]]] | None:
    """Every transient cap T, best lower bound first; stop when no remaining cap can beat the best plan.

    Lower bound at T: a stage takes at least as long as its slowest member's fastest row, and at least
    its members' least GPU-seconds over the pool (members share the pool, concurrently or in turn),
    among rows that fit T and the resident room the other stages leave at the least (each holds at
    least its members' smallest resident state)."""
    kinds = [k for k in sorted(StageKind, key=lambda k: k.order) if job.workflow.by_kind(k)]
    names = {k: [ms.name for ms in job.workflow.by_kind(k)] for k in kinds}
    r_levels = {m: [float(r) for r in np.unique(t.resident)] for m, t in fronts.items()}
    t_levels = np.unique(np.concatenate([t.transient for t in fronts.values()])).tolist()
    solver = _WaveSolver(fronts, budget)
    min_res = {k: max(solver.r_sorted[m][0] for m in names[k]) for k in kinds}
    total_min_res = sum(min_res.values())
    caps = np.asarray(t_levels, dtype=float)
    per_kind_lb: dict[StageKind, np.ndarray] = {}
    for k in kinds:
        rooms = usable - caps - (total_min_res - min_res[k])
        slowest = np.max([solver.least_many(m, rooms, caps) for m in names[k]], axis=0)
        shared = np.sum([solver.least_many(m, rooms, caps, gpu_seconds=True) for m in names[k]], axis=0) / budget
        per_kind_lb[k] = np.maximum(slowest, shared)
    lbs = np.sum([per_kind_lb[k] for k in kinds], axis=0)
    bounds = [(float(lbs[i]), -float(caps[i]), {k: float(per_kind_lb[k][i]) for k in kinds})
              for i in np.flatnonzero(np.isfinite(lbs))]
    # cheap stages first, so a cap is abandoned before its costly stages when it cannot win
    order = sorted(kinds, key=lambda k: len(names[k]))
    best: tuple[float, dict[str, tuple[_Pick, ...]]] | None = None
    for lb, neg_t, per_kind in sorted(bounds, key=lambda b: (b[0], b[1])):
        if best is not None and lb >= best[0] * (1 - PRUNE_TOLERANCE):
            break  # bounds are sorted: no remaining cap can beat the best by more than the tolerance
        t_cap = -neg_t
        room = usable - t_cap
        total: list[tuple[float, float, tuple[tuple[_Pick, ...], ...]]] = [(0.0, 0.0, ())]
        for n_done, k in enumerate(order, start=1):
            pts = _kind_points(names[k], solver, t_cap, r_levels)
            merged = [(a[0] + b[0], a[1] + b[1], a[2] + (b[2],)) for a in total for b in pts
                      if a[0] + b[0] <= room]
            total = _pareto_total(merged)
            rest = order[n_done:]
            rest_res = sum(min_res[r] for r in rest)
            reachable = [p[1] for p in total if p[0] + rest_res <= room]
            if not reachable or (best is not None and min(reachable) + sum(per_kind[r] for r in rest)
                                 >= best[0] * (1 - PRUNE_TOLERANCE)):
                total = []
                break
        for _r, sec, picks in total:
            if best is None or sec < best[0]:
                best = (sec, {k.value: p for k, p in zip(order, picks)})
    return best


def _pareto_total(points: list[tuple[float, float, tuple[tuple[_Pick, ...], ...]]]
                  ) -> list[tuple[float, float, tuple[tuple[_Pick, ...], ...]]]:
    out: list[tuple[float, float, tuple[tuple[_Pick, ...], ...]]] = []
    best = float("inf")
    for p in sorted(points, key=lambda p: (p[0], p[1])):
        if p[1] < best:
            out.append(p)
            best = p[1]
    return out


def _choices(fronts: Mapping[str, OptionTable], picks: Mapping[str, tuple[_Pick, ...]]) -> dict[str, Choice]:
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


def _check_pool(cluster: ClusterSpec, pool: Sequence[int] | None) -> tuple[int, ...]:
    ordered = order_pool(cluster.all_gpus() if pool is None else pool, cluster)
    if not ordered:
        raise SpecError("pool", "no GPUs to plan on", ">= 1 GPU")
    return ordered


def search(job: JobSpec, cluster: ClusterSpec, pool: Sequence[int] | None = None,
           eff: Mapping[OpClass, float] = PRIORS, version: int = 1) -> SearchResult:
    """The fastest memory-feasible plan on ``pool`` (default: every GPU of the cluster)."""
    ordered = _check_pool(cluster, pool)
    n = len(ordered)
    usable = _usable(cluster)
    considered = 0
    for i, rules in enumerate(URGENT_RULES):
        fronts: dict[str, OptionTable] = {}
        shared: dict[tuple[object, ...], tuple[OptionTable, int]] = {}
        for ms in job.workflow.model_stages:
            # model-stages with the same model, head and kind (critic-inf, reward-inf) share one table
            key = (id(job.model_of(ms)), ms.role.head, ms.kind, ms.greedy)
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
        return SearchResult(plan=plan, prediction=predict(job, cluster, plan, eff), objective_s=best[0],
                            candidates_considered=considered,
                            frontier_sizes={k: len(v) for k, v in fronts.items()}, urgent_options=i > 0)
    raise explain_infeasible(job, cluster, n)


def _dominance_free(options: list[StageOption]) -> list[StageOption]:
    """Drop candidates another one beats or ties in all of seconds, GPUs, resident and transient bytes.

    Exact (no optimum is lost: swapping in the dominator keeps any plan feasible and no slower); pairwise,
    so only for the small settings the exhaustive search is meant for."""
    kept: list[StageOption] = []
    for o in sorted(options, key=lambda o: (o.seconds, o.num_gpus, o.resident_bytes, o.transient_bytes)):
        if not any(k.num_gpus <= o.num_gpus and k.resident_bytes <= o.resident_bytes
                   and k.transient_bytes <= o.transient_bytes for k in kept):
            kept.append(o)
    return kept


_WaveRow = tuple[float, int, int, tuple[StageOption, ...]]  # (slowest s, max resident, max transient, members)


def _all_wave_rows(wave: tuple[str, ...], all_opts: Mapping[str, list[StageOption]], budget: int,
                   memo: dict[tuple[str, ...], list[_WaveRow]]) -> list[_WaveRow]:
    """Every GPU-feasible combination of a wave's members, the fastest per (resident, transient) pair
    (a slower combination with the same memory is never part of an optimum)."""
    if wave in memo:
        return memo[wave]
    best: dict[tuple[int, int], _WaveRow] = {}
    for combo in itertools.product(*(all_opts[m] for m in wave)):
        if sum(o.num_gpus for o in combo) > budget:
            continue
        row = (max(o.seconds for o in combo), max(o.resident_bytes for o in combo),
               max(o.transient_bytes for o in combo), combo)
        key = (row[1], row[2])
        if key not in best or row[0] < best[key][0]:
            best[key] = row
    memo[wave] = list(best.values())
    return memo[wave]


def exhaustive_search(job: JobSpec, cluster: ClusterSpec, pool: Sequence[int] | None = None,
                      eff: Mapping[OpClass, float] = PRIORS, version: int = 1,
                      rules: OptionRules = DEFAULT_RULES) -> SearchResult:
    """Every combination of every candidate (no frontier, no caps): the reference for plan quality.

    Exponential: only for small settings (a few GPUs, few model-stages)."""
    ordered = _check_pool(cluster, pool)
    n = len(ordered)
    usable = _usable(cluster)
    all_opts = {ms.name: _dominance_free(option_table(job, ms, cluster, n, eff, rules).options())
                for ms in job.workflow.model_stages}
    kinds = [k for k in sorted(StageKind, key=lambda k: k.order) if job.workflow.by_kind(k)]
    per_kind: list[list[tuple[float, int, int, Choice]]] = []  # (time, sum R, max T, waves)
    memo: dict[tuple[str, ...], list[_WaveRow]] = {}
    for kind in kinds:
        names = [ms.name for ms in job.workflow.by_kind(kind)]
        rows: list[tuple[float, int, int, Choice]] = []
        for part in _partitions(names):
            wave_rows = [_all_wave_rows(tuple(wave), all_opts, n, memo) for wave in part]
            for waves in itertools.product(*wave_rows):
                rows.append((sum(w[0] for w in waves), sum(w[1] for w in waves), max(w[2] for w in waves),
                             tuple(w[3] for w in waves)))
        best_of: dict[tuple[int, int], tuple[float, int, int, Choice]] = {}
        for row in rows:  # same memory, slower: never part of an optimum
            key = (row[1], row[2])
            if key not in best_of or row[0] < best_of[key][0]:
                best_of[key] = row
        per_kind.append(list(best_of.values()))
    best: tuple[float, dict[str, Choice]] | None = None
    for pick in itertools.product(*per_kind):
        if sum(c[1] for c in pick) + max(c[2] for c in pick) > usable:
            continue
        total = sum(c[0] for c in pick)
        if best is None or total < best[0]:
            best = (total, {kind.value: c[3] for kind, c in zip(kinds, pick)})
    if best is None:
        raise explain_infeasible(job, cluster, n)
    plan = assign(job, ordered, best[1], version, cluster.gpus_per_node)
    return SearchResult(plan=plan, prediction=predict(job, cluster, plan, eff), objective_s=best[0],
                        candidates_considered=sum(len(v) for v in all_opts.values()),
                        frontier_sizes={k: len(v) for k, v in all_opts.items()}, urgent_options=False)
