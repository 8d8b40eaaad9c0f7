"""The frozen transition DAG (``TransitionDAG``, its unit-level ``DagBody``), its expansion from
replica classes, its per-GPU index and its record form (``to_dict``, what the daemon stores). Built by
transitions.global_dag.build_transition, which re-exports these names. Pure: no torch, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from transitions.emu import EMU, rank_bytes
from transitions.feasibility import apply_footprint
from transitions.footprints import on_gpus
from transitions.primitives import Footprint, Primitive
from transitions.replica_classes import ReplicaPlan


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
    fps = [on_gpus(c.canon, gpus) for sc in plan.stages for c in sc.classes for gpus in c.gpus.tolist()]
    order = tuple(plan.order())
    used = held_bytes(old_units)
    peak = dict(used)
    for i in order:
        apply_footprint(fps[i], used, peak)
    return DagBody(nodes=tuple(nodes), stage_order=tuple(stage_order), data_edges=tuple(data_edges(nodes)),
                   resource_edges=(), order=order, old_units=tuple(old_units), lost_units=(),
                   new_units=tuple(new_units), renamed=tuple(renamed), stale_units=(), peak_bytes=peak,
                   footprints=tuple(fps), gpu_nodes=gpu_index(fps, order))


def held_bytes(units: list[EMU] | tuple[EMU, ...]) -> dict[int, int]:
    """Bytes ``units`` hold per GPU. A unit's ranks hold ``rank_bytes`` of its state and layout, looked up
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
