"""Wave solver of the plan search: model-stages of one stage running in waves under memory caps.

Members of a wave run concurrently on disjoint GPUs (together at most the pool); waves of a stage run one
after another. For a resident cap R and a transient cap T, a wave's best time is the min over member
choices of its slowest member with their GPUs within the budget; a stage's (sum of wave caps, seconds)
Pareto points come from every split of its members into waves.

Per member, a cube holds the least seconds with transient below level t, resident at most level r and
at most u GPUs (running minima over the three axes), so a wave's time at many caps is one array
expression (WaveSolver.wave_values, .floors). The scalar path (WaveSolver.solve: step functions over
GPU counts) gives the same times and names the rows, for the plan chosen only.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping

import numpy as np
import numpy.ma  # noqa: F401  np.unique imports it lazily: 30 ms off a process's first decision

from planner.options import OptionTable

Pick = tuple[tuple[str, int], ...]  # (model-stage, row of its table) per member of a wave
WaveRef = tuple[tuple[str, ...], float]  # members of a wave and its resident cap
Point = tuple[float, float, tuple[WaveRef, ...]]  # (sum of resident caps, seconds, waves)


def partitions(items: list[str]) -> Iterator[list[list[str]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


def pareto(points: list[Point]) -> list[Point]:
    """Keep the (R, seconds) points that no other point beats in both."""
    out: list[Point] = []
    best = float("inf")
    for p in sorted(points, key=lambda p: (p[0], p[1])):
        if p[1] < best:
            out.append(p)
            best = p[1]
    return out


class WaveSolver:
    """Best seconds of a wave (members on disjoint GPUs, at most ``budget`` together) under a resident
    cap R and a transient cap T, memoised on the rows those caps admit."""

    def __init__(self, fronts: Mapping[str, OptionTable], budget: int) -> None:
        self.fronts = fronts
        self.budget = budget
        # Python lists: scalar bisect is far cheaper than numpy's searchsorted on the hot path
        self.t_sorted = {m: np.unique(t.transient).tolist() for m, t in fronts.items()}
        self.r_sorted = {m: np.unique(t.resident).tolist() for m, t in fronts.items()}
        self.memo: dict[tuple[object, ...], tuple[float, Pick] | None] = {}

        self.steps_memo: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # vectorised wave curves: per member, each row's cell on its (resident level, GPU count) grid
        self.grid: dict[str, tuple[np.ndarray, ...]] = {}
        for m, t in fronts.items():
            idx = np.flatnonzero(t.gpus <= budget)
            r_lv, g_lv = np.unique(t.resident), np.unique(t.gpus[idx])
            self.grid[m] = (np.searchsorted(r_lv, t.resident[idx]), np.searchsorted(g_lv, t.gpus[idx]),
                            np.searchsorted(np.asarray(self.t_sorted[m]), t.transient[idx]), t.seconds[idx],
                            r_lv.astype(float), g_lv)
        # per member, least seconds with transient below level t (axis 0), resident at most level r (axis
        # 1) and at most GPU count u (axis 2); index 0 of the first two axes admits nothing (inf)
        self.cubes: dict[str, np.ndarray] = {}
        by_table: dict[int, np.ndarray] = {}  # model-stages sharing one table (critic-inf, reward-inf)
        for m, (ri, gi, tj, secs, r_lv, g_lv) in self.grid.items():
            cube = by_table.get(id(fronts[m].seconds))
            if cube is None:
                # GPU axis padded in front too: index 0 is "no GPU count fits" (inf), for the min-max
                cube = np.full((len(self.t_sorted[m]) + 1, r_lv.size + 1, g_lv.size + 1), np.inf)
                np.minimum.at(cube, (tj + 1, ri + 1, gi + 1), secs)
                for axis in (0, 1, 2):
                    np.minimum.accumulate(cube, axis=axis, out=cube)
                by_table[id(fronts[m].seconds)] = cube
            self.cubes[m] = cube
        self.t_arrays = {m: np.asarray(v, dtype=float) for m, v in self.t_sorted.items()}
        self.curves: dict[tuple[object, ...], tuple[np.ndarray, np.ndarray]] = {}
        self.levels: dict[tuple[str, ...], np.ndarray] = {}  # union of a wave's members' resident levels
        self._by_gpus: dict[str, tuple[np.ndarray, ...]] = {}
        self.splits: dict[tuple[str, ...], np.ndarray] = {}  # per wave: GPU index left to its last member
        self.parts: dict[tuple[str, ...], list[list[tuple[str, ...]]]] = {}

    def by_gpus(self, m: str) -> tuple[np.ndarray, ...]:
        """A member's rows within the budget sorted by (GPUs, seconds): a step function is then one
        running minimum (only the plan's own picks need them)."""
        if m not in self._by_gpus:
            t = self.fronts[m]
            idx = np.flatnonzero(t.gpus <= self.budget)
            order = idx[np.lexsort((t.seconds[idx], t.gpus[idx]))]
            self._by_gpus[m] = (t.gpus[order], t.seconds[order], t.resident[order], t.transient[order], order)
        return self._by_gpus[m]

    def _min_max(self, members: tuple[str, ...], tabs: list[np.ndarray]) -> np.ndarray:
        """Per row of the members' (N, 1 + GPU counts) padded tables: min over GPU splits within the
        budget of the slowest member (one, two or three members)."""
        n = tabs[0].shape[0]
        if len(tabs) == 1:
            return tabs[0][:, -1]
        k = self.splits.get(members)
        if k is None:  # the last member takes the GPUs the others leave (padded index 0: none fits)
            g = [self.grid[m][5] for m in members]
            left = self.budget - g[0] if len(g) == 2 else self.budget - g[0][:, None] - g[1][None, :]
            k = self.splits[members] = np.searchsorted(g[-1], left, side="right")
        if len(tabs) == 2:
            return np.maximum(tabs[0][:, 1:], tabs[1][:, k]).min(axis=1, initial=np.inf)
        both = np.maximum(tabs[0][:, 1:, None], tabs[1][:, None, 1:])
        return np.maximum(both, tabs[2][:, k]).reshape(n, -1).min(axis=1, initial=np.inf)

    def wave_values(self, members: tuple[str, ...], levels: np.ndarray, t_cap: float) -> np.ndarray:
        """Best seconds of a wave at each resident cap in ``levels`` (inf where nothing fits): the
        min-max of :meth:`solve` for every cap at once, over the members' GPU-count grids."""
        if len(members) > 3:
            out = [self.solve(members, float(r), t_cap) for r in levels]
            return np.array([np.inf if o is None else o[0] for o in out])
        return self._min_max(members, [self.cubes[m][self.t_index(m, t_cap)][
            np.searchsorted(self.grid[m][4], levels, side="right")] for m in members])

    def floors(self, names: list[str], r_caps: np.ndarray, t_caps: np.ndarray) -> np.ndarray:
        """Per pair of caps, a lower bound on a stage's seconds when its waves together hold at most
        ``r_caps`` resident bytes: every way of splitting it into waves, each wave allowed the whole
        cap (a relaxation of the sum), for every pair at once."""
        rows = {m: self.cubes[m][np.searchsorted(self.t_arrays[m], t_caps, side="right"),
                                 np.searchsorted(self.grid[m][4], r_caps, side="right")] for m in names}
        waves: dict[tuple[str, ...], np.ndarray] = {}
        best = np.full(t_caps.shape, np.inf)
        for part in partitions(names):
            total = np.zeros(t_caps.shape)
            for wave in part:
                members = tuple(wave)
                if members not in waves:
                    if len(members) > 3:
                        waves[members] = np.array([np.inf if (o := self.solve(members, float(r), float(t))) is None
                                                   else o[0] for r, t in zip(r_caps, t_caps)])
                    else:
                        waves[members] = self._min_max(members, [rows[m] for m in members])
                total = total + waves[members]
            best = np.minimum(best, total)
        return best

    def t_index(self, member: str, t_cap: float) -> int:
        return bisect.bisect_right(self.t_sorted[member], t_cap)

    def solve(self, members: tuple[str, ...], r_cap: float, t_cap: float) -> tuple[float, Pick] | None:
        idx = tuple((bisect.bisect_right(self.r_sorted[m], r_cap), self.t_index(m, t_cap)) for m in members)
        key = (members, idx)
        if key in self.memo:
            return self.memo[key]
        steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for m, (ri, ti) in zip(members, idx):
            st: tuple[np.ndarray, np.ndarray, np.ndarray] | None = self.steps_memo.get((m, ri, ti))
            if st is None:
                g_col, s_col, r_col, t_col, order = self.by_gpus(m)
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
        result = min_max(members, steps, self.budget)
        self.memo[key] = result
        return result


def min_max(members: tuple[str, ...], steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
             budget: int) -> tuple[float, Pick] | None:
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
    best: tuple[float, Pick] | None = None
    g1, s1, r1 = steps[0]
    for i in range(g1.size):
        rest = min_max(members[1:], steps[1:], budget - int(g1[i]))
        if rest is None:
            continue
        slowest = max(float(s1[i]), rest[0])
        if best is None or slowest < best[0]:
            best = (slowest, ((members[0], int(r1[i])),) + rest[1])
    return best


def wave_curve(solver: WaveSolver, members: tuple[str, ...], t_cap: float) -> tuple[np.ndarray, np.ndarray]:
    """(resident caps, seconds) where the wave's best time drops, over the union of its members' resident
    levels (seconds never rise with a larger cap), memoised on the transient levels the cap admits."""
    key = (members, tuple(solver.t_index(m, t_cap) for m in members))
    curve = solver.curves.get(key)
    if curve is None:
        levels = solver.levels.get(members)
        if levels is None:
            levels = solver.levels[members] = np.unique(np.concatenate([solver.grid[m][4] for m in members]))
        secs = solver.wave_values(members, levels, t_cap)
        ok = np.isfinite(secs)
        ok[1:] &= secs[1:] < secs[:-1]
        curve = solver.curves[key] = (levels[ok], secs[ok])
    return curve


def front(r: np.ndarray, secs: np.ndarray) -> np.ndarray:
    """Indices of the (r, seconds) points no other point beats in both, by growing r."""
    order = np.lexsort((secs, r))
    s = secs[order]
    keep = np.ones(s.size, dtype=bool)
    keep[1:] = s[1:] < np.minimum.accumulate(s)[:-1]
    return order[keep]


def kind_points(names: list[str], solver: WaveSolver, t_cap: float
                ) -> tuple[np.ndarray, np.ndarray, list[tuple[WaveRef, ...]]]:
    """(sum of wave resident caps, stage seconds, waves) Pareto points of one stage under cap T, as two
    arrays and a list; each wave is (members, resident cap), its rows come from :func:`wave_picks`."""
    key = ("kind", tuple(names), tuple(solver.t_index(m, t_cap) for m in names))
    hit = solver.memo.get(key)
    if hit is not None:
        return hit  # type: ignore[return-value]
    names_key = tuple(names)
    if len(names_key) == 1:  # one wave: its curve is the stage's Pareto front
        levels, secs = wave_curve(solver, names_key, t_cap)
        one: list[tuple[WaveRef, ...]] = [((names_key, float(r)),) for r in levels.tolist()]
        solver.memo[key] = (levels, secs, one)  # type: ignore[assignment]
        return levels, secs, one
    parts = solver.parts.get(names_key)
    if parts is None:
        parts = solver.parts[names_key] = [[tuple(w) for w in p] for p in partitions(names)]
    all_r, all_s, combos = [], [], []
    for waves in parts:
        curves = [wave_curve(solver, w, t_cap) for w in waves]
        r, sec = curves[0]  # a curve is already a Pareto front
        which = np.arange(r.size)[:, None]  # per point: index on each wave's curve
        for levels, secs in curves[1:]:
            rr = (r[:, None] + levels[None, :]).ravel()
            ss = (sec[:, None] + secs[None, :]).ravel()
            keep = front(rr, ss)
            which = np.column_stack([which[keep // levels.size], keep % levels.size])
            r, sec = rr[keep], ss[keep]
        all_r.append(r)
        all_s.append(sec)
        combos.append((waves, curves, which))
    sizes = [x.size for x in all_r]
    r, sec = np.concatenate(all_r), np.concatenate(all_s)
    keep = front(r, sec).tolist()
    bounds = np.cumsum(sizes).tolist()
    refs = []
    for i in keep:  # only the points kept name their waves
        p = bisect.bisect_right(bounds, i)
        waves, curves, which = combos[p]
        j = i - (bounds[p - 1] if p else 0)
        refs.append(tuple((w, float(c[0][which[j, n]])) for n, (w, c) in enumerate(zip(waves, curves))))
    result = (r[keep], sec[keep], refs)
    solver.memo[key] = result  # type: ignore[assignment]
    return result


def wave_picks(solver: WaveSolver, waves: tuple[WaveRef, ...], t_cap: float) -> tuple[Pick, ...]:
    """The rows behind a stage point of :func:`kind_points` (the same min-max, one cap at a time)."""
    out = []
    for members, r_cap in waves:
        res = solver.solve(members, r_cap, t_cap)
        assert res is not None  # the curve had a finite time at this cap
        out.append(res[1])
    return tuple(out)
