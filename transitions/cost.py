"""Transition cost L_tran: the makespan of a DAG's schedule, from bytes and links.

Each primitive's duration: communicator set-up (when it moves bytes between GPUs) plus, on its
slowest GPU, the time to push what that GPU sends and to take what it receives through its own link
(per-GPU contention: a GPU's sends to several peers share its port; intra-node pairs use the
intra-node link, others the inter-node link, ClusterSpec.link_between), plus local copies at HBM speed.
Start times follow the execution rule of transitions.global_dag: data and resource edges, and each GPU
runs the primitives touching it one at a time in ``order``. L_tran is the latest end; the critical path
is the chain of whatever held each primitive back. A DAG planned over replica classes
(transitions.replica_classes) is scheduled class by class with numpy over all members at once, with
the same start and end times as the unit-level schedule of its order. Pure: no torch, no I/O.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.hardware import ClusterSpec
from transitions.global_dag import TransitionDAG
from transitions.primitives import Footprint
from transitions.replica_classes import ReplicaClass, ReplicaPlan
from transitions.replica_plan import ClassShape, class_shape

# NCCL communicator creation for a transition's new rank pairs: tens of ms at small scale; used
# once per primitive that moves bytes (its communicators are created in parallel).
DEFAULT_COMMUNICATOR_SETUP_S = 0.02


@dataclass(frozen=True, kw_only=True, slots=True)
class FixedCosts:
    """What a transition costs besides its bytes (opt-in: ``transition_cost(..., fixed=...)``).

    - ``communicator_per_peer_s``: each new communicator a GPU joins, created one after another in that
      GPU's process (ncclCommInitRank blocks): a primitive's set-up is this times the most peers any of
      its GPUs talks to (instead of one ``communicator_setup_s`` for the whole primitive);
    - ``allocation_bytes_per_s``: receivers map fresh buffers for what they receive (page mapping and
      first touch), per GPU, before the bytes land;
    - ``generation_reform_s``: once per transition, forming the new data-channel generation (TCPStore
      rendezvous, the world communicator) after the last primitive.
    Fitted per job from measured transitions by planner.transition_calibration (its fixed part); these
    are the priors before any was measured.
    """

    communicator_per_peer_s: float = DEFAULT_COMMUNICATOR_SETUP_S
    allocation_bytes_per_s: float | None = None  # None: free (buffers come from a pool)
    generation_reform_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.communicator_per_peer_s >= 0 and self.generation_reform_s >= 0):
            raise ValueError("fixed costs must be >= 0 seconds")
        if self.allocation_bytes_per_s is not None and not self.allocation_bytes_per_s > 0:
            raise ValueError(f"allocation_bytes_per_s must be > 0, got {self.allocation_bytes_per_s}")


# Priors: the paper's 16 -> 32 GPU move of an 8B actor + critic took 6.5 s with EMUs, while its bytes (one
# training-state copy per joining GPU, ~16 GB over a 50 GB/s port) explain well under 1 s: ~5 s is fixed
# (process wake-up, rendezvous, communicators). First-touch of fresh device memory runs near memset speed;
# 200 GB/s is below every preset's HBM.
DEFAULT_FIXED_COSTS = FixedCosts(communicator_per_peer_s=DEFAULT_COMMUNICATOR_SETUP_S,
                                 allocation_bytes_per_s=200e9, generation_reform_s=5.0)


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


def primitive_seconds(fp: Footprint, cluster: ClusterSpec, setup_s: float, fixed: FixedCosts | None = None) -> float:
    send: dict[int, float] = {}
    recv: dict[int, float] = {}
    received: dict[int, int] = {}
    peers: dict[int, int] = {}
    for (s, d), nbytes in fp.pair_bytes.items():
        link = cluster.link_between(s, d)
        t = nbytes / link.bytes_per_s + link.latency_s
        send[s] = send.get(s, 0.0) + t
        recv[d] = recv.get(d, 0.0) + t
        received[d] = received.get(d, 0) + nbytes
        peers[s] = peers.get(s, 0) + 1
        peers[d] = peers.get(d, 0) + 1
    hbm = cluster.device.hbm_bytes_per_s
    alloc = None if fixed is None else fixed.allocation_bytes_per_s
    slowest = 0.0
    for g in fp.gpus:
        t = max(send.get(g, 0.0), recv.get(g, 0.0)) + 2.0 * fp.local_bytes.get(g, 0) / hbm
        if alloc is not None:
            t += received.get(g, 0) / alloc
        slowest = max(slowest, t)
    if not fp.pair_bytes:
        return slowest
    if fixed is not None:
        return slowest + fixed.communicator_per_peer_s * max(peers.values())
    return slowest + setup_s


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


def _class_seconds(c: ReplicaClass, cluster: ClusterSpec, setup_s: float,
                   fixed: FixedCosts | None = None) -> tuple[np.ndarray, int, int]:
    """primitive_seconds of every member of a replica class (the links depend on where its members
    sit), and its intra- and inter-node bytes; memoised on the class per cluster, and on its shape
    per cluster and intra-node pattern (a class of a never-seen pair of stage plans often has both)."""
    hit = c.seconds.get(id(cluster))  # by identity: hashing a ClusterSpec costs more than a lookup
    if fixed is None and hit is not None and hit[0] is cluster and hit[1] == setup_s:
        return hit[2]
    sh = c.shape if c.shape is not None else class_shape(c.canon, c.touched)
    if sh.pairs is None:
        sh.pairs = _pair_arrays(c.canon, c.gpus.shape[1])
    nodes = c.gpus // cluster.gpus_per_node
    intra: np.ndarray | None = None
    if (nodes == nodes[:, :1]).all():  # each member on one node (the usual case): every pair intra-node
        key: tuple[object, ...] = (id(cluster), setup_s, c.size)
    else:
        intra = nodes[:, sh.pairs[0]] == nodes[:, sh.pairs[1]]
        key = (id(cluster), setup_s, intra.shape, intra.tobytes())
    done = sh.durations.get(key) if fixed is None else None
    if done is not None and done[0] is cluster:
        out = done[1]
    else:
        if intra is None:
            intra = np.ones((c.size, len(sh.pairs[0])), dtype=bool)
        out = _member_seconds(c, sh, intra, cluster, setup_s, fixed)
    if fixed is not None:  # the opt-in path is not memoised (the memo is keyed on the set-up alone)
        return out
    if done is None:
        if len(sh.durations) > 16:
            sh.durations.clear()
        sh.durations[key] = (cluster, out)
    if len(c.seconds) > 8:
        c.seconds.clear()
    c.seconds[id(cluster)] = (cluster, setup_s, out)
    return out


def _pair_arrays(fp: Footprint, labels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A canonical footprint's pairs as arrays: source labels, destination labels, bytes (float), and
    each pair onto its source and onto its destination (pairs x ``labels``)."""
    pairs = list(fp.pair_bytes.items())
    src = np.array([s for (s, _), _ in pairs], dtype=np.int64)
    dst = np.array([d for (_, d), _ in pairs], dtype=np.int64)
    onto = np.eye(labels)
    return src, dst, np.array([b for _, b in pairs], dtype=np.float64), onto[src], onto[dst]


