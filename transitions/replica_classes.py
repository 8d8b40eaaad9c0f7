"""Fast path of ``build_transition``: the DAG planned over replica classes instead of units.

DP replicas of one model-stage undergo the same local sub-plan up to a renaming of GPUs and unit ids.
A *replica class* is every primitive of one model-stage and kind whose relative shape (each unit's
layout and GPUs relabelled by first appearance, as footprints.canonical_footprint does) is the same:
it holds one canonical footprint and an integer array of the GPU of each label per member. At 1,024
GPUs a plan change has thousands of unit-level primitives but a few dozen classes, so:

- the local plans (transitions.local_dag's rules: reuse, Split, Extend from overlapping replicas, Merge,
  Destroy) are computed with numpy over the plans' GPU arrays, once per relative shape of a pair of
  stage plans (the target's GPUs named by their place in the current plan): a candidate of a shape
  seen before gets that shape's classes mapped onto its own GPUs;
- the memory order is chosen over classes (release before acquire, gen -> inf -> train, longest path)
  and all members of a class run back to back. Each class is checked against capacity on every GPU at
  once with an upper bound (what is held before it, plus everything its members allocate there, plus
  the largest bucket buffer), exact when no two members share a GPU;
- the schedule (transitions.cost) is evaluated per class with numpy over all its members.

The unit-level DAG (primitives, edges, footprints, per-GPU order and exact peaks) is expanded only
when someone reads it (``ReplicaPlan.expand``); what it holds is then the same as if it had been built
unit by unit with this order. ``plan_replicas`` returns None whenever the symmetry it relies on does
not hold (lost GPUs, a weight-sync refresh, added or removed model-stages, a part nobody overlaps, a
class that does not fit as a block): the caller then takes the exact per-unit path, so correctness
never depends on this one. What it derives is memoised in the caller's PlanningCache
(transitions.planning_cache: per plan, per pair of stage plans, per relative shape), so a planner's
repeated builds cost lookups. Pure: no torch, no I/O (numpy).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from itertools import chain

import numpy as np

from planner.hardware import ClusterSpec
from planner.plan import GlobalPlan, Layout, StagePlan
from transitions.emu import EMU, UnitState, part_gpus, part_indices, parts_nest, rank_bytes, t_sub
from transitions.errors import DagCycleError
from transitions.feasibility import bottom_levels
from transitions.footprints import canonical_footprint
from transitions.local_dag import plan_units, target_parts, unit_uid
from transitions.planning_cache import PlanningCache
from transitions.primitives import (
    Destroy,
    Extend,
    Footprint,
    Merge,
    Primitive,
    PrimitiveKind,
    Split,
    relabels,
)

# With fewer units (old and new together) the exact path is as fast, and its per-unit order is finer
# (greedy vs optimum on <= 7-node instances: mean gap 2.5% per unit, 3.75% per class).
MIN_UNITS = 32
_MIX = np.random.default_rng(12345).integers(1, 2**62, size=256, dtype=np.int64) | 1


def gpu_array(gpu_sets: tuple[tuple[int, ...], ...], cache: PlanningCache) -> np.ndarray:
    """The GPU sets of a stage plan as a (replicas x unit size) array; memoised per tuple object."""

    def make() -> np.ndarray:
        size = len(gpu_sets[0])
        arr = np.fromiter(chain.from_iterable(gpu_sets), dtype=np.int64, count=size * len(gpu_sets))
        return arr.reshape(len(gpu_sets), size)

    return cache.gpu_arrays.get_or_make((id(gpu_sets),), (gpu_sets,), make)


def _group_rows(keys: np.ndarray) -> list[np.ndarray]:
    """Row indices grouped by identical rows of ``keys`` (hashed, then verified row by row)."""
    if len(keys) == 0:
        return []
    if (keys == keys[0]).all():  # the usual case: every replica alike
        return [np.arange(len(keys))]
    h = keys @ _MIX[: keys.shape[1]]
    uniq, inv = np.unique(h, return_inverse=True)
    out = []
    for k in range(len(uniq)):
        idx = np.flatnonzero(inv == k) if len(uniq) > 1 else np.arange(len(keys))
        sub = keys[idx]
        if not (sub == sub[0]).all():  # hash collision: split exactly
            for row in np.unique(sub, axis=0):
                out.append(idx[(sub == row).all(1)])
            continue
        out.append(idx)
    return out


def _shape_groups(x: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Rows of GPU sequences ``x`` grouped by relative shape: (row indices, label positions, first
    appearance of each position)."""
    seen: dict[int, int] = {}
    first_list = [seen.setdefault(g, i) for i, g in enumerate(x[0].tolist())]  # small: plain Python
    label_list = [i for i, f in enumerate(first_list) if f == i]
    label_of = {p: k for k, p in enumerate(label_list)}
    labels0, first0 = np.array(label_list, dtype=np.int64), np.array(first_list, dtype=np.int64)
    lab = x[:, labels0]
    if (lab[:, [label_of[f] for f in first_list]] == x).all():  # every row repeats row 0's pattern
        srt = np.sort(lab, axis=1)
        if (srt[:, 1:] != srt[:, :-1]).all():  # ... with distinct GPUs for distinct labels
            return [(np.arange(len(x)), labels0, first0)]
    first = (x[:, :, None] == x[:, None, :]).argmax(axis=2)
    out = []
    for idx in _group_rows(first):
        rep = first[idx[0]]
        out.append((idx, np.flatnonzero(rep == np.arange(len(rep))), rep))
    return out


