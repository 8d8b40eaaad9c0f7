"""Replay a TransitionDAG on an abstract element-level model of shards (for tests and debugging).

Every element of every tensor state gets a distinct value that names its domain (the role's model:
actor-gen and actor-train share one), tensor, state kind and global index; stale replicas (a weight
sync's old generation copies) carry negated values. Replaying the primitives in ``order`` copies those
values along each piece, and checks that:

- every piece reads a live, complete shard on its source GPU and lands inside its destination shard;
- every target shard is written exactly once and ends with exactly the right source values;
- the last copy of an element is never dropped while a pending target still needs it;
- no GPU exceeds the capacity at any point (state, plus bucket buffers while a primitive runs), and
  the peak of each GPU equals what the DAG's memory check predicted;
- afterwards the GPUs hold exactly the new plan's units, nothing else.

Uses numpy (no torch, no I/O); meant for small models: it materialises every element.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from planner.errors import NereusError
from transitions.emu import EMU, StateKey
from transitions.footprints import wire_buffers
from transitions.geometry import StateKind
from transitions.global_dag import TransitionDAG
from transitions.pieces import pieces
from transitions.primitives import Destroy, Merge, Primitive
from transitions.transfer_plan import Piece

_INDEX_BITS = 36


class ReplayError(NereusError):
    """The DAG, replayed element by element, does not do what a transition must (the message says which
    check failed: capacity, a read of an incomplete or missing shard, a target written twice or wrong,
    the last copy dropped, leftovers). A typed failure, not an AssertionError: replay is the oracle that
    tests and debugging tools call, and they report it as such."""


@dataclass(kw_only=True)
class ReplayReport:
    peak_bytes: dict[int, int]
    pieces_local: int = 0
    pieces_remote: int = 0
    bytes_remote: int = 0
    final_units: list[str] = field(default_factory=list)


class _Replay:
    def __init__(self, dag: TransitionDAG, stale: frozenset[str]) -> None:
        self.dag = dag
        self.stale = stale
        self.full: dict[tuple[str, str, str], np.ndarray] = {}
        self.domains: dict[str, str] = {}
        self.alive: dict[tuple[str, int], dict[StateKey, np.ndarray]] = {}
        self.units: dict[str, EMU] = {}
        self.complete: set[str] = set()
        self.cover: dict[tuple[str, StateKey], np.ndarray] = {}
        self.used: dict[int, int] = {}
        self.peak: dict[int, int] = {}

    # --- values ---------------------------------------------------------------------------------
    def domain(self, unit: EMU) -> str:
        d = self.domains.get(unit.uid)
        if d is None:
            state = unit.state
            d = self.domains[unit.uid] = f"{state.role.value}/{state.model.name}/{state.head.value}"
        return d

    def expected(self, unit: EMU, key: StateKey, offsets: tuple[int, ...], lengths: tuple[int, ...],
                 shape: tuple[int, ...]) -> np.ndarray:
        full_key = (self.domain(unit), key[0], key[1].value)
        full = self.full.get(full_key)
        if full is None:
            base = len(self.full) + 1
            full = (base << _INDEX_BITS) + np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
            self.full[full_key] = full
        return full[tuple(slice(o, o + k) for o, k in zip(offsets, lengths))]

    # --- memory and coverage --------------------------------------------------------------------
    def add_bytes(self, gpu: int, nbytes: int) -> None:
        self.used[gpu] = self.used.get(gpu, 0) + nbytes

    def check_capacity(self, gpu: int, during: int, what: str) -> None:
        self.peak[gpu] = max(self.peak.get(gpu, 0), during)
        if during > self.dag.capacity_bytes:
            raise ReplayError(f"GPU {gpu} at {during} bytes > capacity {self.dag.capacity_bytes} ({what})")

    def cover_add(self, unit: EMU, delta: int) -> None:
        if unit.uid in self.stale:
            return
        for g in unit.gpus:
            for s in unit.shards(g):
                arr = self.cover.setdefault((self.domain(unit), s.key), np.zeros(s.global_shape, np.int32))
                arr[s.slices] += delta

    def materialise(self, unit: EMU, fill_values: bool) -> None:
        self.units[unit.uid] = unit
        for g in unit.gpus:
            shards = {}
            for s in unit.shards(g):
                if fill_values:
                    values = self.expected(unit, s.key, s.offsets, s.lengths, s.global_shape)
                    shards[s.key] = -values if unit.uid in self.stale else values
                else:
                    shards[s.key] = np.full(s.lengths, -1, dtype=np.int64)
            self.alive[(unit.uid, g)] = shards

    def free(self, unit: EMU, pending_domains: set[str]) -> None:
        if unit.uid not in self.units:
            raise ReplayError(f"frees {unit.uid}, which is not alive")
        if unit.uid in self.complete:
            self.cover_add(unit, -1)
            if self.domain(unit) in pending_domains:
                for g in unit.gpus:
                    for s in unit.shards(g):
                        if not self.cover[(self.domain(unit), s.key)][s.slices].all():
                            raise ReplayError(f"freeing {unit.uid} drops the last copy of {s.key} on GPU {g}")
        for g in unit.gpus:
            del self.alive[(unit.uid, g)]
            self.add_bytes(g, -unit.bytes_on(g))
        del self.units[unit.uid]
        self.complete.discard(unit.uid)


def replay(dag: TransitionDAG) -> ReplayReport:
    """Replay ``dag``; its stale units' bytes must never reach a target (weight sync)."""
    stale = frozenset(dag.stale_units)
    r = _Replay(dag, stale)
    for u in dag.old_units:
        r.materialise(u, fill_values=True)
        r.complete.add(u.uid)
        r.cover_add(u, +1)
        for g in u.gpus:
            r.add_bytes(g, u.bytes_on(g))
    for g, b in r.used.items():
        r.peak[g] = b
    report = ReplayReport(peak_bytes=r.peak)
    pending = {u.uid: u for u in dag.new_units}
    for _old_uid, new_uid in dag.renamed:
        pending.pop(new_uid)
    for i in dag.order:
        prim = dag.nodes[i]
        if isinstance(prim, Destroy):
            r.free(prim.unit, {r.domain(u) for u in pending.values()})
            continue
        _replay_node(r, i, prim, report, pending)
    _check_end(r, dag, pending, stale, report)
    return report


