"""Split, Merge, Extend, Destroy: frozen data over EMUs that derive, per GPU, the bytes they move.

- Split(unit -> parts): T_sub parts on the unit's own GPUs; a Destroy after all its readers frees it.
- Merge(parts -> unit): the unit on the parts' GPUs; parts delivered in final shape are relabelled.
- Extend(sources -> target): a replica (or part) on other GPUs, read from existing replicas.
- Destroy(unit): drop a replica locally, no collectives.

Every target shard on a GPU is covered, along its split dimension, first by what a source already
holds on that same GPU (a local piece: never sent), then by the sources in order, starting at the
rank-aligned holder so that each source rank feeds its own counterpart. ``transfers(gpu)`` is what one
GPU derives on its own; ``slot_pieces`` places them in the units' buffers (``transitions.layout``),
and ``wire_buffers`` is the bucket memory the executor holds for them, from the executor's own
bucketizer (``transitions.transfer_plan.messages``). ``footprint`` is the per-GPU memory and traffic
summary the DAG builder, the memory check and the cost model use; it is memoised per relative shape
(GPU ids relabelled) in the builder's transitions.planning_cache.PlanningCache, so the thousands of
identical replicas of a large plan cost one derivation. A primitive whose sources do not hold all of
a target shard raises transitions.errors.CoverageError. Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from planner.models import Parallel, TensorSpec
from transitions import transfer_plan
from transitions.emu import EMU, Box, StateKey, UnitState
from transitions.errors import CoverageError
from transitions.geometry import Shard, StateKind, tensor_stages
from transitions.layout import COUNTERS, COUNTERS_KIND, NUM_COUNTERS, unit_slots
from transitions.planning_cache import DEFAULT_CACHE, PlanningCache
from transitions.transfer_plan import Piece, in_flight_bytes, messages


class PrimitiveKind(str, Enum):
    SPLIT = "split"
    MERGE = "merge"
    EXTEND = "extend"
    DESTROY = "destroy"


@dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    """One box of one tensor's state kind copied from a source unit's GPU to a target unit's GPU."""

    src_gpu: int
    dst_gpu: int
    src_unit: str
    dst_unit: str
    tensor: str
    kind: StateKind
    offsets: tuple[int, ...]  # global box
    lengths: tuple[int, ...]
    src_offsets: tuple[int, ...]  # box start inside the source shard (local coordinates)
    dst_offsets: tuple[int, ...]  # box start inside the destination shard
    bytes_per_element: int

    @property
    def num_bytes(self) -> int:
        n = self.bytes_per_element
        for k in self.lengths:
            n *= k
        return n

    @property
    def is_local(self) -> bool:
        return self.src_gpu == self.dst_gpu

    @property
    def src_slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + k) for o, k in zip(self.src_offsets, self.lengths))

    @property
    def dst_slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + k) for o, k in zip(self.dst_offsets, self.lengths))


@dataclass(frozen=True, kw_only=True, slots=True)
class Footprint:
    """Per-GPU effect of a primitive: state allocated at start, freed at end, bucket buffers held while
    it runs, bytes copied locally, and bytes sent per (src, dst) GPU pair."""

    alloc_bytes: dict[int, int]
    free_bytes: dict[int, int]
    buffer_bytes: dict[int, int]
    local_bytes: dict[int, int]
    pair_bytes: dict[tuple[int, int], int]

    @property
    def gpus(self) -> frozenset[int]:
        """GPUs the primitive occupies (memory change or traffic): the per-GPU FIFO resources."""
        out = set(self.alloc_bytes) | set(self.free_bytes) | set(self.local_bytes)
        for s, d in self.pair_bytes:
            out.add(s)
            out.add(d)
        return frozenset(out)

    @property
    def moved_bytes(self) -> int:
        return sum(self.pair_bytes.values())


# --- the four primitives --------------------------------------------------------------------------


class _Derives:
    """Per-GPU derivation as methods (the module functions below do the work)."""

    __slots__ = ()

    def transfers(self, gpu: int | None = None) -> list[Transfer]:
        return transfers(self, gpu)  # type: ignore[arg-type]

    def pieces(self, gpu: int | None = None) -> list[Transfer]:
        return pieces(self, gpu)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True, slots=True)