def _member_seconds(c: ReplicaClass, sh: ClassShape, intra: np.ndarray, cluster: ClusterSpec, setup_s: float,
                    fixed: FixedCosts | None) -> tuple[np.ndarray, int, int]:
    """``_class_seconds`` computed: per member, its slowest touched GPU's sends or receives (each pair's
    time summed onto its source and destination) plus local copies, and the set-up."""
    fp = c.canon
    local = np.zeros(c.gpus.shape[1])
    for g, v in fp.local_bytes.items():
        local[g] = 2.0 * v / cluster.device.hbm_bytes_per_s
    touched = c.touched
    if not fp.pair_bytes:
        seconds = np.full(c.size, local[touched].max() if len(touched) else 0.0)
        seconds.setflags(write=False)
        return seconds, 0, 0
    _, _, nbytes, onto_src, onto_dst = sh.pairs  # type: ignore[misc]
    fast, slow = cluster.intra_node_link, cluster.inter_node_link
    t = np.where(intra, nbytes / fast.bytes_per_s + fast.latency_s, nbytes / slow.bytes_per_s + slow.latency_s)
    send = t @ onto_src
    recv = t @ onto_dst
    per_gpu = np.maximum(send, recv) + local
    setup = setup_s
    if fixed is not None:
        if fixed.allocation_bytes_per_s is not None:
            per_gpu = per_gpu + (nbytes @ onto_dst) / fixed.allocation_bytes_per_s
        peers = np.ones(len(nbytes)) @ (onto_src + onto_dst)
        setup = fixed.communicator_per_peer_s * float(peers.max())
    intra_bytes = int((intra * nbytes).sum())
    seconds = per_gpu[:, touched].max(axis=1) + setup
    seconds.setflags(write=False)
    return seconds, intra_bytes, int(nbytes.sum()) * c.size - intra_bytes


# per class, each (predecessors or touched GPUs) x members: predecessor ends, GPU ends, GPU last nodes
_Seen = tuple[np.ndarray, np.ndarray, np.ndarray]


