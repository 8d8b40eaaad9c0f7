"""Per-GPU memory and traffic of a primitive (``Footprint``), memoised per relative shape. Pure.

``footprint`` is the summary the DAG builder, the memory check and the cost model use: state
allocated and freed, bytes copied locally and sent per GPU pair (from the covers,
``transitions.covers``), and the bucket memory the executor holds (``wire_buffers``: from the
executor's own bucketizer, ``transitions.transfer_plan.messages``). It is memoised per relative
shape (GPU ids relabelled by first appearance) in the caller's PlanningCache
(transitions.planning_cache), so the thousands of identical replicas of a large plan cost one
derivation. ``traffic`` is the same without bucket memory: all a GPU deriving its own pieces needs
(transitions.pieces), at no bucketizing cost; it is memoised in the same cache. A Split's, Merge's
or Extend's traffic and bucket memory come per target GPU (transitions.gpu_traffic: by runs of like
layers, the same figures); ``derive_footprint`` is the derivation from every piece at once.
"""

from __future__ import annotations

from transitions import gpu_traffic, transfer_plan
from transitions.covers import Cover, counter_pieces, covers, derive_target
from transitions.emu import EMU
from transitions.geometry import Shard
from transitions.planning_cache import DEFAULT_CACHE, PlanningCache
from transitions.primitives import (
    Destroy,
    Extend,
    Footprint,
    Merge,
    Primitive,
    Restore,
    Split,
    moves_nothing,
    relabels,
    target_gpus,
)
from transitions.transfer_plan import in_flight_bytes, messages

# (target index, GPU) -> covers(target, prim.sources, GPU)
Covered = dict[tuple[int, int], list[tuple[Shard, int, Cover]]]


def wire_buffers(prim: Primitive, max_bucket_bytes: int | None = None, covered: Covered | None = None
                 ) -> dict[int, int]:
    """Per GPU, the bucket memory the executor holds at once running ``prim``: its packed messages
    of two consecutive rounds (``transitions.transfer_plan``), derived by the executor's own
    bucketizer from every piece, counters included. With early builds on CPU (a unit built from its
    donor's pages sends one zero-copy message) the executor holds less, never more."""
    if max_bucket_bytes is None:
        max_bucket_bytes = transfer_plan.DEFAULT_BUCKET_BYTES
    if moves_nothing(prim):
        return {}
    every = [p for k, t in enumerate(prim.targets) for g in target_gpus(prim, t)
             for p in derive_target(t, prim.sources, g, covered=None if covered is None else covered[(k, g)])]
    wire = messages([*counter_pieces(prim), *every], max_bucket_bytes)
    gpus = {g for m in wire for g in (m.src_worker, m.dst_worker)}
    held = {g: in_flight_bytes(wire, g) for g in sorted(gpus)}
    return {g: n for g, n in held.items() if n}


def _relabel(unit: EMU, labels: dict[int, int]) -> EMU:
    for g in unit.gpus:
        labels.setdefault(g, len(labels))
    final = _relabel(unit.final, labels) if unit.final is not None else None
    # the uid stays: pieces name their units by it (the footprint keeps no names)
    return EMU(uid=unit.uid, state=unit.state, layout=unit.layout, gpus=tuple(labels[g] for g in unit.gpus),
               version=0, final=final)


def _label_gpus(labels: dict[int, int]) -> list[int]:
    gpus = [0] * len(labels)
    for g, i in labels.items():
        gpus[i] = g
    return gpus


def _canonical(prim: Primitive) -> Primitive:
    """``prim`` over GPU labels 0..k-1 (first appearance, in the order ``_shape_key`` uses)."""
    labels: dict[int, int] = {}
    if isinstance(prim, Split):
        return Split(unit=_relabel(prim.unit, labels), parts=tuple(_relabel(p, labels) for p in prim.parts))
    if isinstance(prim, Merge):
        parts = tuple(_relabel(p, labels) for p in prim.parts)
        return Merge(parts=parts, unit=_relabel(prim.unit, labels))
    assert isinstance(prim, Extend)  # Destroy and Restore are never memoised
    target = _relabel(prim.target, labels)
    return Extend(sources=tuple(_relabel(s, labels) for s in prim.sources), target=target)


def _memory(prim: Primitive) -> tuple[dict[int, int], dict[int, int]]:
    """Bytes allocated at start and freed at end, per GPU."""
    alloc: dict[int, int] = {}
    free: dict[int, int] = {}
    if relabels(prim):
        return alloc, free
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
    return alloc, free