class Split(_Derives):
    unit: EMU
    parts: tuple[EMU, ...]

    kind = PrimitiveKind.SPLIT

    @property
    def sources(self) -> tuple[EMU, ...]:
        return (self.unit,)

    @property
    def targets(self) -> tuple[EMU, ...]:
        return self.parts

    @property
    def frees(self) -> tuple[EMU, ...]:
        return ()  # the source lives until every reader is done; a Destroy after them frees it


@dataclass(frozen=True, kw_only=True, slots=True)
class Merge(_Derives):
    parts: tuple[EMU, ...]
    unit: EMU

    kind = PrimitiveKind.MERGE

    @property
    def sources(self) -> tuple[EMU, ...]:
        return self.parts

    @property
    def targets(self) -> tuple[EMU, ...]:
        return (self.unit,)

    @property
    def frees(self) -> tuple[EMU, ...]:
        return self.parts


@dataclass(frozen=True, kw_only=True, slots=True)
class Extend(_Derives):
    sources: tuple[EMU, ...]  # tried in order after same-GPU pieces; the first is the main source
    target: EMU

    kind = PrimitiveKind.EXTEND

    @property
    def targets(self) -> tuple[EMU, ...]:
        return (self.target,)

    @property
    def frees(self) -> tuple[EMU, ...]:
        return ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Destroy(_Derives):
    unit: EMU

    kind = PrimitiveKind.DESTROY

    @property
    def sources(self) -> tuple[EMU, ...]:
        return ()

    @property
    def targets(self) -> tuple[EMU, ...]:
        return ()

    @property
    def frees(self) -> tuple[EMU, ...]:
        return (self.unit,)


Primitive = Split | Merge | Extend | Destroy


def relabels(prim: Primitive) -> bool:
    """A Merge whose parts all arrive in final shape on the unit's GPUs moves and allocates nothing."""
    return isinstance(prim, Merge) and all(p.final == prim.unit for p in prim.parts)


# --- deriving transfers ---------------------------------------------------------------------------


@lru_cache(maxsize=256)
def _tensor_index(state: UnitState) -> dict[str, TensorSpec]:
    return {t.name: t for t in state.model.tensors(state.head)}


def _split_dim(t: TensorSpec) -> int:
    return 1 if t.parallel is Parallel.ROW else 0


Intervals = list[tuple[int, int]]


def _subtract(need: Intervals, lo: int, hi: int) -> tuple[Intervals, Intervals]:
    """Split intervals ``need`` by [lo, hi): (covered pieces, what is still needed)."""
    got, rest = [], []
    for a, b in need:
        x, y = max(a, lo), min(b, hi)
        if x >= y:
            rest.append((a, b))
            continue
        got.append((x, y))
        if a < x:
            rest.append((a, x))
        if y < b:
            rest.append((y, b))
    return got, rest


def _piece(src: EMU, src_gpu: int, src_box: Box, dst: EMU, dst_gpu: int, dst_box: Box, key: StateKey,
           dim: int, lo: int, hi: int, bpe: int) -> Transfer:
    offsets = list(dst_box[0])
    lengths = list(dst_box[1])
    offsets[dim], lengths[dim] = lo, hi - lo
    src_off = tuple(o - so for o, so in zip(offsets, src_box[0]))
    dst_off = tuple(o - do for o, do in zip(offsets, dst_box[0]))
    return Transfer(src_gpu=src_gpu, dst_gpu=dst_gpu, src_unit=src.uid, dst_unit=dst.uid, tensor=key[0],
                    kind=key[1], offsets=tuple(offsets), lengths=tuple(lengths), src_offsets=src_off,
                    dst_offsets=dst_off, bytes_per_element=bpe)


def _remote_holders(src: EMU, tensor: TensorSpec, prefer_tp: int) -> Iterable[int]:
    """Source GPUs holding ``tensor``, rank-aligned first (TP rank ``prefer_tp`` mod tp), then rotating."""
    lay = src.layout
    for stage in tensor_stages(tensor, src.state.model, lay.pp):
        for i in range(lay.tp):
            yield src.gpus[lay.rank_of((prefer_tp + i) % lay.tp, stage)]


_Cover = list[tuple[EMU, int, Box, int, int]]  # (source unit, source GPU, source box, lo, hi)