@dataclass(kw_only=True, slots=True)
class ReplicaClass:
    """Primitives of one model-stage, kind and relative shape; member m's label l is on gpus[m, l].

    Built once per pair of stage plans and shared by every DAG built from them: never mutated after
    ``_finish`` (except ``seconds``, a per-cluster memo of transitions.cost)."""

    kind: PrimitiveKind
    stage: str
    stage_order: int
    canon: Footprint  # over labels
    gpus: np.ndarray  # members x labels
    unit: np.ndarray  # per member: current unit (Split, Destroy), part id (Extend), target unit (Merge)
    refs: np.ndarray  # per member: Split parts, Extend sources, Merge inputs (part id, or -1-kept unit)
    touched: np.ndarray  # labels the primitive occupies (its footprint's GPUs)
    first: int = 0  # stage-local node id of member 0
    g: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))  # gpus[:, touched]
    single: bool = True  # no GPU is touched by two members
    alloc: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # per touched label
    buf: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    delta: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # alloc - free
    acquire: bool = False
    preds: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))  # stage-local, -1 pad
    seconds: dict[int, tuple[object, float, tuple[np.ndarray, int, int]]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.gpus.shape[0])

    def _finish(self) -> None:
        labels = self.touched.tolist()
        fp = self.canon
        self.alloc = np.array([fp.alloc_bytes.get(g, 0) for g in labels], dtype=np.int64)
        self.buf = np.array([fp.buffer_bytes.get(g, 0) for g in labels], dtype=np.int64)
        self.delta = self.alloc - np.array([fp.free_bytes.get(g, 0) for g in labels], dtype=np.int64)
        self.acquire = bool(self.alloc.any() or self.buf.any())
        self.g = self.gpus[:, self.touched]
        self.single = not labels or bool(np.bincount(self.g.ravel()).max() <= 1)


@dataclass(kw_only=True, slots=True)
class _Stage:
    name: str
    state: UnitState
    current: StagePlan
    target: StagePlan
    sub: Layout
    nq: int  # T_sub parts per target unit (1: the target layout is T_sub, parts are the units)
    cur: np.ndarray
    tgt: np.ndarray
    parts: np.ndarray  # (target units * nq) x sub.size
    renamed: list[tuple[int, int]]


@dataclass(kw_only=True, slots=True)
class StageClasses:
    """One model-stage's class-level local plan (cached per pair of stage plans)."""

    stage: _Stage
    classes: list[ReplicaClass]
    edges: list[tuple[int, int]]  # between its classes (indices into ``classes``)
    num_nodes: int


