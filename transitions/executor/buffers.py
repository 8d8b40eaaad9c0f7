"""Flat per-rank buffers and the typed views into them (torch).

A ``RankState`` is the live state one worker holds for one unit rank: one flat uint8 buffer laid out
by ``transitions.layout`` (its slots), and a typed logical view of each slot. CPU buffers of
``MAP_MIN_BYTES`` or more are anonymous mappings of their own, page-aligned, so their pages can move
into another unit's buffer (``transitions.executor.pages``).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from transitions.emu import EMU
from transitions.executor import warm_pool
from transitions.layout import (
    COUNTERS,
    COUNTERS_KIND,
    Box,
    Slot,
    StagePlacement,
    rank_slots,
    unit_buffer_bytes,
    unit_placement,
    unit_slots,
)
from transitions.transfer_plan import Piece

# CPU buffers from this size are anonymous mappings of their own, page-aligned (``alloc_bytes``)
MAP_MIN_BYTES = 1 << 20
HUGE_MIN_BYTES = 2 << 20  # with huge pages: CPU buffers from here on are mapped with them
# Off: on the shared 2-core machine, tiny-25m TP1xDP2 -> TP2xDP2 took min 0.25 s vs 0.34 s with them
# but median 0.50 s vs 0.38 s (the kernel compacts memory at fault time, and stalls under pressure)
HUGE_PAGES = False
TORCH_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                                        "float32": torch.float32, "int64": torch.int64}


def alloc_bytes(num_bytes: int, device: torch.device, *, huge_pages: bool | None = None) -> torch.Tensor:
    """An uninitialised uint8 buffer. CPU buffers of ``MAP_MIN_BYTES`` or more are private anonymous
    mappings of their own, so they start on a page and their pages can be moved into another unit's
    buffer (``pages.move_pages``); they come from the worker's warm pool (``warm_pool.POOL``: memory
    it touched before, so writing it costs no page faults) unless it is off (``WARM_POOL_BYTES`` 0)
    or ``huge_pages`` (default ``HUGE_PAGES``) asks for a mapping advised to use transparent huge
    pages: a fresh buffer's first touch (the kernel zeroing and mapping its pages) is what a
    transition's copies and receives pay for new state, and 2 MiB pages halve it in isolation
    (1.3 -> 2.7 GB/s). The tensor keeps the mapping alive."""
    if device.type != "cpu" or num_bytes < MAP_MIN_BYTES:
        return torch.empty(num_bytes, dtype=torch.uint8, device=device)
    huge = HUGE_PAGES if huge_pages is None else huge_pages
    if warm_pool.WARM_POOL_BYTES > 0 and not huge:
        return warm_pool.POOL.take(num_bytes)
    region = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and num_bytes >= HUGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8)


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return tuple(inv)


def _stored(t: torch.Tensor, storage_lengths: tuple[int, ...], order: tuple[int, ...]) -> torch.Tensor:
    """The logical view of a contiguous buffer ``t`` holding a box in storage ``order``."""
    t = t.view(storage_lengths)
    return t.permute(_inverse(order)) if order else t


def storage_view(view: torch.Tensor, slot: Slot) -> torch.Tensor:
    """A logical view of ``slot``'s tensor (or a box of it) with its dims in storage order."""
    return view.permute(slot.order) if slot.order else view


@dataclass(slots=True)
class RankState:
    """The live state one worker holds for one unit rank: a flat buffer and typed views into it."""

    placement: StagePlacement
    replica: int
    rank: int
    flat: torch.Tensor  # uint8, 1-D
    slots: dict[tuple[str, str], Slot]

    @classmethod
    def allocate(cls, placement: StagePlacement, replica: int, rank: int,
                 device: torch.device) -> RankState:
        slots, size = rank_slots(placement, rank)
        # not zeroed: a transition, a random init or a checkpoint load writes every slot, and zeroing
        # would cost one more pass over the whole state (only the alignment padding stays undefined)
        flat = alloc_bytes(size, device)
        return cls(placement=placement, replica=replica, rank=rank, flat=flat,
                   slots={s.key: s for s in slots})

    def view(self, tensor: str, kind: str) -> torch.Tensor:
        slot = self.slots[(tensor, kind)]
        raw = self.flat[slot.byte_offset: slot.byte_offset + slot.num_bytes]
        return _stored(raw.view(TORCH_DTYPES[slot.dtype]), slot.storage_lengths, slot.order)

    @property
    def counters(self) -> torch.Tensor:
        return self.view(COUNTERS, COUNTERS_KIND)

    def shards(self) -> Iterable[tuple[Slot, torch.Tensor]]:
        for slot in self.slots.values():
            yield slot, self.view(slot.tensor, slot.kind)


def allocate_unit(unit: EMU, gpu: int, device: torch.device) -> RankState:
    """A fresh (uninitialised) buffer for ``unit``'s share on ``gpu``."""
    placement = unit_placement(unit)
    return RankState(placement=placement, replica=0, rank=placement.gpu_sets[0].index(gpu),
                     flat=alloc_bytes(unit_buffer_bytes(unit, gpu), device), slots=dict(unit_slots(unit, gpu)))


def piece_view(state: RankState, slot: Slot, box: Box) -> torch.Tensor:
    """The logical view of ``box`` of ``slot`` inside ``state``'s buffer."""
    full = state.view(slot.tensor, slot.kind)
    idx = tuple(slice(o - so, o - so + k) for o, so, k in zip(box[0], slot.offsets, box[1]))
    return full[idx]


def typed(buf: torch.Tensor, offset: int, p: Piece) -> torch.Tensor:
    """Piece ``p`` at ``offset`` of a bucket, as a logical view. Its bytes lie in storage order, as
    both ends hold them (the order belongs to the tensor), so a bucket laid out as one side's buffer
    holds exactly that side's bytes."""
    order = p.src_slot.order
    lens = tuple(p.box[1][d] for d in order) if order else p.box[1]
    return _stored(buf[offset: offset + p.num_bytes].view(TORCH_DTYPES[p.src_slot.dtype]), lens, order)

