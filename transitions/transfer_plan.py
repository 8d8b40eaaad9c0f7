"""The transfer plan of one DAG node on one worker: pieces, messages and the bucketizer. Pure.

A ``Piece`` is the one record of a box moved: one tensor's state kind, from a slot of a source
unit's buffer on one worker to a slot of a target unit's buffer on another (or the same) worker.
``messages`` is THE bucketizer: it turns a pair's pieces into what goes on the wire, and the runner,
the memory check and replay all use it, so what is checked is what runs:

- pieces contiguous on both sides merge into byte runs; a run of ``DIRECT_MIN_BYTES`` or more is a
  zero-copy message straight from the source buffer into the destination buffer;
- the rest is packed into buckets of at most ``max_bucket_bytes``; a bucket whose pieces lie back to
  back on one side (only alignment padding between them) is read or written in place on that side;
- buckets go in rounds of at most ``max_bucket_bytes`` per pair (two rounds are in flight at once).
Both ends of a pair derive the same ordered pieces, hence the same messages, without talking.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace

from transitions.layout import Box, Slot, align, contiguous_range, slot_start

DEFAULT_BUCKET_BYTES = 8 << 20  # per pair per round; two rounds are in flight at once (pipelining)
DIRECT_MIN_BYTES = 128 << 10  # smaller contiguous runs go through a bucket: one message beats many
SPLIT_MIN_BYTES = 256 << 10  # a bucket this big ends where its pieces stop being adjacent at the destination

Run = tuple[tuple[int, int], tuple[int, int]]  # (src byte range, dst byte range) of a zero-copy move


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """One box of one tensor's state kind copied from a slot of a source unit's buffer on one worker
    to a slot of a target unit's buffer on another (or the same) worker: the one record of a piece
    moved, as the runner, the memory check and replay see it."""

    src_worker: int
    dst_worker: int
    src_slot: Slot
    dst_slot: Slot
    box: Box
    src_unit: str  # the EMU uids read and written
    dst_unit: str

    @property
    def num_bytes(self) -> int:
        return math.prod(self.box[1]) * self.src_slot.element_bytes

    @property
    def tensor(self) -> str:
        return self.dst_slot.tensor

    @property
    def kind(self) -> str:
        """The state kind's name (a ``transitions.geometry.StateKind`` value, or the counters')."""
        return self.dst_slot.kind

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.box[0]

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.box[1]

    @property
    def is_local(self) -> bool:
        return self.src_worker == self.dst_worker

    @property
    def src_offsets(self) -> tuple[int, ...]:
        """Where the box starts inside the source shard (local coordinates)."""
        return tuple(o - so for o, so in zip(self.box[0], self.src_slot.offsets))

    @property
    def dst_offsets(self) -> tuple[int, ...]:
        return tuple(o - do for o, do in zip(self.box[0], self.dst_slot.offsets))

    @property
    def src_slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + k) for o, k in zip(self.src_offsets, self.box[1]))

    @property
    def dst_slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + k) for o, k in zip(self.dst_offsets, self.box[1]))


_new = object.__new__
_set = object.__setattr__


def make_piece(src_worker: int, dst_worker: int, src_slot: Slot, dst_slot: Slot, box: Box, src_unit: str,
               dst_unit: str) -> Piece:
    """``Piece(...)`` of these fields, built without the dataclass ``__init__`` (a frozen dataclass's
    costs ~2.5x this; Piece validates nothing): the bulk constructor of transitions.covers.derive_target,
    which makes every piece a DAG's footprints and workers derive. tests/transitions/test_fast_constructors.py
    checks it sets every field."""
    piece = _new(Piece)
    _set(piece, "src_worker", src_worker)
    _set(piece, "dst_worker", dst_worker)
    _set(piece, "src_slot", src_slot)
    _set(piece, "dst_slot", dst_slot)
    _set(piece, "box", box)
    _set(piece, "src_unit", src_unit)
    _set(piece, "dst_unit", dst_unit)
    return piece


@dataclass(frozen=True, kw_only=True, slots=True)
class Message:
    """What one pair (src -> dst) exchanges in one round: one buffer of ``length`` bytes holding
    ``pieces`` at ``layout`` offsets. A side whose pieces sit back to back in its flat buffer (only
    alignment padding between them) uses that region as the buffer: no packing (``src_start``) or
    no unpacking (``dst_start``); a message direct on both sides is a plain zero-copy move."""

    src_worker: int
    dst_worker: int
    round: int
    tag: int
    pieces: tuple[Piece, ...]
    layout: tuple[int, ...]
    length: int
    src_start: int | None = None
    dst_start: int | None = None

    @property
    def num_bytes(self) -> int:
        return self.length

    @property
    def direct(self) -> bool:
        return self.src_start is not None and self.dst_start is not None


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    """What one worker does for one DAG node: its local copies and the messages it sends or receives."""

    model_stage: str
    primitive: str  # the node as "kind#index" (split#3)
    local: tuple[Piece, ...]
    messages: tuple[Message, ...]
    predicted_s: float

    @property
    def num_rounds(self) -> int:
        return 1 + max((m.round for m in self.messages), default=-1)

    @property
    def bytes_moved(self) -> int:
        return sum(m.num_bytes for m in self.messages)


def in_flight_bytes(messages: Iterable[Message], worker: int) -> int:
    """The most bucket memory ``worker`` holds at once for ``messages``: the packed (not in place)
    messages it sends or receives in two consecutive rounds (two rounds are in flight at once)."""
    per_round: dict[int, int] = defaultdict(int)
    for m in messages:
        if m.src_worker == worker and m.src_start is None:
            per_round[m.round] += m.num_bytes
        if m.dst_worker == worker and m.dst_start is None:
            per_round[m.round] += m.num_bytes
    if not per_round:
        return 0
    return max(per_round.get(r, 0) + per_round.get(r + 1, 0) for r in range(max(per_round) + 1))


def _back_to_back(prev: tuple[int, int], prev_slot: Slot, nxt: tuple[int, int], nxt_slot: Slot) -> bool:
    """Whether byte range ``nxt`` follows ``prev`` with nothing but alignment padding in between."""
    if nxt[0] == prev[1]:
        return True
    return (prev[1] == prev_slot.byte_offset + prev_slot.num_bytes and nxt[0] == nxt_slot.byte_offset
            and nxt[0] == slot_start(prev[1], nxt_slot.num_bytes))


class _Ranges:
    """One ``messages`` call's memo of each piece's byte range on either side (``contiguous_range``,
    asked up to five times per piece), keyed by the piece's identity (each entry keeps its piece alive,
    so no id is reused while the memo lives): alive for that call only."""

    __slots__ = ("got",)

    def __init__(self) -> None:
        self.got: dict[int, tuple[Piece, tuple[int, int] | None, tuple[int, int] | None]] = {}

    def of(self, p: Piece) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        got = self.got.get(id(p))
        if got is None:
            got = self.got[id(p)] = (p, contiguous_range(p.src_slot, p.box), contiguous_range(p.dst_slot, p.box))
        return got[1], got[2]


def _adjacent(pieces: list[Piece], side: str, ranges_: _Ranges | None = None
              ) -> tuple[int, tuple[int, ...], int] | None:
    """(start, offsets relative to start, length) if ``pieces`` lie back to back in one flat buffer
    on ``side`` ("src" or "dst"), in order; None otherwise."""
    units = {p.src_unit if side == "src" else p.dst_unit for p in pieces}
    if len(units) != 1:
        return None
    ranges: list[tuple[tuple[int, int], Slot]] = []
    for p in pieces:
        slot = p.src_slot if side == "src" else p.dst_slot
        r = contiguous_range(slot, p.box) if ranges_ is None else ranges_.of(p)[0 if side == "src" else 1]
        if r is None:
            return None
        if ranges and not _back_to_back(ranges[-1][0], ranges[-1][1], r, slot):
            return None
        ranges.append((r, slot))
    start = ranges[0][0][0]
    return start, tuple(r[0] - start for r, _ in ranges), ranges[-1][0][1] - start


def _coalesce(pieces: list[Piece], ranges_: _Ranges) -> list[tuple[Run | None, list[Piece]]]:
    """Merge pieces contiguous on both sides into byte runs; a piece that is not stays alone (None)."""
    out: list[tuple[Run | None, list[Piece]]] = []
    for p in pieces:
        src, dst = ranges_.of(p)
        if src is None or dst is None:
            out.append((None, [p]))
            continue
        if out and out[-1][0] is not None:
            last = out[-1][1][-1]
            (s0, s1), (d0, d1) = out[-1][0]
            # only alignment padding may lie between runs, and the same amount on both sides
            if (last.src_unit, last.dst_unit) == (p.src_unit, p.dst_unit) and src[0] - s1 == dst[0] - d1 \
                    and _back_to_back((s0, s1), last.src_slot, src, p.src_slot) \
                    and _back_to_back((d0, d1), last.dst_slot, dst, p.dst_slot):
                out[-1] = (((s0, src[1]), (d0, dst[1])), out[-1][1] + [p])
                continue
        out.append(((src, dst), [p]))
    return out


def _split_piece(p: Piece, max_bytes: int) -> list[Piece]:
    """Split a piece along its first stored dimension so each part fits in a bucket (one row at least)."""
    d = p.src_slot.order[0] if p.src_slot.order else 0
    if p.num_bytes <= max_bytes or p.box[1][d] <= 1:
        return [p]
    row_bytes = p.num_bytes // p.box[1][d]
    rows = max(1, max_bytes // row_bytes)
    out = []
    for start in range(0, p.box[1][d], rows):
        n = min(rows, p.box[1][d] - start)
        offs, lens = list(p.box[0]), list(p.box[1])
        offs[d], lens[d] = offs[d] + start, n
        box = (tuple(offs), tuple(lens))
        out.append(Piece(src_worker=p.src_worker, dst_worker=p.dst_worker, src_slot=p.src_slot,
                         dst_slot=p.dst_slot, box=box, src_unit=p.src_unit, dst_unit=p.dst_unit))
    return out


def messages(pieces: Iterable[Piece], max_bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Message]:
    """The messages carrying ``pieces`` between workers (local pieces are skipped), pair by pair in
    worker order, each pair's in the order its receiver posts them: its zero-copy runs first (all in
    round 0, they need no buffer), then its buckets, in rounds of at most ``max_bucket_bytes``."""
    by_pair: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    for p in pieces:
        if p.src_worker != p.dst_worker:
            by_pair[(p.src_worker, p.dst_worker)].append(p)
    out: list[Message] = []
    ranges_ = _Ranges()
    for (src, dst), pair_pieces in sorted(by_pair.items()):
        direct: list[tuple[Run, list[Piece]]] = []
        packed: list[Piece] = []
        for run, members in _coalesce(pair_pieces, ranges_):
            if run is not None and run[0][1] - run[0][0] >= DIRECT_MIN_BYTES:
                direct.append((run, members))
            else:
                for p in members:
                    packed.extend(_split_piece(p, max_bucket_bytes))
        for tag, (run, members) in enumerate(direct):
            layout = tuple(ranges_.of(p)[0][0] - run[0][0] for p in members)  # type: ignore[index]
            out.append(Message(src_worker=src, dst_worker=dst, round=0, tag=tag, pieces=tuple(members),
                               layout=layout, length=run[0][1] - run[0][0], src_start=run[0][0],
                               dst_start=run[1][0]))
        out += _rounds(src, dst, _buckets(packed, max_bucket_bytes, ranges_), max_bucket_bytes,
                       first_tag=len(direct), ranges_=ranges_)
    return out


def _buckets(packed: list[Piece], max_bucket_bytes: int, ranges_: _Ranges) -> list[list[Piece]]:
    """``packed`` cut into buckets of at most ``max_bucket_bytes`` (each piece 16-byte aligned). A
    bucket also closes where its pieces stop lying back to back in the destination (a direct run
    sits in between): the destination then receives each bucket in place instead of unpacking it,
    unless that would make the bucket too small to be worth a message (``SPLIT_MIN_BYTES``)."""
    buckets: list[list[Piece]] = [[]]
    size = 0
    adjacent, last = False, None  # whether the open bucket lies back to back in the destination
    for p in packed:
        here = ranges_.of(p)[1]
        follows = (here is not None and last is not None and adjacent and last[2] == p.dst_unit
                   and _back_to_back(last[0], last[1], here, p.dst_slot))
        gap = bool(buckets[-1]) and size >= SPLIT_MIN_BYTES and not follows
        if buckets[-1] and (size + align(p.num_bytes) > max_bucket_bytes or gap):
            buckets.append([])
            size = 0
        adjacent = here is not None and (follows or not buckets[-1])
        last = (here, p.dst_slot, p.dst_unit) if here is not None else None
        buckets[-1].append(p)
        size += align(p.num_bytes)
    return [b for b in buckets if b]


def _rounds(src: int, dst: int, buckets: list[list[Piece]], max_bucket_bytes: int, first_tag: int,
            ranges_: _Ranges | None = None) -> list[Message]:
    """The buckets' messages in rounds by volume: each carries at most ``max_bucket_bytes`` per pair."""
    out: list[Message] = []
    rnd, volume = 0, 0
    for tag, bucket in enumerate(buckets, start=first_tag):
        message = _bucket_message(src, dst, rnd, tag, bucket, ranges_)
        if volume and volume + message.length > max_bucket_bytes:
            rnd, volume = rnd + 1, 0
            message = replace(message, round=rnd)
        volume += message.length
        out.append(message)
    return out


def _bucket_message(src: int, dst: int, rnd: int, tag: int, bucket: list[Piece], ranges_: _Ranges | None = None
                    ) -> Message:
    """A packed bucket, laid out as the destination (else the source) holds it when its pieces sit
    back to back there, so that side skips its copy."""
    on_dst, on_src = _adjacent(bucket, "dst", ranges_), _adjacent(bucket, "src", ranges_)
    if on_dst is not None:
        start, layout, length = on_dst
        same = on_src is not None and on_src[1:] == (layout, length)
        return Message(src_worker=src, dst_worker=dst, round=rnd, tag=tag, pieces=tuple(bucket), layout=layout,
                       length=length, src_start=on_src[0] if same and on_src else None, dst_start=start)
    if on_src is not None:
        start, layout, length = on_src
        return Message(src_worker=src, dst_worker=dst, round=rnd, tag=tag, pieces=tuple(bucket), layout=layout,
                       length=length, src_start=start)
    offsets, cursor = [], 0
    for p in bucket:
        offsets.append(cursor)
        cursor += align(p.num_bytes)
    return Message(src_worker=src, dst_worker=dst, round=rnd, tag=tag, pieces=tuple(bucket),
                   layout=tuple(offsets), length=cursor)