@dataclass(kw_only=True, slots=True)
class ReplicaPlan:
    """The class-level DAG of one transition, its checked class order, and what expanding it needs.
    Node ids: model-stages one after another, each stage's classes in order, members in order."""

    old_version: int
    new_version: int
    stages: list[StageClasses]
    classes: list[ReplicaClass]  # every stage's, flattened
    class_stage: list[int]  # index into ``stages``
    first: list[int]  # global node id of each class's member 0
    stage_base: list[int]  # global node id of each stage's first node
    class_order: list[int]
    num_nodes: int
    initial: np.ndarray  # bytes per GPU before the transition
    cache: PlanningCache | None = None  # the builder's, for the expansion's footprints (None: the default)

    def __getstate__(self) -> dict[str, object]:
        """Pickled without ``cache``: the builder's memos stay with the builder (a worker that receives
        the DAG expands it, if ever, with its own process's DEFAULT_CACHE)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "cache"}

    def __setstate__(self, state: dict[str, object]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self.cache = None

    @property
    def bytes_moved(self) -> int:
        return sum(c.size * c.canon.moved_bytes for c in self.classes)

    def order(self) -> list[int]:
        out: list[int] = []
        for k in self.class_order:
            out += range(self.first[k], self.first[k] + self.classes[k].size)
        return out

    def expand(self) -> tuple[list[Primitive], list[int], list[EMU], list[EMU], list[tuple[str, str]]]:
        """(nodes, stage order per node, old units, new units, renamed) at unit level."""
        nodes: list[Primitive] = []
        stage_order: list[int] = []
        old_units: list[EMU] = []
        new_units: list[EMU] = []
        renamed: list[tuple[str, str]] = []
        for sc in self.stages:
            st = sc.stage
            cur = plan_units(st.state, st.current, self.old_version)
            tgt = plan_units(st.state, st.target, self.new_version)
            parts = [p for u in tgt for p in target_parts(u, st.sub)]
            old_units += cur
            new_units += tgt
            renamed += [(cur[i].uid, tgt[j].uid) for i, j in st.renamed]
            for c in sc.classes:
                nodes += [_member(c, m, cur, tgt, parts) for m in range(c.size)]
                stage_order += [c.stage_order] * c.size
        return nodes, stage_order, old_units, new_units, renamed


def _member(c: ReplicaClass, m: int, cur: list[EMU], tgt: list[EMU], parts: list[EMU]) -> Primitive:
    u = int(c.unit[m])
    refs = [int(r) for r in c.refs[m]]
    if c.kind is PrimitiveKind.DESTROY:
        return Destroy(unit=cur[u])
    if c.kind is PrimitiveKind.SPLIT:
        return Split(unit=cur[u], parts=tuple(parts[r] for r in refs))
    if c.kind is PrimitiveKind.EXTEND:
        return Extend(sources=tuple(cur[r] for r in refs), target=parts[u])
    return Merge(parts=tuple(parts[r] if r >= 0 else cur[-1 - r] for r in refs), unit=tgt[u])


def _unit_emu(st: _Stage, version: int, index: int, current: bool) -> EMU:
    plan = st.current if current else st.target
    return EMU(uid=unit_uid(st.name, version, index), state=st.state, layout=plan.layout,
               gpus=tuple(plan.gpu_sets[index]), version=version)


def _columns(layout: Layout, sub: Layout) -> np.ndarray:
    ident = tuple(range(layout.size))
    return np.array([part_gpus(layout, ident, sub, a, b) for a, b in part_indices(layout, sub)], dtype=np.int64)


# --- local plans over arrays ----------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class _Local:
    """One model-stage's primitives as member arrays per kind (before grouping by shape)."""

    splits: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (current unit, part ids)
    extends: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (part id, sources)
    merges: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (target unit, inputs)
    destroys: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def _owners(plan: StagePlan, num_gpus: int, cache: PlanningCache) -> tuple[np.ndarray, np.ndarray]:
    """Per GPU: the replica of ``plan`` on it and its rank there (-1: none); memoised per plan, by
    identity (the current plan stays the same while a planner tries candidates)."""

    def make() -> tuple[np.ndarray, np.ndarray]:
        cur = gpu_array(plan.gpu_sets, cache)
        dc, sc = cur.shape
        owner = np.full(num_gpus, -1, dtype=np.int64)
        rank = np.full(num_gpus, -1, dtype=np.int64)
        owner[cur.ravel()] = np.repeat(np.arange(dc), sc)
        rank[cur.ravel()] = np.tile(np.arange(sc), dc)
        return owner, rank

    return cache.owners.get_or_make((id(plan), num_gpus), (plan,), make)


