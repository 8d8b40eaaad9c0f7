"""One model-stage's local plan over replica classes, computed with numpy over GPU arrays. Pure.

The rules are transitions.local_dag's (reuse, Split, Extend from overlapping replicas, Merge,
Destroy), applied to every DP replica at once over the plans' GPU arrays (``local_plan``); the
primitives are then grouped into classes by relative shape (GPUs relabelled by first appearance, as
transitions.footprints.canonical_footprint does), each with one canonical footprint memoised in the
builder's PlanningCache (``classes_of``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain

import numpy as np

from planner.plan import Layout, StagePlan
from transitions.emu import part_gpus, part_indices
from transitions.footprints import canonical_footprint
from transitions.geometry import layouts_nest
from transitions.local_dag import target_parts
from transitions.planning_cache import PlanningCache
from transitions.primitives import (
    Destroy,
    Extend,
    Merge,
    Primitive,
    PrimitiveKind,
    Split,
    relabels,
)
from transitions.replica_plan import ClassShape, ReplicaClass, ReplicaStage, class_shape, unit_emu

_MIX = np.random.default_rng(12345).integers(1, 2**62, size=256, dtype=np.int64) | 1


def gpu_array(gpu_sets: tuple[tuple[int, ...], ...], cache: PlanningCache) -> np.ndarray:
    """The GPU sets of a stage plan as a (replicas x unit size) array; memoised per tuple object."""

    def make() -> np.ndarray:
        size = len(gpu_sets[0])
        arr = np.fromiter(chain.from_iterable(gpu_sets), dtype=np.int64, count=size * len(gpu_sets))
        return arr.reshape(len(gpu_sets), size)

    return cache.gpu_arrays.get_or_make((id(gpu_sets),), (gpu_sets,), make)


def group_rows(keys: np.ndarray) -> list[np.ndarray]:
    """Row indices grouped by identical rows of ``keys`` (hashed, then verified row by row)."""
    if len(keys) == 0:
        return []
    if (keys == keys[0]).all():  # the usual case: every replica alike
        return [np.arange(len(keys))]
    mix = _MIX if keys.shape[1] <= len(_MIX) else np.resize(_MIX, keys.shape[1])  # wider rows reuse the draws
    h = keys @ mix[: keys.shape[1]]
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
    out = []
    for idx, pattern in pattern_groups(x, False):
        first = np.array(pattern, dtype=np.int64)
        out.append((idx, np.flatnonzero(first == np.arange(len(first))), first))
    return out


PEELS = 4  # patterns ``pattern_groups`` peels one by one before it compares every row's pattern at once


def pattern_groups(x: np.ndarray, neg: bool) -> list[tuple[np.ndarray, list[int]]]:
    """``group_rows`` of each row's first-appearance pattern (with ``neg``, followed by which entries are
    negative), in its order (by hash, then pattern), each with that pattern. A plan change has a few
    patterns: each is peeled off by checking every row against one row's pattern at once (a row follows
    pattern P iff each entry equals the one at its first appearance in P and distinct labels hold
    distinct values); past PEELS the rows left are compared pairwise (``_patterns``)."""
    found: list[tuple[tuple[int, ...], np.ndarray]] = []
    rest, at = x, np.arange(len(x))
    for _ in range(PEELS):
        seen: dict[int, int] = {}
        row = rest[0].tolist()
        first = [seen.setdefault(g, i) for i, g in enumerate(row)]  # small: plain Python
        labels = list(seen.values())  # first appearances, in position order
        key = tuple(first) + (tuple(int(g < 0) for g in row) if neg else ())
        same = rest[:, first] == rest  # each entry equals the one at its first appearance in row 0
        if neg:
            same &= (rest < 0) == (np.array(row) < 0)
        lab = rest[:, labels] if len(labels) > 1 else None
        if same.all() and (lab is None or _distinct(lab)):  # flat checks first: the usual case
            found.append((key, at))
            rest = rest[:0]
            break
        ok = rows_all(same)
        if lab is not None:
            srt = np.sort(lab, axis=1)
            ok &= rows_all(srt[:, 1:] != srt[:, :-1])
        if ok.all():
            found.append((key, at))
            rest = rest[:0]
            break
        found.append((key, at[ok]))
        rest, at = rest[~ok], at[~ok]
    if not found[1:]:
        return [(found[0][1], list(found[0][0][: x.shape[1]]))]
    if len(rest):  # more patterns than PEELS: the rest pairwise
        found += [(tuple(p), at[idx]) for idx, p in _patterns(rest, neg)]
    mix = _mix(len(found[0][0]))
    found.sort(key=lambda kv: (_wrap(sum(a * b for a, b in zip(kv[0], mix, strict=True))), kv[0]))
    return [(idx, list(key[: x.shape[1]])) for key, idx in found]


def _distinct(lab: np.ndarray) -> bool:
    """Whether every row of ``lab`` holds distinct values: at once where no value repeats anywhere
    (classes whose members share no GPU), else row by row."""
    flat = lab.ravel()
    if flat.min() >= 0 and np.bincount(flat).max() <= 1:
        return True
    srt = np.sort(lab, axis=1)
    return bool((srt[:, 1:] != srt[:, :-1]).all())


def _patterns(x: np.ndarray, neg: bool) -> list[tuple[np.ndarray, list[int]]]:
    first = (x[:, :, None] == x[:, None, :]).argmax(axis=2)
    keys = np.concatenate([first, (x < 0).astype(np.int64)], axis=1) if neg else first
    return [(idx, keys[idx[0]].tolist()) for idx in group_rows(keys)]


def _mix(width: int) -> list[int]:
    """The hash weights ``group_rows`` gives rows of ``width`` entries."""
    return (_MIX if width <= len(_MIX) else np.resize(_MIX, width))[:width].tolist()


def _wrap(h: int) -> int:
    """``h`` as numpy's int64 sum of products leaves it (modulo 2**64, signed)."""
    return (h + 2**63) % 2**64 - 2**63


