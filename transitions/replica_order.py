"""Edges between replica classes and their memory order, over arrays. Pure.

``link`` derives one model-stage's unit-level data edges (global_dag.data_edges' rules) over the
classes' member arrays and lifts them to edges between classes; ``order_classes`` orders the classes
greedily as transitions.feasibility orders units (release before acquire, gen -> inf -> train, longest
path; a class that does not fit waits for a release on a GPU it is over on, its members' resource
edges recorded; a blocked pass retried with the largest demand first, then the most freed by
successors first), checking each class against capacity on every GPU at once. ``batched`` splits a
class whose members share a GPU into batches that share none (used after a loss).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

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
    node_ids = [np.arange(c.first, c.first + c.size) for c in mine]
    for c, ids in zip(mine, node_ids, strict=True):
        if c.kind is PrimitiveKind.DESTROY:
            destroy_node[c.unit] = ids
        elif c.kind is PrimitiveKind.MERGE:
            merge_node[c.unit] = ids
            neg = c.refs < 0
            if neg.any():
                kept_into[-1 - c.refs[neg]] = np.broadcast_to(ids[:, None], c.refs.shape)[neg]
    freer = np.where(destroy_node >= 0, destroy_node, kept_into)  # who frees each current unit
    src: list[np.ndarray] = []
    dst: list[np.ndarray] = []
    for c, ids in zip(mine, node_ids, strict=True):
        if c.kind is PrimitiveKind.EXTEND:
            f = freer[c.refs]
            freed = f >= 0
            if freed.all():  # every source freed by someone (the usual case): no mask
                src.append(np.repeat(ids, f.shape[1]))
                dst.append(f.ravel())
            else:
                src.append(np.broadcast_to(ids[:, None], f.shape)[freed])
                dst.append(f[freed])
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
    if not mine:
        return []
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
    bounds = np.searchsorted(dst, [c.first for c in mine] + [num]).tolist()
    counts = np.bincount(dst, minlength=num)  # per node: its predecessors
    for k, c in enumerate(mine):
        lo, hi = bounds[k], bounds[k + 1]
        mine_counts = counts[c.first:c.first + c.size]
        most = int(mine_counts.max())  # a class has at least one member
        if most == int(mine_counts.min()):  # as many per member: they come member by member, in order
            c.preds = src[lo:hi].reshape(c.size, most)
            continue
        d, p = dst[lo:hi] - c.first, src[lo:hi]
        preds = np.full((c.size, most), -1, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(mine_counts)[:-1]])
        preds[d, np.arange(len(d)) - starts[d]] = p
        c.preds = preds
    return edges


PASSES = ("stage", "peak", "unlock")  # transitions.feasibility.PRIORITIES, over classes


@dataclass(frozen=True, kw_only=True, slots=True)
class ClassOrder:
    """A checked class order and the resource edges its waits leave: (the member that last released
    on a GPU, a member that waited on that GPU), global node ids, as the per-unit greedy records them."""

    order: list[int]
    resource_edges: list[tuple[int, int]]


def class_order(classes: list[ReplicaClass], edges: list[tuple[int, int]], initial: np.ndarray,
                capacity: int) -> list[int] | None:
    """``order_classes``' order (None if every pass is blocked)."""
    found = order_classes(classes, edges, initial, capacity, [c.first for c in classes])
    return None if found is None else found.order


def order_classes(classes: list[ReplicaClass], edges: list[tuple[int, int]], initial: np.ndarray,
                  capacity: int, first: list[int]) -> ClassOrder | None:
    """Greedy class order (transitions.feasibility's rules), each class checked on every GPU: releases
    first, then by stage order and longest path; a class that does not fit waits until a class that
    releases on a GPU it is over on has run. If that pass is blocked, the same with the largest
    transient demand first, then with the classes whose successors free the most first (feasibility's
    three passes). None if all are blocked (the per-unit path decides). ``first``: each class's global
    node id of member 0, for the resource edges."""
    n = len(classes)
    succ, indeg = adjacency(n, edges)
    try:  # classes only lead from Split/Extend to Merge/Destroy, so this cannot close a cycle; if it
        # ever did, the per-unit path (whose DAG is finer) decides
        level = bottom_levels(n, edges, [float(c.canon.moved_bytes + 1) for c in classes])
    except DagCycleError:
        return None
    for priority in PASSES:
        done = _greedy(classes, succ, indeg, _keys(classes, level, priority), initial, capacity)
        if done is not None:
            order, waited = done
            return ClassOrder(order=order, resource_edges=_resource_edges(classes, order, waited, first,
                                                                          len(initial)))
    return None


def _keys(classes: list[ReplicaClass], level: list[float], priority: str) -> list[tuple[float, ...]]:
    """Each class's heap key (a bool ranks False, a release, first), as feasibility._greedy's per node."""
    if priority == "stage":
        return [(int(c.acquire), c.stage_order, -level[i], i) for i, c in enumerate(classes)]
    if priority == "peak":
        demand = [int((c.alloc + c.buf).max()) if len(c.touched) else 0 for c in classes]
        return [(int(c.acquire), -demand[i], c.stage_order, -level[i], i) for i, c in enumerate(classes)]
    unlocks = _unlocks(classes)
    return [(int(c.acquire), -unlocks[i], c.stage_order, -level[i], i) for i, c in enumerate(classes)]


