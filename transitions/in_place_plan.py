"""Building a unit inside the buffer of the unit it is cut from: whether a node can, and how. Pure.

A TP or PP Split/Merge that keeps part of a shard on a worker can compact the kept bytes forward
inside the old unit's buffer once nothing reads it any more, instead of copying them into fresh
memory (``transitions.executor.in_place`` runs it). The worker's peak memory then drops by the new
unit's size, and no fresh page is first touched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from transitions.emu import EMU
from transitions.global_dag import TransitionDAG
from transitions.layout import contiguous_range, unit_buffer_bytes
from transitions.primitives import Merge, Primitive
from transitions.transfer_plan import Piece, Step


@dataclass(frozen=True, kw_only=True, slots=True)
class InPlace:
    """A node whose target on one worker is built inside the buffer of ``donor``, after ``build_after``.

    Chosen only when the donor is freed by this node or a later one, every local piece of the node
    goes from the donor into the target, nothing is received into the target, the target's buffer is
    no larger, and copying the pieces forward in ``pieces`` order (target byte order), row by row,
    never overwrites a donor byte that is still to be read."""

    node: int
    donor: str
    target: EMU
    target_bytes: int
    pieces: tuple[Piece, ...]
    build_after: int  # compact once this node is done (the node itself, or the donor's last reader here)




def _forward_order(pieces: Sequence[Piece]) -> tuple[Piece, ...] | None:
    """``pieces`` in destination byte order if compacting them forward inside one buffer is safe:
    each destination is contiguous, starts at or before its source and advances no faster per row
    (rows along dim 0, each one contiguous run in the source), and ends before every later piece's
    source begins. None when any of that fails."""
    spans = []
    for p in pieces:
        dst = contiguous_range(p.dst_slot, p.box)
        if dst is None:
            return None
        # rows run along the first stored dim (a 1-D box: one element a row); each must be one run
        # in the source, since a row that overlaps its own destination is memmoved
        d = p.src_slot.order[0] if p.src_slot.order else 0
        lens = list(p.box[1])
        lens[d] = 1
        first_row = contiguous_range(p.src_slot, (p.box[0], tuple(lens)))
        if first_row is None:
            return None
        src_start, rows = first_row[0], p.box[1][d]
        pitch = math.prod(p.src_slot.storage_lengths[1:]) * p.src_slot.element_bytes
        if dst[0] > src_start or (dst[1] - dst[0]) // rows > pitch:
            return None
        spans.append((dst[0], dst[1], src_start, p))
    spans.sort(key=lambda x: x[0])
    later = math.inf
    for _, dst_end, src_start, _ in reversed(spans):
        if dst_end > later:
            return None
        later = min(later, src_start)
    return tuple(p for *_, p in spans)


def in_place_plan(dag: TransitionDAG, node: int, step: Step, worker: int, order: Sequence[int] = (),
                  steps: dict[int, Step] | None = None) -> InPlace | None:
    """Whether node ``node`` can build its target on ``worker`` inside the buffer of the unit it cuts
    it from (a Split or Merge keeping part of a shard), and how. The donor must be freed by the node
    itself, or (given ``worker``'s ``order`` and ``steps``) by a later node; the build then waits for
    the transfers of the last node that reads the donor here (``build_after``). A node that moves data
    itself must receive nothing into the target. Pure: from the DAG and the steps alone."""
    prim = dag.nodes[node]
    local = [p for p in step.local if p.dst_worker == worker]
    cut = cut_here(prim, local, worker)
    if cut is None:
        return None
    donor, target = cut
    donor_uid, target_uid = donor.uid, target.uid
    if any(u.uid == donor_uid for u in prim.frees):
        build_after = node
    else:
        last = _last_reader(dag, node, donor_uid, target.uid, worker, order, steps)
        if last is None:
            return None
        build_after = last
    if any(m.dst_worker == worker and any(p.dst_unit == target_uid for p in m.pieces) for m in step.messages):
        return None  # a receive would land in the donor's buffer while the node still reads it
    size = unit_buffer_bytes(target, worker)
    if size > unit_buffer_bytes(donor, worker):
        return None
    ordered = _forward_order(local)
    if ordered is None:
        return None
    return InPlace(node=node, donor=donor_uid, target=target, target_bytes=size, pieces=ordered,
                   build_after=build_after)


def cut_here(prim: Primitive, into: Sequence[Piece], worker: int) -> tuple[EMU, EMU] | None:
    """(donor, target) when ``into``, the pieces landing on ``worker`` for ``prim``, are all local
    copies from one unit held here into ``prim``'s only target here (a Split or Merge keeping part of
    a shard), and no part already in final shape is relabelled into that target (it would exist
    before the copies). None otherwise."""
    pairs = {(p.src_unit, p.dst_unit) for p in into}
    if len(pairs) != 1 or any(p.src_worker != worker for p in into):
        return None
    donor_uid, target_uid = next(iter(pairs))
    donor = next((u for u in prim.sources if u.uid == donor_uid and u.holds(worker)), None)
    mine = [t for t in prim.targets if t.holds(worker)]
    if donor is None or len(mine) != 1 or mine[0].uid != target_uid:
        return None
    if isinstance(prim, Merge) and any(part.final == mine[0] and part.holds(worker) for part in prim.parts):
        return None
    return donor, mine[0]


def _last_reader(dag: TransitionDAG, node: int, donor: str, target: str, worker: int, order: Sequence[int],
                 steps: dict[int, Step] | None) -> int | None:
    """When a later node in ``worker``'s order frees ``donor`` here: the last node up to it that reads
    the donor on this worker (``node`` itself if none does), after which the target can be built in
    the donor's buffer. None when no later node frees it, or a node in between touches the target or
    relabels the donor (the target must not exist, nor the donor change, before the build)."""
    if steps is None or node not in order:
        return None
    last = node
    for later in order[order.index(node) + 1:]:
        prim = dag.nodes[later]
        touched = {u.uid for u in (*prim.sources, *prim.targets)}
        if isinstance(prim, Merge):
            touched |= {part.uid for part in prim.parts}
        if target in touched or (isinstance(prim, Merge) and donor in {part.uid for part in prim.parts}):
            return None
        if later in steps and _reads(steps[later], worker, donor):
            last = later
        if any(u.uid == donor and u.holds(worker) for u in prim.frees):
            return last if not (later in steps and _reads(steps[later], worker, donor)) else None
    return None


def _reads(step: Step, worker: int, uid: str) -> list[Piece]:
    """The pieces of ``step`` that ``worker`` reads from unit ``uid`` (local copies and sends)."""
    out = [p for p in step.local if p.src_unit == uid and p.src_worker == worker]
    for m in step.messages:
        if m.src_worker == worker:
            out.extend(p for p in m.pieces if p.src_unit == uid)
    return out

