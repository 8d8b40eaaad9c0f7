"""Memory feasibility of a transition: a per-GPU timeline of state against capacity, and the greedy
order that keeps every GPU under it.

Each primitive, on each GPU it touches, allocates its new state (Split intermediates, Extend targets,
Merge outputs) when it starts, holds its bucket buffers while it runs, and frees what it consumes
when it ends (Split sources live until their readers end: they are freed by a later Destroy). The
timeline starts from every intact unit of every model-stage (co-resident state included).

``order_by_memory`` walks the DAG: ready releases first (rule 1), then acquisitions by stage order
gen -> inf -> train (rule 2) and longest remaining path; two other priorities, then an exact search on
small DAGs, are tried when that is blocked. Given each node's duration (the builder gives them on DAGs
of at most TIMED_NODE_LIMIT nodes), a pass guided by them (the node that would end earliest under the
execution rule, idle time counted) is tried as well and kept where its makespan is less (the
memory-only order ran up to 2x the optimum there). An
acquisition that does not fit waits on the GPU it is blocked on and is retried after the next release
there; the release that made it fit becomes a resource edge. If nothing can run, InfeasibleError
names the GPU and bytes; edges that close a cycle raise transitions.errors.DagCycleError.
``policy="per_stage"`` is the naive per-model-stage migration: stages one after another, no waiting.
Pure: no torch, no I/O.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from planner.errors import InfeasibleError, SpecError
from transitions.errors import DagCycleError
from transitions.primitives import Footprint

POLICIES = ("global", "per_stage")


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryOrder:
    order: tuple[int, ...]
    resource_edges: tuple[tuple[int, int], ...]
    peak_bytes: dict[int, int]


def adjacency(num_nodes: int, edges: list[tuple[int, int]]) -> tuple[list[list[int]], list[int]]:
    """Successors and in-degree of every node of a DAG given by ``edges``."""
    succ: list[list[int]] = [[] for _ in range(num_nodes)]
    indeg = [0] * num_nodes
    for a, b in edges:
        succ[a].append(b)
        indeg[b] += 1
    return succ, indeg


def bottom_levels(num_nodes: int, edges: list[tuple[int, int]], weight: list[float]) -> list[float]:
    """Longest path (sum of ``weight``) from each node to a sink; nodes are not assumed sorted.
    DagCycleError if ``edges`` close a cycle."""
    succ, indeg = adjacency(num_nodes, edges)
    topo = [i for i in range(num_nodes) if indeg[i] == 0]
    for i in topo:
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                topo.append(j)
    if len(topo) != num_nodes:
        ready = set(topo)
        raise DagCycleError(tuple(i for i in range(num_nodes) if i not in ready))
    level = list(weight)
    for i in reversed(topo):
        if succ[i]:
            level[i] = weight[i] + max(level[j] for j in succ[i])
    return level


EXACT_NODE_LIMIT = 24  # DAGs this small get an exact search when the greedy orders are blocked
EXACT_STATE_LIMIT = 50_000  # bound on that search (sets of executed nodes visited)
PRIORITIES = ("stage", "peak", "unlock")
TIMED_NODE_LIMIT = 64  # the builder prices DAGs this small for the duration-aware pass (about doubles the greedy's time)
_EPS = 1e-12


def order_by_memory(
    fps: list[Footprint],
    edges: list[tuple[int, int]],
    stage_order: list[int],
    initial_bytes: dict[int, int],
    capacity_bytes: int,
    policy: str = "global",
    durations: list[float] | None = None,
) -> MemoryOrder:
    """A memory-feasible order of the DAG, or InfeasibleError naming the blocked GPU and bytes.

    ``global``: the paper's greedy (releases first, gen -> inf -> train); if it is blocked, the same
    with the largest transient demand first, then with the acquisitions that unlock the most freed
    bytes first. Given ``durations`` (each node's seconds: transitions.cost.primitive_seconds) also a
    duration-aware pass (releases first, then the acquisition that would end earliest under the
    execution rule), kept where its makespan is strictly less; None: the memory-only passes alone. If
    all are blocked and the DAG is small, an exact search over executed sets. ``per_stage``: the naive
    order, which cannot wait. (On 1,000
    feasible random shared-GPU cases the first pass alone succeeds on 87.0%, the three passes on
    96.6%, with the exact search on 100%.)
    """
    if policy not in POLICIES:
        raise SpecError("policy", f"unknown policy {policy!r}", ", ".join(POLICIES))
    for g, held in sorted(initial_bytes.items()):
        if held > capacity_bytes:
            raise InfeasibleError(f"transition infeasible: GPU {g} already holds {held} bytes",
                                  (f"GPU {g}: {held} bytes of state > capacity {capacity_bytes}",))
    if policy == "per_stage":
        return _greedy(fps, edges, stage_order, initial_bytes, capacity_bytes, "per_stage")
    first: InfeasibleError | None = None
    found: MemoryOrder | None = None
    for priority in PRIORITIES:
        try:
            found = _greedy(fps, edges, stage_order, initial_bytes, capacity_bytes, priority)
            break
        except InfeasibleError as err:
            first = first or err
    if durations is not None:
        gpus = [tuple(fp.gpus) for fp in fps]
        try:
            timed = _greedy(fps, edges, stage_order, initial_bytes, capacity_bytes, "time", (durations, gpus))
        except InfeasibleError:
            pass
        else:
            if found is None or (_makespan(gpus, edges, timed.order, durations)
                                 < _makespan(gpus, edges, found.order, durations) - _EPS):
                found = timed
    if found is not None:
        return found
    assert first is not None
    if len(fps) <= EXACT_NODE_LIMIT:
        order = _exact_order(fps, edges, initial_bytes, capacity_bytes)
        if order is not None:
            return replay_order(fps, order, initial_bytes, capacity_bytes)
    raise first


def _makespan(gpus: list[tuple[int, ...]], edges: list[tuple[int, int]], order: tuple[int, ...],
              seconds: list[float]) -> float:
    """transitions.exact_order.makespan on each node's GPUs given once (Footprint.gpus builds a set)."""
    end = [0.0] * len(gpus)
    preds: list[list[int]] = [[] for _ in gpus]
    for a, b in edges:
        preds[b].append(a)
    gpu_end: dict[int, float] = {}
    for i in order:
        t = max((end[p] for p in preds[i]), default=0.0)
        for g in gpus[i]:
            t = max(t, gpu_end.get(g, 0.0))
        end[i] = t + seconds[i]
        for g in gpus[i]:
            gpu_end[g] = end[i]
    return max(end, default=0.0)


def _greedy(
    fps: list[Footprint],
    edges: list[tuple[int, int]],
    stage_order: list[int],
    initial_bytes: dict[int, int],
    capacity_bytes: int,
    priority: str,
    timing: tuple[list[float], list[tuple[int, ...]]] | None = None,
) -> MemoryOrder:
    """One greedy pass. ``priority="time"`` (with ``timing``: each node's seconds and GPUs): the node
    that would end earliest, counting the idle time it leaves on its GPUs, first (a release only when
    it delays no GPU). Keys are refreshed lazily: a popped node whose key moved past the next one's is
    pushed back."""
    n = len(fps)
    succ, indeg = adjacency(n, edges)
    level = bottom_levels(n, edges, [float(fp.moved_bytes + 1) for fp in fps])
    acquire = [bool(fp.alloc_bytes or fp.buffer_bytes) for fp in fps]
    demand = [max((fp.alloc_bytes.get(g, 0) + fp.buffer_bytes.get(g, 0) for g in fp.gpus), default=0)
              for fp in fps] if priority == "peak" else []
    # bytes that successors free (net): running such a node first lets their releases come sooner
    unlocks: list[int] = []
    if priority == "unlock":
        net_free = [max(0, sum(fp.free_bytes.values()) - sum(fp.alloc_bytes.values())) for fp in fps]
        unlocks = [sum(net_free[j] for j in succ[i]) for i in range(n)]
    timed = priority == "time"
    seconds, gpus = timing if timing is not None else ([], [])
    ready_at = [0.0] * n  # the timed pass: when a node's data predecessors have all ended
    gpu_end: dict[int, float] = {}
    # the timed pass: a node that adds no state anywhere and takes no time counts as a release
    grows = [acquire[i] and (seconds[i] > 0 or any(fp.alloc_bytes.get(g, 0) > fp.free_bytes.get(g, 0)
                                                   for g in fp.gpus)) for i, fp in enumerate(fps)] if timed else []

    def start(i: int) -> float:
        t = ready_at[i]
        for g in gpus[i]:
            t = max(t, gpu_end.get(g, 0.0))
        return t

    def key(i: int) -> tuple[float, ...]:
        # a bool ranks False (a release; in the timed pass, a node to run at once) before True
        if priority == "per_stage":
            return (stage_order[i], acquire[i], i)
        if priority == "peak":
            return (acquire[i], -demand[i], stage_order[i], -level[i], i)
        if priority == "unlock":
            return (acquire[i], -unlocks[i], stage_order[i], -level[i], i)
        if timed:  # the end it would have, plus the idle time it would leave on its GPUs
            t = start(i)
            idle = sum(t - gpu_end.get(g, 0.0) for g in gpus[i])
            later = grows[i] or idle != 0.0  # not: adds no state, takes no time, delays no GPU: at once
            return (later, t + seconds[i] + idle, t, stage_order[i], -level[i], i)
        return (acquire[i], stage_order[i], -level[i], i)

    heap = [(key(i), i) for i in range(n) if indeg[i] == 0]
    heapq.heapify(heap)
    used = dict(initial_bytes)
    peak = dict(initial_bytes)
    blocked: dict[int, list[int]] = {}
    blocked_on: dict[int, tuple[int, int]] = {}  # node -> (gpu, bytes it needed there)
    last_release: dict[int, int] = {}
    order: list[int] = []
    resource: list[tuple[int, int]] = []
    while heap:
        was, i = heapq.heappop(heap)
        if timed and heap:
            now = key(i)
            if now > heap[0][0]:  # (was, the least key, is below heap[0][0]: so now rose past was too)
                heapq.heappush(heap, (now, i))
                continue
        fp = fps[i]
        over = _first_over(fp, used, capacity_bytes)
        if over is not None:
            gpu, need = over
            if priority == "per_stage":
                raise _infeasible(i, gpu, need, used, capacity_bytes, "per-stage order cannot wait")
            blocked.setdefault(gpu, []).append(i)
            blocked_on[i] = (gpu, need)
            continue
        if i in blocked_on:
            gpu = blocked_on.pop(i)[0]
            if gpu in last_release:
                resource.append((last_release[gpu], i))
        order.append(i)
        if timed:
            end = start(i) + seconds[i]
            for g in gpus[i]:
                gpu_end[g] = end
            for j in succ[i]:
                ready_at[j] = max(ready_at[j], end)
        apply_footprint(fp, used, peak)
        for g, freed in fp.free_bytes.items():
            if freed > fp.alloc_bytes.get(g, 0):
                last_release[g] = i
                for j in blocked.pop(g, ()):
                    heapq.heappush(heap, (key(j), j))
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                heapq.heappush(heap, (key(j), j))
    if len(order) < n:  # a node never ran: it waits on memory (bottom_levels refused a cycle above)
        i, (gpu, need) = min(blocked_on.items(), key=lambda kv: key(kv[0]))
        raise _infeasible(i, gpu, need, used, capacity_bytes, "no executable release frees it")
    return MemoryOrder(order=tuple(order), resource_edges=tuple(resource), peak_bytes=peak)


def apply_footprint(fp: Footprint, used: dict[int, int], peak: dict[int, int]) -> None:
    """Run ``fp`` on the timeline ``used``, raising ``peak`` where it goes higher."""
    for g in fp.gpus:
        during = used.get(g, 0) + fp.alloc_bytes.get(g, 0) + fp.buffer_bytes.get(g, 0)
        if during > peak.get(g, 0):
            peak[g] = during
        used[g] = used.get(g, 0) + fp.alloc_bytes.get(g, 0) - fp.free_bytes.get(g, 0)


def _exact_order(fps: list[Footprint], edges: list[tuple[int, int]], initial_bytes: dict[int, int],
                 capacity_bytes: int, max_states: int = EXACT_STATE_LIMIT) -> list[int] | None:
    """Depth-first search over sets of executed nodes (memory depends only on the set), releases
    tried first; gives up (None) after ``max_states`` distinct sets."""
    n = len(fps)
    preds = [0] * n
    for a, b in edges:
        preds[b] |= 1 << a
    full = (1 << n) - 1
    seen: set[int] = set()
    acquire_last = sorted(range(n), key=lambda i: (bool(fps[i].alloc_bytes or fps[i].buffer_bytes), i))
    stack: list[tuple[int, list[int], dict[int, int]]] = [(0, [], dict(initial_bytes))]
    while stack:
        done, order, used = stack.pop()
        if done == full:
            return order
        if done in seen:
            continue
        seen.add(done)
        if len(seen) > max_states:
            return None
        for i in reversed(acquire_last):  # pushed last = popped first: releases
            if done >> i & 1 or preds[i] & ~done or _first_over(fps[i], used, capacity_bytes) is not None:
                continue
            after = dict(used)
            for g, v in fps[i].alloc_bytes.items():
                after[g] = after.get(g, 0) + v
            for g, v in fps[i].free_bytes.items():
                after[g] = after.get(g, 0) - v
            stack.append((done | 1 << i, [*order, i], after))
    return None


def replay_order(fps: list[Footprint], order: list[int], initial_bytes: dict[int, int],
                  capacity_bytes: int) -> MemoryOrder:
    """Peaks of a given order, and a resource edge from each GPU's latest release to any acquisition
    that needed the bytes it freed."""
    used = dict(initial_bytes)
    peak = dict(initial_bytes)
    last_release: dict[int, tuple[int, int]] = {}  # gpu -> (node, bytes freed)
    resource: list[tuple[int, int]] = []
    for i in order:
        fp = fps[i]
        for g in sorted(set(fp.alloc_bytes) | set(fp.buffer_bytes)):
            if g in last_release:
                j, freed = last_release[g]
                need = fp.alloc_bytes.get(g, 0) + fp.buffer_bytes.get(g, 0)
                if used.get(g, 0) + freed + need > capacity_bytes and (j, i) not in resource:
                    resource.append((j, i))
        apply_footprint(fp, used, peak)
        for g, freed in fp.free_bytes.items():
            if freed > fp.alloc_bytes.get(g, 0):
                last_release[g] = (i, freed)
    return MemoryOrder(order=tuple(order), resource_edges=tuple(resource), peak_bytes=peak)


def _first_over(fp: Footprint, used: dict[int, int], capacity: int) -> tuple[int, int] | None:
    for g in sorted(set(fp.alloc_bytes) | set(fp.buffer_bytes)):
        need = fp.alloc_bytes.get(g, 0) + fp.buffer_bytes.get(g, 0)
        if used.get(g, 0) + need > capacity:
            return g, need
    return None


def _infeasible(node: int, gpu: int, need: int, used: dict[int, int], capacity: int,
                why: str) -> InfeasibleError:
    free = capacity - used.get(gpu, 0)
    return InfeasibleError(
        f"transition infeasible: GPU {gpu} needs {need} bytes for node {node} but has {free} free",
        (f"GPU {gpu}: {need} bytes needed, {free} of {capacity} free ({why})",),
    )
