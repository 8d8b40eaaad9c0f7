"""Split, Merge, Extend, Destroy, Restore: the frozen records of a transition DAG's nodes. Pure.

- Split(unit -> parts): T_sub parts on the unit's own GPUs; a Destroy after all its readers frees it.
- Merge(parts -> unit): the unit on the parts' GPUs; parts delivered in final shape are relabelled.
- Extend(sources -> target): a replica (or part) on other GPUs, read from existing replicas.
- Destroy(unit): drop a replica locally, no collectives.
- Restore(target from a checkpoint): each GPU of the target reads its shard from the checkpoint.

What they move is derived elsewhere, per GPU and without talking: the pieces (one record per box
moved, ``transitions.transfer_plan.Piece``) in ``transitions.covers`` and ``transitions.pieces``,
their per-GPU memory and traffic (``Footprint``, memoised per relative shape) in
``transitions.footprints``. Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from transitions.emu import EMU

if TYPE_CHECKING:
    from transitions.transfer_plan import Piece


class PrimitiveKind(str, Enum):
    SPLIT = "split"
    MERGE = "merge"
    EXTEND = "extend"
    DESTROY = "destroy"
    RESTORE = "restore"


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


class _Node:
    """What every primitive answers: the units it reads, makes and frees (none unless a primitive
    says otherwise), and its per-GPU transfers as a method (``transitions.pieces`` does the work; it
    imports this module; its ``pieces(prim, gpu)`` adds the local copies)."""

    __slots__ = ()

    @property
    def sources(self) -> tuple[EMU, ...]:
        return ()

    @property
    def targets(self) -> tuple[EMU, ...]:
        return ()

    @property
    def frees(self) -> tuple[EMU, ...]:
        return ()

    def transfers(self, gpu: int | None = None) -> list[Piece]:
        from transitions.pieces import transfers

        return transfers(self, gpu)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True, slots=True)
class Split(_Node):
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
class Merge(_Node):
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
class Extend(_Node):
    sources: tuple[EMU, ...]  # tried in order after same-GPU pieces; the first is the main source
    target: EMU

    kind = PrimitiveKind.EXTEND

    @property
    def targets(self) -> tuple[EMU, ...]:
        return (self.target,)


@dataclass(frozen=True, kw_only=True, slots=True)
class Destroy(_Node):
    unit: EMU

    kind = PrimitiveKind.DESTROY

    @property
    def frees(self) -> tuple[EMU, ...]:
        return (self.unit,)


@dataclass(frozen=True, kw_only=True, slots=True)
class Restore(_Node):
    """``target`` read from the committed checkpoint ``url``/``tag`` (transitions.checkpoint): every GPU
    of it allocates its shard and fills it from the checkpoint's chunks, whatever layout saved them."""

    target: EMU
    url: str
    tag: str

    kind = PrimitiveKind.RESTORE

    @property
    def targets(self) -> tuple[EMU, ...]:
        return (self.target,)


Primitive = Split | Merge | Extend | Destroy | Restore


def relabels(prim: Primitive) -> bool:
    """A Merge whose parts all arrive in final shape on the unit's GPUs moves and allocates nothing."""
    return isinstance(prim, Merge) and all(p.final == prim.unit for p in prim.parts)




def moves_nothing(prim: Primitive) -> bool:
    """Whether ``prim`` moves no byte between or within GPUs (its pieces are none)."""
    return isinstance(prim, Destroy | Restore) or relabels(prim)


def target_gpus(prim: Primitive, target: EMU) -> list[int]:
    """The GPUs of ``target`` whose shards ``prim`` fills (a Merge's part already in final shape on a
    GPU is relabelled there: nothing to copy)."""
    if isinstance(prim, Merge):
        return [g for g in target.gpus if not any(p.final == target and p.holds(g) for p in prim.parts)]
    return list(target.gpus)
