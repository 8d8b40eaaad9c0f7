"""The records of a transition planned over replica classes, and its expansion to units. Pure.

A ``ReplicaClass`` is every primitive of one model-stage and kind with the same relative shape: one
canonical footprint over GPU labels and the GPU of each label per member. ``StageClasses`` is one
model-stage's classes and the edges between them; ``ReplicaPlan`` a whole transition's, with its
checked class order, expanded to unit-level primitives on demand (``ReplicaPlan.expand``). Built by
transitions.replica_classes; the schedule over classes is transitions.cost's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from planner.plan import Layout, StagePlan
from transitions.emu import EMU, UnitState, part_indices
from transitions.local_dag import unit_uid
from transitions.planning_cache import PlanningCache
from transitions.primitives import Destroy, Extend, Footprint, Merge, Primitive, PrimitiveKind, Split


@dataclass(kw_only=True, slots=True, eq=False)
class ClassShape:
    """What every class of one relative shape shares, derived once (memoised in
    PlanningCache.class_shapes, so a never-seen pair of stage plans made of known shapes reuses it):
    its canonical footprint, touched labels and their bytes, its pairs as arrays over labels, and
    per-cluster member durations by intra-node pattern (transitions.cost's memo)."""

    canon: Footprint
    touched: np.ndarray
    empty: bool  # no GPU touched and nothing renamed: the exact path deals with such a stage
    alloc: np.ndarray  # per touched label
    buf: np.ndarray
    delta: np.ndarray  # alloc - free
    acquire: bool
    # transitions.cost's, filled on its first use: (source labels, destination labels, bytes) per pair in
    # canon.pair_bytes' order, each pair onto its source and onto its destination (pairs x labels), and
    # per cluster and intra-node pattern the members' durations
    pairs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    durations: dict[tuple[object, ...], tuple[object, tuple[np.ndarray, int, int]]] = field(default_factory=dict)


def class_shape(canon: Footprint, touched: np.ndarray, empty: bool = False) -> ClassShape:
    """``ClassShape`` of a canonical footprint, ``touched`` its labels occupied."""
    at = touched.tolist()
    alloc = np.array([canon.alloc_bytes.get(g, 0) for g in at], dtype=np.int64)
    buf = np.array([canon.buffer_bytes.get(g, 0) for g in at], dtype=np.int64)
    delta = alloc - np.array([canon.free_bytes.get(g, 0) for g in at], dtype=np.int64)
    for a in (alloc, buf, delta):
        a.setflags(write=False)
    return ClassShape(canon=canon, touched=touched, empty=empty, alloc=alloc, buf=buf, delta=delta,
                      acquire=bool(alloc.any() or buf.any()))


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
    shape: ClassShape | None = None  # canon's and touched's derived arrays (set by ``_finish`` if not given)
    # transitions.cost's, filled on first use: ``g`` and ``preds`` transposed (C order), so that a gather
    # by them reduces over members' GPUs or predecessors along axis 0 (4x faster than along axis 1)
    g_t: np.ndarray | None = None
    preds_t: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(self.gpus.shape[0])

    def _finish(self) -> None:
        if self.shape is None:
            self.shape = class_shape(self.canon, self.touched)
        sh = self.shape
        self.alloc, self.buf, self.delta, self.acquire = sh.alloc, sh.buf, sh.delta, sh.acquire
        # every label touched (labels are sorted): the GPUs as they are
        self.g = self.gpus if len(self.touched) == self.gpus.shape[1] else self.gpus[:, self.touched]
        self.single = not len(self.touched) or bool(np.bincount(self.g.ravel()).max() <= 1)


@dataclass(kw_only=True, slots=True)
class ReplicaStage:
    """One model-stage's current and target plans as GPU arrays (replicas x unit size), its T_sub
    parts, and the current units kept as target units (renamed)."""

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

    stage: ReplicaStage
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
    resource_edges: list[tuple[int, int]] = field(default_factory=list)  # where a class waited: global ids
    initial: np.ndarray  # bytes per GPU before the transition
    # after a loss, per stage: the old plan's index of each surviving replica (None: all survive), since
    # a stage's ``current`` plan then holds the survivors alone; and the units that touched a lost GPU
    survivors: list[np.ndarray | None] = field(default_factory=list)
    lost_units: tuple[EMU, ...] = ()
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
        for k, sc in enumerate(self.stages):
            st = sc.stage
            cur = stage_units(st.state, st.current, self.old_version, self.survivors[k] if self.survivors else None)
            tgt = stage_units(st.state, st.target, self.new_version)
            parts = tgt if st.nq == 1 else stage_parts(st, tgt)
            old_units += cur
            new_units += tgt
            renamed += [(cur[i].uid, tgt[j].uid) for i, j in st.renamed]
            for c in sc.classes:
                nodes += members(c, cur, tgt, parts)
                stage_order += [c.stage_order] * c.size
        return nodes, stage_order, old_units, new_units, renamed


_new = object.__new__
# EMU's slots' own setters, in field order (what its frozen dataclass ``__init__`` reaches through
# object.__setattr__): the expansion builds every unit and part of a plan (~5,000 at 1,024 GPUs)
_put_uid, _put_state, _put_layout, _put_gpus, _put_version, _put_final = (
    vars(EMU)[name].__set__ for name in ("uid", "state", "layout", "gpus", "version", "final"))


def make_emu(uid: str, state: UnitState, layout: Layout, gpus: tuple[int, ...], version: int,
             final: EMU | None) -> EMU:
    """``EMU(...)`` of these fields without its ``__init__`` checks (right number of GPUs, none twice, a
    part's inside its final unit's): the expansion's units come from validated StagePlans (and their
    parts from columns of a unit's GPUs), where those hold by construction.
    tests/transitions/test_replica_expand.py checks it sets every field."""
    unit = _new(EMU)
    _put_uid(unit, uid)
    _put_state(unit, state)
    _put_layout(unit, layout)
    _put_gpus(unit, gpus)
    _put_version(unit, version)
    _put_final(unit, final)
    return unit


def stage_units(state: UnitState, plan: StagePlan, version: int, index: np.ndarray | None = None) -> list[EMU]:
    """``plan_units(state, plan, version)``: the plan's units at ``version``; with ``index``, replica i
    is the unit numbered ``index[i]`` (the survivors of a loss keep their old plan's uids)."""
    name, layout = state.model_stage, plan.layout
    numbers = range(len(plan.gpu_sets)) if index is None else index.tolist()
    return [make_emu(unit_uid(name, version, numbers[k]), state, layout, tuple(g), version, None)
            for k, g in enumerate(plan.gpu_sets)]


def stage_parts(st: ReplicaStage, tgt: list[EMU]) -> list[EMU]:
    """Every target unit's ``target_parts`` (its ``nq`` T_sub parts, in part order), their GPUs read
    from the stage's part array (built from the same columns ``part_gpus`` takes)."""
    names = [f".p{a}.{b}" for a, b in part_indices(st.target.layout, st.sub)]
    rows = st.parts.tolist()
    out: list[EMU] = []
    for j, unit in enumerate(tgt):
        base = j * st.nq
        out += [make_emu(unit.uid + names[k], unit.state, st.sub, tuple(rows[base + k]), unit.version, unit)
                for k in range(st.nq)]
    return out


def members(c: ReplicaClass, cur: list[EMU], tgt: list[EMU], parts: list[EMU]) -> list[Primitive]:
    """Every member of ``c`` as a primitive (``member`` of each, with the member arrays read once)."""
    units, refs = c.unit.tolist(), c.refs.tolist()
    if c.kind is PrimitiveKind.DESTROY:
        return [Destroy(unit=cur[u]) for u in units]
    if c.kind is PrimitiveKind.SPLIT:
        return [Split(unit=cur[u], parts=tuple([parts[r] for r in rs])) for u, rs in zip(units, refs)]
    if c.kind is PrimitiveKind.EXTEND:
        return [Extend(sources=tuple([cur[r] for r in rs]), target=parts[u]) for u, rs in zip(units, refs)]
    return [Merge(parts=tuple([parts[r] if r >= 0 else cur[-1 - r] for r in rs]), unit=tgt[u])
            for u, rs in zip(units, refs)]


def member(c: ReplicaClass, m: int, cur: list[EMU], tgt: list[EMU], parts: list[EMU]) -> Primitive:
    u = int(c.unit[m])
    refs = [int(r) for r in c.refs[m]]
    if c.kind is PrimitiveKind.DESTROY:
        return Destroy(unit=cur[u])
    if c.kind is PrimitiveKind.SPLIT:
        return Split(unit=cur[u], parts=tuple(parts[r] for r in refs))
    if c.kind is PrimitiveKind.EXTEND:
        return Extend(sources=tuple(cur[r] for r in refs), target=parts[u])
    return Merge(parts=tuple(parts[r] if r >= 0 else cur[-1 - r] for r in refs), unit=tgt[u])


def unit_emu(st: ReplicaStage, version: int, index: int, current: bool) -> EMU:
    plan = st.current if current else st.target
    return EMU(uid=unit_uid(st.name, version, index), state=st.state, layout=plan.layout,
               gpus=tuple(plan.gpu_sets[index]), version=version)


@dataclass(kw_only=True, slots=True)
class ShapeEntry:
    """A stage's class-level plan over GPU labels (what ``_build_stage`` gives for every pair of
    stage plans with the same relative shape): the plan built for the first such pair, and its
    classes' and parts' GPUs as labels, derived on the first pair that reuses it (a shape seen once
    never pays for them). Held in PlanningCache.shape_stages."""

    built: StageClasses | None
    gpu_of: np.ndarray  # the GPU of each label in ``built``
    num_gpus: int
    labels: list[np.ndarray] | None = None  # per class: labels of ``gpus``
    parts: np.ndarray | None = None  # labels of the stage's T_sub parts

    def label_arrays(self, built: StageClasses) -> tuple[list[np.ndarray], np.ndarray]:
        """(per class: labels of its ``gpus``, labels of the parts) of ``built`` (this entry's)."""
        if self.labels is None or self.parts is None:
            label_of = np.full(self.num_gpus, -1, dtype=np.int64)
            label_of[self.gpu_of] = np.arange(len(self.gpu_of), dtype=np.int64)
            self.labels = [label_of[c.gpus] for c in built.classes]
            self.parts = label_of[built.stage.parts]
        return self.labels, self.parts
