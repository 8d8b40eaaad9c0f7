"""transitions.wire_stream term by term: PairStream's per-round packed bytes against
transitions.transfer_plan's bucketizer (the exact path it claims to equal, fed every piece) on random
pairs of small buffers, and against values worked out by hand from the bucketizer's rules."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from transitions.layout import PAGE_BYTES, Slot, slot_start
from transitions.transfer_plan import Piece, messages
from transitions.wire_stream import PairStream, Rec, _even_from, per_round

Wire = tuple[tuple[int, ...], tuple[int, ...]]
F32 = 4


def oracle(pieces: list[Piece], max_bucket_bytes: int) -> Wire:
    """The bucketizer itself over every piece: packed bytes per round on the sender (messages not read
    in place) and on the receiver (not written in place), as long as the last round with any message."""
    msgs = messages(pieces, max_bucket_bytes)
    rounds = 1 + max((m.round for m in msgs), default=-1)
    sent, received = [0] * rounds, [0] * rounds
    for m in msgs:
        if m.src_start is None:
            sent[m.round] += m.length
        if m.dst_start is None:
            received[m.round] += m.length
    # trailing rounds with nothing packed on either side are not counted (a direct run is in round 0)
    while sent and not sent[-1] and not received[-1]:
        sent.pop()
        received.pop()
    return tuple(sent), tuple(received)


def slot(name: str, rows: int, cols: int, c0: int, c1: int, byte_offset: int, order: tuple[int, ...] = ()) -> Slot:
    """The shard of columns [c0, c1) of a float32 rows x cols tensor, at ``byte_offset``."""
    return Slot(tensor=name, kind="param", dtype="float32", global_shape=(rows, cols), offsets=(0, c0),
                lengths=(rows, c1 - c0), byte_offset=byte_offset, order=order)


def piece(src: Slot, dst: Slot, rows: tuple[int, int], cols: tuple[int, int], src_unit: str = "s",
          dst_unit: str = "d") -> Piece:
    return Piece(src_worker=0, dst_worker=1, src_slot=src, dst_slot=dst,
                 box=((rows[0], cols[0]), (rows[1] - rows[0], cols[1] - cols[0])), src_unit=src_unit, dst_unit=dst_unit)


def moved(p: Piece, ts: int, td: int) -> Piece:
    return replace(p, src_slot=replace(p.src_slot, byte_offset=p.src_slot.byte_offset + ts),
                   dst_slot=replace(p.dst_slot, byte_offset=p.dst_slot.byte_offset + td))


def _lay(sizes: list[int], start: int) -> tuple[list[int], int]:
    """Byte offsets of slots of ``sizes`` laid one after the other as rank_slots does; the end."""
    offsets, end = [], start
    for n in sizes:
        end = slot_start(end, n)
        offsets.append(end)
        end += n
    return offsets, end


def random_layer(rng: random.Random) -> tuple[list[Piece], int, int]:
    """One layer's pieces between a source and a target buffer (the same tensors, sharded by columns
    differently on either side, cut into row ranges; sometimes another unit or a column-major side),
    and the bytes each side's layer spans; at least one piece."""
    while True:
        got = _layer(rng)
        if got[0]:
            return got