@lru_cache(maxsize=1024)
def part_columns(layout: Layout, sub: Layout) -> np.ndarray:
    """Per T_sub part of a ``layout`` unit, the unit ranks holding it (read-only: memoised)."""
    ident = tuple(range(layout.size))
    cols = np.array([part_gpus(layout, ident, sub, a, b) for a, b in part_indices(layout, sub)], dtype=np.int64)
    cols.setflags(write=False)
    return cols


@dataclass(kw_only=True, slots=True)
class LocalArrays:
    """One model-stage's primitives as member arrays per kind (before grouping by shape)."""

    splits: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (current unit, part ids)
    extends: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (part id, sources)
    merges: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (target unit, inputs)
    destroys: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def stage_owners(plan: StagePlan, num_gpus: int, cache: PlanningCache) -> tuple[np.ndarray, np.ndarray]:
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


def local_plan(st: ReplicaStage, num_gpus: int, cache: PlanningCache) -> LocalArrays | None:
    """Every replica's primitives at once: each T_sub part is kept (a current unit reused whole),
    split from the one current unit holding it, or extended from the replicas overlapping it; target
    units of several parts are merged; current units nothing keeps are destroyed."""
    owner, rank = stage_owners(st.current, num_gpus, cache)
    own, rk = owner[st.parts], rank[st.parts]
    reuse, split_c = _reuse_or_split(st, own, rk)
    out = LocalArrays()
    kept = np.zeros(len(st.cur), dtype=bool)
    reused = reuse.any()
    if reused:
        kept_units = own[reuse, 0]
        kept[kept_units] = True
        if st.nq == 1:
            st.renamed = list(zip(kept_units.tolist(), np.flatnonzero(reuse).tolist()))
    elif st.nq == 1:
        st.renamed = []
    out.extends = _extends(np.flatnonzero(~reuse & (split_c < 0)), own, len(st.cur))
    if st.nq > 1 and not reused:  # every target unit merged from its own parts alone: one group
        inputs = np.arange(len(st.parts)).reshape(-1, st.nq)
        out.merges = [(np.arange(len(inputs)), inputs)]
    elif st.nq > 1:  # every target unit made of several parts
        inputs = np.where(reuse, -1 - own[:, 0], np.arange(len(st.parts))).reshape(-1, st.nq)
        out.merges = [(idx, inputs[idx]) for idx in group_rows((inputs < 0).astype(np.int64))]
    out.splits = _splits(np.flatnonzero(split_c >= 0), own, len(st.cur))
    out.destroys = np.flatnonzero(~kept)
    return out


