"""Raw memory moves of the executor (CPU), on hand-made pieces: the ragged ends of a run moved as
pages, and the compaction of a strided piece inside one buffer, including one that starts in place.

No transition DAG makes these cases today (every piece of every layout change is one contiguous run
on both sides: tests/transitions/test_pieces_contiguous.py), so they are pinned here directly."""

from __future__ import annotations

import torch

from transitions.executor.buffers import RankState, alloc_bytes
from transitions.executor.in_place import _compact_piece
from transitions.executor.pages import move_or_copy
from transitions.layout import PAGE_BYTES, Slot
from transitions.transfer_plan import Piece


def _random(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def test_a_run_off_the_page_grid_moves_its_pages_and_copies_both_ragged_ends() -> None:
    src, dst = alloc_bytes(4 << 20, torch.device("cpu")), alloc_bytes(4 << 20, torch.device("cpu"))
    src.copy_(_random(src.numel(), 1))
    original = src.clone()
    offset, n = 100, 5 * PAGE_BYTES + (64 << 10) + 17  # starts 100 bytes into a page on both sides
    moved: list[tuple[int, int, int]] = []
    copied, body = move_or_copy(dst.data_ptr() + offset, src.data_ptr() + offset, n, moved)
    head = PAGE_BYTES - offset
    assert body > 0 and moved == [(dst.data_ptr() + offset + head, src.data_ptr() + offset + head, body)]
    assert copied == n - body and head < copied  # both ends were copied, the pages between moved
    assert torch.equal(dst[offset: offset + n], original[offset: offset + n])
    assert int(src[offset + head: offset + head + body].count_nonzero()) == 0  # moved away, not copied


def test_a_run_at_different_page_offsets_is_copied_whole() -> None:
    src, dst = alloc_bytes(2 << 20, torch.device("cpu")), alloc_bytes(2 << 20, torch.device("cpu"))
    src.copy_(_random(src.numel(), 2))
    n = 200 << 10
    moved: list[tuple[int, int, int]] = []
    assert move_or_copy(dst.data_ptr() + 300, src.data_ptr() + 100, n, moved) == (n, 0) and not moved
    assert torch.equal(dst[300: 300 + n], src[100: 100 + n])


def _slot(rows: int, cols: int, byte_offset: int) -> Slot:
    return Slot(tensor="w", kind="param", dtype="float32", global_shape=(rows, 16), offsets=(0, 0),
                lengths=(rows, cols), byte_offset=byte_offset)


def _compact(rows: int, cols: int, src_cols: int, src_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact the first ``cols`` columns of a rows x src_cols donor slot at ``src_offset`` into a
    rows x cols slot at byte 0 of the same buffer; returns (what the target holds, what it should)."""
    flat = torch.zeros(src_offset + rows * src_cols * 4, dtype=torch.uint8)
    src, dst = _slot(rows, src_cols, src_offset), _slot(rows, cols, 0)
    donor = RankState(placement=None, replica=0, rank=0, flat=flat, slots={src.key: src})  # type: ignore[arg-type]
    target = RankState(placement=None, replica=0, rank=0, flat=flat, slots={dst.key: dst})  # type: ignore[arg-type]
    logical = torch.randn(rows, src_cols, generator=torch.Generator().manual_seed(rows * cols))
    donor.view(*src.key).copy_(logical)
    piece = Piece(src_worker=0, dst_worker=0, src_slot=src, dst_slot=dst, box=((0, 0), (rows, cols)),
                  src_unit="a", dst_unit="b")
    _compact_piece(piece, donor, target)
    return target.view(*dst.key).clone(), logical[:, :cols]


def test_a_strided_piece_that_starts_in_place_still_moves_its_later_rows() -> None:
    """Row 0 is already where it belongs; rows 1.. must come forward (row 1 overlaps its source)."""
    got, want = _compact(rows=8, cols=4, src_cols=8, src_offset=0)
    assert torch.equal(got, want)


def test_a_strided_piece_behind_its_source_is_compacted_in_chunks() -> None:
    for src_offset in (64, 1024):  # overlapping the destination by a few rows, and clear of it
        got, want = _compact(rows=16, cols=4, src_cols=12, src_offset=src_offset)
        assert torch.equal(got, want), src_offset
