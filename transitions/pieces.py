"""The pieces of one primitive, all of them or one GPU's share. Pure.

``pieces(prim)`` is every box ``prim`` moves or copies (``transitions.transfer_plan.Piece``, placed in
the units' slots), ``pieces(prim, gpu)`` those one GPU sends, receives or copies: its own target
shards and, for the GPUs reading from it (known from the memoised traffic, transitions.footprints,
or from a DAG node's footprint: ``share``), theirs read from it, so a worker's share costs a few of the primitive's GPUs. ``transfers`` are the
pieces that cross GPUs. Counters are separate (``transitions.covers.counter_pieces``).
"""

from __future__ import annotations

from transitions.covers import derive_target
from transitions.footprints import canonical_footprint
from transitions.planning_cache import DEFAULT_CACHE, PlanningCache
from transitions.primitives import Primitive, moves_nothing, target_gpus
from transitions.transfer_plan import Piece


def readers(prim: Primitive, gpu: int, cache: PlanningCache) -> set[int]:
    """The GPUs ``prim`` sends to from ``gpu`` (from the traffic memoised in ``cache``)."""
    fp, labels = canonical_footprint(prim, cache, buffers=False)
    return {labels[d] for s, d in fp.pair_bytes if labels[s] == gpu}


def pieces(prim: Primitive, gpu: int | None = None, cache: PlanningCache | None = None) -> list[Piece]:
    """Every piece (local copies included) of ``prim``; with ``gpu``, those it sends or receives.
    ``cache``: whose traffic memo finds ``gpu``'s readers (None: the process's DEFAULT_CACHE)."""
    if gpu is None or moves_nothing(prim):
        return share(prim, None, set())
    return share(prim, gpu, readers(prim, gpu, DEFAULT_CACHE if cache is None else cache))


def share(prim: Primitive, gpu: int | None, reading: set[int]) -> list[Piece]:
    """The pieces of ``prim`` that ``gpu`` sends, receives or copies, given the GPUs ``reading`` from it
    (a DAG node's footprint says which: transitions.dag_pieces); ``gpu`` None: every piece."""
    if moves_nothing(prim):
        return []
    out: list[Piece] = []
    for target in prim.targets:
        for g in target_gpus(prim, target):
            if gpu is None or g == gpu:
                out += derive_target(target, prim.sources, g)
            elif g in reading:
                out += derive_target(target, prim.sources, g, gpu)
    return out


def transfers(prim: Primitive, gpu: int | None = None, cache: PlanningCache | None = None) -> list[Piece]:
    """Pieces that cross GPUs (slices already on their target GPU are not copied)."""
    return [p for p in pieces(prim, gpu, cache) if not p.is_local]