def _reuse_or_split(st: ReplicaStage, own: np.ndarray, rk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per part: whether a current unit is reused as it, and else the column of the one current
    unit it is split from (-1: none; it is extended)."""
    sub, lc, lt = st.sub, st.current.layout, st.target.layout
    one_owner = rows_all(own == own[:, :1]) & (own[:, 0] >= 0)
    split_c = np.full(len(st.parts), -1, dtype=np.int64)
    if lc == sub:
        reuse = one_owner & rows_all(rk == np.arange(sub.size))
        if lt != sub and not layouts_nest(st.state.model, st.state.head, sub, lt):
            reuse[:] = False
        return reuse, split_c
    rk_t = rk.T.copy()  # ranks x parts: each column compared along axis 0
    for k, cols in enumerate(part_columns(lc, sub)):
        split_c[one_owner & (rk_t == cols[:, None]).all(axis=0)] = k
    return np.zeros(len(st.parts), dtype=bool), split_c


def rows_all(eq: np.ndarray) -> np.ndarray:
    """``eq.all(axis=1)`` of a boolean array: at once where it all holds (the usual case), else along
    axis 0 of its transpose (numpy reduces many short rows ~3x slower than few long ones)."""
    if eq.all():
        return np.ones(len(eq), dtype=bool)
    return np.asarray(eq.T.copy().all(axis=0))


def _extends(e_ids: np.ndarray, own: np.ndarray, dc: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(part ids, sources) per group: the replicas overlapping each part, most shared GPUs first."""
    out: list[tuple[np.ndarray, np.ndarray]] = []
    if not len(e_ids):
        return out
    e_own = own[e_ids]
    neg = e_own < 0
    alone = rows_all(neg) if neg.any() else None
    if alone is not None and alone.any():  # parts on GPUs no replica holds: one source each, round-robin (as local_dag)
        rr = np.arange(int(alone.sum()), dtype=np.int64) % dc
        out.append((e_ids[alone], rr[:, None]))
        e_ids, e_own = e_ids[~alone], e_own[~alone]
    if not len(e_ids):
        return out
    for idx, rep in pattern_groups(e_own, True):
        rep_own = e_own[idx[0]].tolist()
        pos = [p for p in range(len(rep)) if rep[p] == p and rep_own[p] >= 0]
        pos.sort(key=lambda p: (-rep.count(p), p))
        out.append((e_ids[idx], e_own[idx][:, pos]))
    return out


def _splits(s_ids: np.ndarray, own: np.ndarray, dc: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(current units, their part ids in target order) per number of parts split from each."""
    out: list[tuple[np.ndarray, np.ndarray]] = []
    if not len(s_ids):
        return out
    s_unit = own[s_ids, 0]
    order = np.lexsort((s_ids, s_unit))
    s_unit, s_ids = s_unit[order], s_ids[order]
    counts = np.bincount(s_unit, minlength=dc)
    units = np.flatnonzero(counts)
    ks = np.unique(counts[units])
    if len(ks) == 1:  # every unit split into as many parts (the usual case): all of them, in order
        return [(units, s_ids.reshape(-1, int(ks[0])))]
    for k in ks:
        chosen = units[counts[units] == k]
        rows = np.isin(s_unit, chosen)
        out.append((chosen, s_ids[rows].reshape(-1, int(k))))
    return out


Group = tuple[PrimitiveKind, np.ndarray, np.ndarray, np.ndarray]  # kind, unit, refs, GPU sequences


def classes_of(st: ReplicaStage, local: LocalArrays, order: int, cache: PlanningCache) -> list[ReplicaClass]:
    """The stage's primitives grouped into classes by relative shape ([] if one would be empty: the
    exact path deals with it)."""
    out: list[ReplicaClass] = []
    for kind, unit, refs, x in _groups(st, local):
        # a Destroy's shape is its unit's GPUs in rank order: one class
        shapes = _shape_groups(x) if kind is not PrimitiveKind.DESTROY else [
            (np.arange(len(x)), np.arange(x.shape[1]), np.arange(x.shape[1]))]
        for idx, labels, first in shapes:
            whole = len(idx) == len(x)  # one class of every member: the arrays as they are
            g = x if whole else x[idx]
            if len(labels) < g.shape[1]:
                g = g[:, labels]
            shape = _class_shape(st, kind, unit, refs, idx, first, g, cache)
            if shape.empty:
                return []
            c = ReplicaClass(kind=kind, stage=st.name, stage_order=order, canon=shape.canon, gpus=g,
                             unit=unit if whole else unit[idx], refs=refs if whole else refs[idx],
                             touched=shape.touched, first=sum(x.size for x in out), shape=shape)
            c._finish()
            out.append(c)
    return out


def _groups(st: ReplicaStage, local: LocalArrays) -> list[Group]:
    """Per kind and member arrays: the GPU sequence of every member (its units' GPUs in field order)."""
    cur, tgt, parts, nq = st.cur, st.tgt, st.parts, st.nq

    def part_seq(pid: np.ndarray) -> list[np.ndarray]:  # a part's GPUs, then its final unit's
        return [parts[pid]] if nq == 1 else [parts[pid], tgt[pid // nq]]

    groups: list[Group] = []
    for u, refs in local.splits:  # each part's GPUs (then its final unit's), part after part: one gather
        each = parts[refs] if nq == 1 else np.concatenate([parts[refs], tgt[refs // nq]], axis=2)
        groups.append((PrimitiveKind.SPLIT, u, refs, np.concatenate([cur[u], each.reshape(len(u), -1)], axis=1)))
    for pid, refs in local.extends:  # the sources' GPUs, source after source: one gather
        seq = part_seq(pid) + [cur[refs].reshape(len(pid), -1)]
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
    return groups


def _class_shape(st: ReplicaStage, kind: PrimitiveKind, unit: np.ndarray, refs: np.ndarray, idx: np.ndarray,
                 first: np.ndarray, g: np.ndarray, cache: PlanningCache) -> ClassShape:
    """The class's canonical footprint, touched labels and what derives from them, memoised per relative
    shape: the layouts come with the kind and the inputs' types (a kept current unit, or a T_sub part)."""
    key = (kind, st.state, st.current.layout, st.target.layout, tuple((refs[idx[0]] < 0).tolist()),
           first.tobytes())
    hit = cache.class_shapes.get(key)
    if hit is not None:
        return hit
    rep = _representative(st, kind, int(unit[idx[0]]), refs[idx[0]])
    canon, gpus = canonical_footprint(rep, cache)
    # invariant: _shape_groups labels GPUs by first appearance, as canonical_footprint does
    assert gpus == g[0].tolist(), f"replica class labels disagree: {gpus} vs {g[0].tolist()}"
    touched = np.array(sorted(canon.gpus), dtype=np.int64)
    empty = not len(touched) and not (kind is PrimitiveKind.MERGE and relabels(rep))
    return cache.class_shapes.put(key, class_shape(canon, touched, empty))


def _representative(st: ReplicaStage, kind: PrimitiveKind, unit: int, refs: np.ndarray) -> Primitive:
    """Member ``unit`` of a class as a real primitive (uids and versions do not change its shape)."""
    old_version, new_version = 0, 1
    cur = {int(i): unit_emu(st, old_version, int(i), True) for i in refs if kind is PrimitiveKind.EXTEND}
    if kind in (PrimitiveKind.SPLIT, PrimitiveKind.DESTROY):
        cur[unit] = unit_emu(st, old_version, unit, True)
    if kind is PrimitiveKind.MERGE:
        cur.update({-1 - int(r): unit_emu(st, old_version, -1 - int(r), True) for r in refs if r < 0})
    pids = [unit] if kind is PrimitiveKind.EXTEND else [int(r) for r in refs if r >= 0]
    tgt_ids = {p // st.nq for p in pids} | ({unit} if kind is PrimitiveKind.MERGE else set())
    tgt = {j: unit_emu(st, new_version, j, False) for j in tgt_ids}
    part_of = {p: target_parts(tgt[p // st.nq], st.sub)[p % st.nq] for p in pids}
    if kind is PrimitiveKind.DESTROY:
        return Destroy(unit=cur[unit])
    if kind is PrimitiveKind.SPLIT:
        return Split(unit=cur[unit], parts=tuple(part_of[int(r)] for r in refs))
    if kind is PrimitiveKind.EXTEND:
        return Extend(sources=tuple(cur[int(r)] for r in refs), target=part_of[unit])
    return Merge(parts=tuple(part_of[int(r)] if r >= 0 else cur[-1 - int(r)] for r in refs), unit=tgt[unit])
