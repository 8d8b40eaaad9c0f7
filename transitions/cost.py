"""Transition cost L_tran: the makespan of a DAG's schedule, from bytes and links.

Each primitive's duration: communicator set-up (when it moves bytes between GPUs) plus, on its
slowest GPU, the time to push what that GPU sends and to take what it receives through its own link
(per-GPU contention: a GPU's sends to several peers share its port; intra-node pairs use the
intra-node link, others the inter-node link, ClusterSpec.link_between), plus local copies at HBM speed.
Start times follow the execution rule of transitions.global_dag: data and resource edges, and each GPU
runs the primitives touching it one at a time in ``order``. L_tran is the latest end; the critical path
is the chain of whatever held each primitive back. Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.hardware import ClusterSpec
from transitions.global_dag import TransitionDAG
from transitions.primitives import Footprint
from transitions.replica_classes import ReplicaClass, ReplicaPlan

# NCCL communicator creation for a transition's new rank pairs: tens of ms at small scale; used
# once per primitive that moves bytes (its communicators are created in parallel).
DEFAULT_COMMUNICATOR_SETUP_S = 0.02


@dataclass(frozen=True, kw_only=True, slots=True)
class TransitionCost:
    seconds: float
    bytes_moved: int
    intra_node_bytes: int
    inter_node_bytes: int
    critical_path: tuple[int, ...]  # node ids, first to last
    start_s: tuple[float, ...]  # per node
    end_s: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "bytes_moved": self.bytes_moved,
                "intra_node_bytes": self.intra_node_bytes, "inter_node_bytes": self.inter_node_bytes,
                "critical_path": list(self.critical_path)}


def primitive_seconds(fp: Footprint, cluster: ClusterSpec, setup_s: float) -> float:
    send: dict[int, float] = {}
    recv: dict[int, float] = {}
    for (s, d), nbytes in fp.pair_bytes.items():
        link = cluster.link_between(s, d)
        t = nbytes / link.bytes_per_s + link.latency_s
        send[s] = send.get(s, 0.0) + t
        recv[d] = recv.get(d, 0.0) + t
    hbm = cluster.device.hbm_bytes_per_s
    slowest = 0.0
    for g in fp.gpus:
        t = max(send.get(g, 0.0), recv.get(g, 0.0)) + 2.0 * fp.local_bytes.get(g, 0) / hbm
        slowest = max(slowest, t)
    return slowest + (setup_s if fp.pair_bytes else 0.0)


def schedule(dag: TransitionDAG, durations: list[float]) -> tuple[list[float], list[float], list[int]]:
    """(start, end, what held each node back: a predecessor id or -1) under the execution rule."""
    n = len(dag.nodes)
    preds: list[list[int]] = [[] for _ in range(n)]
    for a, b in (*dag.data_edges, *dag.resource_edges):
        preds[b].append(a)
    start = [0.0] * n
    end = [0.0] * n
    held_by = [-1] * n
    gpu_last: dict[int, int] = {}
    for i in dag.order:
        t, by = 0.0, -1
        for p in preds[i]:
            if end[p] > t:
                t, by = end[p], p
        for g in dag.footprints[i].gpus:
            j = gpu_last.get(g)
            if j is not None and end[j] > t:
                t, by = end[j], j
            gpu_last[g] = i
        start[i], end[i], held_by[i] = t, t + durations[i], by
    return start, end, held_by


def _class_seconds(c: ReplicaClass, cluster: ClusterSpec, setup_s: float) -> tuple[np.ndarray, int, int]:
    """primitive_seconds of every member of a replica class (the links depend on where its members
    sit), and its intra- and inter-node bytes."""
    fp = c.canon
    labels = c.gpus.shape[1]
    local = np.zeros(labels)
    for g, v in fp.local_bytes.items():
        local[g] = 2.0 * v / cluster.device.hbm_bytes_per_s
    touched = c.touched
    if not fp.pair_bytes:
        if not len(touched):
            return np.zeros(c.size), 0, 0
        return np.broadcast_to(local[touched].max(), (c.size,)).copy(), 0, 0
    pairs = list(fp.pair_bytes.items())
    src = np.array([s for (s, _), _ in pairs], dtype=np.int64)
    dst = np.array([d for (_, d), _ in pairs], dtype=np.int64)
    nbytes = np.array([b for _, b in pairs], dtype=np.float64)
    per_node = cluster.gpus_per_node
    intra = c.gpus[:, src] // per_node == c.gpus[:, dst] // per_node
    fast, slow = cluster.intra_node_link, cluster.inter_node_link
    t = np.where(intra, nbytes / fast.bytes_per_s + fast.latency_s, nbytes / slow.bytes_per_s + slow.latency_s)
    send = np.zeros((c.size, labels))
    recv = np.zeros((c.size, labels))
    for k in range(len(pairs)):  # pairs of one shape: a handful
        send[:, src[k]] += t[:, k]
        recv[:, dst[k]] += t[:, k]
    per_gpu = np.maximum(send, recv) + local
    intra_bytes = int((intra * nbytes).sum())
    return per_gpu[:, touched].max(axis=1) + setup_s, intra_bytes, int(nbytes.sum()) * c.size - intra_bytes


def replica_schedule(plan: ReplicaPlan, cluster: ClusterSpec, setup_s: float
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """``schedule`` over replica classes: (start, end, held back by, intra bytes, inter bytes) per node.

    Members of a class run back to back in the DAG's order; a member starts when its GPUs are free
    (each GPU runs one primitive at a time) and its data predecessors have ended, as in ``schedule``.
    """
    n = plan.num_nodes
    start = np.zeros(n)
    end = np.zeros(n)
    held = np.full(n, -1, dtype=np.int64)
    gpu_end = np.zeros(cluster.num_gpus)
    gpu_last = np.full(cluster.num_gpus, -1, dtype=np.int64)
    node_class = plan.node_class()
    into = node_class[plan.edge_dst]
    intra = inter = 0
    for k in plan.class_order:
        c = plan.classes[k]
        ids = np.arange(c.first_node, c.first_node + c.size)
        dur, a, b = _class_seconds(c, cluster, setup_s)
        intra += a
        inter += b
        t = np.zeros(c.size)
        by = np.full(c.size, -1, dtype=np.int64)
        sel = np.flatnonzero(into == k)
        if len(sel):  # data predecessors: latest end per member
            src, dst = plan.edge_src[sel], plan.edge_dst[sel] - c.first_node
            pe = end[src]
            last = np.lexsort((pe, dst))
            dst_s, src_s, pe_s = dst[last], src[last], pe[last]
            tail = np.append(dst_s[1:] != dst_s[:-1], True)
            t[dst_s[tail]] = pe_s[tail]
            by[dst_s[tail]] = np.where(pe_s[tail] > 0, src_s[tail], -1)
        if not len(c.touched):
            start[ids], end[ids], held[ids] = t, t + dur, by
            continue
        g = c.gpus[:, c.touched]
        if c.single:
            ge = gpu_end[g]
            j = ge.argmax(axis=1)
            tg = ge[np.arange(c.size), j]
            later = tg > t
            by = np.where(later, gpu_last[g][np.arange(c.size), j], by)
            t = np.maximum(t, tg)
            start[ids], end[ids], held[ids] = t, t + dur, by
            gpu_end[g] = (t + dur)[:, None]
            gpu_last[g] = ids[:, None]
            continue
        for m in range(c.size):  # members sharing GPUs: one after another
            row = g[m]
            j = int(gpu_end[row].argmax())
            if gpu_end[row[j]] > t[m]:
                t[m], by[m] = gpu_end[row[j]], gpu_last[row[j]]
            start[ids[m]], end[ids[m]], held[ids[m]] = t[m], t[m] + dur[m], by[m]
            gpu_end[row] = t[m] + dur[m]
            gpu_last[row] = ids[m]
    return start, end, held, intra, inter


def _replica_cost(plan: ReplicaPlan, cluster: ClusterSpec, setup_s: float) -> TransitionCost:
    start, end, held_by, intra, inter = replica_schedule(plan, cluster, setup_s)
    path: list[int] = []
    if len(end):
        i = int(end.argmax())  # the first node with the latest end, as below
        while i != -1:
            path.append(i)
            i = int(held_by[i])
    return TransitionCost(seconds=float(end.max()) if len(end) else 0.0, bytes_moved=intra + inter,
                          intra_node_bytes=intra, inter_node_bytes=inter, critical_path=tuple(reversed(path)),
                          start_s=tuple(start.tolist()), end_s=tuple(end.tolist()))


def transition_cost(dag: TransitionDAG, cluster: ClusterSpec,
                    communicator_setup_s: float = DEFAULT_COMMUNICATOR_SETUP_S) -> TransitionCost:
    """L_tran of ``dag`` on ``cluster`` with its bytes moved and critical path."""
    if dag.replicas is not None:
        return _replica_cost(dag.replicas, cluster, communicator_setup_s)
    durations = [primitive_seconds(fp, cluster, communicator_setup_s) for fp in dag.footprints]
    start, end, held_by = schedule(dag, durations)
    intra = inter = 0
    for fp in dag.footprints:
        for (s, d), nbytes in fp.pair_bytes.items():
            if cluster.node_of(s) == cluster.node_of(d):
                intra += nbytes
            else:
                inter += nbytes
    path: list[int] = []
    if dag.nodes:
        i = max(range(len(end)), key=lambda k: (end[k], -k))
        while i != -1:
            path.append(i)
            i = held_by[i]
    return TransitionCost(seconds=max(end, default=0.0), bytes_moved=intra + inter, intra_node_bytes=intra,
                          inter_node_bytes=inter, critical_path=tuple(reversed(path)), start_s=tuple(start),
                          end_s=tuple(end))
