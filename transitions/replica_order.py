"""Edges between replica classes and their memory order, over arrays. Pure.

``link`` derives one model-stage's unit-level data edges (global_dag.data_edges' rules) over the
classes' member arrays and lifts them to edges between classes; ``class_order`` orders the classes
greedily (release before acquire, gen -> inf -> train, longest path), checking each class against
capacity on every GPU at once.
"""

from __future__ import annotations

import heapq

import numpy as np

from transitions.errors import DagCycleError
from transitions.feasibility import adjacency, bottom_levels
from transitions.primitives import PrimitiveKind
from transitions.replica_plan import ReplicaClass, ReplicaStage


def _edges(st: ReplicaStage, mine: list[ReplicaClass]) -> tuple[np.ndarray, np.ndarray]:
    """Unit-level data edges of one model-stage (stage-local node ids): producer before reader,
    readers and producer before the node that frees a unit (global_dag.data_edges' rules, over arrays)."""
    dc = len(st.cur)
    destroy_node = np.full(dc, -1, dtype=np.int64)
    merge_node = np.full(len(st.tgt), -1, dtype=np.int64)
    kept_into = np.full(dc, -1, dtype=np.int64)  # merge node freeing a kept unit
    for c in mine:
        ids = np.arange(c.first, c.first + c.size)
        if c.kind is PrimitiveKind.DESTROY:
            destroy_node[c.unit] = ids
        elif c.kind is PrimitiveKind.MERGE:
            merge_node[c.unit] = ids
            neg = c.refs < 0
            kept_into[-1 - c.refs[neg]] = np.broadcast_to(ids[:, None], c.refs.shape)[neg]
    freer = np.where(destroy_node >= 0, destroy_node, kept_into)  # who frees each current unit
    src: list[np.ndarray] = []
    dst: list[np.ndarray] = []
    for c in mine:
        ids = np.arange(c.first, c.first + c.size)
        if c.kind is PrimitiveKind.EXTEND:
            f = freer[c.refs]
            src.append(np.broadcast_to(ids[:, None], f.shape)[f >= 0])
            dst.append(f[f >= 0])
            if st.nq > 1:
                src.append(ids)
                dst.append(merge_node[c.unit // st.nq])
        elif c.kind is PrimitiveKind.SPLIT:
            f = freer[c.unit]
            src.append(ids[f >= 0])
            dst.append(f[f >= 0])
            if st.nq > 1:
                src.append(np.repeat(ids, c.refs.shape[1]))
                dst.append(merge_node[c.refs.ravel() // st.nq])
    if not src:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(src), np.concatenate(dst)


def link(st: ReplicaStage, mine: list[ReplicaClass]) -> list[tuple[int, int]] | None:
    """Each class's data predecessors per member (``preds``) and the edges between classes; None if
    members of one class would depend on each other (not a block)."""
    src, dst = _edges(st, mine)
    num = sum(c.size for c in mine)
    if len(dst) and (dst.min() < 0 or dst.max() >= num):  # checked before node ids index node_class
        return None
    node_class = np.repeat(np.arange(len(mine)), [c.size for c in mine])
    pairs = np.unique(node_class[src] * len(mine) + node_class[dst])
    edges = [(int(p) // len(mine), int(p) % len(mine)) for p in pairs]
    if any(x == y for x, y in edges):
        return None
    order = np.argsort(dst, kind="stable")
    src, dst = src[order], dst[order]
    for c in mine:
        lo, hi = np.searchsorted(dst, [c.first, c.first + c.size])
        d, p = dst[lo:hi] - c.first, src[lo:hi]
        counts = np.bincount(d, minlength=c.size)  # one per member (a class has at least one)
        preds = np.full((c.size, int(counts.max())), -1, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        preds[d, np.arange(len(d)) - starts[d]] = p
        c.preds = preds
    return edges


def class_order(classes: list[ReplicaClass], edges: list[tuple[int, int]], initial: np.ndarray,
                capacity: int) -> list[int] | None:
    """Greedy class order (global_dag's rules), each class checked on every GPU; None if blocked."""
    n = len(classes)
    succ, indeg = adjacency(n, edges)
    try:  # classes only lead from Split/Extend to Merge/Destroy, so this cannot close a cycle; if it
        # ever did, the per-unit path (whose DAG is finer) decides
        level = bottom_levels(n, edges, [float(c.canon.moved_bytes + 1) for c in classes])
    except DagCycleError:
        return None
    heap = [((int(c.acquire), c.stage_order, -level[i], i), i) for i, c in enumerate(classes) if indeg[i] == 0]
    heapq.heapify(heap)
    used = initial.copy()
    order: list[int] = []
    while heap:
        _, i = heapq.heappop(heap)
        c = classes[i]
        if len(c.touched):
            g = c.g
            if c.single:
                if c.acquire and (used[g] + (c.alloc + c.buf) > capacity).any():
                    return None
                used[g] += c.delta
            else:  # members sharing a GPU run one after another: bound by all their allocations
                if c.acquire:
                    total = used.copy()
                    np.add.at(total, g, np.broadcast_to(c.alloc, g.shape))
                    most = np.zeros_like(used)
                    np.maximum.at(most, g, np.broadcast_to(c.buf, g.shape))
                    if (total + most > capacity).any():
                        return None
                np.add.at(used, g, np.broadcast_to(c.delta, g.shape))
        order.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                d = classes[j]
                heapq.heappush(heap, ((int(d.acquire), d.stage_order, -level[j], j), j))
    return order if len(order) == n else None
