"""One pair's bucket memory, streamed: the bucketizer fed piece by piece, repeated layers skipped. Pure.

``PairStream`` is transitions.transfer_plan.messages for ONE (src, dst) pair, kept to what
``in_flight_bytes`` counts: per round, the bytes of the messages packed (not in place) on either
side. It follows ``messages`` step by step (runs coalesced on both sides, direct from
``DIRECT_MIN_BYTES``, the rest split and packed into buckets, buckets into rounds), as a state machine
fed one piece at a time, so that a run of identical layers (``feed_run``: one layer's pieces shifted
by a fixed number of pages per layer) need not be fed whole: once the state after a layer, taken
relative to that layer's offsets, equals the state after an earlier one, every later period of
layers emits the same buckets again (rounds shifted), and is added without being fed. Pages keep the
bucketizer's alignment tests (``transitions.layout.slot_start``) unchanged under the shift.
tests/transitions/test_gpu_traffic.py checks it against ``messages``.
"""

from __future__ import annotations

from itertools import groupby

from transitions import transfer_plan
from transitions.layout import PAGE_BYTES, align, contiguous_range, slot_start
from transitions.transfer_plan import (
    DIRECT_MIN_BYTES,
    SPLIT_MIN_BYTES,
    Piece,
    _split_piece,
)

Range = tuple[int, int]


