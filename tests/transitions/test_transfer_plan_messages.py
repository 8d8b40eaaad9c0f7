"""The bucketizer (transitions.transfer_plan.messages) on hand-laid slots: zero-copy runs, buckets read
or written in place, packed buckets, pieces cut to fit, rounds by volume, and the in-flight memory."""

from __future__ import annotations

from transitions.layout import Slot
from transitions.transfer_plan import (
    DIRECT_MIN_BYTES,
    SPLIT_MIN_BYTES,
    Message,
    Piece,
    Step,
    _adjacent,
    _bucket_message,
    _rounds,
    in_flight_bytes,
    messages,
)


def _slot(n: int, at: int, offset: int = 0, tensor: str = "w") -> Slot:
    """A 1-D float32 shard of ``n`` elements starting at element ``offset``, at byte ``at``."""
    return Slot(tensor=tensor, kind="param", dtype="float32", global_shape=(1 << 30,), offsets=(offset,),
                lengths=(n,), byte_offset=at)


def _piece(n: int, src_at: int, dst_at: int, src: int = 0, dst: int = 1, tensor: str = "w",
           src_unit: str = "a", dst_unit: str = "b") -> Piece:
    """A whole 1-D shard of ``n`` float32 from byte ``src_at`` on ``src`` to byte ``dst_at`` on ``dst``."""
    return Piece(src_worker=src, dst_worker=dst, src_slot=_slot(n, src_at, tensor=tensor),
                 dst_slot=_slot(n, dst_at, tensor=tensor), box=((0,), (n,)), src_unit=src_unit, dst_unit=dst_unit)


def _strided(rows: int, cols: int, dst_at: int, src: int = 0, dst: int = 1, tensor: str = "s") -> Piece:
    """The left half (``cols`` of 2 * ``cols`` columns) of a row-major matrix: strided in the source,
    one run in the destination."""
    src_slot = Slot(tensor=tensor, kind="param", dtype="float32", global_shape=(rows, 2 * cols), offsets=(0, 0),
                    lengths=(rows, 2 * cols), byte_offset=0)
    dst_slot = Slot(tensor=tensor, kind="param", dtype="float32", global_shape=(rows, 2 * cols), offsets=(0, 0),
                    lengths=(rows, cols), byte_offset=dst_at)
    return Piece(src_worker=src, dst_worker=dst, src_slot=src_slot, dst_slot=dst_slot, box=((0, 0), (rows, cols)),
                 src_unit="a", dst_unit="b")


def _shape(ms: list[Message]) -> list[tuple[object, ...]]:
    return [(m.src_worker, m.dst_worker, m.round, m.tag, len(m.pieces), m.layout, m.length, m.src_start,
             m.dst_start) for m in ms]


def test_piece_coordinates_are_local_to_each_shard() -> None:
    src = Slot(tensor="w", kind="exp_avg", dtype="bfloat16", global_shape=(16, 16), offsets=(2, 0), lengths=(4, 10),
               byte_offset=0)
    dst = Slot(tensor="w", kind="exp_avg", dtype="bfloat16", global_shape=(16, 16), offsets=(0, 3), lengths=(8, 5),
               byte_offset=0)
    p = Piece(src_worker=3, dst_worker=3, src_slot=src, dst_slot=dst, box=((2, 3), (4, 5)), src_unit="a",
              dst_unit="b")
    assert p.num_bytes == 4 * 5 * 2 and p.tensor == "w" and p.kind == "exp_avg" and p.is_local
    assert p.offsets == (2, 3) and p.lengths == (4, 5)
    assert p.src_offsets == (0, 3) and p.dst_offsets == (2, 0)
    assert p.src_slices == (slice(0, 4), slice(3, 8)) and p.dst_slices == (slice(2, 6), slice(0, 5))
    assert not _piece(1, 0, 0, src=0, dst=1).is_local


def test_step_counts_rounds_and_bytes() -> None:
    ms = messages([_piece(10, 0, 0), _piece(10, 1000, 500)], max_bucket_bytes=48)
    step = Step(model_stage="s", primitive="split#0", local=(), messages=tuple(ms), predicted_s=0.0)
    assert [m.round for m in ms] == [0, 1] and step.num_rounds == 2 and step.bytes_moved == 80
    assert Step(model_stage="s", primitive="x#1", local=(), messages=(), predicted_s=0.0).num_rounds == 0


