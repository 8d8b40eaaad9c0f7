"""The wave solver (planner/waves.py) against brute force on random small tables: a wave's best time
under resident / transient caps and a GPU budget (one to four members, the scalar and the vectorised
paths), the rows it names, the stage floors (every split into waves, each wave the whole cap), the
stage's Pareto points (every split, every cap per wave), and the set partitions and Pareto helpers
under them. Found by mutation testing (tests/mutate.py --module planner/waves.py: the search tests
reached the solver only through plans on presets, where most branches give the same plan)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from planner.options import OptionTable
from planner.waves import (
    Point,
    WaveSolver,
    front,
    kind_points,
    min_max,
    pareto,
    partitions,
    wave_curve,
    wave_picks,
)

BUDGET = 8


def _table(name: str, rng: np.random.Generator, rows: int) -> OptionTable:
    gpus = rng.choice([1, 2, 3, 4, 6, 8], size=rows)
    resident = rng.choice([10, 20, 30, 40], size=rows)
    transient = rng.choice([1, 2, 3], size=rows)
    # more GPUs are mostly faster, with noise, so that step functions have several steps
    seconds = np.round(100.0 / gpus * rng.uniform(0.6, 1.4, size=rows), 3)
    n = rows
    return OptionTable(model_stage=name, tp=np.arange(n, dtype=np.int64), pp=np.ones(n, np.int64),
                       dp=gpus.astype(np.int64), b=np.ones(n, np.int64), g=np.ones(n, np.int64),
                       recompute=np.zeros(n, bool), seconds=seconds.astype(float), gpus=gpus.astype(np.int64),
                       resident=resident.astype(np.int64), transient=transient.astype(np.int64))


def _fronts(seed: int, names: tuple[str, ...]) -> dict[str, OptionTable]:
    rng = np.random.default_rng(seed)
    return {m: _table(m, rng, int(rng.integers(3, 8))) for m in names}


def _brute(fronts: dict[str, OptionTable], members: tuple[str, ...], r_cap: float, t_cap: float,
           budget: int = BUDGET) -> float:
    """Least slowest-member seconds over every choice of one row per member that fits the caps."""
    best = np.inf
    choices = [[i for i in range(len(fronts[m])) if fronts[m].resident[i] <= r_cap and fronts[m].transient[i] <= t_cap]
               for m in members]
    for combo in itertools.product(*choices):
        if sum(int(fronts[m].gpus[i]) for m, i in zip(members, combo)) <= budget:
            best = min(best, max(float(fronts[m].seconds[i]) for m, i in zip(members, combo)))
    return best


NAMES = ("a", "b", "c", "d")
CAPS = [(r, t) for r in (5, 10, 20, 30, 40) for t in (0, 1, 2, 3)]


def test_partitions_are_every_set_partition_once() -> None:
    for n, bell in ((0, 1), (1, 1), (2, 2), (3, 5), (4, 15)):
        items = list("wxyz"[:n])
        parts = list(partitions(items))
        assert len(parts) == bell
        canon = {tuple(sorted(tuple(sorted(w)) for w in p)) for p in parts}
        assert len(canon) == bell
        assert all(sorted(x for w in p for x in w) == items for p in parts)


def test_pareto_and_front_keep_exactly_the_unbeaten_points() -> None:
    pts: list[Point] = [(3.0, 5.0, ()), (1.0, 9.0, ()), (2.0, 9.0, ()), (1.0, 7.0, ()), (4.0, 5.0, ()), (5.0, 1.0, ())]
    assert pareto(pts) == [(1.0, 7.0, ()), (3.0, 5.0, ()), (5.0, 1.0, ())]
    r, s = np.array([3.0, 1.0, 2.0, 1.0, 4.0, 5.0]), np.array([5.0, 9.0, 9.0, 7.0, 5.0, 1.0])
    assert front(r, s).tolist() == [3, 0, 5]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_a_waves_best_time_and_rows_are_the_brute_force_optimum(seed: int, size: int) -> None:
    fronts = _fronts(seed, NAMES)
    solver = WaveSolver(fronts, BUDGET)
    members = NAMES[:size]
    for r_cap, t_cap in CAPS:
        want = _brute(fronts, members, r_cap, t_cap)
        got = solver.solve(members, float(r_cap), float(t_cap))
        if not np.isfinite(want):
            assert got is None
            continue
        assert got is not None and got[0] == pytest.approx(want)
        # the rows named fit the caps and the budget, and give that time
        rows = dict(got[1])
        assert [m for m, _ in got[1]] == list(members)
        assert sum(int(fronts[m].gpus[i]) for m, i in rows.items()) <= BUDGET
        assert all(fronts[m].resident[i] <= r_cap and fronts[m].transient[i] <= t_cap for m, i in rows.items())
        assert max(float(fronts[m].seconds[i]) for m, i in rows.items()) == pytest.approx(want)
        assert solver.solve(members, float(r_cap), float(t_cap)) == got  # memoised alike
    # the vectorised path: every resident cap at once, for each transient cap
    levels = np.array([5.0, 10.0, 20.0, 30.0, 40.0])
    for t_cap in (0, 1, 2, 3):
        want_v = [_brute(fronts, members, r, t_cap) for r in levels]
        assert solver.wave_values(members, levels, float(t_cap)).tolist() == pytest.approx(want_v)


@pytest.mark.parametrize("seed", range(4))
def test_min_max_over_a_smaller_budget(seed: int) -> None:
    fronts = _fronts(seed, NAMES)
    solver = WaveSolver(fronts, BUDGET)
    for size in (1, 2, 3, 4):
        members = NAMES[:size]
        for budget in (2, 5, 8):
            steps = []  # step functions: each member's rows that are faster than every row with fewer GPUs
            for m in members:
                g, s, _r, _t, order = solver.by_gpus(m)
                keep = [k for k in range(s.size) if all(s[k] < s[j] for j in range(k))]
                steps.append((g[keep], s[keep], order[keep]))
            got = min_max(members, steps, budget)
            want = _brute(fronts, members, 1e9, 1e9, budget)
            assert (got is None) == (not np.isfinite(want))
            if got is not None:
                assert got[0] == pytest.approx(want)
                assert sum(int(fronts[m].gpus[i]) for m, i in got[1]) <= budget


def test_by_gpus_sorts_rows_within_the_budget_by_gpus_then_seconds() -> None:
    fronts = _fronts(1, ("a",))
    solver = WaveSolver(fronts, 4)
    g, s, r, t, order = solver.by_gpus("a")
    t_a = fronts["a"]
    assert order.tolist() == sorted((i for i in range(len(t_a)) if t_a.gpus[i] <= 4),
                                    key=lambda i: (int(t_a.gpus[i]), float(t_a.seconds[i])))
    assert (g == t_a.gpus[order]).all() and (s == t_a.seconds[order]).all()
    assert (r == t_a.resident[order]).all() and (t == t_a.transient[order]).all()


@pytest.mark.parametrize("seed", range(5))
def test_stage_floors_are_the_best_split_with_each_wave_given_the_whole_cap(seed: int) -> None:
    names = list(NAMES[: 2 + seed % 3])  # 2, 3 or 4 members
    fronts = _fronts(seed, NAMES)
    solver = WaveSolver(fronts, BUDGET)
    r_caps = np.array([r for r, _ in CAPS], dtype=float)
    t_caps = np.array([t for _, t in CAPS], dtype=float)
    got = solver.floors(names, r_caps, t_caps)
    for k, (r_cap, t_cap) in enumerate(CAPS):
        want = min(sum(_brute(fronts, tuple(w), r_cap, t_cap) for w in part) for part in partitions(names))
        assert got[k] == pytest.approx(want), (r_cap, t_cap)


def _stage_points(fronts: dict[str, OptionTable], names: list[str], t_cap: float) -> set[tuple[float, float]]:
    """The stage's (sum of wave resident caps, seconds) Pareto points by brute force: every split into
    waves and every resident level per wave."""
    levels = sorted({int(x) for t in fronts.values() for x in t.resident})
    pts: list[Point] = []
    for part in partitions(names):
        for caps in itertools.product(levels, repeat=len(part)):
            secs = sum(_brute(fronts, tuple(w), c, t_cap) for w, c in zip(part, caps))
            if np.isfinite(secs):
                pts.append((float(sum(caps)), round(secs, 9), ()))
    return {(p[0], p[1]) for p in pareto(pts)}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("size", [1, 2, 3])
def test_stage_points_are_the_brute_force_pareto_front_and_name_their_waves(seed: int, size: int) -> None:
    names = list(NAMES[:size])
    fronts = _fronts(seed + 10, NAMES)
    solver = WaveSolver(fronts, BUDGET)
    for t_cap in (1.0, 3.0):
        r, secs, refs = kind_points(names, solver, t_cap)
        assert {(float(a), round(float(b), 9)) for a, b in zip(r, secs)} == _stage_points(fronts, names, t_cap)
        assert kind_points(names, solver, t_cap)[2] is refs  # memoised
        for total, s, waves in zip(r.tolist(), secs.tolist(), refs):
            assert sorted(m for w, _ in waves for m in w) == sorted(names)
            assert sum(c for _, c in waves) == pytest.approx(total)
            picks = wave_picks(solver, waves, t_cap)
            assert sum(max(float(fronts[m].seconds[i]) for m, i in p) for p in picks) == pytest.approx(s)
            for (_, cap), p in zip(waves, picks):
                assert all(fronts[m].resident[i] <= cap and fronts[m].transient[i] <= t_cap for m, i in p)


def test_a_wave_curve_lists_the_caps_where_its_time_drops() -> None:
    fronts = _fronts(3, NAMES)
    solver = WaveSolver(fronts, BUDGET)
    levels, secs = wave_curve(solver, ("a", "b"), 3.0)
    all_levels = sorted({int(x) for m in ("a", "b") for x in fronts[m].resident})
    times = [_brute(fronts, ("a", "b"), r, 3.0) for r in all_levels]
    want = [(lv, t) for k, (lv, t) in enumerate(zip(all_levels, times))
            if np.isfinite(t) and (k == 0 or t < times[k - 1])]
    assert list(zip(levels.tolist(), secs.tolist())) == [(float(lv), pytest.approx(t)) for lv, t in want]


def test_a_member_with_no_row_within_the_budget_has_no_wave() -> None:
    one = (np.array([4, 6], np.int64), np.array([3.0, 2.0]), np.array([0, 1], np.int64))
    assert min_max(("a",), [one], 3) is None
    assert min_max(("a",), [one], 4) == (3.0, (("a", 0),))


def _flat(name: str, gpus: list[int], seconds: list[float]) -> OptionTable:
    n = len(gpus)
    return OptionTable(model_stage=name, tp=np.arange(n, dtype=np.int64), pp=np.ones(n, np.int64),
                       dp=np.ones(n, np.int64), b=np.ones(n, np.int64), g=np.ones(n, np.int64),
                       recompute=np.zeros(n, bool), seconds=np.array(seconds), gpus=np.array(gpus, np.int64),
                       resident=np.full(n, 10, np.int64), transient=np.ones(n, np.int64))


def test_rows_beyond_the_budget_are_never_picked() -> None:
    # b's 12-GPU row is the fastest but does not fit 8 GPUs
    fronts = {"a": _flat("a", [2, 4], [5.0, 4.0]), "b": _flat("b", [12, 2, 6], [1.0, 6.0, 3.0])}
    solver = WaveSolver(fronts, BUDGET)
    assert solver.solve(("a", "b"), 10.0, 1.0) == (5.0, (("a", 0), ("b", 2)))
    assert solver.solve(("b",), 10.0, 1.0) == (3.0, (("b", 2),))
    assert solver.wave_values(("a", "b"), np.array([10.0]), 1.0).tolist() == [5.0]
    assert solver.wave_values(("b",), np.array([10.0]), 1.0).tolist() == [3.0]  # alone, still within 8
    assert solver.floors(["b"], np.array([10.0]), np.array([1.0])).tolist() == [3.0]
    assert solver.floors(["a", "b"], np.array([10.0]), np.array([1.0])).tolist() == [5.0]


def test_a_stage_of_four_members_in_one_wave_when_more_gpus_do_not_help() -> None:
    # seconds do not fall with GPUs: one wave of all four (the slowest, 4 s) beats any split (a sum)
    fronts = {m: _flat(m, [2, 4], [s, s]) for m, s in zip(NAMES, (1.0, 2.0, 3.0, 4.0))}
    solver = WaveSolver(fronts, BUDGET)
    assert solver.floors(list(NAMES), np.array([10.0, 5.0]), np.array([1.0, 1.0])).tolist() == [4.0, np.inf]
    r, secs, refs = kind_points(list(NAMES), solver, 1.0)
    assert (r.tolist(), secs.tolist()) == ([10.0], [4.0])
    assert [sorted(w) for w, _ in refs[0]] == [list(NAMES)]
    assert solver.wave_values(NAMES, np.array([10.0]), 1.0).tolist() == [4.0]
