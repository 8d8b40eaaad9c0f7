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
    for recs, sh in feeds:
        if sh is None:
            for r in recs:
                stream.feed(r)
        else:
            stream.feed_recs(recs, sh)
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
