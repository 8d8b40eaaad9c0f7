"""The makespan-optimal memory-feasible order of a small transition DAG (branch and bound). Pure.

The greedy order (transitions.feasibility) is chosen with a duration estimate of its own; on small
DAGs it can still be far from the fastest. For DAGs of at most ``EXACT_MAKESPAN_NODES`` nodes the
builder (transitions.global_dag) searches the memory-feasible topological orders under the execution
rule the cost model schedules by (transitions.cost.schedule: a node starts once its data
predecessors and the previous node on each of its GPUs have ended; each GPU runs its nodes one at a
time, in order, so its memory follows the checked timeline) and keeps the greedy order unless
another one is strictly faster.

The search dives first along the candidate that ends earliest (so its first leaf is a list schedule)
and prunes a branch once its makespan, a GPU's busy time still to come, or a node's earliest start
plus its longest path of durations to a sink reaches the best found. Two reductions keep it exact:
a zero-duration node that frees no less than it allocates on every GPU and delays no GPU is placed
at once without branching (moving it earlier never delays anything nor raises memory), and a set of
placed nodes reached again with the same GPU and frontier end times is not searched twice. It stops
after ``EXACT_BUDGET`` expansions with the best order found so far (None if none beat the bound):
the answer is then feasible, and faster than the bound, but not proven optimal.
"""

from __future__ import annotations

from transitions.feasibility import bottom_levels
from transitions.primitives import Footprint

EXACT_MAKESPAN_NODES = 16  # DAGs this small are searched (the budget bounds the time, not the size)
EXACT_BUDGET = 1_000  # expansions (new states, and sets whose memory completion is decided): <= ~10 ms of CPU
_EPS = 1e-12


def makespan(fps: list[Footprint], edges: list[tuple[int, int]], order: tuple[int, ...] | list[int],
             durations: list[float]) -> float:
    """The makespan of ``order`` under the execution rule (what transitions.cost.schedule computes;
    resource edges join nodes that share a GPU, so the per-GPU FIFO implies them)."""
    preds: list[list[int]] = [[] for _ in fps]
    for a, b in edges:
        preds[b].append(a)
    end = [0.0] * len(fps)
    gpu_end: dict[int, float] = {}
    for i in order:
        t = max((end[p] for p in preds[i]), default=0.0)
        for g in fps[i].gpus:
            t = max(t, gpu_end.get(g, 0.0))
        end[i] = t + durations[i]
        for g in fps[i].gpus:
            gpu_end[g] = end[i]
    return max(end, default=0.0)


