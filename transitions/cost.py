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

from planner.hardware import ClusterSpec
from transitions.global_dag import TransitionDAG
from transitions.primitives import Footprint

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


def transition_cost(dag: TransitionDAG, cluster: ClusterSpec,
                    communicator_setup_s: float = DEFAULT_COMMUNICATOR_SETUP_S) -> TransitionCost:
    """L_tran of ``dag`` on ``cluster`` with its bytes moved and critical path."""
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