def _traffic(prim: Primitive, covered: Covered | None = None) -> tuple[dict[int, int], dict[tuple[int, int], int]]:
    """Bytes copied within each GPU and sent per (src, dst) pair; the covers derived go into ``covered``."""
    local: dict[int, int] = {}
    pair: dict[tuple[int, int], int] = {}
    if moves_nothing(prim):
        return local, pair
    for k, target in enumerate(prim.targets):
        for dst in target_gpus(prim, target):
            cov = covers(target, prim.sources, dst)
            if covered is not None:
                covered[(k, dst)] = cov
            for shard, dim, cover in cov:
                row_bytes = shard.num_bytes // shard.lengths[dim]
                for _, src, _, lo, hi in cover:
                    nbytes = row_bytes * (hi - lo)
                    if src == dst:
                        local[dst] = local.get(dst, 0) + nbytes
                    else:
                        pair[(src, dst)] = pair.get((src, dst), 0) + nbytes
    return local, pair


def derive_footprint(prim: Primitive, buffers: bool = True) -> Footprint:
    """``prim``'s footprint from all its pieces at once (no memo): the reference derivation."""
    alloc, free = _memory(prim)
    covered: Covered = {}
    local, pair = _traffic(prim, covered)
    buffer = wire_buffers(prim, covered=covered) if pair and buffers else {}
    return _footprint(alloc, free, buffer, local, pair)


def _footprint(alloc: dict[int, int], free: dict[int, int], buffer: dict[int, int], local: dict[int, int],
               pair: dict[tuple[int, int], int]) -> Footprint:
    return Footprint(alloc_bytes={g: v for g, v in alloc.items() if v},
                     free_bytes={g: v for g, v in free.items() if v},
                     buffer_bytes=buffer, local_bytes=local, pair_bytes=pair)


def _canonical_footprint(prim: Primitive, cache: PlanningCache, buffers: bool = True) -> Footprint:
    """A Split's, Merge's or Extend's footprint from the memoised entries of its target GPUs
    (transitions.gpu_traffic: the same figures as ``derive_footprint``), any other from its pieces."""
    if not gpu_traffic.applies(prim):
        return derive_footprint(prim, buffers)
    alloc, free = _memory(prim)
    local, pair, buffer = gpu_traffic.traffic(prim, cache, buffers)
    return _footprint(alloc, free, buffer, local, pair)


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
    return key, _label_gpus(labels)


def _unmemoised(prim: Destroy | Restore) -> tuple[Footprint, list[int]]:
    """A Destroy frees, a Restore allocates, its unit's bytes; neither moves any: no memo needed."""
    unit = prim.unit if isinstance(prim, Destroy) else prim.target
    gpus = list(unit.gpus)
    held = {r: unit.bytes_on(g) for r, g in enumerate(gpus)}
    alloc, free = ({}, held) if isinstance(prim, Destroy) else (held, {})
    return Footprint(alloc_bytes=alloc, free_bytes=free, buffer_bytes={}, local_bytes={}, pair_bytes={}), gpus


def canonical_footprint(prim: Primitive, cache: PlanningCache, buffers: bool = True) -> tuple[Footprint, list[int]]:
    """``prim``'s footprint over GPU labels 0..k-1 (first appearance: each unit's GPUs, then its
    ``final``'s, units in field order) and the GPU of each label; memoised per relative shape in
    ``cache.footprints``, so every replica of the same shape (transitions.replica_classes) shares one
    derivation. Without ``buffers`` the traffic is all the caller may read: it is derived without bucket
    memory, unless the full footprint (traffic and buckets) is memoised already, which is returned as it is."""
    if isinstance(prim, Destroy | Restore):
        return _unmemoised(prim)
    key, gpus = _shape_key(prim)
    fp = cache.footprints.get(key)
    if fp is None and not buffers:
        fp = cache.footprints.get(("traffic", key))
        if fp is None:
            fp = cache.footprints.put(("traffic", key), _canonical_footprint(_canonical(prim), cache, buffers=False))
    elif fp is None:
        fp = cache.footprints.put(key, _canonical_footprint(_canonical(prim), cache))
    return fp, gpus


def traffic(prim: Primitive, cache: PlanningCache) -> Footprint:
    """``prim``'s footprint without bucket memory, on its own GPUs (memoised like ``footprint``)."""
    return on_gpus(*canonical_footprint(prim, cache, buffers=False))


def footprint(prim: Primitive, cache: PlanningCache | None = None) -> Footprint:
    """Per-GPU memory and traffic of ``prim`` (exact: derived from its pieces and buckets); ``cache``:
    whose footprint memo serves it (None: transitions.planning_cache.DEFAULT_CACHE, the documented
    default of callers that own none)."""
    return on_gpus(*canonical_footprint(prim, DEFAULT_CACHE if cache is None else cache))


def on_gpus(fp: Footprint, gpus: list[int]) -> Footprint:
    """A footprint over labels mapped onto the GPU of each label."""
    return Footprint(
        alloc_bytes={gpus[g]: v for g, v in fp.alloc_bytes.items()},
        free_bytes={gpus[g]: v for g, v in fp.free_bytes.items()},
        buffer_bytes={gpus[g]: v for g, v in fp.buffer_bytes.items()},
        local_bytes={gpus[g]: v for g, v in fp.local_bytes.items()},
        pair_bytes={(gpus[s], gpus[d]): v for (s, d), v in fp.pair_bytes.items()},
    )
