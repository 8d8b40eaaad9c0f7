"""Building a unit inside the buffer of the unit it is cut from (CPU): the compaction itself (torch).

``transitions.in_place_plan`` decides whether a node can and in which order the pieces go; here the
kept bytes are compacted forward inside the donor's buffer, and the donor's pages past the new unit
are given back to the OS.
"""

from __future__ import annotations

import time

from transitions.executor.buffers import RankState, piece_view, storage_view
from transitions.executor.pages import memmove, release_tail
from transitions.in_place_plan import InPlace
from transitions.layout import unit_placement, unit_slots
from transitions.transfer_plan import Piece


def _compact_piece(p: Piece, donor: RankState, target: RankState) -> None:
    """Copy one piece from ``donor`` into ``target`` (a view of the donor's buffer), forward: a run
    contiguous on both sides is one memmove; strided rows go in chunks copied directly once their
    destination ends before their source begins, row by row (memmove) before that.
    ``_forward_order`` made every step safe: no write reaches a byte still to be read."""
    src = storage_view(piece_view(donor, p.src_slot, p.box), p.src_slot)
    dst = storage_view(piece_view(target, p.dst_slot, p.box), p.dst_slot)
    src_start, dst_start = src.data_ptr(), dst.data_ptr()
    if src_start == dst_start and src.is_contiguous():
        return  # already in place (the counters, at the start of every buffer)
    if src.is_contiguous():
        memmove(dst_start, src_start, p.num_bytes)
        return
    size = src.element_size()
    pitch, row = src.stride(0) * size, dst.stride(0) * size
    rows, r = src.shape[0], 0
    while r < rows:
        direct = (src_start + r * pitch - dst_start - r * row) // row  # rows that cannot overlap
        if direct >= 1:
            k = min(rows - r, direct)
            dst[r:r + k].copy_(src[r:r + k])
        else:  # this row's destination overlaps its own source: memmove allows that
            k = 1
            memmove(dst_start + r * row, src_start + r * pitch, src[r].numel() * size)
        r += k


def build_in_place(plan: InPlace, worker: int, units: dict[str, RankState]) -> tuple[int, float]:
    """Build ``plan``'s target as a view of its donor's buffer, compacted piece by piece in target
    byte order; then drop the donor and give its pages past the target back. A failure half-way
    leaves neither (both half-overwritten: no copy of anything). Returns bytes copied and seconds."""
    start = time.perf_counter()
    donor = units[plan.donor]
    placement = unit_placement(plan.target)
    target = RankState(placement=placement, replica=0, rank=placement.gpu_sets[0].index(worker),
                       flat=donor.flat[: plan.target_bytes], slots=unit_slots(plan.target, worker))
    units[plan.target.uid] = target
    try:
        for p in plan.pieces:
            _compact_piece(p, donor, target)
    except BaseException:
        units.pop(plan.target.uid, None)
        units.pop(plan.donor, None)
        raise
    units.pop(plan.donor, None)
    release_tail(donor.flat, plan.target_bytes)
    return sum(p.num_bytes for p in plan.pieces), time.perf_counter() - start

