"""A pair's streamed wire memoised by the stream's own input (wire_stream.PairStream.content_key):
pairs of other target GPUs whose pieces lie alike share one streaming, and every footprint stays the
one derived from every piece at once (footprints.derive_footprint: covers, pieces, the bucketizer)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from test_wire_stream_terms import BUCKETS, PAGE_BYTES, _every, moved, oracle, piece, random_run, slot

from planner.hardware import CPU, LOOPBACK, NVLINK4, ClusterSpec
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout
from transitions.footprints import _canonical_footprint, derive_footprint
from transitions.global_dag import build_transition
from transitions.gpu_traffic import applies
from transitions.planning_cache import PlanningCache
from transitions.primitives import Footprint, Primitive
from transitions.scenarios import stage_plan, stage_states
from transitions.transfer_plan import Piece
from transitions.wire_stream import PairStream, Rec, _shift_key

DEEP = ModelSpec(name="deep", num_layers=24, hidden_size=512, num_attention_heads=8, num_kv_heads=4, head_dim=64,
                 ffn_hidden_size=1536, vocab_size=1000)


def _items(fp: Footprint) -> list[list[object]]:
    return [list(d.items()) for d in (fp.alloc_bytes, fp.free_bytes, fp.buffer_bytes, fp.local_bytes, fp.pair_bytes)]


def _unshift(key: tuple[object, ...]) -> list[list[tuple[int, int]]]:
    """_shift_key's input back from the key (the test that the key loses nothing)."""
    first = key[0]
    if not isinstance(first, tuple) or (first and not isinstance(first[0], tuple)):
        raise AssertionError(key)
    layers = [list(first)]
    for run in key[1:]:
        assert isinstance(run, tuple)
        move: tuple[tuple[int, int], ...] = run[0]
        times: int = run[1]
        for _ in range(times):
            layers.append([(a + da, b + db) for (a, b), (da, db) in zip(layers[-1], move)])
    return layers


def test_shift_keys_keep_every_shift() -> None:
    rng = random.Random(7)
    seen: dict[tuple[object, ...], list[list[tuple[int, int]]]] = {}
    for _ in range(400):
        pieces, layers = rng.randint(1, 4), rng.randint(1, 12)
        stride = [(rng.choice([0, 4096, 8192]), rng.choice([0, 4096])) for _ in range(pieces)]
        shifts = [[(j * s + (rng.choice([0, 16]) if rng.random() < 0.1 else 0), j * d) for s, d in stride]
                  for j in range(layers)]
        key = _shift_key(shifts)
        assert _unshift(key) == shifts
        assert seen.setdefault(key, shifts) == shifts  # equal keys only for equal shifts
    # a run of like layers is a few tuples, not one list per layer
    even = [[(j * 4096, j * 8192), (j * 4096 + 64, j * 8192)] for j in range(80)]
    assert len(_shift_key(even)) == 2 and _unshift(_shift_key(even)) == even
    assert _shift_key([]) == ()
    ragged = [[(0, 0), (1, 1)], [(2, 2)]]  # not one piece list per layer: kept whole
    assert _shift_key(ragged) == (((0, 0), (1, 1)), ((2, 2),))


def _pp_change(tp_old: int, pp_old: int, tp_new: int, pp_new: int) -> tuple[PlanningCache, list[Primitive]]:
    cluster = ClusterSpec(device=CPU, num_nodes=2, gpus_per_node=8, intra_node_link=NVLINK4, inter_node_link=LOOPBACK)
    states = {"actor-train": stage_states(DEEP)["actor-train"]}
    old = GlobalPlan(version=1, stages=(stage_plan("actor-train", Layout(tp_old, pp_old), list(range(tp_old * pp_old)),
                                                   1),))
    new_gpus = list(range(16 - tp_new * pp_new, 16))
    new = GlobalPlan(version=2, stages=(stage_plan("actor-train", Layout(tp_new, pp_new), new_gpus, 1),))
    cache = PlanningCache()
    dag = build_transition(states, cluster, old, new, lost_gpus=frozenset(), exact=True, cache=cache)
    return cache, [p for p in dag.nodes if applies(p)]


def test_middle_stages_share_one_streaming_and_match_every_piece() -> None:
    # TP2xPP2 -> TP1xPP8 onto other GPUs: the middle target stages read their layers alike
    cache, nodes = _pp_change(2, 2, 1, 8)
    assert nodes
    for prim in nodes:
        assert _items(_canonical_footprint(prim, cache)) == _items(derive_footprint(prim)), prim
    assert 0 < len(cache.pair_streams) < len(cache.pair_wires), cache.sizes()