def _covers(target: EMU, sources: tuple[EMU, ...], gpu: int) -> list[tuple[Shard, int, _Cover]]:
    """For every shard ``target`` holds on ``gpu``: its split dim and where each of its rows comes from.

    The cover is computed once per tensor and reused for its other state kinds: sources hold every
    kind the target holds (same model-stage, or a training stage feeding a parameters-only one).
    CoverageError if no source holds some of a shard's rows.
    """
    index = _tensor_index(target.state)
    owner = target.final if target.final is not None else target
    tp_rank = owner.layout.coords(owner.rank_of(gpu))[0]
    local = [s for s in sources if s.holds(gpu)]
    local_boxes = [s.boxes(gpu) for s in local]
    out: list[tuple[Shard, int, _Cover]] = []
    cover: _Cover = []
    cover_tensor = ""
    dim = 0
    for shard in target.shards(gpu):
        key = shard.key
        if key[0] != cover_tensor:
            t = index[key[0]]
            dim = _split_dim(t)
            cover_tensor, cover = key[0], []
            need = [(shard.offsets[dim], shard.offsets[dim] + shard.lengths[dim])]
            for s, boxes in zip(local, local_boxes):
                sb = boxes.get(key)
                if sb is None:
                    continue
                got, need = _subtract(need, sb[0][dim], sb[0][dim] + sb[1][dim])
                cover += [(s, gpu, sb, lo, hi) for lo, hi in got]
                if not need:
                    break
            for s in sources:
                if not need:
                    break
                for g in _remote_holders(s, t, tp_rank):
                    sb = s.boxes(g).get(key)
                    if sb is None:
                        continue
                    got, need = _subtract(need, sb[0][dim], sb[0][dim] + sb[1][dim])
                    cover += [(s, g, sb, lo, hi) for lo, hi in got]
                    if not need:
                        break
            if need:
                raise CoverageError(target.uid, gpu, key, tuple(need))
        out.append((shard, dim, cover))
    return out


def derive_target(target: EMU, sources: tuple[EMU, ...], gpu: int,
                  from_gpu: int | None = None) -> list[Transfer]:
    """Pieces (local and remote) that fill everything ``target`` holds on ``gpu`` from ``sources``;
    with ``from_gpu``, only those read from that GPU."""
    out: list[Transfer] = []
    for shard, dim, cover in _covers(target, sources, gpu):
        box: Box = (shard.offsets, shard.lengths)
        out += [_piece(s, g, sb, target, gpu, box, shard.key, dim, lo, hi, shard.bytes_per_element)
                for s, g, sb, lo, hi in cover if from_gpu is None or g == from_gpu]
    return out


def _target_gpus(prim: Primitive, target: EMU) -> list[int]:
    if isinstance(prim, Merge):  # a part already in final shape on g is relabelled, nothing to copy
        return [g for g in target.gpus if not any(p.final == target and p.holds(g) for p in prim.parts)]
    return list(target.gpus)


def pieces(prim: Primitive, gpu: int | None = None) -> list[Transfer]:
    """Every piece (local copies included) of ``prim``; with ``gpu``, those it sends or receives.

    For one GPU only its own target shards and those of the GPUs reading from it (known from the
    cached footprint) are derived, so a worker's share costs a few of the primitive's GPUs.
    """
    if isinstance(prim, Destroy) or relabels(prim):
        return []
    readers: set[int] = set()
    if gpu is not None:
        traffic, labels = canonical_footprint(prim, DEFAULT_CACHE, buffers=False)
        readers = {labels[d] for s, d in traffic.pair_bytes if labels[s] == gpu}
    out: list[Transfer] = []
    for target in prim.targets:
        for g in _target_gpus(prim, target):
            if gpu is None or g == gpu:
                out += derive_target(target, prim.sources, g)
            elif g in readers:
                out += derive_target(target, prim.sources, g, gpu)
    return out


def transfers(prim: Primitive, gpu: int | None = None) -> list[Transfer]:
    """Pieces that cross GPUs (slices already on their target GPU are not copied)."""
    return [p for p in pieces(prim, gpu) if not p.is_local]


def slot_pieces(prim: Primitive, items: Iterable[Transfer]) -> list[Piece]:
    """``items`` (pieces of ``prim``) placed in the units' buffers: the executor's records."""
    units = {u.uid: u for u in (*prim.sources, *prim.targets)}
    out = []
    for t in items:
        src, dst = units[t.src_unit], units[t.dst_unit]
        key = (t.tensor, t.kind.value)
        out.append(Piece(src_worker=t.src_gpu, dst_worker=t.dst_gpu, src_slot=unit_slots(src, t.src_gpu)[key],
                         dst_slot=unit_slots(dst, t.dst_gpu)[key], box=(t.offsets, t.lengths),
                         src_unit=t.src_unit, dst_unit=t.dst_unit))
    return out