def _unlocks(classes: list[ReplicaClass]) -> list[float]:
    """Per class, what its members' successors free net (feasibility's ``unlocks``), per member."""
    out = np.zeros(len(classes))
    by_stage: dict[str, list[int]] = {}
    for k, c in enumerate(classes):
        by_stage.setdefault(c.stage, []).append(k)
    for ks in by_stage.values():
        firsts = np.array([classes[k].first for k in ks])
        for j in ks:
            c = classes[j]
            net = max(0, -int(c.delta.sum()))  # what one member frees, less what it allocates
            if not net or not c.preds.shape[1]:
                continue
            rows = np.broadcast_to(np.arange(c.size)[:, None], c.preds.shape)
            ok = c.preds >= 0
            pred = np.unique(np.stack((rows[ok], c.preds[ok]), axis=1), axis=0)[:, 1]  # once per member
            owner = np.searchsorted(firsts, pred, side="right") - 1
            np.add.at(out, np.array(ks)[owner], float(net))
    return [float(out[k]) / classes[k].size for k in range(len(classes))]


def _greedy(classes: list[ReplicaClass], succ: list[list[int]], indeg0: list[int], keys: list[tuple[float, ...]],
            initial: np.ndarray, capacity: int) -> tuple[list[int], dict[int, np.ndarray]] | None:
    """One pass: (order, per class that waited: each member's GPU it was last blocked on, -1 none)."""
    indeg = list(indeg0)
    heap = [(keys[i], i) for i in range(len(classes)) if indeg[i] == 0]
    heapq.heapify(heap)
    used = initial.copy()
    order: list[int] = []
    parked: dict[int, np.ndarray] = {}  # class -> the GPUs it does not fit on
    waited: dict[int, np.ndarray] = {}
    while heap:
        _, i = heapq.heappop(heap)
        c = classes[i]
        if len(c.touched):
            g = c.g
            if c.acquire:
                blocked = _blocked(c, used, capacity)
                if blocked is not None:
                    parked[i], waited[i] = blocked
                    continue
            if c.single:
                used[g] += c.delta
            else:
                np.add.at(used, g, np.broadcast_to(c.delta, g.shape))
            if parked:  # a class waiting on a GPU this one released on is tried again
                freed = g[:, c.delta < 0]
                for j in [j for j, over in parked.items() if np.isin(over, freed).any()]:
                    del parked[j]
                    heapq.heappush(heap, (keys[j], j))
        order.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                heapq.heappush(heap, (keys[j], j))
    return (order, waited) if len(order) == len(classes) else None


def _blocked(c: ReplicaClass, used: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray] | None:
    """None if ``c`` fits on every GPU; else (the GPUs it is over on, each member's first such GPU or -1).
    Members sharing a GPU run one after another: bound by all their allocations and the largest buffer."""
    g = c.g
    need = c.alloc + c.buf
    if c.single:
        over = used[g] + need > capacity
        if not over.any():
            return None
    else:
        total = used.copy()
        np.add.at(total, g, np.broadcast_to(c.alloc, g.shape))
        most = np.zeros_like(used)
        np.maximum.at(most, g, np.broadcast_to(c.buf, g.shape))
        over_gpu = total + most > capacity
        if not over_gpu.any():
            return None
        over = over_gpu[g] & (need > 0)
    big = len(used)
    first = np.where(over, g, big).min(axis=1)
    return np.unique(g[over]), np.where(first < big, first, -1)


def _resource_edges(classes: list[ReplicaClass], order: list[int], waited: dict[int, np.ndarray],
                    first: list[int], n_gpus: int) -> list[tuple[int, int]]:
    """Replays ``order``: each member that waited, from the member that last released on the GPU it
    waited on (a member frees more than it allocates there) when it runs, as feasibility._greedy does."""
    if not waited:
        return []
    last = np.full(n_gpus, -1)
    out: list[tuple[int, int]] = []
    for k in order:
        c = classes[k]
        ids = first[k] + np.arange(c.size)
        gpu = waited.get(k)
        if gpu is not None:
            waits = np.flatnonzero(gpu >= 0)
            src = last[gpu[waits]]
            keep = src != -1
            out += [(a, b) for a, b in np.stack((src[keep], ids[waits][keep]), axis=1).tolist()]
        rel = c.delta < 0
        if not rel.any():
            continue
        if c.single:
            last[c.g[:, rel]] = ids[:, None]
        else:
            for member, row in enumerate(c.g[:, rel]):  # one after another: the last one on a GPU stays
                last[row] = ids[member]
    return out


def batched(mine: list[ReplicaClass]) -> list[ReplicaClass]:
    """Each class whose members share a GPU split into batches of members that share none (first fit in
    member order), each batch a class of its own, so that a batch runs at once instead of its members
    one after another; the stage's node ids renumbered in the new class order."""
    out: list[ReplicaClass] = []
    for c in mine:
        if c.single:
            out.append(c)
            continue
        taken: list[set[int]] = []
        members: list[list[int]] = []
        for m, row in enumerate(c.g.tolist()):
            for b, gpus in enumerate(taken):
                if gpus.isdisjoint(row):
                    gpus.update(row)
                    members[b].append(m)
                    break
            else:
                taken.append(set(row))
                members.append([m])
        for batch in members:
            idx = np.array(batch)
            part = ReplicaClass(kind=c.kind, stage=c.stage, stage_order=c.stage_order, canon=c.canon,
                                gpus=c.gpus[idx], unit=c.unit[idx], refs=c.refs[idx], touched=c.touched,
                                shape=c.shape)
            part._finish()
            out.append(part)
    first = 0
    for c in out:
        c.first = first
        first += c.size
    return out