def test_tp_ranks_share_one_streaming_and_match_every_piece() -> None:
    # TP1xPP4 -> TP4xPP2 onto other GPUs: the target's TP ranks slice their sources alike
    cache, nodes = _pp_change(1, 4, 4, 2)
    for prim in nodes:
        assert _items(_canonical_footprint(prim, cache)) == _items(derive_footprint(prim)), prim
    assert 0 < len(cache.pair_streams) < len(cache.pair_wires), cache.sizes()


def test_a_shared_cache_serves_random_changes_exactly() -> None:
    from transitions.scenarios import random_scenario

    cache = PlanningCache()
    checked = 0
    for seed in range(40):
        sc = random_scenario(random.Random(1000 + seed), loss_probability=0.2)
        try:
            dag = build_transition(sc.states, sc.cluster, sc.old, sc.new, lost_gpus=sc.lost_gpus, exact=True,
                                   cache=PlanningCache())
        except Exception:  # noqa: BLE001 - an unbuildable random change has nothing to compare
            continue
        for prim in (p for p in dag.nodes if applies(p)):
            assert _items(_canonical_footprint(prim, cache)) == _items(derive_footprint(prim)), prim
            checked += 1
    assert checked > 50 and len(cache.pair_streams)


# --- the key itself: sound (equal keys, equal wires) and complete up to whole pages ---------------------

def _feeds(stream: PairStream, prefix: list[Piece], layer: list[Piece], shifts: list[list[tuple[int, int]]],
           suffix: list[Piece]) -> list[tuple[list[Rec], list[list[tuple[int, int]]] | None]]:
    return [([stream.rec(p) for p in prefix], None), ([stream.rec(p) for p in layer], shifts),
            ([stream.rec(p) for p in suffix], None)]


def _key_and_wire(prefix: list[Piece], layer: list[Piece], shifts: list[list[tuple[int, int]]], suffix: list[Piece],
                  bucket: int) -> tuple[tuple[object, ...], tuple[tuple[int, ...], tuple[int, ...]]]:
    stream = PairStream(bucket)
    feeds = _feeds(stream, prefix, layer, shifts, suffix)
    key = stream.content_key(feeds)
    stream.feed_all(feeds)
    wire = stream.finish()
    assert wire == oracle(_every(prefix, layer, shifts, suffix), bucket)
    return key, wire


def _shift_all(pieces: list[Piece], ts: int, td: int) -> list[Piece]:
    return [moved(p, ts, td) for p in pieces]


def _variants(rng: random.Random, prefix: list[Piece], layer: list[Piece], shifts: list[list[tuple[int, int]]],
              suffix: list[Piece]) -> list[tuple[str, list[Piece], list[Piece], list[list[tuple[int, int]]], list[Piece]]]:
    """The same pair moved by whole pages (equal keys), and moved or changed in one detail (other keys
    unless the stream cannot tell them apart)."""
    ts, td = rng.randint(1, 5) * PAGE_BYTES, rng.randint(1, 5) * PAGE_BYTES
    paged = [("pages", _shift_all(prefix, ts, td), _shift_all(layer, ts, td), shifts, _shift_all(suffix, ts, td))]
    k = rng.randrange(len(layer))
    one = [*layer[:k], moved(layer[k], 16, 0), *layer[k + 1:]]
    dst_one = [*layer[:k], moved(layer[k], 0, 16), *layer[k + 1:]]
    unit = [*layer[:k], replace(layer[k], src_unit="other"), *layer[k + 1:]]
    dst_unit = [*layer[:k], replace(layer[k], dst_unit="other"), *layer[k + 1:]]
    bumped = [list(s) for s in shifts]
    bumped[-1][0] = (bumped[-1][0][0] + 16, bumped[-1][0][1])
    return [*paged, ("src+16", prefix, one, shifts, suffix), ("dst+16", prefix, dst_one, shifts, suffix),
            ("src unit", prefix, unit, shifts, suffix), ("dst unit", prefix, dst_unit, shifts, suffix),
            ("shift+16", prefix, layer, bumped, suffix), ("one side paged", _shift_all(prefix, ts, 0),
                                                          _shift_all(layer, ts, 16), shifts, _shift_all(suffix, ts, 16))]