def counter_pieces(prim: Primitive) -> list[Piece]:
    """The unit counters (version, step, minibatch position) each new share copies: from a source on
    the same GPU if any, else from the rank-aligned GPU of the first source. Derived for every target
    GPU in one fixed order, so both ends of a pair agree on it."""
    if not prim.sources:
        return []
    key = (COUNTERS, COUNTERS_KIND)
    out = []
    for target in prim.targets:
        for g in target.gpus:
            if isinstance(prim, Merge) and any(p.final == target and p.holds(g) for p in prim.parts):
                continue  # relabelled: the part's buffer, counters included, becomes the unit's
            local = [s for s in prim.sources if s.holds(g)]
            src = local[0] if local else prim.sources[0]
            src_gpu = g if local else src.gpus[target.gpus.index(g) % len(src.gpus)]
            out.append(Piece(src_worker=src_gpu, dst_worker=g, src_slot=unit_slots(src, src_gpu)[key],
                             dst_slot=unit_slots(target, g)[key], box=((0,), (NUM_COUNTERS,)),
                             src_unit=src.uid, dst_unit=target.uid))
    return out


def wire_buffers(prim: Primitive, max_bucket_bytes: int | None = None) -> dict[int, int]:
    """Per GPU, the bucket memory the executor holds at once running ``prim``: its packed messages
    of two consecutive rounds (``transitions.transfer_plan``), derived by the executor's own
    bucketizer from every piece, counters included. With early builds on CPU (a unit built from its
    donor's pages sends one zero-copy message) the executor holds less, never more."""
    if max_bucket_bytes is None:
        max_bucket_bytes = transfer_plan.DEFAULT_BUCKET_BYTES
    if isinstance(prim, Destroy) or relabels(prim):
        return {}
    wire = messages([*counter_pieces(prim), *slot_pieces(prim, pieces(prim))], max_bucket_bytes)
    gpus = {g for m in wire for g in (m.src_worker, m.dst_worker)}
    held = {g: in_flight_bytes(wire, g) for g in sorted(gpus)}
    return {g: n for g, n in held.items() if n}


# --- footprints, cached per relative shape --------------------------------------------------------


def _relabel(unit: EMU, labels: dict[int, int]) -> EMU:
    for g in unit.gpus:
        labels.setdefault(g, len(labels))
    final = _relabel(unit.final, labels) if unit.final is not None else None
    # the uid stays: pieces name their units by it (the footprint keeps no names)
    return EMU(uid=unit.uid, state=unit.state, layout=unit.layout, gpus=tuple(labels[g] for g in unit.gpus),
               version=0, final=final)


def _canonical(prim: Primitive) -> tuple[Primitive, list[int]]:
    labels: dict[int, int] = {}
    canon: Primitive
    if isinstance(prim, Split):
        canon = Split(unit=_relabel(prim.unit, labels), parts=tuple(_relabel(p, labels) for p in prim.parts))
    elif isinstance(prim, Merge):
        parts = tuple(_relabel(p, labels) for p in prim.parts)
        canon = Merge(parts=parts, unit=_relabel(prim.unit, labels))
    elif isinstance(prim, Extend):
        target = _relabel(prim.target, labels)
        canon = Extend(sources=tuple(_relabel(s, labels) for s in prim.sources), target=target)
    else:
        canon = Destroy(unit=_relabel(prim.unit, labels))
    gpus = [0] * len(labels)
    for g, i in labels.items():
        gpus[i] = g
    return canon, gpus


def _canonical_footprint(prim: Primitive, buffers: bool = True) -> Footprint:
    alloc: dict[int, int] = {}
    free: dict[int, int] = {}
    if not relabels(prim):
        for t in prim.targets:
            for g in t.gpus:
                alloc[g] = alloc.get(g, 0) + t.bytes_on(g)
        for f in prim.frees:
            for g in f.gpus:
                free[g] = free.get(g, 0) + f.bytes_on(g)
        if isinstance(prim, Merge):  # parts in final shape become the unit: neither new nor freed
            for p in prim.parts:
                if p.final == prim.unit:
                    for g in p.gpus:
                        alloc[g] -= p.bytes_on(g)
                        free[g] -= p.bytes_on(g)
    local: dict[int, int] = {}
    pair: dict[tuple[int, int], int] = {}
    if not isinstance(prim, Destroy) and not relabels(prim):
        for target in prim.targets:
            for dst in _target_gpus(prim, target):
                for shard, dim, cover in _covers(target, prim.sources, dst):
                    row_bytes = shard.num_bytes // shard.lengths[dim]
                    for _, src, _, lo, hi in cover:
                        nbytes = row_bytes * (hi - lo)
                        if src == dst:
                            local[dst] = local.get(dst, 0) + nbytes
                        else:
                            pair[(src, dst)] = pair.get((src, dst), 0) + nbytes
    buffer = wire_buffers(prim) if pair and buffers else {}
    return Footprint(alloc_bytes={g: v for g, v in alloc.items() if v},
                     free_bytes={g: v for g, v in free.items() if v},
                     buffer_bytes=buffer, local_bytes=local, pair_bytes=pair)