def replica_schedule(plan: ReplicaPlan, cluster: ClusterSpec, setup_s: float, fixed: FixedCosts | None = None
                     ) -> tuple[np.ndarray, np.ndarray, list[int], int, int]:
    """``schedule`` over replica classes: (start, end per node, critical path, intra bytes, inter bytes).

    Members of a class run back to back in the DAG's order; a member starts when its GPUs are free
    (each GPU runs one primitive at a time) and its data predecessors have ended, as in ``schedule``.
    What held a node back is only looked up along the critical path.
    """
    ends = [np.zeros(sc.num_nodes + 1) for sc in plan.stages]  # stage-local; the last is a 0 for padding
    starts = [np.zeros(sc.num_nodes) for sc in plan.stages]
    gpu_end = np.zeros(cluster.num_gpus)
    gpu_last = np.full(cluster.num_gpus, -1, dtype=np.int64)
    seen: dict[int, _Seen] = {}
    intra = inter = 0
    empty = np.zeros((0, 0))
    for k in plan.class_order:
        c = plan.classes[k]
        st = plan.class_stage[k]
        end = ends[st]
        dur, a, b = _class_seconds(c, cluster, setup_s, fixed)
        intra += a
        inter += b
        has_preds = c.preds.shape[1] > 0
        if has_preds and c.preds_t is None:
            c.preds_t = np.ascontiguousarray(c.preds.T)
        pe = end[c.preds_t] if has_preds else empty  # predecessors x members
        t = pe.max(axis=0) if has_preds else np.zeros(c.size)
        lo, hi = c.first, c.first + c.size
        if not len(c.touched):
            starts[st][lo:hi] = t
            end[lo:hi] = t + dur
            seen[k] = (pe, empty, empty)
            continue
        g = c.g
        if c.single:
            if c.g_t is None:
                c.g_t = np.ascontiguousarray(g.T)
            g_t = c.g_t  # touched GPUs x members
            ge = gpu_end[g_t]
            gl = gpu_last[g_t]
            t = np.maximum(t, ge.max(axis=0))
            starts[st][lo:hi] = t
            end[lo:hi] = t + dur
            gpu_end[g_t] = end[lo:hi]
            gpu_last[g_t] = np.arange(plan.first[k], plan.first[k] + c.size)
            seen[k] = (pe, ge, gl)
            continue
        ge_rows = np.zeros(g.shape)
        gl_rows = np.zeros(g.shape, dtype=np.int64)
        for m in range(c.size):  # members sharing GPUs: one after another
            row = g[m]
            ge_rows[m], gl_rows[m] = gpu_end[row], gpu_last[row]
            t[m] = max(t[m], float(ge_rows[m].max()))
            gpu_end[row] = t[m] + dur[m]
            gpu_last[row] = plan.first[k] + m
        starts[st][lo:hi] = t
        end[lo:hi] = t + dur
        seen[k] = (pe, ge_rows.T, gl_rows.T)
    start = np.concatenate(starts) if starts else np.zeros(0)
    end_all = np.concatenate([e[:-1] for e in ends]) if ends else np.zeros(0)
    return start, end_all, _critical_path(plan, start, end_all, seen), intra, inter


def _critical_path(plan: ReplicaPlan, start: np.ndarray, end: np.ndarray, seen: dict[int, _Seen]) -> list[int]:
    """From the first node with the latest end back through what held each node back: a data
    predecessor ending at its start (checked first, as ``schedule`` does), else the GPU it waited on."""
    if not len(end):
        return []
    path = [int(end.argmax())]
    while True:
        i = path[-1]
        k = bisect_right(plan.first, i) - 1  # classes hold consecutive, non-empty node ranges
        c, m = plan.classes[k], i - plan.first[k]
        pe, ge, gl = seen[k]
        s = float(start[i])
        by = -1
        if s > 0 and pe.shape[0] and float(pe[:, m].max()) >= s:
            by = int(c.preds[m, int(pe[:, m].argmax())]) + plan.stage_base[plan.class_stage[k]]
        elif s > 0 and ge.shape[0] and float(ge[:, m].max()) >= s:
            by = int(gl[int(ge[:, m].argmax()), m])
        if by < 0:
            return path[::-1]
        path.append(by)


def _replica_cost(plan: ReplicaPlan, cluster: ClusterSpec, setup_s: float,
                  fixed: FixedCosts | None) -> TransitionCost:
    start, end, path, intra, inter = replica_schedule(plan, cluster, setup_s, fixed)
    reform = fixed.generation_reform_s if fixed is not None and len(end) else 0.0
    return TransitionCost(seconds=(float(end.max()) if len(end) else 0.0) + reform, bytes_moved=intra + inter,
                          intra_node_bytes=intra, inter_node_bytes=inter, critical_path=tuple(path),
                          start_s=tuple(start.tolist()), end_s=tuple(end.tolist()))


def transition_cost(dag: TransitionDAG, cluster: ClusterSpec,
                    communicator_setup_s: float = DEFAULT_COMMUNICATOR_SETUP_S,
                    fixed: FixedCosts | None = None) -> TransitionCost:
    """L_tran of ``dag`` on ``cluster`` with its bytes moved and critical path; ``fixed`` (e.g.
    DEFAULT_FIXED_COSTS) adds per-peer communicator creation, buffer allocation and the generation
    re-forming (without it: one ``communicator_setup_s`` per primitive that moves bytes, as before)."""
    if dag.replicas is not None:
        return _replica_cost(dag.replicas, cluster, communicator_setup_s, fixed)
    durations = [primitive_seconds(fp, cluster, communicator_setup_s, fixed) for fp in dag.footprints]
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
    reform = fixed.generation_reform_s if fixed is not None and dag.nodes else 0.0
    return TransitionCost(seconds=max(end, default=0.0) + reform, bytes_moved=intra + inter, intra_node_bytes=intra,
                          inter_node_bytes=inter, critical_path=tuple(reversed(path)), start_s=tuple(start),
                          end_s=tuple(end))