class _Search:
    """One branch-and-bound search; ``best`` holds the fastest order found below the bound. GPUs are
    renumbered 0..m-1 (lists, not dicts, in the inner loop)."""

    def __init__(self, fps: list[Footprint], edges: list[tuple[int, int]], initial_bytes: dict[int, int],
                 capacity: int, durations: list[float], bound: float, budget: int) -> None:
        n = len(fps)
        self.n, self.durations, self.budget = n, durations, budget
        index = {g: k for k, g in enumerate(sorted({g for fp in fps for g in fp.gpus}))}
        self.gpus = [tuple(index[g] for g in sorted(fp.gpus)) for fp in fps]
        # per node: (GPU, room it needs there: capacity - alloc - buffer, the change it leaves)
        self.effect = [tuple((index[g], capacity - fp.alloc_bytes.get(g, 0) - fp.buffer_bytes.get(g, 0),
                              fp.alloc_bytes.get(g, 0) - fp.free_bytes.get(g, 0)) for g in sorted(fp.gpus))
                       for fp in fps]
        # zero-duration nodes that never raise memory: placed at once when they delay no GPU
        self.free_move = [durations[i] <= 0.0 and all(d <= 0 for _, _, d in self.effect[i]) for i in range(n)]
        self.preds: list[list[int]] = [[] for _ in range(n)]
        self.succ: list[list[int]] = [[] for _ in range(n)]
        self.succ_mask = [0] * n
        self.pred_mask = [0] * n
        self.indeg = [0] * n
        for a, b in edges:
            self.pred_mask[b] |= 1 << a
            self.preds[b].append(a)
            self.succ[a].append(b)
            self.succ_mask[a] |= 1 << b
            self.indeg[b] += 1
        self.tail = bottom_levels(n, edges, durations)  # longest path of durations to a sink, its own included
        self.by_tail: list[list[int]] = [[] for _ in index]  # per GPU: its nodes, longest tail first
        for i in sorted(range(n), key=lambda i: -self.tail[i]):
            for g in self.gpus[i]:
                self.by_tail[g].append(i)
        self.used = [initial_bytes.get(g, 0) for g in index]
        self.end = [0.0] * n
        self.gpu_end = [0.0] * len(index)
        self.remaining = [0.0] * len(index)  # per GPU: the durations of its nodes not yet placed
        for i in range(n):
            for g in self.gpus[i]:
                self.remaining[g] += durations[i]
        self.order: list[int] = []
        self.placed = 0  # bit set of placed nodes
        self.seen: set[tuple[object, ...]] = set()
        self.completes: dict[int, bool] = {}  # placed set -> some memory-feasible completion exists
        self.try_order = sorted(range(n), key=lambda i: (any(c > 0 for _, _, c in self.effect[i]), i))
        self.expansions = 0
        self.cut = False  # the budget stopped a branch
        self.best = bound
        self.best_order: tuple[int, ...] | None = None

    def start(self, i: int) -> float:
        end, gpu_end = self.end, self.gpu_end
        return max(max((end[p] for p in self.preds[i]), default=0.0),
                   max((gpu_end[g] for g in self.gpus[i]), default=0.0))

    def lower_bound(self, span: float) -> float:
        """No completion of the current prefix ends before this: on each GPU, its last placed node's
        end plus the larger of its unplaced nodes' total duration and their longest path to a sink."""
        lb, indeg, tail = span, self.indeg, self.tail
        for g, nodes in enumerate(self.by_tail):
            top = 0.0
            for j in nodes:
                if indeg[j] >= 0:
                    top = tail[j]
                    break
            lb = max(lb, self.gpu_end[g] + max(self.remaining[g], top))
        return lb

    def run(self, span: float) -> None:
        n, used, indeg = self.n, self.used, self.indeg
        if len(self.order) == n:
            if span < self.best - _EPS:
                self.best, self.best_order = span, tuple(self.order)
            return
        if self.expansions >= self.budget:
            self.cut = True
            return
        self.expansions += 1
        placed = self.placed
        frontier = tuple(self.end[p] for p in range(n) if placed >> p & 1 and self.succ_mask[p] & ~placed)
        key = (placed, span, *self.gpu_end, *frontier)
        if key in self.seen:
            return
        self.seen.add(key)
        ready = [(self.start(i), i) for i in range(n)
                 if indeg[i] == 0 and all(used[g] <= room for g, room, _ in self.effect[i])
                 and self.can_complete(placed | 1 << i, i)]
        for s, i in ready:
            if self.free_move[i] and all(self.gpu_end[g] >= s for g in self.gpus[i]):
                ready = [(s, i)]  # placing it now dominates every other choice
                break
        else:
            ready.sort(key=lambda si: (si[0] + self.durations[si[1]], -self.tail[si[1]], si[1]))
        for s, i in ready:
            end = s + self.durations[i]
            if max(span, end) >= self.best - _EPS:
                continue
            saved = [self.gpu_end[g] for g in self.gpus[i]]
            self.place(i, end)
            if self.lower_bound(max(span, end)) < self.best - _EPS:
                self.run(max(span, end))
            self.unplace(i, saved)

    def can_complete(self, placed: int, last: int) -> bool:
        """Whether some memory-feasible order completes the set ``placed`` (``last``, just added to
        the current one, on top of self.used); memory depends on the set alone, so each set is
        decided once (each new set counts against the budget)."""
        used = list(self.used)
        for g, _, change in self.effect[last]:
            used[g] += change
        return self._completes(placed, used)

    def _completes(self, placed: int, used: list[int]) -> bool:
        known = self.completes.get(placed)
        if known is not None:
            return known
        self.expansions += 1
        ok = placed == (1 << self.n) - 1
        for i in self.try_order:
            if ok or self.expansions >= self.budget:
                break
            if placed >> i & 1 or self.pred_mask[i] & ~placed \
                    or any(used[g] > room for g, room, _ in self.effect[i]):
                continue
            after = list(used)
            for g, _, change in self.effect[i]:
                after[g] += change
            ok = self._completes(placed | 1 << i, after)
        if not ok and self.expansions >= self.budget:
            self.cut = True
            return True  # undecided: let the search look (it stops at the budget too)
        self.completes[placed] = ok
        return ok

    def place(self, i: int, end: float) -> None:
        self.indeg[i] = -1
        self.placed |= 1 << i
        self.end[i] = end
        self.order.append(i)
        for g, _, change in self.effect[i]:
            self.gpu_end[g] = end
            self.used[g] += change
            self.remaining[g] -= self.durations[i]
        for j in self.succ[i]:
            self.indeg[j] -= 1

    def unplace(self, i: int, saved: list[float]) -> None:
        for j in self.succ[i]:
            self.indeg[j] += 1
        for k, (g, _, change) in enumerate(self.effect[i]):
            self.gpu_end[g] = saved[k]
            self.used[g] -= change
            self.remaining[g] += self.durations[i]
        self.order.pop()
        self.placed &= ~(1 << i)
        self.indeg[i] = 0


def fastest_order(fps: list[Footprint], edges: list[tuple[int, int]], initial_bytes: dict[int, int],
                  capacity: int, durations: list[float], bound: float = float("inf")) -> tuple[int, ...] | None:
    """The memory-feasible topological order with the least makespan, if one is strictly below
    ``bound`` (None otherwise: e.g. the greedy order, whose makespan is the bound, is already optimal).
    After EXACT_BUDGET expansions: the fastest found so far (see the module's docstring)."""
    return search_order(fps, edges, initial_bytes, capacity, durations, bound)[0]


def search_order(fps: list[Footprint], edges: list[tuple[int, int]], initial_bytes: dict[int, int],
                 capacity: int, durations: list[float], bound: float = float("inf"),
                 budget: int = EXACT_BUDGET) -> tuple[tuple[int, ...] | None, bool]:
    """(what fastest_order returns, whether the search completed: the answer is then proven optimal)."""
    search = _Search(fps, edges, initial_bytes, capacity, durations, bound, budget)
    search.run(0.0)
    return search.best_order, not search.cut
