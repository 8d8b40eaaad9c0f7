"""Exhaustive plan search: every combination of every candidate, the reference for plan quality.

Same candidates (planner.options), same objective (sum over waves of the slowest member) and the same
memory rule as planner.search, but no frontier, no bounds and no caps: exponential, so only for the
small settings where bench/decisions.py and the tests compare the two.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from planner.cost import PRIORS, OpClass
from planner.hardware import ClusterSpec
from planner.infeasible import explain_infeasible
from planner.options import DEFAULT_RULES, OptionRules, StageOption, option_table
from planner.prediction import predict, step_overhead_seconds
from planner.search import Choice, SearchResult, assign, check_pool, usable_bytes
from planner.waves import partitions
from planner.workflow import JobSpec, StageKind


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
    ordered = check_pool(cluster, pool)
    n = len(ordered)
    usable = usable_bytes(cluster)
    all_opts = {ms.name: _dominance_free(option_table(job, ms, cluster, n, eff, rules).options())
                for ms in job.workflow.model_stages}
    kinds = [k for k in sorted(StageKind, key=lambda k: k.order) if job.workflow.by_kind(k)]
    per_kind: list[list[tuple[float, int, int, Choice]]] = []  # (time, sum R, max T, waves)
    memo: dict[tuple[str, ...], list[_WaveRow]] = {}
    for kind in kinds:
        names = [ms.name for ms in job.workflow.by_kind(kind)]
        rows: list[tuple[float, int, int, Choice]] = []
        for part in partitions(names):
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
    return SearchResult(plan=plan, prediction=predict(job, cluster, plan, eff), objective_s=best[0] + step_overhead_seconds(cluster, eff),
                        candidates_considered=sum(len(v) for v in all_opts.values()),
                        frontier_sizes={k: len(v) for k, v in all_opts.items()}, urgent_options=False)