def _replay_node(r: _Replay, i: int, prim: Primitive, report: ReplayReport, pending: dict[str, EMU]) -> None:
    """One node that builds targets: allocate (checked against capacity, bucket buffers included),
    copy every piece, check each target shard written exactly once with the right values, free."""
    relabelled: set[tuple[str, int]] = set()
    for t in prim.targets:
        if t.uid in r.units:
            raise ReplayError(f"{t.uid} produced twice")
        r.materialise(t, fill_values=False)
        if isinstance(prim, Merge):
            for p in prim.parts:
                if p.final == t:
                    for g in p.gpus:
                        r.alive[(t.uid, g)] = r.alive[(p.uid, g)]
                        relabelled.add((t.uid, g))
    written = {(t.uid, g): {k: np.zeros(v.shape, np.int32) for k, v in r.alive[(t.uid, g)].items()}
               for t in prim.targets for g in t.gpus if (t.uid, g) not in relabelled}
    buffers = wire_buffers(prim)  # the executor's own bucketizer, as the memory check counts it
    alloc: dict[int, int] = {}
    for t in prim.targets:
        for g in t.gpus:
            if (t.uid, g) not in relabelled:
                alloc[g] = alloc.get(g, 0) + t.bytes_on(g)
    for g in r.dag.footprints[i].gpus | set(alloc) | set(buffers):
        r.check_capacity(g, r.used.get(g, 0) + alloc.get(g, 0) + buffers.get(g, 0), f"node {i}")
    for g, b in alloc.items():
        r.add_bytes(g, b)
    for pc in pieces(prim):
        _copy_piece(r, i, pc, written, report)
    for t in prim.targets:
        for g in t.gpus:
            for s in t.shards(g):
                if (t.uid, g) in written and not (written[(t.uid, g)][s.key] == 1).all():
                    raise ReplayError(f"{t.uid} on GPU {g}: {s.key} not written exactly once")
                want = r.expected(t, s.key, s.offsets, s.lengths, s.global_shape)
                if not np.array_equal(r.alive[(t.uid, g)][s.key], want):
                    raise ReplayError(f"{t.uid} on GPU {g}: {s.key} holds the wrong bytes")
        r.complete.add(t.uid)
        r.cover_add(t, +1)
        pending.pop(t.uid, None)
    for f in prim.frees:
        if isinstance(prim, Merge) and f.final is not None and f.final in prim.targets:
            r.cover_add(f, -1)  # relabelled: its bytes now belong to the merged unit
            for g in f.gpus:
                del r.alive[(f.uid, g)]
            del r.units[f.uid]
            r.complete.discard(f.uid)
            continue
        r.free(f, {r.domain(u) for u in pending.values()})