def _layer(rng: random.Random) -> tuple[list[Piece], int, int]:
    tensors = []
    for t in range(rng.randint(1, 4)):
        rows = rng.choice([1, 2, 3, 8, 16, 64])
        cols = rng.choice([4, 6, 64, 256, 1024, 4096])
        halves = [(0, cols), (0, cols // 2), (cols // 2, cols)] if cols >= 2 else [(0, cols)]
        tensors.append((f"t{t}", rows, cols, rng.choice(halves), rng.choice(halves)))
    src_order = rng.sample(range(len(tensors)), len(tensors)) if rng.random() < 0.3 else list(range(len(tensors)))
    dst_order = rng.sample(range(len(tensors)), len(tensors)) if rng.random() < 0.3 else list(range(len(tensors)))
    size = [rows * (c[1] - c[0]) * F32 for _, rows, _, c, _ in tensors]
    dsize = [rows * (c[1] - c[0]) * F32 for _, rows, _, _, c in tensors]
    s_off, s_end = _lay([size[i] for i in src_order], rng.choice([0, 16, PAGE_BYTES]))
    d_off, d_end = _lay([dsize[i] for i in dst_order], rng.choice([0, 48, 2 * PAGE_BYTES]))
    pieces: list[Piece] = []
    for i, (name, rows, cols, sc, dc) in enumerate(tensors):
        c0, c1 = max(sc[0], dc[0]), min(sc[1], dc[1])
        if c0 >= c1:
            continue
        s_col_major = rows > 1 and rng.random() < 0.15
        src = slot(name, rows, cols, *sc, s_off[src_order.index(i)], (1, 0) if s_col_major else ())
        dst = slot(name, rows, cols, *dc, d_off[dst_order.index(i)])
        cuts = sorted({0, rows, *rng.sample(range(rows + 1), min(rows + 1, rng.randint(0, 3)))})
        su = rng.choice(["s", "s", "s", "s2"])
        du = rng.choice(["d", "d", "d", "d2"])
        for a, b in zip(cuts, cuts[1:]):
            pieces.append(piece(src, dst, (a, b), (c0, c1), su, du))
    if rng.random() < 0.2:
        rng.shuffle(pieces)
    return pieces, s_end, d_end


BUCKETS = [16 << 10, 64 << 10, 100_000, 256 << 10, 1 << 20, 8 << 20]


def _streamed(prefix: list[Piece], layer: list[Piece], shifts: list[list[tuple[int, int]]], suffix: list[Piece],
              bucket: int | None) -> Wire:
    stream = PairStream(bucket)
    for p in prefix:
        stream.feed(stream.rec(p))
    stream.feed_run(layer, shifts)
    for p in suffix:
        stream.feed(stream.rec(p))
    return stream.finish()


def _every(prefix: list[Piece], layer: list[Piece], shifts: list[list[tuple[int, int]]], suffix: list[Piece]
           ) -> list[Piece]:
    return [*prefix, *(moved(p, ts, td) for layer_shifts in shifts for p, (ts, td) in zip(layer, layer_shifts)),
            *suffix]


def random_run(rng: random.Random) -> tuple[list[Piece], list[Piece], list[list[tuple[int, int]]], list[Piece]]:
    """A prefix fed piece by piece, a layer repeated over ``shifts`` (from some layer on, every piece moves
    by one stride per layer: whole pages, or not), and a suffix."""
    layer, s_span, d_span = random_layer(rng)
    n = rng.randint(1, 14)
    paged = rng.random() < 0.8
    ss = -(-s_span // PAGE_BYTES) * PAGE_BYTES + rng.choice([0, 0, PAGE_BYTES]) if paged else s_span + 16
    ds = -(-d_span // PAGE_BYTES) * PAGE_BYTES + rng.choice([0, 0, PAGE_BYTES]) if paged else d_span
    first = rng.choice([0, 0, 1, 2, n])
    shifts, base_s, base_d = [], PAGE_BYTES * 64, PAGE_BYTES * 128
    for j in range(n):
        if j < first:  # irregular layers before the even ones
            step = (rng.choice([ss, ss + PAGE_BYTES, ss + 16]), rng.choice([ds, ds + PAGE_BYTES]))
        else:
            step = (ss, ds)
        base_s, base_d = base_s + step[0], base_d + step[1]
        shifts.append([(base_s, base_d)] * len(layer))
    prefix = random_layer(rng)[0] if rng.random() < 0.4 else []
    suffix: list[Piece] = []
    if rng.random() < 0.3:  # elsewhere
        suffix = [moved(p, base_s + 2 * ss, base_d + 2 * ds) for p in random_layer(rng)[0]]
    elif rng.random() < 0.5:  # the layer once more where the next one would be: it may join the last run
        suffix = [moved(p, base_s + ss, base_d + ds) for p in layer[:rng.randint(1, len(layer))]]
    return prefix, layer, shifts, suffix


@pytest.mark.parametrize("seed", range(40))
def test_streamed_layers_equal_the_bucketizer_over_every_piece(seed: int) -> None:
    """Oracle: transfer_plan.messages over every piece of every layer (shifted), whatever the bucket
    size: the stream, periods skipped, gives the same packed bytes per round on both sides."""
    rng = random.Random(seed)
    for _ in range(8):
        prefix, layer, shifts, suffix = random_run(rng)
        bucket = rng.choice(BUCKETS)
        assert _streamed(prefix, layer, shifts, suffix, bucket) == oracle(_every(prefix, layer, shifts, suffix),
                                                                            bucket)


# --- _even_from: where the layers start moving by one stride, worked out by hand ---------------------

P = PAGE_BYTES


def test_even_from_needs_three_layers() -> None:
    """Fewer than three layers: no run of two strides to skip over (first = len(shifts))."""
    assert _even_from([])[0] == 0
    assert _even_from([[(0, 0)], [(P, P)]])[0] == 2


def test_even_from_three_even_layers_start_at_zero() -> None:
    """Every piece moves by (P, 2P) per layer: even from layer 0, stride (P, 2P); the second piece sits
    elsewhere but moves alike."""
    shifts = [[(0, 0), (16, 32)], [(P, 2 * P), (P + 16, 2 * P + 32)], [(2 * P, 4 * P), (2 * P + 16, 4 * P + 32)]]
    assert _even_from(shifts) == (0, (P, 2 * P))
    # the same over five layers
    shifts = [[(k * P, 2 * k * P), (k * P + 16, 2 * k * P + 32)] for k in range(5)]
    assert _even_from(shifts) == (0, (P, 2 * P))


def test_even_from_strides_must_be_whole_pages_on_both_sides() -> None:
    """A stride of 16 bytes on either side would move the bucketizer's page alignment: no run."""
    assert _even_from([[(k * P, 16 * k)] for k in range(3)])[0] == 3
    assert _even_from([[(16 * k, k * P)] for k in range(3)])[0] == 3
    assert _even_from([[(k * P + 16 * k, k * P)] for k in range(4)])[0] == 4


def test_even_from_a_still_run_is_even_from_zero() -> None:
    """Layers that do not move at all (stride (0, 0)) are alike from the first layer: first = 0."""
    assert _even_from([[(5 * P, 0)] for _ in range(4)]) == (0, (0, 0))


def test_even_from_skips_irregular_leading_layers() -> None:
    """Layer 0 -> 1 moves by (3P, P), then every step is (P, 2P): even from layer 1."""
    shifts = [[(0, 0), (0, P)], [(3 * P, P), (3 * P, 2 * P)], [(4 * P, 3 * P), (4 * P, 4 * P)],
              [(5 * P, 5 * P), (5 * P, 6 * P)], [(6 * P, 7 * P), (6 * P, 8 * P)]]
    assert _even_from(shifts) == (1, (P, 2 * P))


def test_even_from_every_piece_must_move_alike() -> None:
    """The stride is read off piece 0; piece 1 moves (P, 2P) in the last step instead of (P, P): the
    last step is not even, so no run at all (even though layers 0 -> 1 are)."""
    shifts = [[(0, 0), (0, 0)], [(P, P), (P, P)], [(2 * P, 2 * P), (2 * P, 3 * P)]]
    assert _even_from(shifts)[0] == 3


def test_even_from_wants_at_least_two_even_steps() -> None:
    """Only the last step (layer 2 -> 3) is even: a run of two layers is not worth a recurrence test."""
    assert _even_from([[(0, 0)], [(5 * P, 5 * P)], [(7 * P, 7 * P)], [(8 * P, 8 * P)]])[0] == 4
    # two even steps at the end (layers 1 -> 2 -> 3): even from layer 1
    assert _even_from([[(0, 0)], [(5 * P, 5 * P)], [(6 * P, 6 * P)], [(7 * P, 7 * P)]]) == (1, (P, P))


def test_per_round_pads_missing_rounds_and_is_empty_without_any() -> None:
    """Rounds run 0..last with any bytes on either side; rounds without bytes on a side read 0."""
    assert per_round({}, {}) == ((), ())
    assert per_round({2: 5}, {0: 7}) == ((0, 0, 5), (7, 0, 0))


# --- skipping: how many layers are fed, worked out by hand; bytes against the bucketizer --------------

class Counting(PairStream):
    """A PairStream that counts the pieces it is fed."""

    def __init__(self, max_bucket_bytes: int | None = None) -> None:
        super().__init__(max_bucket_bytes)
        self.fed = 0

    def feed(self, r: Rec) -> None:
        self.fed += 1
        super().feed(r)


def _whole(name: str, rows: int, cols: int, src_at: int, dst_at: int) -> Piece:
    """A whole float32 rows x cols slot copied whole: contiguous on both sides."""
    return piece(slot(name, rows, cols, 0, cols, src_at), slot(name, rows, cols, 0, cols, dst_at), (0, rows), (0, cols))


def _strided(name: str, src_at: int, dst_at: int) -> Piece:
    """Two rows of half a 4 x 8 float32 slot: 32 bytes, contiguous on neither side."""
    return piece(slot(name, 4, 8, 0, 8, src_at), slot(name, 4, 8, 0, 8, dst_at), (0, 2), (0, 4))


def _stream_layers(layer: list[Piece], n: int, stride: tuple[int, int], tail: list[Piece], bucket: int
                   ) -> tuple[Wire, int, Wire]:
    """(streamed wire, pieces fed, the bucketizer's wire) for ``n`` layers moved by ``stride``, then ``tail``."""
    shifts = [[(k * stride[0], k * stride[1])] * len(layer) for k in range(n)]
    stream = Counting(bucket)
    stream.feed_run(layer, shifts)
    for p in tail:
        stream.feed(stream.rec(p))
    fed = stream.fed - len(tail)
    return stream.finish(), fed, oracle(_every([], layer, shifts, tail), bucket)


KB = 1 << 10


@pytest.mark.skipif((64 * KB) % PAGE_BYTES != 0, reason="needs pages dividing 64 KiB")
def test_one_direct_run_across_layers_is_fed_until_it_recurs() -> None:
    """64 KiB layers back to back on both sides make one run: 64 KiB after layer 0, 128 KiB (direct)
    after layer 1; a run ALREADY direct when a piece joins keeps only that piece, so the run holds
    layer 2's piece alone after layer 2, layer 3's after layer 3: the state after layer 3 is the one
    after layer 2 relative to its layer, four layers fed of 20, the other 16 skipped. A 16 KiB piece right after the last layer joins the run; the 32
    bytes strided piece after it is the only one packed (alone, on both sides)."""
    layer = [_whole("a", 16, 1024, 0, 0)]
    n = 20
    tail = [_whole("c", 4, 1024, n * 64 * KB, n * 64 * KB), _strided("d", 1 << 30, 1 << 30)]
    got, fed, want = _stream_layers(layer, n, (64 * KB, 64 * KB), tail, 1 << 20)
    assert fed == 4
    assert got == want == ((32,), (32,))


@pytest.mark.skipif((4 * KB) % PAGE_BYTES != 0, reason="needs 4 KiB pages")
def test_direct_layers_apart_are_fed_twice() -> None:
    """128 KiB layers with a gap between them (one page on the source, two on the target): each is a
    direct run of its own, the state after layer 1 is the one after layer 0: two layers fed. A 16 KiB
    piece right after the last layer's run (on both sides, strides differ) joins it; the strided
    piece after it is packed alone."""
    layer = [_whole("a", 32, 1024, 0, 0)]
    n, ss, ds = 20, 128 * KB + 4 * KB, 128 * KB + 8 * KB
    end_s, end_d = (n - 1) * ss + 128 * KB, (n - 1) * ds + 128 * KB
    tail = [_whole("c", 4, 1024, end_s, end_d), _strided("d", 1 << 30, 1 << 30)]
    got, fed, want = _stream_layers(layer, n, (ss, ds), tail, 1 << 20)
    assert fed == 2
    assert got == want == ((32,), (32,))


@pytest.mark.skipif((32 * KB) % PAGE_BYTES != 0, reason="needs pages dividing 32 KiB")
def test_small_pieces_apart_recur_with_their_buckets() -> None:
    """16 KiB pieces 32 KiB apart on both sides, 64 KiB buckets: four pieces a bucket, one bucket a
    round, every bucket packed on both sides (nothing back to back). The state (open run, open bucket)
    recurs every 4 layers; from layer 9 on the volume recurs too (one bucket per round), so 10 layers
    are fed of 50 and the other 40 added whole: 12 full rounds and 32 KiB (two pieces) in round 12."""
    layer = [_whole("y", 4, 1024, 0, 0)]
    got, fed, want = _stream_layers(layer, 50, (32 * KB, 32 * KB), [], 64 * KB)
    assert fed == 10
    assert got == want == ((64 * KB,) * 12 + (32 * KB,), (64 * KB,) * 12 + (32 * KB,))


@pytest.mark.skipif((4 * KB) % PAGE_BYTES != 0, reason="needs 4 KiB pages")
def test_buckets_that_grow_a_round_are_added_while_it_has_room() -> None:
    """64 KiB pieces, back to back on the source, a page apart on the target; 1 MiB buckets. A bucket
    closes once 256 KiB (4 pieces) stop being adjacent at the target, 4 buckets fill a round. The
    state after layer 5 is the one after layer 1 with 256 KiB more in round 0: the 3 periods the round
    has room for are added, 6 layers fed of 18. Buckets are in place on the source (back to back
    there): 1 MiB then 128 KiB received. A 16 KiB piece right after the last layer on both sides
    joins its run (80 KiB, not direct): packed with it."""
    layer = [_whole("y", 16, 1024, 0, 0)]
    n, ss, ds = 18, 64 * KB, 68 * KB
    tail = [_whole("c", 4, 1024, n * ss, (n - 1) * ds + 64 * KB)]
    got, fed, want = _stream_layers(layer, n, (ss, ds), tail, 1 << 20)
    assert fed == 6
    assert got == want
    assert got[1] == (1 << 20, 128 * KB + 16 * KB)


def _rows_of_half(name: str, kib: int, at: int) -> Piece:
    """``kib`` rows of the first half (1 KiB) of a kib x 512 float32 slot: contiguous on neither side."""
    s = slot(name, kib, 512, 0, 512, at)
    return piece(s, s, (0, kib), (0, 256))


def test_rounds_fill_greedily_across_layers_whose_buckets_straddle_rounds() -> None:
    """Layers of three packed pieces (256, 350 and 500 KiB, each a bucket of its own: 256 KiB and up,
    nothing adjacent), 7 layers, then a 300 KiB piece; rounds of at most 1000 KiB, filled in order:
    256+350 | 500+256 | 350+500 | ... (two layers every three rounds), 20 pieces in 10 rounds, then
    500+300 = 800 KiB. Nothing is in place: sent and received alike."""
    layer = [_rows_of_half("a", 256, 0), _rows_of_half("b", 350, 1 << 22), _rows_of_half("c", 500, 2 << 22)]
    n, stride = 7, 1 << 26
    tail = [_rows_of_half("z", 300, 1 << 31)]
    got, _, want = _stream_layers(layer, n, (stride, stride), tail, 1000 * KB)
    rounds = tuple(k * KB for k in (606, 756, 850) * 3 + (606, 800))
    assert got == want == (rounds, rounds)


def _whole_on_source(name: str, src_at: int, dst_at: int) -> Piece:
    """A whole 4 x 1024 float32 slot (16 KiB) on the source, half the columns of a 4 x 2048 one on the
    target: contiguous on the source only, so packed, and in place on the source where back to back."""
    src, dst = slot(name, 4, 1024, 0, 1024, src_at), slot(name, 4, 2048, 0, 2048, dst_at)
    return piece(src, dst, (0, 4), (0, 1024))


@pytest.mark.skipif((16 * KB) % PAGE_BYTES != 0, reason="needs pages dividing 16 KiB")
def test_a_bucket_with_an_earlier_piece_is_not_taken_for_one_of_layers() -> None:
    """Three 16 KiB pieces apart from everything, then 11 layers of one 16 KiB piece back to back on
    the source (16 KiB a layer) and apart on the target; 32 KiB buckets, one per round: [q1 q2]
    [q3 a0] [a1 a2] ... [a9 a10]. The first two are packed on both sides; the layers' buckets are read
    in place on the source (sent 0), though [q3 a0] looks like [a1 a2] shifted (same sizes, same
    shifts between them): sent 32, 32, 0 x 5 KiB; received 32 KiB in all 7 rounds."""
    base = 1 << 24
    prefix = [_whole_on_source(f"q{i}", base - (i + 2) * (1 << 20), (1 << 28) + i * (1 << 20)) for i in range(3)]
    layer = [_whole_on_source("a", base, 1 << 26)]
    n, ss, ds = 11, 16 * KB, 128 * KB
    shifts = [[((k + 1) * ss, (k + 1) * ds)] for k in range(n)]
    got = _streamed(prefix, layer, shifts, [], 32 * KB)
    assert got == oracle(_every(prefix, layer, shifts, []), 32 * KB)
    assert got == ((32 * KB, 32 * KB, 0, 0, 0, 0, 0), (32 * KB,) * 7)
