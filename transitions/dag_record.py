"""The frozen transition DAG (``TransitionDAG``, its unit-level ``DagBody``), its expansion from
replica classes, its per-GPU index and its record form (``to_dict``, what the daemon stores). Built by
transitions.global_dag.build_transition, which re-exports these names. Pure: no torch, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from transitions.emu import EMU, rank_bytes
from transitions.primitives import Footprint, Primitive
from transitions.replica_classes import ReplicaPlan
from transitions.replica_order import _edges as stage_edges


@dataclass(frozen=True, kw_only=True, slots=True)
class DagBody:
    """The unit-level DAG: primitives, edges, the checked order and its memory peaks."""

    nodes: tuple[Primitive, ...]
    stage_order: tuple[int, ...]  # per node: 0 generation, 1 inference, 2 training
    data_edges: tuple[tuple[int, int], ...]
    resource_edges: tuple[tuple[int, int], ...]
    order: tuple[int, ...]
    old_units: tuple[EMU, ...]  # intact units before the transition
    lost_units: tuple[EMU, ...]  # units that had a GPU on a lost GPU
    new_units: tuple[EMU, ...]
    renamed: tuple[tuple[str, str], ...]  # (old uid, new uid) of units that stay as they are
    stale_units: tuple[str, ...]  # old units dropped unread (refreshed by a weight sync)
    peak_bytes: dict[int, int]  # per GPU touched: the highest point of its timeline
    footprints: tuple[Footprint, ...]
    gpu_nodes: dict[int, tuple[int, ...]]  # GPU -> node ids in order


@dataclass(frozen=True, kw_only=True, slots=True, eq=False, weakref_slot=True)
class TransitionDAG:
    """Frozen plan of a transition. Built either unit by unit (``body`` given) or over replica classes
    (``replicas``, transitions.replica_classes): then the unit-level DAG is expanded on first use of
    any unit-level attribute, and the schedule (transitions.cost) runs on the classes."""

    old_version: int
    new_version: int
    capacity_bytes: int
    replicas: ReplicaPlan | None = field(default=None, repr=False)
    body_: DagBody | None = field(default=None, repr=False)

    @property
    def body(self) -> DagBody:
        body = self.body_
        if body is None:
            assert self.replicas is not None
            body = _expand(self.replicas)
            object.__setattr__(self, "body_", body)  # a cache of what ``replicas`` determines
        return body

    @property
    def expanded(self) -> bool:
        return self.body_ is not None

    @property
    def nodes(self) -> tuple[Primitive, ...]:
        return self.body.nodes

    @property
    def stage_order(self) -> tuple[int, ...]:
        return self.body.stage_order

    @property
    def data_edges(self) -> tuple[tuple[int, int], ...]:
        return self.body.data_edges

    @property
    def resource_edges(self) -> tuple[tuple[int, int], ...]:
        return self.body.resource_edges

    @property
    def order(self) -> tuple[int, ...]:
        return self.body.order

    @property
    def old_units(self) -> tuple[EMU, ...]:
        return self.body.old_units

    @property
    def lost_units(self) -> tuple[EMU, ...]:
        return self.body.lost_units

    @property
    def new_units(self) -> tuple[EMU, ...]:
        return self.body.new_units

    @property
    def renamed(self) -> tuple[tuple[str, str], ...]:
        return self.body.renamed

    @property
    def stale_units(self) -> tuple[str, ...]:
        return self.body.stale_units

    @property
    def peak_bytes(self) -> dict[int, int]:
        return self.body.peak_bytes

    @property
    def footprints(self) -> tuple[Footprint, ...]:
        return self.body.footprints

    @property
    def gpu_nodes(self) -> dict[int, tuple[int, ...]]:
        return self.body.gpu_nodes

    @property
    def num_nodes(self) -> int:
        return self.replicas.num_nodes if self.body_ is None and self.replicas else len(self.body.nodes)

    def nodes_on(self, gpu: int) -> list[int]:
        """Node ids that touch ``gpu``, in execution order (what one worker runs)."""
        return list(self.gpu_nodes.get(gpu, ()))

    def ids_by_group(self, group_of: dict[int, int]) -> dict[int, list[int]]:
        """Per group of GPUs (``group_of``: GPU -> group, e.g. the daemon's nodes; GPUs not in it are
        left out), the sorted ids of the DAG nodes touching any of its GPUs: what ``gpu_nodes`` gives,
        grouped. A DAG over replica classes answers from its classes' GPU arrays (each member touches
        its class's labels on its own GPUs), without expanding to units: an order's per-node parts
        need no unit-level DAG."""
        if self.body_ is not None or self.replicas is None:
            out: dict[int, set[int]] = {}
            for gpu, ids in self.gpu_nodes.items():
                if gpu in group_of:
                    out.setdefault(group_of[gpu], set()).update(ids)
            return {k: sorted(v) for k, v in out.items()}
        plan = self.replicas
        size = 1 + max([*group_of, *(int(c.g.max()) for c in plan.classes if c.g.size)], default=0)
        lookup = np.full(size, -1, dtype=np.int64)
        lookup[list(group_of)] = list(group_of.values())
        node_ids: list[np.ndarray] = []
        groups: list[np.ndarray] = []
        for k, c in enumerate(plan.classes):
            if not c.g.size:
                continue
            grouped = lookup[c.g]  # members x touched labels
            node_ids.append(np.repeat(plan.first[k] + np.arange(c.size, dtype=np.int64), grouped.shape[1]))
            groups.append(grouped.ravel())
        if not node_ids:
            return {}
        group, node = np.concatenate(groups), np.concatenate(node_ids)
        keep = group >= 0
        pairs = np.unique(group[keep] * plan.num_nodes + node[keep])  # sorted by group, then node id
        group, node = np.divmod(pairs, plan.num_nodes)
        cuts = np.flatnonzero(np.diff(group)) + 1
        return {int(g[0]): n.tolist() for g, n in zip(np.split(group, cuts), np.split(node, cuts)) if len(g)}

    def with_order(self, order: tuple[int, ...], resource_edges: tuple[tuple[int, int], ...] = ()
                   ) -> TransitionDAG:
        """The same DAG run in another order (for comparisons; memory is not re-checked)."""
        body = replace(self.body, order=order, resource_edges=resource_edges,
                       gpu_nodes=gpu_index(list(self.body.footprints), order))
        return TransitionDAG(old_version=self.old_version, new_version=self.new_version,
                             capacity_bytes=self.capacity_bytes, body_=body)

    @property
    def initial_bytes(self) -> dict[int, int]:
        """Per GPU, the bytes its intact old units hold before the transition (where the timeline starts)."""
        return held_bytes(self.old_units)

    @property
    def bytes_moved(self) -> int:
        if self.body_ is None and self.replicas is not None:
            return self.replicas.bytes_moved
        return sum(fp.moved_bytes for fp in self.footprints)

    def to_dict(self) -> dict[str, Any]:
        units: dict[str, dict[str, object]] = {}
        for prim in self.nodes:
            for u in (*prim.sources, *prim.targets, *prim.frees):
                if u.uid not in units:  # described once, not once per mention
                    units[u.uid] = u.describe()
        for u in (*self.old_units, *self.new_units, *self.lost_units):
            if u.uid not in units:
                units[u.uid] = u.describe()
        return {
            "old_version": self.old_version,
            "new_version": self.new_version,
            "nodes": [
                {"id": i, "kind": p.kind.value, "sources": [u.uid for u in p.sources],
                 "targets": [u.uid for u in p.targets], "frees": [u.uid for u in p.frees],
                 "bytes_moved": self.footprints[i].moved_bytes}
                for i, p in enumerate(self.nodes)
            ],
            "data_edges": [list(e) for e in self.data_edges],
            "resource_edges": [list(e) for e in self.resource_edges],
            "order": list(self.order),
            "units": units,
            "old_units": [u.uid for u in self.old_units],
            "lost_units": [u.uid for u in self.lost_units],
            "new_units": [u.uid for u in self.new_units],
            "renamed": [list(r) for r in self.renamed],
            "stale_units": list(self.stale_units),
            "capacity_bytes": self.capacity_bytes,
            "peak_bytes": {str(g): b for g, b in sorted(self.peak_bytes.items())},
            "bytes_moved": self.bytes_moved,
        }


def data_edges(nodes: list[Primitive]) -> list[tuple[int, int]]:
    producer: dict[str, int] = {}
    readers: dict[str, list[int]] = {}
    for i, p in enumerate(nodes):
        for u in p.targets:
            producer[u.uid] = i
        for u in p.sources:
            readers.setdefault(u.uid, []).append(i)
    edges: set[tuple[int, int]] = set()
    for i, p in enumerate(nodes):
        for u in p.sources:
            j = producer.get(u.uid)
            if j is not None:
                edges.add((j, i))
        for u in p.frees:
            j = producer.get(u.uid)
            if j is not None and j != i:
                edges.add((j, i))
            for r in readers.get(u.uid, ()):
                if r != i:
                    edges.add((r, i))
    return sorted(edges)


def _expand(plan: ReplicaPlan) -> DagBody:
    """The unit-level DAG of a class-level plan: members of each class back to back, in class order;
    edges re-derived from the primitives, peaks replayed exactly (the class check bounds them)."""
    nodes, stage_order, old_units, new_units, renamed = plan.expand()
    # each member's footprint is its class's over its own GPUs (what footprint(member) derives, without
    # relabelling every member to look it up): node ids run stage by stage, class by class
    fps = [fp for sc in plan.stages for c in sc.classes for fp in member_footprints(c.canon, c.gpus.tolist())]
    order = tuple(plan.order())
    return DagBody(nodes=tuple(nodes), stage_order=tuple(stage_order), data_edges=tuple(class_data_edges(plan)),
                   resource_edges=tuple(plan.resource_edges), order=order, old_units=tuple(old_units),
                   lost_units=plan.lost_units,
                   new_units=tuple(new_units), renamed=tuple(renamed), stale_units=(),
                   peak_bytes=class_peaks(plan, held_bytes(old_units)), footprints=tuple(fps),
                   gpu_nodes=class_gpu_index(plan))


def class_data_edges(plan: ReplicaPlan) -> list[tuple[int, int]]:
    """``data_edges`` of the expanded nodes, from the class arrays: each stage's unit-level edges as
    ``link`` derived them (replica_order._edges: data_edges' rules over arrays, stage-local node ids;
    units never cross stages), offset by the stage's first node, sorted, each once.
    tests/transitions/test_replica_expand.py checks it against data_edges."""
    keys: list[np.ndarray] = []
    for sc, base in zip(plan.stages, plan.stage_base, strict=True):
        if sc.classes:
            src, dst = stage_edges(sc.stage, sc.classes)
            keys.append((src + base) * plan.num_nodes + (dst + base))
    if not keys:
        return []
    key = np.unique(np.concatenate(keys)).tolist()
    return [(k // plan.num_nodes, k % plan.num_nodes) for k in key]


_new = object.__new__
# Footprint's slots' own setters (what its frozen dataclass ``__init__`` reaches through
# object.__setattr__): the expansion builds one footprint per member (~2,500 at 1,024 GPUs)
_put_alloc, _put_free, _put_buffer, _put_local, _put_pair = (
    vars(Footprint)[name].__set__ for name in ("alloc_bytes", "free_bytes", "buffer_bytes", "local_bytes",
                                               "pair_bytes"))


def member_footprints(canon: Footprint, rows: list[list[int]]) -> list[Footprint]:
    """``on_gpus(canon, row)`` for every row (a member's GPU per label), the label maps read once and
    each footprint built without the dataclass ``__init__`` (Footprint checks nothing).
    tests/transitions/test_replica_expand.py checks both against on_gpus."""
    alloc, free, buf = list(canon.alloc_bytes.items()), list(canon.free_bytes.items()), list(canon.buffer_bytes.items())
    local, pair = list(canon.local_bytes.items()), list(canon.pair_bytes.items())
    out: list[Footprint] = []
    for g in rows:  # a map the class leaves empty is an empty dict, without running a comprehension
        fp = _new(Footprint)
        _put_alloc(fp, {g[k]: v for k, v in alloc} if alloc else {})
        _put_free(fp, {g[k]: v for k, v in free} if free else {})
        _put_buffer(fp, {g[k]: v for k, v in buf} if buf else {})
        _put_local(fp, {g[k]: v for k, v in local} if local else {})
        _put_pair(fp, {(g[s], g[d]): v for (s, d), v in pair} if pair else {})
        out.append(fp)
    return out


def class_peaks(plan: ReplicaPlan, held: dict[int, int]) -> dict[int, int]:
    """What ``apply_footprint`` of every member in ``plan.order()`` leaves in ``peak`` from ``held``,
    replayed per class over its member arrays: a member changes only the GPUs of its class's touched
    labels (distinct GPUs), so a class whose members share no GPU runs at once, the others member by
    member. A GPU's peak is the highest of what it holds at the start and while any member runs on it
    (held + alloc + buffer); a GPU held nothing at the start enters only once that is above zero.
    The GPUs held at the start come first, in ``held``'s order, then the others by id. ``held`` and the
    classes name GPUs of the plan's cluster only (``_relabelled_stage`` refuses any other)."""
    now = np.zeros(len(plan.initial), dtype=np.int64)  # every GPU of the plan's cluster
    now[list(held)] = list(held.values())
    high = now.copy()
    for k in plan.class_order:
        c = plan.classes[k]
        need = c.alloc + c.buf
        for g in ((c.g,) if c.single else c.g):  # rows: one member at a time
            high[g] = np.maximum(high[g], now[g] + need)
            now[g] += c.delta
    peak = high.tolist()
    out = {g: peak[g] for g in held}
    for g in np.flatnonzero(high > 0).tolist():
        if g not in out:
            out[g] = peak[g]
    return out


def class_gpu_index(plan: ReplicaPlan) -> dict[int, tuple[int, ...]]:
    """``gpu_index(footprints, plan.order())`` from the class arrays: per GPU, the ids of the members
    touching it in execution order (GPUs by id)."""
    gpus: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    for k in plan.class_order:
        c = plan.classes[k]
        gpus.append(c.g.ravel())
        ids.append(np.repeat(plan.first[k] + np.arange(c.size), len(c.touched)))
    if not gpus:
        return {}
    gpu, node = np.concatenate(gpus), np.concatenate(ids)
    if not len(gpu):  # no class touches a GPU
        return {}
    by_gpu = np.argsort(gpu * len(gpu) + np.arange(len(gpu)))  # by GPU, then in execution order
    gpu, node = gpu[by_gpu], node[by_gpu]
    starts = [0, *(np.flatnonzero(np.diff(gpu)) + 1).tolist(), len(gpu)]
    gl, nl = gpu.tolist(), node.tolist()
    return {gl[a]: tuple(nl[a:b]) for a, b in zip(starts[:-1], starts[1:])}


def held_bytes(units: list[EMU] | tuple[EMU, ...]) -> dict[int, int]:
    """Bytes ``units`` hold per GPU. A unit's ranks hold ``emu.rank_bytes`` of its state and layout (summed
    from the TP boxes: no shards built for units nothing moves), looked up
    once per (state, layout) object pair: replicas share both, and hashing a state per unit is dear."""
    out: dict[int, int] = {}
    per_rank: dict[tuple[int, int], tuple[int, ...]] = {}
    for u in units:
        if u.final is not None:  # a T_sub part holds its final unit's shards
            for g in u.gpus:
                out[g] = out.get(g, 0) + u.bytes_on(g)
            continue
        key = (id(u.state), id(u.layout))
        held = per_rank.get(key)
        if held is None:
            held = per_rank[key] = rank_bytes(u.state, u.layout)
        for g, n in zip(u.gpus, held):
            out[g] = out.get(g, 0) + n
    return out


def gpu_index(fps: list[Footprint], order: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    index: dict[int, list[int]] = {}
    for i in order:
        for g in fps[i].gpus:
            index.setdefault(g, []).append(i)
    return {g: tuple(nodes) for g, nodes in index.items()}