@pytest.mark.parametrize("seed", range(8))
def test_equal_keys_stream_alike_and_whole_pages_keep_the_key(seed: int) -> None:
    rng = random.Random(seed)
    wires: dict[tuple[object, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}
    differ = 0
    for _ in range(5):
        prefix, layer, shifts, suffix = random_run(rng)
        bucket = rng.choice(BUCKETS)
        key, wire = _key_and_wire(prefix, layer, shifts, suffix, bucket)
        assert wires.setdefault(key, wire) == wire
        for name, *variant in _variants(rng, prefix, layer, shifts, suffix):
            k2, w2 = _key_and_wire(*variant, bucket)  # type: ignore[arg-type,call-arg]
            assert wires.setdefault(k2, w2) == w2, name  # sound: one wire per key
            if name == "pages":
                assert k2 == key  # complete up to whole pages on either side
            else:
                differ += k2 != key
        assert _key_and_wire(prefix, layer, shifts, suffix, bucket * 2)[0] != key  # the bound is in the key
    assert differ >= 5 * 6 * 0.8  # a detail moved is a new key nearly always


def test_a_piece_too_big_for_a_bucket_keys_the_parts_it_splits_into() -> None:
    # two pieces with the same bytes and byte ranges (neither contiguous) whose rows differ: 4 x 3000 of a
    # 4 x 4000 shard and 2 x 6000 of a 2 x 8000 one split into other parts at a 16 KiB bucket
    a = piece(slot("t", 4, 4000, 0, 4000, 0), slot("t", 4, 4000, 0, 4000, 0), (0, 4), (0, 3000))
    b = piece(slot("t", 2, 8000, 0, 8000, 0), slot("t", 2, 8000, 0, 8000, 0), (0, 2), (0, 6000))
    ka, wa = _key_and_wire([a], [], [], [], 16 << 10)
    kb, wb = _key_and_wire([b], [], [], [], 16 << 10)
    assert a.num_bytes == b.num_bytes and ka != kb
    # small enough for one bucket: no parts, the key is the records alone
    record = _key_and_wire([a], [], [], [], 1 << 20)[0][1]
    assert isinstance(record, tuple) and record[-1] is None


def test_an_empty_feed_keys_the_bound_alone() -> None:
    stream = PairStream(1 << 20)
    assert stream.content_key([]) == (1 << 20,) == stream.content_key([([], None)])


def _rec(p: Piece, nbytes: int = 4096, src: tuple[int, int] | None = (4096, 8192),
         dst: tuple[int, int] | None = (65536, 69632), src_slot: tuple[int, int] = (4096, 4096),
         dst_slot: tuple[int, int] = (65536, 8192)) -> Rec:
    return Rec(p, -1, 0, 0, nbytes, src, dst, src_slot, dst_slot)


def _base_piece(su: str = "s", du: str = "d") -> Piece:
    return piece(slot("t", 4, 256, 0, 256, 0), slot("t", 4, 256, 0, 256, 0), (0, 4), (0, 256), su, du)


def _key(feeds: list[tuple[list[Rec], list[list[tuple[int, int]]] | None]], bucket: int = 1 << 20) -> tuple[object, ...]:
    return PairStream(bucket).content_key(feeds)


def test_every_field_of_every_record_is_in_the_key() -> None:
    """What the stream reads of a record (bytes, both byte ranges, both slots, units) moves the key,
    for the first record (whose slots set each side's base) and for a later one alike."""
    p, q = _base_piece(), _base_piece()
    shifts = [[(0, 0)], [(4096, 8192)], [(8192, 16384)]]

    def feeds(first: Rec, second: Rec) -> list[tuple[list[Rec], list[list[tuple[int, int]]] | None]]:
        return [([first], None), ([second], shifts)]

    base = _key(feeds(_rec(p), _rec(q)))
    changes = [dict(nbytes=4097), dict(src=(4112, 8192)), dict(src=(4096, 8208)), dict(src=None),
               dict(dst=(65552, 69632)), dict(dst=(65536, 69648)), dict(dst=None), dict(src_slot=(4112, 4096)),
               dict(src_slot=(4096, 4112)), dict(dst_slot=(65552, 8192)), dict(dst_slot=(65536, 8208))]
    for change in changes:
        assert _key(feeds(_rec(p, **change), _rec(q))) != base, ("first", change)  # type: ignore[arg-type]
        assert _key(feeds(_rec(p), _rec(q, **change))) != base, ("later", change)  # type: ignore[arg-type]
    # units: only which records share one on either side
    assert _key(feeds(_rec(p), _rec(_base_piece(su="s2")))) != base
    assert _key(feeds(_rec(p), _rec(_base_piece(du="d2")))) != base
    assert _key(feeds(_rec(_base_piece("x", "y")), _rec(_base_piece("x", "y")))) == base
    # the shifts and the bound
    assert _key([([_rec(p)], None), ([_rec(q)], [[(0, 0)], [(4096, 8192)], [(8192, 16400)]])]) != base
    assert _key([([_rec(p)], None), ([_rec(q)], None)]) != base
    assert _key(feeds(_rec(p), _rec(q)), 1 << 19) != base


def _moved_recs(by_src: int, by_dst: int) -> list[tuple[list[Rec], list[list[tuple[int, int]]] | None]]:
    p = _base_piece()

    def at(src: tuple[int, int], dst: tuple[int, int], ss: int, ds: int) -> Rec:
        return _rec(p, src=(src[0] + by_src, src[1] + by_src), dst=(dst[0] + by_dst, dst[1] + by_dst),
                    src_slot=(ss + by_src, 4096), dst_slot=(ds + by_dst, 8192))

    return [([at((4096, 8192), (65536, 69632), 4096, 65536), at((12288, 16384), (73728, 77824), 12288, 73728)],
             None)]


def test_whole_pages_keep_the_key_and_anything_less_does_not() -> None:
    base = _key(_moved_recs(0, 0))
    assert _key(_moved_recs(3 * PAGE_BYTES, 0)) == base == _key(_moved_recs(0, 5 * PAGE_BYTES))
    assert _key(_moved_recs(PAGE_BYTES, 7 * PAGE_BYTES)) == base
    for by in (16, 48, PAGE_BYTES // 2, PAGE_BYTES + 16):  # alignment to pages may differ: another key
        assert _key(_moved_recs(by, 0)) != base
        assert _key(_moved_recs(0, by)) != base


def test_a_big_piece_keys_its_box_against_each_slot() -> None:
    """A piece too big for the bucket is split by rows of its box; each part's byte range follows from
    the box's offsets within each side's slot, its lengths and each slot's shape, order and dtype."""
    def big(src_slot_cols: tuple[int, int], dst_slot_cols: tuple[int, int], cols: tuple[int, int],
            order: tuple[int, ...] = (), dtype: str = "float32", rows: int = 4) -> Rec:
        src = replace(slot("t", rows, 8000, *src_slot_cols, 0, order), dtype=dtype)
        dst = slot("t", rows, 8000, *dst_slot_cols, 0)
        p = piece(src, dst, (0, rows), cols)
        return _rec(p, nbytes=p.num_bytes, src=None, dst=None, src_slot=(0, src.num_bytes), dst_slot=(0, dst.num_bytes))

    def key(r: Rec) -> tuple[object, ...]:
        return _key([([r], None)], 16 << 10)

    base = key(big((0, 4000), (0, 4000), (1000, 4000)))
    # the same box 1000 columns into a slot that starts 500 columns later: offsets - slot start differ
    assert key(big((500, 4500), (0, 4000), (500, 3500))) != base
    assert key(big((0, 4000), (500, 4500), (1000, 4000))) != key(big((0, 4000), (0, 4000), (1000, 4000)))
    assert key(big((0, 4000), (0, 4000), (1000, 4000), order=(1, 0))) != base
    assert key(big((0, 4000), (0, 4000), (1000, 4000), dtype="bfloat16")) != base
    assert key(big((0, 5000), (0, 4000), (1000, 4000))) != base  # the source slot's shape
    assert key(big((0, 4000), (0, 5000), (1000, 4000))) != base  # the target slot's shape
    # the box's offset within each slot, not the two offsets' sum nor its lengths: the source side ...
    at = key(big((500, 4500), (0, 5000), (1000, 4000)))
    assert key(big((250, 4250), (250, 5250), (1250, 4250))) != at  # box + slot start alike, box - slot not
    assert key(big((500, 4500), (100, 5100), (1100, 4100))) != at  # box lengths - slot start alike
    # ... and the target side
    at = key(big((0, 5000), (500, 4500), (1000, 4000)))
    assert key(big((250, 5250), (250, 4250), (1250, 4250))) != at
    assert key(big((100, 5100), (500, 4500), (1100, 4100))) != at


def test_a_pair_met_again_is_served_from_the_memo() -> None:
    """A second build with the stream memo kept (its per-GPU memos empty) gets every streamed pair's
    wire from it: the very object the first derived, never a new streaming."""
    from transitions.gpu_traffic import PairWire, dst_key, dst_traffic, dst_wires

    cache, nodes = _pp_change(2, 2, 1, 8)
    again = PlanningCache()
    again.pair_streams = cache.pair_streams
    served = 0
    for prim in nodes:
        for target in prim.targets:
            for gpu in target.gpus:
                key = dst_key(prim, target, gpu, 1, 0)
                entry, segs = dst_traffic(prim, target, gpu, key, cache, 1, 0)
                first = dst_wires(prim, target, gpu, key, entry, segs, cache, 1, 0)
                second = dst_wires(prim, target, gpu, key, *dst_traffic(prim, target, gpu, key, again, 1, 0), again, 1, 0)
                for (src, a), (src2, b) in zip(first, second, strict=True):
                    assert src == src2 and a == b
                    if a != PairWire((), ()):  # a streamed pair (zero-copy ones are answered without streaming)
                        assert b is a
                        served += 1
    assert served > 0
