"""The makespan-optimal memory-feasible order of a small transition DAG (branch and bound). Pure.

The greedy order (transitions.feasibility) is chosen on memory alone; on small DAGs it can be far
from the fastest (a 6-node instance ran 2x the optimum). For DAGs of at most ``EXACT_MAKESPAN_NODES``
nodes the builder (transitions.global_dag) searches every memory-feasible topological order under
the execution rule the cost model schedules by (transitions.cost.schedule: a node starts once its
data predecessors and the previous node on each of its GPUs have ended; each GPU runs its nodes one
at a time, in order, so its memory follows the checked timeline) and keeps the greedy order unless
another one is strictly faster. Bounded: a branch stops once its makespan, or any GPU's busy time
still to come, reaches the best found.
"""

from __future__ import annotations

from transitions.primitives import Footprint

EXACT_MAKESPAN_NODES = 7  # 7! = 5,040 orders at most, before pruning: a few ms in the worst case
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
    """One branch-and-bound search; ``best`` holds the fastest order found below the bound."""

    def __init__(self, fps: list[Footprint], edges: list[tuple[int, int]], initial_bytes: dict[int, int],
                 capacity: int, durations: list[float], bound: float) -> None:
        n = len(fps)
        self.fps, self.durations, self.capacity = fps, durations, capacity
        self.gpus = [tuple(sorted(fp.gpus)) for fp in fps]
        self.need = [{g: fp.alloc_bytes.get(g, 0) + fp.buffer_bytes.get(g, 0) for g in self.gpus[i]}
                     for i, fp in enumerate(fps)]
        self.delta = [{g: fp.alloc_bytes.get(g, 0) - fp.free_bytes.get(g, 0) for g in self.gpus[i]}
                      for i, fp in enumerate(fps)]
        self.preds: list[list[int]] = [[] for _ in range(n)]
        self.succ: list[list[int]] = [[] for _ in range(n)]
        self.indeg = [0] * n
        for a, b in edges:
            self.preds[b].append(a)
            self.succ[a].append(b)
            self.indeg[b] += 1
        self.used = dict(initial_bytes)
        self.end = [0.0] * n
        self.gpu_end: dict[int, float] = {}
        self.remaining: dict[int, float] = {}  # per GPU: the durations of its nodes not yet placed
        for i in range(n):
            for g in self.gpus[i]:
                self.remaining[g] = self.remaining.get(g, 0.0) + durations[i]
        self.order: list[int] = []
        self.best = bound
        self.best_order: tuple[int, ...] | None = None

    def fits(self, i: int) -> bool:
        return all(self.used.get(g, 0) + need <= self.capacity for g, need in self.need[i].items())

    def run(self, span: float) -> None:
        n = len(self.fps)
        if len(self.order) == n:
            if span < self.best - _EPS:
                self.best, self.best_order = span, tuple(self.order)
            return
        for i in range(n):
            if self.indeg[i] != 0 or not self.fits(i):
                continue
            start = max((self.end[p] for p in self.preds[i]), default=0.0)
            for g in self.gpus[i]:
                start = max(start, self.gpu_end.get(g, 0.0))
            end = start + self.durations[i]
            if max(span, end) >= self.best - _EPS:
                continue
            saved = [(g, self.gpu_end.get(g), self.used.get(g, 0)) for g in self.gpus[i]]
            self.place(i, end)
            if all(self.gpu_end.get(g, 0.0) + self.remaining[g] < self.best - _EPS for g in self.remaining):
                self.run(max(span, end))
            self.unplace(i, saved)

    def place(self, i: int, end: float) -> None:
        self.indeg[i] = -1
        self.end[i] = end
        self.order.append(i)
        for g in self.gpus[i]:
            self.gpu_end[g] = end
            self.used[g] = self.used.get(g, 0) + self.delta[i][g]
            self.remaining[g] -= self.durations[i]
        for j in self.succ[i]:
            self.indeg[j] -= 1

    def unplace(self, i: int, saved: list[tuple[int, float | None, int]]) -> None:
        for j in self.succ[i]:
            self.indeg[j] += 1
        for g, gpu_end, used in saved:
            if gpu_end is None:
                self.gpu_end.pop(g, None)
            else:
                self.gpu_end[g] = gpu_end
            self.used[g] = used
            self.remaining[g] += self.durations[i]
        self.order.pop()
        self.indeg[i] = 0


def fastest_order(fps: list[Footprint], edges: list[tuple[int, int]], initial_bytes: dict[int, int],
                  capacity: int, durations: list[float], bound: float = float("inf")) -> tuple[int, ...] | None:
    """The memory-feasible topological order with the least makespan, if one is strictly below
    ``bound`` (None otherwise: e.g. the greedy order, whose makespan is the bound, is already optimal)."""
    search = _Search(fps, edges, initial_bytes, capacity, durations, bound)
    search.run(0.0)
    return search.best_order