def per_round(sent: dict[int, int], received: dict[int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Bytes by round as two tuples, as long as the last round with any."""
    rounds = 1 + max((*sent, *received), default=-1)
    return tuple(sent.get(r, 0) for r in range(rounds)), tuple(received.get(r, 0) for r in range(rounds))


class Rec:
    """A piece (or one part of a split one) shifted by ``ts`` / ``td`` bytes on the source / target side."""

    __slots__ = ("piece", "part", "ts", "td", "nbytes", "src", "dst", "src_slot", "dst_slot")

    def __init__(self, piece: Piece, part: int, ts: int, td: int, nbytes: int, src: Range | None,
                 dst: Range | None, src_slot: Range, dst_slot: Range) -> None:
        self.piece, self.part, self.ts, self.td, self.nbytes = piece, part, ts, td, nbytes
        self.src, self.dst, self.src_slot, self.dst_slot = src, dst, src_slot, dst_slot

    def shifted(self, ts: int, td: int) -> Rec:
        src, dst = self.src, self.dst
        return Rec(self.piece, self.part, self.ts + ts, self.td + td, self.nbytes,
                   None if src is None else (src[0] + ts, src[1] + ts), None if dst is None else (dst[0] + td, dst[1] + td),
                   (self.src_slot[0] + ts, self.src_slot[1]), (self.dst_slot[0] + td, self.dst_slot[1]))

    def key(self, ts: int, td: int) -> tuple[int, int, int, int]:
        return (id(self.piece), self.part, self.ts - ts, self.td - td)


def _moved(r: Range | None, by: int) -> Range | None:
    return None if r is None else (r[0] + by, r[1] + by)


def _back_to_back(prev: Range, prev_slot: Range, nxt: Range, nxt_slot: Range) -> bool:
    """transitions.transfer_plan._back_to_back on (start, size) slots."""
    if nxt[0] == prev[1]:
        return True
    return prev[1] == prev_slot[0] + prev_slot[1] and nxt[0] == nxt_slot[0] and nxt[0] == slot_start(prev[1], nxt_slot[1])


def _adjacent(recs: list[Rec], src_side: bool) -> tuple[tuple[int, ...], int] | None:
    """transitions.transfer_plan._adjacent: (offsets from the start, length) if back to back on a side."""
    if len({r.piece.src_unit if src_side else r.piece.dst_unit for r in recs}) != 1:
        return None
    prev: tuple[Range, Range] | None = None
    for r in recs:
        here, slot = (r.src, r.src_slot) if src_side else (r.dst, r.dst_slot)
        if here is None or (prev is not None and not _back_to_back(prev[0], prev[1], here, slot)):
            return None
        prev = (here, slot)
    start = (recs[0].src if src_side else recs[0].dst)[0]  # type: ignore[index]
    return tuple((r.src if src_side else r.dst)[0] - start for r in recs), prev[0][1] - start  # type: ignore[index,union-attr]


class _Run:
    """The open run of pieces contiguous on both sides: its byte ranges, and its pieces (only the last
    once ``direct``: long enough to go as a zero-copy message)."""

    __slots__ = ("src", "dst", "members", "direct")

    def __init__(self, r: Rec) -> None:
        assert r.src is not None and r.dst is not None
        self.src, self.dst, self.members = r.src, r.dst, [r]
        self.direct = r.src[1] - r.src[0] >= DIRECT_MIN_BYTES

    def state(self, ts: int, td: int) -> tuple[object, ...]:
        head = (None, None) if self.direct else (self.src[0] - ts, self.dst[0] - td)
        return (*head, self.src[1] - ts, self.dst[1] - td, tuple(m.key(ts, td) for m in self.members))

    def shift(self, ts: int, td: int) -> None:
        self.src = (self.src[0] + ts, self.src[1] + ts)
        self.dst = (self.dst[0] + td, self.dst[1] + td)
        self.members = [m.shifted(ts, td) for m in self.members]


class PairStream:
    """The bucketizer of one pair, fed in order; ``sent`` / ``received``: packed bytes per round."""

    def __init__(self, max_bucket_bytes: int | None = None) -> None:
        # read at the call, as footprints.wire_buffers does (tests change it)
        self.max = transfer_plan.DEFAULT_BUCKET_BYTES if max_bucket_bytes is None else max_bucket_bytes
        self.run: _Run | None = None
        self.bucket: list[Rec] = []
        self.size = 0
        self.adjacent = False
        self.round, self.volume = 0, 0
        self.packed = 0  # pieces packed so far
        self.log: list[tuple[int, int, int]] = []  # (round, sent, received) per bucket
        self._parts: dict[int, list[tuple[int, Range | None, Range | None]]] = {}

    def rec(self, piece: Piece) -> Rec:
        src, dst = piece.src_slot, piece.dst_slot
        return Rec(piece, -1, 0, 0, piece.num_bytes, contiguous_range(src, piece.box), contiguous_range(dst, piece.box),
                   (src.byte_offset, src.num_bytes), (dst.byte_offset, dst.num_bytes))

    def feed(self, r: Rec) -> None:
        """One piece, as ``_coalesce`` meets it. A run already ``DIRECT_MIN_BYTES`` long keeps only its
        ends and last piece: it goes direct whatever follows, and only those decide what joins it."""
        if r.src is None or r.dst is None:
            self._close_run()
            self._pack(r)
            return
        run = self.run
        if run is not None:
            last = run.members[-1]
            if (last.piece.src_unit, last.piece.dst_unit) == (r.piece.src_unit, r.piece.dst_unit) \
                    and r.src[0] - run.src[1] == r.dst[0] - run.dst[1] \
                    and _back_to_back(run.src, last.src_slot, r.src, r.src_slot) \
                    and _back_to_back(run.dst, last.dst_slot, r.dst, r.dst_slot):
                run.src, run.dst = (run.src[0], r.src[1]), (run.dst[0], r.dst[1])
                run.members = [r] if run.direct else [*run.members, r]
                run.direct = run.src[1] - run.src[0] >= DIRECT_MIN_BYTES
                return
            self._close_run()
        self.run = _Run(r)

    def _close_run(self) -> None:
        run, self.run = self.run, None
        if run is not None and not run.direct:  # a direct run holds no bucket
            for m in run.members:
                self._pack(m)

    def _split(self, r: Rec) -> list[Rec]:
        parts = self._parts.get(id(r.piece))
        if parts is None:
            parts = self._parts[id(r.piece)] = [
                (q.num_bytes, contiguous_range(q.src_slot, q.box), contiguous_range(q.dst_slot, q.box))
                for q in _split_piece(r.piece, self.max)]
        if len(parts) == 1:
            return [r]
        return [Rec(r.piece, i, r.ts, r.td, n, _moved(s, r.ts), _moved(d, r.td), r.src_slot, r.dst_slot)
                for i, (n, s, d) in enumerate(parts)]

    def _pack(self, r: Rec) -> None:
        """A packed piece into the open bucket, as ``_buckets`` places it."""
        self.packed += 1
        for p in self._split(r):
            here, last = p.dst, self.bucket[-1] if self.bucket else None
            follows = (here is not None and last is not None and last.dst is not None and self.adjacent
                       and last.piece.dst_unit == p.piece.dst_unit
                       and _back_to_back(last.dst, last.dst_slot, here, p.dst_slot))
            gap = bool(self.bucket) and self.size >= SPLIT_MIN_BYTES and not follows
            if self.bucket and (self.size + align(p.nbytes) > self.max or gap):
                self._close_bucket()
            self.adjacent = here is not None and (follows or not self.bucket)
            self.bucket.append(p)
            self.size += align(p.nbytes)

    def _close_bucket(self) -> None:
        """The open bucket as ``_bucket_message`` lays it out, into its round as ``_rounds`` does."""
        bucket, self.bucket, self.size = self.bucket, [], 0
        on_dst, on_src = _adjacent(bucket, False), _adjacent(bucket, True)
        if on_dst is not None:
            length, src_packed, dst_packed = on_dst[1], on_src != on_dst, False
        elif on_src is not None:
            length, src_packed, dst_packed = on_src[1], False, True
        else:
            length, src_packed, dst_packed = sum(align(r.nbytes) for r in bucket), True, True
        if self.volume and self.volume + length > self.max:
            self.round, self.volume = self.round + 1, 0
        self.volume += length
        self.log.append((self.round, length if src_packed else 0, length if dst_packed else 0))

    def finish(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(sent, received): packed bytes per round, every piece fed."""
        self._close_run()
        if self.bucket:
            self._close_bucket()
        sent: dict[int, int] = {}
        received: dict[int, int] = {}
        for r, s, d in self.log:
            if s:
                sent[r] = sent.get(r, 0) + s
            if d:
                received[r] = received.get(r, 0) + d
        return per_round(sent, received)

    def _shift(self, ts: int, td: int) -> None:
        if self.run is not None:
            self.run.shift(ts, td)
        self.bucket = [m.shifted(ts, td) for m in self.bucket]

    def feed_run(self, pieces: list[Piece], shifts: list[list[tuple[int, int]]]) -> None:
        """Layer after layer: ``pieces`` with each piece shifted by that layer's (source, target) bytes."""
        self.feed_recs([self.rec(p) for p in pieces], shifts)

    def content_key(self, feeds: list[tuple[list[Rec], list[list[tuple[int, int]]] | None]]) -> tuple[object, ...]:
        """Everything the stream's output depends on if fed ``feeds`` (each a list of records made by
        ``rec``, fed one by one where its shifts are None, else by ``feed_recs``), up to moving every
        source-side byte offset by one whole number of pages and every target-side one by another: the
        stream only compares offsets of one side with each other, takes their differences and aligns
        them to pages or ALIGN_BYTES (``slot_start``), none of which such a move changes. Per record:
        its bytes, byte ranges and slot (offset, size) less its side's base (the first record's slot
        start, rounded down to a page), which records are of one unit on either side (units are only
        compared for equality), and for a piece too big for a bucket the box and slot geometry its
        parts follow from; then the feeds' boundaries and shifts (differences already). Which records
        are one piece object only decides how much of a run is skipped, never what is emitted. Equal keys:
        the same buckets in the same rounds, by construction. gpu_traffic memoises a pair's wire by it,
        so middle PP stages, TP ranks and replicas whose pieces lie alike share one streaming."""
        first = next((recs[0] for recs, _ in feeds if recs), None)
        if first is None:
            return (self.max,)
        bs, bd = first.src_slot[0] - first.src_slot[0] % PAGE_BYTES, first.dst_slot[0] - first.dst_slot[0] % PAGE_BYTES
        units: dict[str, int] = {}
        out: list[object] = [self.max]
        for recs, shifts in feeds:
            for r in recs:
                p = r.piece
                parts = None
                if r.nbytes > self.max:  # what _split would cut it into follows from its box and slots
                    ss, ds = p.src_slot, p.dst_slot
                    parts = (tuple(o - b for o, b in zip(p.box[0], ss.offsets)), p.box[1], ss.lengths, ss.order,
                             ss.dtype, tuple(o - b for o, b in zip(p.box[0], ds.offsets)), ds.lengths, ds.order,
                             ds.dtype)
                out.append((r.nbytes,
                            None if r.src is None else (r.src[0] - bs, r.src[1] - bs),
                            None if r.dst is None else (r.dst[0] - bd, r.dst[1] - bd),
                            r.src_slot[0] - bs, r.src_slot[1], r.dst_slot[0] - bd, r.dst_slot[1],
                            units.setdefault(p.src_unit, len(units)), units.setdefault(p.dst_unit, len(units)), parts))
            out.append(None if shifts is None else _shift_key(shifts))
        return tuple(out)

    def feed_all(self, feeds: list[tuple[list[Rec], list[list[tuple[int, int]]] | None]]) -> None:
        """``feeds`` as ``content_key`` reads them: each list of records one by one where its shifts
        are None, else layer after layer (``feed_recs``)."""
        for recs, shifts in feeds:
            if shifts is None:
                for r in recs:
                    self.feed(r)
            else:
                self.feed_recs(recs, shifts)

    def feed_recs(self, base: list[Rec], shifts: list[list[tuple[int, int]]]) -> None:
        """``feed_run`` of records made by ``rec``."""
        first, stride = _even_from(shifts)
        seen: dict[tuple[object, ...], tuple[int, int, int, int]] = {}
        j = 0
        while j < len(shifts):
            for r, (ts, td) in zip(base, shifts[j]):
                self.feed(r.shifted(ts, td))
            if j >= first:
                j += self._recur(seen, j, shifts, stride)
            j += 1

    def _recur(self, seen: dict[tuple[object, ...], tuple[int, int, int, int]], j: int,
               shifts: list[list[tuple[int, int]]], stride: tuple[int, int]) -> int:
        """After layer ``j``: the layers skipped, if the state recurs (``seen`` keeps the states met)."""
        ts, td = shifts[j][0]
        run = None if self.run is None else self.run.state(ts, td)
        idle = (run, "no piece packed since", self.packed)  # the bucket as it was: nothing packed
        state = (run, tuple(m.key(ts, td) for m in self.bucket), self.size, self.adjacent)
        skipped = 0
        if idle in seen:
            skipped = self._skip_idle(seen[idle][0], j, len(shifts), stride)
        elif state in seen:
            skipped = self._skip(seen[state], j, len(shifts), stride)
        if skipped:
            seen.clear()
        seen[state] = seen[idle] = (j + skipped, len(self.log), self.round, self.volume)
        return skipped

    def _skip_idle(self, i: int, j: int, n: int, stride: tuple[int, int]) -> int:
        """Nothing was packed from layer ``i`` to ``j`` and the open run recurs, moved: nothing will be
        packed in the whole periods left either (the bucket stays as it is); how many layers that skips."""
        times = (n - 1 - j) // (j - i)
        if self.run is not None and times:
            self.run.shift(times * (j - i) * stride[0], times * (j - i) * stride[1])
        return times * (j - i)

    def _skip(self, hit: tuple[int, int, int, int], j: int, n: int, stride: tuple[int, int]) -> int:
        """The state after layer ``j`` is the one after layer ``hit[0]`` moved by the layers between,
        but for the round's volume: add the periods left whole that act alike, without feeding them;
        how many layers that skips. Alike: the volume came back (every period the same buckets in the
        same rounds, shifted), or it grew by ``grow`` within one round (every period the same buckets
        in that round, as long as the round has room for them)."""
        i, logged, round_i, volume_i = hit
        period, grow = j - i, self.volume - volume_i
        times = (n - 1 - j) // period
        if grow:
            if self.round != round_i or grow < 0:
                return 0
            times = min(times, (self.max - self.volume) // grow)
        rounds = self.round - round_i
        repeat = self.log[logged:]
        for k in range(1, times + 1):
            self.log += [(r + k * rounds, s, d) for r, s, d in repeat]
        self.round += times * rounds
        self.volume += times * grow
        self._shift(times * period * stride[0], times * period * stride[1])
        return times * period


def _shift_key(shifts: list[list[tuple[int, int]]]) -> tuple[object, ...]:
    """``shifts`` exactly, compact: the first layer's shifts, then runs of equal per-layer moves
    ((source, target) bytes per piece from the layer before) with their lengths; layers of like slots
    move alike, so a run of 80 layers is a few tuples, not 80 lists."""
    if not shifts or any(len(layer) != len(shifts[0]) for layer in shifts):
        return tuple(map(tuple, shifts))  # not one piece list per layer: kept whole
    moves = [tuple((c[0] - p[0], c[1] - p[1]) for c, p in zip(cur, prev)) for prev, cur in zip(shifts, shifts[1:])]
    return (tuple(shifts[0]), *((move, len(list(run))) for move, run in groupby(moves)))


def _even_from(shifts: list[list[tuple[int, int]]]) -> tuple[int, tuple[int, int]]:
    """(first layer, stride): from that layer on, every piece moves by the same stride per layer, a
    whole number of pages on both sides (the bucketizer then acts alike on every layer); first is
    len(shifts) where no such run of two layers or more exists."""
    n = len(shifts)
    if n < 3:
        return n, (0, 0)
    a, b = shifts[-2], shifts[-1]
    stride = (b[0][0] - a[0][0], b[0][1] - a[0][1])
    if stride[0] % PAGE_BYTES or stride[1] % PAGE_BYTES:
        return n, (0, 0)
    first = n - 1
    while first > 0 and all((y[0] - x[0], y[1] - x[1]) == stride for x, y in zip(shifts[first - 1], shifts[first])):
        first -= 1
    return (first, stride) if first < n - 2 else (n, (0, 0))