def _copy_piece(r: _Replay, i: int, pc: Piece, written: dict[tuple[str, int], dict[StateKey, np.ndarray]],
                report: ReplayReport) -> None:
    if pc.src_unit not in r.complete:
        raise ReplayError(f"node {i} reads {pc.src_unit}, which is not complete")
    key: StateKey = (pc.tensor, StateKind(pc.kind))
    src = r.alive.get((pc.src_unit, pc.src_worker))
    if src is None or key not in src:
        raise ReplayError(f"node {i}: {pc.src_unit} holds no {pc.tensor}/{pc.kind} on GPU {pc.src_worker}")
    dst = r.alive[(pc.dst_unit, pc.dst_worker)][key]
    src_arr = src[key]
    if any(o + k > n for o, k, n in zip(pc.src_offsets, pc.lengths, src_arr.shape)) or \
            any(o + k > n for o, k, n in zip(pc.dst_offsets, pc.lengths, dst.shape)):
        raise ReplayError(f"node {i}: piece {pc} outside its shards")
    dst[pc.dst_slices] = src_arr[pc.src_slices]
    written[(pc.dst_unit, pc.dst_worker)][key][pc.dst_slices] += 1
    if pc.is_local:
        report.pieces_local += 1
    else:
        report.pieces_remote += 1
        report.bytes_remote += pc.num_bytes


def _check_end(r: _Replay, dag: TransitionDAG, pending: dict[str, EMU], stale: frozenset[str],
               report: ReplayReport) -> None:
    """Exactly the new plan's units are left, with the right values, and the peaks are the DAG's."""
    if pending:
        raise ReplayError(f"targets never produced: {sorted(pending)}")
    renamed = dict(dag.renamed)
    left = {renamed.get(uid, uid) for uid in r.units}
    planned = {u.uid for u in dag.new_units}
    if left != planned:
        raise ReplayError(f"left on GPUs {sorted(left - planned)}, missing {sorted(planned - left)}")
    for (uid, g), shards in r.alive.items():
        unit = r.units[uid]
        if uid in stale:
            raise ReplayError(f"stale {uid} survived")
        for s in unit.shards(g):
            want = r.expected(unit, s.key, s.offsets, s.lengths, s.global_shape)
            if not np.array_equal(shards[s.key], want):
                raise ReplayError(f"{uid} on GPU {g}: {s.key} wrong at the end")
    for g, peak in r.peak.items():
        predicted = dag.peak_bytes.get(g, 0)
        if peak != predicted:
            raise ReplayError(f"GPU {g}: replay peak {peak} != predicted {predicted}")
    report.final_units = sorted(left)
