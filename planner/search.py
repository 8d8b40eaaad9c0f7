"""Plan search (paper Eq. 1): the fastest plan whose every GPU fits in memory.

1. Per model-stage, candidates (planner.options) reduced to a latency/resource frontier.
2. Inside a stage (generation, inference, training) model-stages run in *waves*: members of a wave run
   concurrently on disjoint GPUs (together at most |pool|), waves run one after another. Each way of
   splitting a stage's model-stages into waves is tried.
3. Memory couples the stages: a GPU holds the resident state of one model-stage per wave and peaks
   while the largest transient runs, so peak <= sum over waves of the resident cap R_w + the transient
   cap T. For each T (distinct transient sizes), a wave's best time is a function of R_w (min-max over
   members under the GPU budget, solved by a threshold sweep); dynamic programming over waves and stages
   keeps (sum of R, time) Pareto points and takes the fastest that fits.
4. GPU sets are assigned from the pool (whole nodes first, larger units first so TP stays in a node),
   and the plan is scored with planner.prediction.predict.
Urgent path: when nothing fits, recomputation, then TP across nodes are allowed.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from planner.cost import PRIORS, OpClass
from planner.errors import InfeasibleError, SpecError
from planner.hardware import ClusterSpec
from planner.memory import HEADROOM_FRACTION, WORKSPACE_BYTES, peak_total, resident_bytes, transient_bytes
from planner.options import DEFAULT_RULES, OptionRules, StageOption, frontier, stage_options
from planner.plan import GlobalPlan, Layout, StagePlan, power_of_two_upto
from planner.prediction import Prediction, predict
from planner.workflow import JobSpec, ModelStage, StageKind

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


Choice = tuple[tuple[StageOption, ...], ...]  # waves of one stage, each a tuple of member options


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


def _pareto(points: list[tuple[float, float, Choice]]) -> list[tuple[float, float, Choice]]:
    """Keep (R, time) points no other point beats in both."""
    out: list[tuple[float, float, Choice]] = []
    best = float("inf")
    for p in sorted(points, key=lambda p: (p[0], p[1])):
        if p[1] < best:
            out.append(p)
            best = p[1]
    return out


class _WaveSolver:
    """Best time of a wave under caps (R, T) and the GPU budget, memoised."""

    def __init__(self, fronts: dict[str, list[StageOption]], budget: int) -> None:
        self.fronts = fronts
        self.budget = budget
        self.memo: dict[tuple[tuple[str, ...], int, int], tuple[float, tuple[StageOption, ...]] | None] = {}

    def solve(self, members: tuple[str, ...], r_cap: int, t_cap: int) -> tuple[float, tuple[StageOption, ...]] | None:
        key = (members, r_cap, t_cap)
        if key in self.memo:
            return self.memo[key]
        lists = [[o for o in self.fronts[m] if o.resident_bytes <= r_cap and o.transient_bytes <= t_cap
                  and o.num_gpus <= self.budget] for m in members]
        result: tuple[float, tuple[StageOption, ...]] | None = None
        if all(lists):
            if len(lists) == 1:
                best = min(lists[0], key=lambda o: o.seconds)
                result = (best.seconds, (best,))
            else:
                result = _min_max(lists, self.budget)
        self.memo[key] = result
        return result


def _min_max(lists: list[list[StageOption]], budget: int) -> tuple[float, tuple[StageOption, ...]] | None:
    """Min over choices of the slowest member, with the members' GPUs summing to at most ``budget``.

    For a time threshold tau each member takes its fewest-GPU option no slower than tau; the smallest
    feasible tau is found by bisection over the sorted candidate times."""
    prepared = []
    for opts in lists:
        opts = sorted(opts, key=lambda o: o.seconds)
        times = [o.seconds for o in opts]
        prefix: list[StageOption] = []
        for o in opts:
            prefix.append(o if not prefix or o.num_gpus < prefix[-1].num_gpus else prefix[-1])
        prepared.append((times, prefix))
    taus = sorted({t for times, _ in prepared for t in times})

    def pick(tau: float) -> tuple[StageOption, ...] | None:
        chosen = []
        for times, prefix in prepared:
            i = bisect.bisect_right(times, tau) - 1
            if i < 0:
                return None
            chosen.append(prefix[i])
        return tuple(chosen) if sum(o.num_gpus for o in chosen) <= budget else None

    lo, hi = 0, len(taus) - 1
    if pick(taus[hi]) is None:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if pick(taus[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    chosen = pick(taus[lo])
    assert chosen is not None
    return max(o.seconds for o in chosen), chosen


def _kind_points(kind_members: list[str], solver: _WaveSolver, t_cap: int,
                 r_levels: dict[str, list[int]]) -> list[tuple[float, float, Choice]]:
    """(sum of wave resident caps, stage time, waves) Pareto points of one stage for transient cap T."""
    points: list[tuple[float, float, Choice]] = []
    for part in _partitions(kind_members):
        combined: list[tuple[float, float, Choice]] = [(0.0, 0.0, ())]
        for wave in part:
            members = tuple(wave)
            levels = sorted({r for m in members for r in r_levels[m]})
            wave_pts: list[tuple[float, float, Choice]] = []
            for r in levels:
                res = solver.solve(members, r, t_cap)
                if res is not None:
                    wave_pts.append((float(max(o.resident_bytes for o in res[1])), res[0], (res[1],)))
            wave_pts = _pareto(wave_pts)
            combined = _pareto([(a[0] + b[0], a[1] + b[1], a[2] + b[2]) for a in combined for b in wave_pts])
            if not combined:
                break
        points += combined
    return _pareto(points)


def _solve(job: JobSpec, fronts: dict[str, list[StageOption]], budget: int,
           usable: float) -> tuple[float, dict[str, Choice]] | None:
    kinds = [k for k in sorted(StageKind, key=lambda k: k.order) if job.workflow.by_kind(k)]
    r_levels = {m: sorted({o.resident_bytes for o in opts}) for m, opts in fronts.items()}
    t_levels = sorted({o.transient_bytes for opts in fronts.values() for o in opts})
    solver = _WaveSolver(fronts, budget)
    best: tuple[float, dict[str, Choice]] | None = None
    for t_cap in t_levels:
        room = usable - t_cap
        if room < 0:
            break
        total: list[tuple[float, float, tuple[Choice, ...]]] = [(0.0, 0.0, ())]
        for kind in kinds:
            pts = _kind_points([ms.name for ms in job.workflow.by_kind(kind)], solver, t_cap, r_levels)
            merged = [(a[0] + b[0], a[1] + b[1], a[2] + (b[2],)) for a in total for b in pts if a[0] + b[0] <= room]
            total = _pareto3(merged)
            if not total:
                break
        for r, t, choices in total:
            if r <= room and (best is None or t < best[0]):
                best = (t, {kind.value: c for kind, c in zip(kinds, choices)})
    return best


def _pareto3(points: list[tuple[float, float, tuple[Choice, ...]]]) -> list[tuple[float, float, tuple[Choice, ...]]]:
    out: list[tuple[float, float, tuple[Choice, ...]]] = []
    best = float("inf")
    for p in sorted(points, key=lambda p: (p[0], p[1])):
        if p[1] < best:
            out.append(p)
            best = p[1]
    return out


def assign(job: JobSpec, pool: tuple[int, ...], choices: Mapping[str, Choice], version: int) -> GlobalPlan:
    """GPU sets from the ordered pool: each wave starts at the pool's first GPU, larger units first."""
    stages: list[StagePlan] = []
    for kind in sorted(StageKind, key=lambda k: k.order):
        for wave in choices.get(kind.value, ()):
            offset = 0
            for o in sorted(wave, key=lambda o: (-o.layout.size, o.model_stage)):
                size = o.layout.size
                sets = tuple(pool[offset + i * size: offset + (i + 1) * size] for i in range(o.dp))
                offset += o.num_gpus
                stages.append(StagePlan(model_stage=o.model_stage, layout=o.layout, gpu_sets=sets,
                                        micro_batch_size=o.micro_batch_size, grad_accum=o.grad_accum,
                                        recompute=o.recompute))
    return GlobalPlan(version=version, stages=tuple(stages))