def test_runs_of_direct_size_are_one_zero_copy_message() -> None:
    half = DIRECT_MIN_BYTES // 2 // 4  # two back-to-back shards of 64 KiB: one run of exactly 128 KiB
    pieces = [_piece(half, 0, 4096), _piece(half, 4 * half, 4096 + 4 * half)]
    assert _shape(messages(pieces)) == [(0, 1, 0, 0, 2, (0, 4 * half), DIRECT_MIN_BYTES, 0, 4096)]
    assert messages(pieces)[0].direct
    # one element short of it: a bucket, in place on both sides all the same
    short = [_piece(half, 0, 4096), _piece(half - 1, 4 * half, 4096 + 4 * half)]
    assert _shape(messages(short)) == [(0, 1, 0, 0, 2, (0, 4 * half), DIRECT_MIN_BYTES - 4, 0, 4096)]


def test_padding_between_shards_keeps_a_bucket_in_place() -> None:
    # 40 bytes, then the next slot 16-byte aligned at 48, on both sides
    pieces = [_piece(10, 0, 0), _piece(10, 48, 48)]
    assert _shape(messages(pieces)) == [(0, 1, 0, 0, 2, (0, 48), 88, 0, 0)]


def test_a_gap_that_is_not_alignment_padding_packs_the_bucket() -> None:
    # 56 is no slot start after 40 (that is 48): neither side lies back to back
    pieces = [_piece(10, 0, 0), _piece(10, 56, 56)]
    assert _shape(messages(pieces)) == [(0, 1, 0, 0, 2, (0, 48), 96, None, None)]


def test_a_bucket_is_laid_out_as_the_side_holding_it_back_to_back() -> None:
    # back to back at the destination only (the source out of order): written in place there
    dst_only = [_piece(10, 500, 0), _piece(10, 0, 40)]
    assert _shape(messages(dst_only)) == [(0, 1, 0, 0, 2, (0, 40), 80, None, 0)]
    # at the source only
    src_only = [_piece(10, 100, 500), _piece(10, 140, 0)]
    assert _shape(messages(src_only)) == [(0, 1, 0, 0, 2, (0, 40), 80, 100, None)]
    # back to back on both sides but spaced differently (padding on one side only): the destination's
    both = [_piece(10, 0, 0), _piece(10, 40, 48)]
    assert _shape(messages(both)) == [(0, 1, 0, 0, 2, (0, 48), 88, None, 0)]


def test_pieces_back_to_back_across_two_units_are_not_one_region() -> None:
    # one source unit, two destination units whose slots happen to line up: in place at the source only
    into_two = [_piece(10, 0, 0, dst_unit="b"), _piece(10, 40, 40, dst_unit="c")]
    assert _shape(messages(into_two)) == [(0, 1, 0, 0, 2, (0, 40), 80, 0, None)]
    from_two = [_piece(10, 0, 0, src_unit="a"), _piece(10, 40, 40, src_unit="z")]
    assert _shape(messages(from_two)) == [(0, 1, 0, 0, 2, (0, 40), 80, None, 0)]


def test_adjacency_without_a_range_memo_reads_the_slots() -> None:
    pieces = [_piece(10, 100, 0), _piece(10, 140, 48)]
    assert _adjacent(pieces, "src") == (100, (0, 40), 80)
    assert _adjacent(pieces, "dst") == (0, (0, 48), 88)
    assert _adjacent([_piece(10, 100, 0), _piece(10, 200, 40)], "src") is None
    m = _bucket_message(0, 1, 2, 5, pieces)
    assert (m.round, m.tag, m.layout, m.length, m.src_start, m.dst_start) == (2, 5, (0, 48), 88, None, 0)


def test_pairs_go_in_worker_order_and_local_pieces_are_not_sent() -> None:
    pieces = [_piece(10, 0, 0, src=2, dst=0), _piece(10, 0, 0, src=0, dst=2), _piece(10, 0, 64, src=1, dst=1),
              _piece(10, 0, 0, src=0, dst=1)]
    assert [(m.src_worker, m.dst_worker) for m in messages(pieces)] == [(0, 1), (0, 2), (2, 0)]
    assert messages([_piece(10, 0, 64, src=1, dst=1)]) == []