def _local_plan(st: _Stage, num_gpus: int, cache: PlanningCache) -> _Local | None:
    cur, sub = st.cur, st.sub
    lc, lt = st.current.layout, st.target.layout
    out = _Local()
    dc, sc = cur.shape
    owner, rank = _owners(st.current, num_gpus, cache)
    own = owner[st.parts]
    rk = rank[st.parts]
    one_owner = (own == own[:, :1]).all(1) & (own[:, 0] >= 0)
    n_parts = len(st.parts)
    split_c = np.full(n_parts, -1, dtype=np.int64)
    if lc == sub:
        reuse = one_owner & (rk == np.arange(sub.size)).all(1)
        if lt != sub and not parts_nest(st.state, sub, lt):
            reuse[:] = False
    else:
        reuse = np.zeros(n_parts, dtype=bool)
        for k, cols in enumerate(_columns(lc, sub)):
            split_c[one_owner & (rk == cols).all(1)] = k
    ext = ~reuse & (split_c < 0)
    kept = np.zeros(dc, dtype=bool)
    kept[own[reuse, 0]] = True
    if st.nq == 1:
        st.renamed = list(zip(own[reuse, 0].tolist(), np.flatnonzero(reuse).tolist()))
    # Extends: sources are the replicas overlapping the part, most shared GPUs first
    e_ids = np.flatnonzero(ext)
    if len(e_ids):
        e_own = own[e_ids]
        alone = (e_own < 0).all(1)
        if alone.any():  # parts on GPUs no replica holds: one source each, round-robin (as local_dag)
            rr = np.arange(int(alone.sum()), dtype=np.int64) % dc
            out.extends.append((e_ids[alone], rr[:, None]))
            e_ids, e_own = e_ids[~alone], e_own[~alone]
    if len(e_ids):
        first = (e_own[:, :, None] == e_own[:, None, :]).argmax(axis=2)
        pattern = np.concatenate([first, (e_own < 0).astype(np.int64)], axis=1)
        for idx in _group_rows(pattern):
            rep, rep_own = first[idx[0]], e_own[idx[0]]
            pos = [p for p in range(len(rep)) if rep[p] == p and rep_own[p] >= 0]
            pos.sort(key=lambda p: (-int((rep == p).sum()), p))
            out.extends.append((e_ids[idx], e_own[idx][:, pos]))
    # Merges: every target unit made of several parts
    if st.nq > 1:
        inputs = np.where(reuse, -1 - own[:, 0], np.arange(n_parts)).reshape(-1, st.nq)
        for idx in _group_rows((inputs < 0).astype(np.int64)):
            out.merges.append((idx, inputs[idx]))
    # Splits: every current unit some part comes from, with its parts in target order
    s_ids = np.flatnonzero(split_c >= 0)
    if len(s_ids):
        s_unit = own[s_ids, 0]
        order = np.lexsort((s_ids, s_unit))
        s_unit, s_ids = s_unit[order], s_ids[order]
        counts = np.bincount(s_unit, minlength=dc)
        units = np.flatnonzero(counts)
        for k in np.unique(counts[units]):
            chosen = units[counts[units] == k]
            rows = np.isin(s_unit, chosen)
            out.splits.append((chosen, s_ids[rows].reshape(-1, int(k))))
    out.destroys = np.flatnonzero(~kept)
    return out