def _check_pool(cluster: ClusterSpec, pool: Sequence[int] | None) -> tuple[int, ...]:
    ordered = order_pool(cluster.all_gpus() if pool is None else pool, cluster)
    if not ordered:
        raise SpecError("pool", "no GPUs to plan on", ">= 1 GPU")
    return ordered


def _infeasible(job: JobSpec, cluster: ClusterSpec, n: int) -> InfeasibleError:
    """Explain: per model-stage, its smallest footprint on this pool, and how far over capacity it is."""
    capacity = cluster.device.memory_bytes
    reasons = []
    for ms in job.workflow.model_stages:
        need = _smallest_footprint(job, ms, n)
        if need > capacity:
            reasons.append(f"{ms.name}: needs at least {need / 1e9:.1f} GB per GPU on {n} GPUs, "
                           f"{(need - capacity) / 1e9:.1f} GB ({need - capacity} bytes) over the "
                           f"{capacity / 1e9:.0f} GB of a {cluster.device.name}")
    if not reasons:
        reasons.append(f"every model-stage fits alone, but their resident state together exceeds "
                       f"{capacity / 1e9:.0f} GB per GPU on {n} GPUs")
    return InfeasibleError(f"no plan fits in memory on {n} x {cluster.device.name}", tuple(reasons))