def _shape_key(prim: Primitive) -> tuple[tuple[object, ...], list[int]]:
    """Hashable relative shape of ``prim`` (GPUs relabelled in the order _canonical uses) and the GPU
    of each label; cheaper than building the canonical primitive when the footprint is cached."""
    labels: dict[int, int] = {}

    def unit_key(u: EMU) -> tuple[object, ...]:
        for g in u.gpus:
            labels.setdefault(g, len(labels))
        final = unit_key(u.final) if u.final is not None else None
        return (u.state, u.layout, tuple(labels[g] for g in u.gpus), final)

    if isinstance(prim, Split):
        key: tuple[object, ...] = ("split", unit_key(prim.unit), *(unit_key(p) for p in prim.parts))
    elif isinstance(prim, Merge):
        parts = tuple(unit_key(p) for p in prim.parts)
        key = ("merge", parts, unit_key(prim.unit))
    else:
        assert isinstance(prim, Extend)
        target = unit_key(prim.target)
        key = ("extend", target, *(unit_key(u) for u in prim.sources))
    gpus = [0] * len(labels)
    for g, i in labels.items():
        gpus[i] = g
    return key, gpus


def canonical_footprint(prim: Primitive, cache: PlanningCache, buffers: bool = True) -> tuple[Footprint, list[int]]:
    """``prim``'s footprint over GPU labels 0..k-1 (first appearance: each unit's GPUs, then its
    ``final``'s, units in field order) and the GPU of each label; memoised per relative shape in
    ``cache.footprints``, so every replica of the same shape (transitions.replica_classes) shares one
    derivation. Without ``buffers`` its bucket memory is left out (empty): the traffic alone, which
    is all a worker deriving its pieces needs, costs no bucketizing."""
    if isinstance(prim, Destroy):
        gpus = list(prim.unit.gpus)
        return Footprint(alloc_bytes={}, free_bytes={r: prim.unit.bytes_on(g) for r, g in enumerate(gpus)},
                         buffer_bytes={}, local_bytes={}, pair_bytes={}), gpus
    key, gpus = _shape_key(prim)
    fp = cache.footprints.get(key)
    if fp is None and not buffers:
        fp = cache.footprints.get(("traffic", key))
        if fp is None:
            fp = cache.footprints.put(("traffic", key), _canonical_footprint(_canonical(prim)[0], buffers=False))
    elif fp is None:
        fp = cache.footprints.put(key, _canonical_footprint(_canonical(prim)[0]))
    return fp, gpus


def footprint(prim: Primitive, cache: PlanningCache | None = None) -> Footprint:
    """Per-GPU memory and traffic of ``prim`` (exact: derived from its pieces and buckets); ``cache``:
    whose footprint memo serves it (None: transitions.planning_cache.DEFAULT_CACHE, the documented
    default of callers that own none, such as ``pieces`` on a worker)."""
    if isinstance(prim, Destroy):
        return Footprint(alloc_bytes={}, free_bytes={g: prim.unit.bytes_on(g) for g in prim.unit.gpus},
                         buffer_bytes={}, local_bytes={}, pair_bytes={})
    fp, gpus = canonical_footprint(prim, DEFAULT_CACHE if cache is None else cache)
    return Footprint(
        alloc_bytes={gpus[g]: v for g, v in fp.alloc_bytes.items()},
        free_bytes={gpus[g]: v for g, v in fp.free_bytes.items()},
        buffer_bytes={gpus[g]: v for g, v in fp.buffer_bytes.items()},
        local_bytes={gpus[g]: v for g, v in fp.local_bytes.items()},
        pair_bytes={(gpus[s], gpus[d]): v for (s, d), v in fp.pair_bytes.items()},
    )