def _classes_of(st: _Stage, local: _Local, order: int, cache: PlanningCache) -> list[ReplicaClass]:
    cur, tgt, parts, nq = st.cur, st.tgt, st.parts, st.nq

    def part_seq(pid: np.ndarray) -> list[np.ndarray]:  # a part's GPUs, then its final unit's
        return [parts[pid]] if nq == 1 else [parts[pid], tgt[pid // nq]]

    out: list[ReplicaClass] = []
    groups: list[tuple[PrimitiveKind, np.ndarray, np.ndarray, np.ndarray]] = []
    for u, refs in local.splits:
        seq = [cur[u]] + [a for k in range(refs.shape[1]) for a in part_seq(refs[:, k])]
        groups.append((PrimitiveKind.SPLIT, u, refs, np.concatenate(seq, axis=1)))
    for pid, refs in local.extends:
        seq = part_seq(pid) + [cur[refs[:, k]] for k in range(refs.shape[1])]
        groups.append((PrimitiveKind.EXTEND, pid, refs, np.concatenate(seq, axis=1)))
    for j, refs in local.merges:
        seq = []
        for k in range(refs.shape[1]):
            seq += [cur[-1 - refs[:, k]]] if refs[0, k] < 0 else part_seq(refs[:, k])
        seq.append(tgt[j])
        groups.append((PrimitiveKind.MERGE, j, refs, np.concatenate(seq, axis=1)))
    if len(local.destroys):
        d = local.destroys
        groups.append((PrimitiveKind.DESTROY, d, np.zeros((len(d), 0), dtype=np.int64), cur[d]))
    for kind, unit, refs, x in groups:
        # a Destroy's shape is its unit's GPUs in rank order: one class
        shapes = _shape_groups(x) if kind is not PrimitiveKind.DESTROY else [
            (np.arange(len(x)), np.arange(x.shape[1]), np.arange(x.shape[1]))]
        for idx, labels, first in shapes:
            # the relative shape fixes the canonical footprint: layouts come with the kind and the
            # inputs' types (a kept current unit, or a T_sub part of a target unit)
            key = (kind, st.state, st.current.layout, st.target.layout, tuple((refs[idx[0]] < 0).tolist()),
                   first.tobytes())
            hit = cache.class_shapes.get(key)
            g = (x if len(idx) == len(x) else x[idx])[:, labels]
            if hit is None:
                rep = _representative(st, kind, int(unit[idx[0]]), refs[idx[0]])
                canon, gpus = canonical_footprint(rep, cache)
                # invariant: _shape_groups labels GPUs by first appearance, as canonical_footprint does
                assert gpus == g[0].tolist(), f"replica class labels disagree: {gpus} vs {g[0].tolist()}"
                touched = np.array(sorted(canon.gpus), dtype=np.int64)
                empty = not len(touched) and not (kind is PrimitiveKind.MERGE and relabels(rep))
                hit = cache.class_shapes.put(key, (canon, touched, empty))
            canon, touched, empty = hit
            if empty:
                return []  # an empty primitive: let the exact path deal with it
            c = ReplicaClass(kind=kind, stage=st.name, stage_order=order, canon=canon, gpus=g, unit=unit[idx],
                             refs=refs[idx], touched=touched, first=sum(x.size for x in out))
            c._finish()
            out.append(c)
    return out


def _representative(st: _Stage, kind: PrimitiveKind, unit: int, refs: np.ndarray) -> Primitive:
    """Member ``unit`` of a class as a real primitive (uids and versions do not change its shape)."""
    old_version, new_version = 0, 1
    cur = {int(i): _unit_emu(st, old_version, int(i), True) for i in refs if kind is PrimitiveKind.EXTEND}
    if kind in (PrimitiveKind.SPLIT, PrimitiveKind.DESTROY):
        cur[unit] = _unit_emu(st, old_version, unit, True)
    if kind is PrimitiveKind.MERGE:
        cur.update({-1 - int(r): _unit_emu(st, old_version, -1 - int(r), True) for r in refs if r < 0})
    pids = [unit] if kind is PrimitiveKind.EXTEND else [int(r) for r in refs if r >= 0]
    tgt_ids = {p // st.nq for p in pids} | ({unit} if kind is PrimitiveKind.MERGE else set())
    tgt = {j: _unit_emu(st, new_version, j, False) for j in tgt_ids}
    part_of = {p: target_parts(tgt[p // st.nq], st.sub)[p % st.nq] for p in pids}
    if kind is PrimitiveKind.DESTROY:
        return Destroy(unit=cur[unit])
    if kind is PrimitiveKind.SPLIT:
        return Split(unit=cur[unit], parts=tuple(part_of[int(r)] for r in refs))
    if kind is PrimitiveKind.EXTEND:
        return Extend(sources=tuple(cur[int(r)] for r in refs), target=part_of[unit])
    return Merge(parts=tuple(part_of[int(r)] if r >= 0 else cur[-1 - int(r)] for r in refs), unit=tgt[unit])


# --- edges, memory order --------------------------------------------------------------------------


def _edges(st: _Stage, mine: list[ReplicaClass]) -> tuple[np.ndarray, np.ndarray]:
    """Unit-level data edges of one model-stage (stage-local node ids): producer before reader,
    readers and producer before the node that frees a unit (global_dag.data_edges' rules, over arrays)."""
    dc = len(st.cur)
    n_parts = len(st.parts)
    destroy_node = np.full(dc, -1, dtype=np.int64)
    producer = np.full(n_parts, -1, dtype=np.int64)  # node producing each part
    merge_node = np.full(len(st.tgt), -1, dtype=np.int64)
    kept_into = np.full(dc, -1, dtype=np.int64)  # merge node freeing a kept unit
    for c in mine:
        ids = np.arange(c.first, c.first + c.size)
        if c.kind is PrimitiveKind.DESTROY:
            destroy_node[c.unit] = ids
        elif c.kind is PrimitiveKind.EXTEND:
            producer[c.unit] = ids
        elif c.kind is PrimitiveKind.SPLIT:
            producer[c.refs] = ids[:, None]
        else:
            merge_node[c.unit] = ids
    for c in mine:
        if c.kind is PrimitiveKind.MERGE:
            ids = np.arange(c.first, c.first + c.size)
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


def _link(st: _Stage, mine: list[ReplicaClass]) -> list[tuple[int, int]] | None:
    """Each class's data predecessors per member (``preds``) and the edges between classes; None if
    members of one class would depend on each other (not a block)."""
    src, dst = _edges(st, mine)
    num = sum(c.size for c in mine)
    node_class = np.repeat(np.arange(len(mine)), [c.size for c in mine]) if mine else np.zeros(0, np.int64)
    pairs = np.unique(node_class[src] * len(mine) + node_class[dst]) if len(src) else np.zeros(0, np.int64)
    edges = [(int(p) // len(mine), int(p) % len(mine)) for p in pairs]
    if any(x == y for x, y in edges) or (len(dst) and (dst.min() < 0 or dst.max() >= num)):
        return None
    order = np.argsort(dst, kind="stable")
    src, dst = src[order], dst[order]
    for c in mine:
        lo, hi = np.searchsorted(dst, [c.first, c.first + c.size])
        d, p = dst[lo:hi] - c.first, src[lo:hi]
        counts = np.bincount(d, minlength=c.size)
        preds = np.full((c.size, int(counts.max()) if len(d) else 0), -1, dtype=np.int64)
        if len(d):
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
            preds[d, np.arange(len(d)) - starts[d]] = p
        c.preds = preds
    return edges


def _order(classes: list[ReplicaClass], edges: list[tuple[int, int]], initial: np.ndarray,
           capacity: int) -> list[int] | None:
    """Greedy class order (global_dag's rules), each class checked on every GPU; None if blocked."""
    n = len(classes)
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for x, y in edges:
        succ[x].append(y)
        indeg[y] += 1
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


def _stage_classes(state: UnitState, cp: StagePlan, tp: StagePlan, n_gpus: int,
                   cache: PlanningCache) -> StageClasses | None:
    """The class-level local plan of one model-stage; memoised per pair of stage plans (by identity:
    a planner keeps proposing the same plans), None where it is not symmetric."""
    return cache.stage_pairs.get_or_make((id(cp), id(tp), state, n_gpus), (cp, tp),
                                         lambda: _relabelled_stage(state, cp, tp, n_gpus, cache))


@dataclass(kw_only=True, slots=True)
class ShapeEntry:
    """A stage's class-level plan over GPU labels (what ``_build_stage`` gives for every pair of
    stage plans with the same relative shape): the plan built for the first such pair, and its
    classes' and parts' GPUs as labels. Held in PlanningCache.shape_stages."""

    built: StageClasses | None
    labels: list[np.ndarray]  # per class: labels of ``gpus``
    parts: np.ndarray  # labels of the stage's T_sub parts
    gpu_of: np.ndarray  # the GPU of each label in ``built``


def _relabelled_stage(state: UnitState, cp: StagePlan, tp: StagePlan, n_gpus: int,
                      cache: PlanningCache) -> StageClasses | None:
    """``_build_stage``'s plan, taken from ``cache.shape_stages`` when a pair of the same relative shape
    was built before. That key is the state, the layouts and the target GPUs as labels (a current GPU
    is labelled by its position in the current plan, a GPU only the target uses by its order of
    appearance). Everything ``_build_stage`` derives is equivariant under renaming GPUs (it only
    compares GPU ids for equality), so one entry serves every candidate of that shape."""
    cur, tgt = gpu_array(cp.gpu_sets, cache), gpu_array(tp.gpu_sets, cache)
    if cur.min() < 0 or tgt.min() < 0 or cur.max() >= n_gpus or tgt.max() >= n_gpus:
        return None  # the exact path names the offending GPU
    owner, rank = _owners(cp, n_gpus, cache)
    flat = tgt.ravel()
    own = owner[flat]
    label = own * cur.shape[1] + rank[flat]
    fresh = own < 0
    n_fresh = int(fresh.sum())
    if n_fresh:  # target GPUs are distinct (StagePlan), so appearance order is position order
        label[fresh] = cur.size + np.arange(n_fresh, dtype=np.int64)
        gpu_of = np.concatenate([cur.ravel(), flat[fresh]])
    else:
        gpu_of = cur.ravel()
    key = (state, cp.layout, tp.layout, cur.shape, tgt.shape, label.tobytes())
    entry = cache.shape_stages.get(key)  # least recently used evicted first: a planner's hot shapes stay
    if entry is None:
        built = _build_stage(state, cp, tp, n_gpus, cache)
        label_of = np.full(n_gpus, -1, dtype=np.int64)
        label_of[gpu_of] = np.arange(len(gpu_of), dtype=np.int64)
        cache.shape_stages.put(key, ShapeEntry(
            built=built, labels=[] if built is None else [label_of[c.gpus] for c in built.classes],
            parts=np.zeros(0, dtype=np.int64) if built is None else label_of[built.stage.parts], gpu_of=gpu_of))
        return built
    b = entry.built
    if b is None:
        return None
    st = b.stage
    stage = _Stage(name=st.name, state=state, current=cp, target=tp, sub=st.sub, nq=st.nq, cur=cur, tgt=tgt,
                   parts=gpu_of[entry.parts], renamed=st.renamed)
    # on the very same GPUs the classes' durations (transitions.cost memo, per cluster) are the same too
    same_gpus = len(gpu_of) == len(entry.gpu_of) and bool((gpu_of == entry.gpu_of).all())
    classes = []
    for c, lab in zip(b.classes, entry.labels, strict=True):
        gpus = c.gpus if same_gpus else gpu_of[lab]
        classes.append(ReplicaClass(kind=c.kind, stage=c.stage, stage_order=c.stage_order, canon=c.canon, gpus=gpus,
                                    unit=c.unit, refs=c.refs, touched=c.touched, first=c.first,
                                    g=c.g if same_gpus else gpus[:, c.touched], single=c.single, alloc=c.alloc,
                                    buf=c.buf, delta=c.delta, acquire=c.acquire, preds=c.preds,
                                    seconds=c.seconds if same_gpus else {}))
    return StageClasses(stage=stage, classes=classes, edges=b.edges, num_nodes=b.num_nodes)


def _build_stage(state: UnitState, cp: StagePlan, tp: StagePlan, n_gpus: int,
                 cache: PlanningCache) -> StageClasses | None:
    cur, tgt = gpu_array(cp.gpu_sets, cache), gpu_array(tp.gpu_sets, cache)
    if cur.min() < 0 or tgt.min() < 0 or cur.max() >= n_gpus or tgt.max() >= n_gpus:
        return None  # the exact path names the offending GPU
    sub = t_sub(cp.layout, tp.layout)
    if tp.layout == sub:
        parts, nq = tgt, 1
    else:
        cols = _columns(tp.layout, sub)
        parts, nq = tgt[:, cols].reshape(-1, sub.size), len(cols)
    st = _Stage(name=state.model_stage, state=state, current=cp, target=tp, sub=sub, nq=nq, cur=cur, tgt=tgt,
                parts=parts, renamed=[])
    local = _local_plan(st, n_gpus, cache)
    if local is None:
        return None
    mine = _classes_of(st, local, state.stage_order, cache)
    if not mine and (len(local.destroys) or local.extends or local.splits or local.merges):
        return None
    edges = _link(st, mine)
    if edges is None:
        return None
    return StageClasses(stage=st, classes=mine, edges=edges, num_nodes=sum(c.size for c in mine))


def _initial(state: UnitState, cp: StagePlan, n_gpus: int, cache: PlanningCache) -> np.ndarray:
    """Bytes each GPU holds of one stage plan's units (memoised per plan, by identity)."""

    def make() -> np.ndarray:
        cur = gpu_array(cp.gpu_sets, cache)
        per_rank = np.array(rank_bytes(state, cp.layout), dtype=np.int64)
        out = np.zeros(n_gpus, dtype=np.int64)
        np.add.at(out, cur.ravel(), np.tile(per_rank, len(cur)))
        return out

    return cache.held_bytes.get_or_make((id(cp), state, n_gpus), (cp,), make)


def plan_replicas(states: Mapping[str, UnitState], cluster: ClusterSpec, old: GlobalPlan, new: GlobalPlan,
                  capacity: int, min_units: int = 0, *, cache: PlanningCache) -> ReplicaPlan | None:
    """The class-level plan of a transition, or None where the exact per-unit path must be used
    (also with fewer than ``min_units`` units, where that one is as fast and orders finer). ``cache``
    (the builder's) memoises plans, pairs and shapes across calls, and serves the plan's expansion."""
    if sum(len(sp.gpu_sets) for sp in (*old, *new)) < min_units:
        return None
    n_gpus = cluster.num_gpus
    old_names = [sp.model_stage for sp in old]
    if sorted(old_names) != sorted(sp.model_stage for sp in new):
        return None
    stages: list[StageClasses] = []
    initial = np.zeros(n_gpus, dtype=np.int64)
    for name in old_names:
        cp = old.stage(name)
        sc = _stage_classes(states[name], cp, new.stage(name), n_gpus, cache)
        if sc is None:
            return None
        stages.append(sc)
        initial += _initial(states[name], cp, n_gpus, cache)
    if (initial > capacity).any():
        return None
    classes: list[ReplicaClass] = []
    class_stage: list[int] = []
    first: list[int] = []
    stage_base: list[int] = []
    edges: list[tuple[int, int]] = []
    base = 0
    for k, sc in enumerate(stages):
        offset = len(classes)
        edges += [(x + offset, y + offset) for x, y in sc.edges]
        stage_base.append(base)
        for c in sc.classes:
            classes.append(c)
            class_stage.append(k)
            first.append(base + c.first)
        base += sc.num_nodes
    order = _order(classes, edges, initial, capacity)
    if order is None:
        return None
    return ReplicaPlan(old_version=old.version, new_version=new.version, stages=stages, classes=classes,
                       class_stage=class_stage, first=first, stage_base=stage_base, class_order=order,
                       num_nodes=base, initial=initial, cache=cache)