def _smallest_footprint(job: JobSpec, ms: ModelStage, n: int) -> int:
    """Lower bound of a model-stage's own peak: largest unit that fits the pool, one sequence per
    micro-batch, recomputation for training."""
    model = job.model_of(ms)
    best: int | None = None
    for tp in power_of_two_upto(n):
        if not model.valid_tp(tp):
            continue
        for pp in power_of_two_upto(min(model.num_layers, n // tp)):
            layout = Layout(tp, pp)
            need = peak_total(resident_bytes(model, ms, layout).total_bytes,
                              transient_bytes(model, ms, layout, job.workload, 1, 1,
                                              ms.kind is StageKind.TRAINING).total_bytes)
            best = need if best is None else min(best, need)
    return best if best is not None else 0


def search(job: JobSpec, cluster: ClusterSpec, pool: Sequence[int] | None = None,
           eff: Mapping[OpClass, float] = PRIORS, version: int = 1) -> SearchResult:
    """The fastest memory-feasible plan on ``pool`` (default: every GPU of the cluster)."""
    ordered = _check_pool(cluster, pool)
    n = len(ordered)
    usable = _usable(cluster)
    considered = 0
    for i, rules in enumerate(URGENT_RULES):
        fronts: dict[str, list[StageOption]] = {}
        for ms in job.workflow.model_stages:
            opts = stage_options(job, ms, cluster, n, eff, rules)
            considered += len(opts)
            fronts[ms.name] = frontier(opts)
        if not all(fronts.values()):
            continue
        best = _solve(job, fronts, n, usable)
        if best is None:
            continue
        plan = assign(job, ordered, best[1], version)
        return SearchResult(plan=plan, prediction=predict(job, cluster, plan, eff), objective_s=best[0],
                            candidates_considered=considered,
                            frontier_sizes={k: len(v) for k, v in fronts.items()}, urgent_options=i > 0)
    raise _infeasible(job, cluster, n)


def exhaustive_search(job: JobSpec, cluster: ClusterSpec, pool: Sequence[int] | None = None,
                      eff: Mapping[OpClass, float] = PRIORS, version: int = 1,
                      rules: OptionRules = DEFAULT_RULES) -> SearchResult:
    """Every combination of every candidate (no frontier, no caps): the reference for plan quality.

    Exponential: only for small settings (a few GPUs, few model-stages)."""
    ordered = _check_pool(cluster, pool)
    n = len(ordered)
    usable = _usable(cluster)
    all_opts = {ms.name: stage_options(job, ms, cluster, n, eff, rules) for ms in job.workflow.model_stages}
    kinds = [k for k in sorted(StageKind, key=lambda k: k.order) if job.workflow.by_kind(k)]
    per_kind: list[list[tuple[float, int, int, Choice]]] = []  # (time, sum R, max T, waves)
    for kind in kinds:
        names = [ms.name for ms in job.workflow.by_kind(kind)]
        rows: list[tuple[float, int, int, Choice]] = []
        for part in _partitions(names):
            wave_rows: list[list[tuple[float, int, int, tuple[StageOption, ...]]]] = []
            for wave in part:
                combos = []
                for combo in itertools.product(*(all_opts[m] for m in wave)):
                    if sum(o.num_gpus for o in combo) <= n:
                        combos.append((max(o.seconds for o in combo), max(o.resident_bytes for o in combo),
                                       max(o.transient_bytes for o in combo), combo))
                wave_rows.append(combos)
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
    for combo in itertools.product(*per_kind):
        if sum(c[1] for c in combo) + max(c[2] for c in combo) > usable:
            continue
        t = sum(c[0] for c in combo)
        if best is None or t < best[0]:
            best = (t, {kind.value: c[3] for kind, c in zip(kinds, combo)})
    if best is None:
        raise _infeasible(job, cluster, n)
    plan = assign(job, ordered, best[1], version)
    return SearchResult(plan=plan, prediction=predict(job, cluster, plan, eff), objective_s=best[0],
                        candidates_considered=sum(len(v) for v in all_opts.values()),
                        frontier_sizes={k: len(v) for k, v in all_opts.items()}, urgent_options=False)
