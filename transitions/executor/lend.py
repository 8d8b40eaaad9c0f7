"""Local copies out of a donor nothing reads any more, made as page moves (CPU): pages lent until freed.

A node's local pieces copy bytes a worker keeps from a unit it gives up into a new one (a TP or PP
merge keeps its own half of every tensor: tiny-25m, 164 MB per worker). Copying them beside the
transfers costs a pass over the bytes, and writing pages of the new buffer that an earlier early
build emptied costs a first touch on top (~1 GB/s here). When that donor is read by no later node
up to the one freeing it, the runs contiguous on both sides and at the same offset within a page
move instead, once the node's transfers (its sends read the donor) are done: ``mremap``, no byte
copied (the ragged ends of a run are). Until the DAG frees the donor, a failure moves the pages
back (``Lent.undo``), so the survivors hold exactly what the DAG's order keeps.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from transitions.executor.buffers import MAP_MIN_BYTES, RankState
from transitions.executor.pages import MOVE_MIN_BYTES, PagesMoved, move_or_copy
from transitions.global_dag import TransitionDAG
from transitions.layout import PAGE_BYTES, contiguous_range
from transitions.primitives import Destroy, Merge
from transitions.transfer_plan import Piece, Step


@dataclass(slots=True)
class Lent(PagesMoved):
    """Pages moved out of ``donor`` into ``targets``, kept until the DAG frees the donor."""

    donor: str
    targets: set[str] = field(default_factory=set)


def _mapped(state: RankState) -> bool:
    """A buffer of its own mapping (``alloc_bytes``), whose pages may move: never malloc's heap."""
    return state.flat.device.type == "cpu" and state.flat.numel() >= MAP_MIN_BYTES


def _free_after(dag: TransitionDAG, order: Sequence[int], index: int, donor: str, dsts: set[str],
                worker: int) -> bool:
    """Whether nothing on ``worker`` reads ``donor`` after node ``order[index]`` until it is freed:
    the node frees it, or a later Destroy does, and no node in between touches it or the targets
    (reads, writes, frees or relabels them). Relabelling Merges run outside the order: none may
    name the donor."""
    touched = {donor} | dsts
    for later in order[index:]:
        prim = dag.nodes[later]
        frees = {u.uid for u in prim.frees if u.holds(worker)}
        if donor in frees and (later == order[index] or isinstance(prim, Destroy)):
            return True
        if later != order[index] and touched & ({u.uid for u in (*prim.sources, *prim.targets)} | frees):
            return False
    return False


def movable_pieces(dag: TransitionDAG, index: int, step: Step, worker: int, units: dict[str, RankState],
                   order: Sequence[int], kept: set[str]) -> list[Piece]:
    """The local pieces of node ``order[index]`` on ``worker`` that can move as pages after its
    transfers: contiguous on both sides, at least ``MOVE_MIN_BYTES``, at the same offset within a
    page, between buffers of their own mappings, out of a donor (none of ``kept``, which other
    builds still read) that no later node reads before it is freed."""
    node = order[index]
    targets = {t.uid for t in dag.nodes[node].targets}
    by_donor: dict[str, list[Piece]] = defaultdict(list)
    for p in step.local:
        if p.dst_worker != worker or p.src_unit in kept or p.src_unit in targets:
            continue
        src, dst = units.get(p.src_unit), units.get(p.dst_unit)
        if src is None or dst is None or not (_mapped(src) and _mapped(dst)):
            continue
        rs, rd = contiguous_range(p.src_slot, p.box), contiguous_range(p.dst_slot, p.box)
        if rs is None or rd is None or rs[1] - rs[0] < max(MOVE_MIN_BYTES, 2 * PAGE_BYTES):
            continue
        if (src.flat.data_ptr() + rs[0] - dst.flat.data_ptr() - rd[0]) % PAGE_BYTES:
            continue
        by_donor[p.src_unit].append(p)
    out: list[Piece] = []
    for donor, pieces in by_donor.items():
        dsts = {p.dst_unit for p in pieces}
        if _free_after(dag, order, index, donor, dsts, worker) and not _relabelled(dag, donor, order):
            out += pieces
    return out


def _relabelled(dag: TransitionDAG, donor: str, order: Sequence[int]) -> bool:
    """Whether a Merge outside the worker's order (one that only relabels here) takes the donor."""
    held = set(order)
    return any(i not in held and isinstance(prim, Merge) and any(u.uid == donor for u in prim.parts)
               for i, prim in enumerate(dag.nodes))


def lend_pages(pieces: Sequence[Piece], units: dict[str, RankState]) -> list[Lent]:
    """Move ``pieces`` (``movable_pieces``) from their donors into their targets, per donor."""
    out: dict[str, Lent] = {}
    for p in pieces:
        lent = out.get(p.src_unit)
        if lent is None:
            lent = out[p.src_unit] = Lent(donor=p.src_unit)
        start = time.perf_counter()
        src, dst = units[p.src_unit], units[p.dst_unit]
        rs, rd = contiguous_range(p.src_slot, p.box), contiguous_range(p.dst_slot, p.box)
        assert rs is not None and rd is not None
        try:
            lent.copied += move_or_copy(dst.flat.data_ptr() + rd[0], src.flat.data_ptr() + rs[0], rs[1] - rs[0],
                                        lent.moved)[0]
        except BaseException:
            for done in out.values():
                done.undo()
            raise
        lent.targets.add(p.dst_unit)
        lent.seconds += time.perf_counter() - start
    return list(out.values())