def test_buckets_fill_rounds_by_volume_after_the_direct_runs() -> None:
    big = DIRECT_MIN_BYTES // 4
    pieces = [_piece(10, 0, 0), _piece(big, 4096, 8192), _piece(10, 1000, 2000), _piece(12, 3000, 7000)]
    got = _shape(messages(pieces, max_bucket_bytes=96))
    # the run first (tag 0, round 0); the buckets after it: 48 + 48 fill round 0, 48 opens round 1
    assert got == [(0, 1, 0, 0, 1, (0,), DIRECT_MIN_BYTES, 4096, 8192),
                   (0, 1, 0, 1, 2, (0, 48), 96, None, None),
                   (0, 1, 1, 2, 1, (0,), 48, 3000, 7000)]


def test_a_second_bucket_fills_up_exactly_like_the_first() -> None:
    pieces = [_piece(10, 1000 * i, 500 + 1000 * i) for i in range(4)]  # 40 bytes each, 48 aligned, apart
    assert [len(m.pieces) for m in messages(pieces, max_bucket_bytes=96)] == [2, 2]


def test_rounds_hold_up_to_the_bucket_size_in_volume() -> None:
    def rounds(*sizes: int) -> list[int]:
        buckets = [[_piece(n // 4, 0, 0)] for n in sizes]
        return [m.round for m in _rounds(0, 1, buckets, 96, first_tag=3)]

    assert rounds(48, 48) == [0, 0]  # exactly full
    assert rounds(32, 32, 48) == [0, 0, 1]  # the third would overflow the first round
    assert rounds(64, 64, 32) == [0, 1, 1]  # a new round starts empty
    assert [m.tag for m in _rounds(0, 1, [[_piece(4, 0, 0)], [_piece(4, 0, 0)]], 96, first_tag=3)] == [3, 4]


def test_a_piece_bigger_than_a_bucket_is_cut_into_whole_rows() -> None:
    p = _strided(rows=10, cols=4, dst_at=0)  # 16-byte rows, 160 bytes
    got = messages([p], max_bucket_bytes=64)
    assert [q.box for m in got for q in m.pieces] == [((0, 0), (4, 4)), ((4, 0), (4, 4)), ((8, 0), (2, 4))]
    assert [(m.round, m.tag, m.length, m.dst_start) for m in got] == [(0, 0, 64, 0), (1, 1, 64, 64),
                                                                       (2, 2, 32, 128)]
    assert all((q.src_worker, q.dst_worker, q.src_unit, q.dst_unit) == (0, 1, "a", "b") for m in got for q in m.pieces)
    # two or three rows of one bucket each: one row a piece
    assert [q.box for m in messages([_strided(rows=2, cols=4, dst_at=0)], 16) for q in m.pieces] == [
        ((0, 0), (1, 4)), ((1, 0), (1, 4))]
    assert [q.box for m in messages([_strided(rows=3, cols=4, dst_at=0)], 16) for q in m.pieces] == [
        ((0, 0), (1, 4)), ((1, 0), (1, 4)), ((2, 0), (1, 4))]
    # exactly a bucket: left whole
    assert [len(m.pieces) for m in messages([p], max_bucket_bytes=160)] == [1]


def test_a_row_parallel_piece_is_cut_along_its_stored_first_dim() -> None:
    src = Slot(tensor="o", kind="param", dtype="float32", global_shape=(4, 8), offsets=(0, 0), lengths=(4, 8),
               byte_offset=0, order=(1, 0))
    dst = Slot(tensor="o", kind="param", dtype="float32", global_shape=(4, 8), offsets=(0, 0), lengths=(2, 8),
               byte_offset=0, order=(1, 0))
    p = Piece(src_worker=0, dst_worker=1, src_slot=src, dst_slot=dst, box=((0, 0), (2, 8)), src_unit="a",
              dst_unit="b")  # 8 stored columns of 2 rows each: strided in the source
    got = messages([p], max_bucket_bytes=24)
    assert [q.box for m in got for q in m.pieces] == [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((0, 6), (2, 2))]


def test_a_single_row_bigger_than_a_bucket_goes_whole() -> None:
    p = _strided(rows=1, cols=40, dst_at=0)
    assert p.num_bytes == 160
    got = messages([p], max_bucket_bytes=64)
    assert [(len(m.pieces), m.length) for m in got] == [(1, 160)]


def test_a_big_bucket_closes_where_the_destination_stops_being_back_to_back() -> None:
    rows = SPLIT_MIN_BYTES // 16  # 16-byte rows: exactly SPLIT_MIN_BYTES
    first = _strided(rows=rows, cols=4, dst_at=0)
    after = _piece(4, 1 << 24, SPLIT_MIN_BYTES)  # right behind it at the destination
    apart = _piece(4, 1 << 24, SPLIT_MIN_BYTES + 64)  # elsewhere
    assert [len(m.pieces) for m in messages([first, after])] == [2]
    assert [(len(m.pieces), m.dst_start) for m in messages([first, apart])] == [(1, 0), (1, SPLIT_MIN_BYTES + 64)]
    # below SPLIT_MIN_BYTES a bucket is kept whole (then packed)
    small = _strided(rows=rows - 1, cols=4, dst_at=0)
    got = messages([small, _piece(4, 1 << 24, SPLIT_MIN_BYTES)])
    assert [(len(m.pieces), m.dst_start) for m in got] == [(2, None)]


def test_a_bucket_whose_pieces_stopped_being_back_to_back_closes_at_its_size() -> None:
    # a small piece, then a big one elsewhere at the destination (the bucket is packed from then on),
    # then one right behind the big one: the bucket, over SPLIT_MIN_BYTES, closes before it
    rows = SPLIT_MIN_BYTES // 16
    small = _piece(4, 1 << 24, 0)
    big = _strided(rows=rows, cols=4, dst_at=8192)  # not the next page-aligned slot start (4096)
    behind = _piece(4, (1 << 24) + 4096, 8192 + SPLIT_MIN_BYTES)
    assert [len(m.pieces) for m in messages([small, big, behind])] == [2, 1]


def test_a_big_bucket_fits_a_round_with_the_next_one_exactly() -> None:
    rows = SPLIT_MIN_BYTES // 16
    first, apart = _strided(rows=rows, cols=4, dst_at=0), _piece(4, 1 << 24, SPLIT_MIN_BYTES + 64)
    assert [m.round for m in messages([first, apart], max_bucket_bytes=SPLIT_MIN_BYTES + 16)] == [0, 0]
    assert [m.round for m in messages([first, apart], max_bucket_bytes=SPLIT_MIN_BYTES + 15)] == [0, 1]


def test_a_bucket_after_a_strided_destination_is_not_split_on_adjacency() -> None:
    rows = SPLIT_MIN_BYTES // 16
    # strided at the destination too (a column block into a wider slot): no adjacency known after it
    src_slot = Slot(tensor="m", kind="param", dtype="float32", global_shape=(rows, 8), offsets=(0, 0),
                    lengths=(rows, 8), byte_offset=0)
    dst_slot = Slot(tensor="m", kind="param", dtype="float32", global_shape=(rows, 8), offsets=(0, 0),
                    lengths=(rows, 8), byte_offset=0)
    both_strided = Piece(src_worker=0, dst_worker=1, src_slot=src_slot, dst_slot=dst_slot,
                         box=((0, 0), (rows, 4)), src_unit="a", dst_unit="b")
    got = messages([both_strided, _piece(4, 1 << 24, 1 << 24)])
    assert [len(m.pieces) for m in got] == [1, 1]  # the open bucket was never back to back: it closes


def test_in_flight_bytes_is_the_worst_two_consecutive_rounds_of_packed_buffers() -> None:
    def msg(src: int, dst: int, rnd: int, length: int, src_start: int | None = None,
            dst_start: int | None = None) -> Message:
        return Message(src_worker=src, dst_worker=dst, round=rnd, tag=0, pieces=(), layout=(), length=length,
                       src_start=src_start, dst_start=dst_start)

    ms = [msg(0, 1, 0, 100), msg(0, 2, 1, 50), msg(1, 0, 2, 30), msg(0, 1, 3, 1000, src_start=0),
          msg(2, 0, 5, 7, dst_start=0)]
    assert in_flight_bytes(ms, 0) == 150  # rounds 0 + 1; round 3 is read in place, round 5 written in place
    assert in_flight_bytes(ms, 1) == 1030  # its round-2 send and its round-3 receive
    assert in_flight_bytes(ms, 2) == 50  # round 1's receive (its round-5 send is alone: 7)
    assert in_flight_bytes(ms, 9) == 0
