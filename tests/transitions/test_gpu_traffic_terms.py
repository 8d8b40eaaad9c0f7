"""transitions.gpu_traffic's small parts worked out by hand: which primitives it serves, a target GPU's
relative key and counter source, the bucket peak of consecutive rounds and the per-GPU round sums;
and its traffic against the derivation from every piece on hand-made Splits and Extends whose target
GPUs hold a source or not, with and without bucket memory."""

from __future__ import annotations

from planner.models import TINY_3M
from planner.plan import Layout
from planner.workflow import ACTOR_TRAIN, REF_INF
from transitions import gpu_traffic
from transitions.covers import counter_pieces, derive_target
from transitions.emu import EMU
from transitions.footprints import derive_footprint
from transitions.gpu_traffic import add_rounds, applies, dst_key, peak_bytes
from transitions.planning_cache import PlanningCache
from transitions.primitives import Destroy, Extend, Merge, Split
from transitions.scenarios import stage_states
from transitions.transfer_plan import DEFAULT_BUCKET_BYTES, in_flight_bytes, messages

STATES = stage_states(TINY_3M, (ACTOR_TRAIN, REF_INF))
TRAIN, REF = STATES["actor-train"], STATES["ref-inf"]


def _u(uid: str, tp: int, gpus: tuple[int, ...], final: EMU | None = None, state: object = TRAIN) -> EMU:
    return EMU(uid=uid, state=state, layout=Layout(tp, 1), gpus=gpus, version=1, final=final)  # type: ignore[arg-type]


def test_peak_is_the_most_two_consecutive_rounds_hold() -> None:
    assert peak_bytes([]) == 0
    assert peak_bytes([5]) == 5
    assert peak_bytes([1, 2, 3]) == 5
    assert peak_bytes([4, 0, 0, 4]) == 4
    assert peak_bytes([0, 7, 0]) == 7


def test_rounds_add_up_per_gpu_and_grow_as_needed() -> None:
    into: dict[int, list[int]] = {}
    add_rounds(into, 3, (1, 2))
    add_rounds(into, 3, (3,))
    add_rounds(into, 3, (0, 0, 5))
    add_rounds(into, 1, ())
    assert into == {3: [4, 2, 5], 1: []}


def test_it_serves_splits_merges_and_extends_whose_targets_share_no_gpu() -> None:
    unit = _u("u", 2, (0, 1))
    assert applies(Extend(sources=(unit,), target=_u("t", 1, (2,))))
    assert applies(Split(unit=unit, parts=(_u("p0", 1, (0,)), _u("p1", 1, (1,)))))
    assert not applies(Split(unit=unit, parts=(_u("p0", 1, (0,)), _u("p1", 1, (0,)))))
    assert applies(Merge(parts=(_u("p0", 1, (0,)), _u("p1", 1, (1,))), unit=_u("m", 2, (0, 1))))
    assert not applies(Destroy(unit=unit))


def test_a_gpus_key_is_relative_to_the_units() -> None:
    """Two Extends alike up to a renaming of GPUs and uids have the same keys GPU for GPU; another
    state, another rank or a source that is also the target's final differ."""
    a = Extend(sources=(_u("s", 2, (0, 1)),), target=_u("t", 2, (1, 2)))
    b = Extend(sources=(_u("s'", 2, (5, 6)),), target=_u("t'", 2, (6, 7)))
    assert dst_key(a, a.target, 1, 1, 0) == dst_key(b, b.target, 6, 1, 0)
    assert dst_key(a, a.target, 2, 1, 0) == dst_key(b, b.target, 7, 1, 0)
    assert dst_key(a, a.target, 1, 1, 0) != dst_key(a, a.target, 2, 1, 0)
    c = Extend(sources=(_u("s", 2, (0, 1), state=REF),), target=_u("t", 2, (1, 2), state=REF))
    assert dst_key(c, c.target, 1, 1, 0) != dst_key(a, a.target, 1, 1, 0)
    # the same unit read twice is not two different sources
    twice = Extend(sources=(_u("s", 2, (0, 1)), _u("s", 2, (0, 1))), target=_u("t", 2, (1, 2)))
    other = Extend(sources=(_u("s", 2, (0, 1)), _u("r", 2, (0, 1))), target=_u("t", 2, (1, 2)))
    assert dst_key(twice, twice.target, 1, 1, 0) != dst_key(other, other.target, 1, 1, 0)
    # a part headed into a merge: its final's rank map is part of the key
    home = _u("m", 2, (3, 4))
    home_swapped = _u("m", 2, (4, 3))
    p = Extend(sources=(_u("s", 2, (0, 1)),), target=_u("p", 1, (3,), final=home))
    q = Extend(sources=(_u("s", 2, (0, 1)),), target=_u("p", 1, (3,), final=home_swapped))
    assert dst_key(p, p.target, 3, 1, 0) != dst_key(q, q.target, 3, 1, 0)


def test_counters_come_from_the_rank_aligned_gpu_of_the_first_source_unless_held() -> None:
    src = _u("s", 2, (0, 1))
    ext = Extend(sources=(src, _u("r", 2, (4, 5))), target=_u("t", 4, (2, 3, 1, 6)))
    assert gpu_traffic._counter_role(ext, ext.target, 2) == (0, 0)
    assert gpu_traffic._counter_role(ext, ext.target, 3) == (0, 1)
    assert gpu_traffic._counter_role(ext, ext.target, 6) == (0, 1)  # rank 3 % 2 GPUs
    assert gpu_traffic._counter_role(ext, ext.target, 1) is None  # GPU 1 holds a source: copied locally


def _check(prim: Split | Extend) -> None:
    for buffers in (True, False):
        local, pair, buf = gpu_traffic.traffic(prim, PlanningCache(), buffers)
        ref = derive_footprint(prim, buffers)
        assert (list(local.items()), list(pair.items()), list(buf.items())) == \
            (list(ref.local_bytes.items()), list(ref.pair_bytes.items()), list(ref.buffer_bytes.items()))


def test_hand_made_primitives_match_the_derivation_from_every_piece() -> None:
    unit = _u("u", 2, (0, 1))
    _check(Extend(sources=(unit,), target=_u("t", 1, (2,))))
    _check(Extend(sources=(unit,), target=_u("t", 4, (1, 2, 3, 0))))
    _check(Extend(sources=(unit, _u("r", 1, (5,))), target=_u("t", 2, (5, 6))))
    home = _u("m", 2, (0, 3))
    _check(Split(unit=unit, parts=(_u("p0", 1, (0,), final=home), _u("p1", 1, (1,)))))
    _check(Extend(sources=(unit,), target=_u("p", 1, (3,), final=home)))


def test_a_pairs_rounds_hold_every_packed_message_of_the_round() -> None:
    """TP1 -> TP2 and back: many packed buckets share one round of a pair. The pair's rounds, streamed
    or from the bucketizer, peak where transfer_plan.in_flight_bytes says the executor's messages do."""
    shared = 0
    for src_tp, dst_tp in ((1, 2), (2, 1), (4, 2)):
        ext = Extend(sources=(_u("s", src_tp, tuple(range(src_tp))),), target=_u("t", dst_tp, tuple(range(10, 10 + dst_tp))))
        for gpu in ext.target.gpus:
            counter = [p for p in counter_pieces(ext) if p.dst_worker == gpu]
            every = counter + derive_target(ext.target, ext.sources, gpu)
            segs = gpu_traffic.gpu_segments(ext, ext.target, gpu)
            for src in sorted({p.src_worker for p in every}):
                mine = [p for p in every if p.src_worker == src]
                wire = gpu_traffic.pair_wire(mine)
                msgs = messages(mine, DEFAULT_BUCKET_BYTES)
                shared += sum(m.src_start is None and m.round == 0 for m in msgs) > 1
                assert peak_bytes(list(wire.sent)) == in_flight_bytes(msgs, src) > 0
                assert peak_bytes(list(wire.received)) == in_flight_bytes(msgs, gpu) > 0
                assert gpu_traffic.streamed(ext, ext.target, gpu, src, segs, (counter or [None])[0]) == wire
    assert shared > 3


def test_bytes_are_whole_and_bucket_memory_is_counted_unless_left_out() -> None:
    ext = Extend(sources=(_u("s", 1, (0,)),), target=_u("t", 2, (10, 11)))
    local, pair, buf = gpu_traffic.traffic(ext, PlanningCache())  # bucket memory by default
    assert buf and buf == derive_footprint(ext).buffer_bytes
    assert all(type(n) is int for n in (*local.values(), *pair.values(), *buf.values()))
    _, _, left_out = gpu_traffic.traffic(ext, PlanningCache(), buffers=False)
    assert left_out == {}


def test_a_gpus_entry_met_again_with_its_senders_placed_otherwise() -> None:
    """The second Extend's target GPUs have the first's keys (the same positions in every unit), but
    its sender GPU 1 also sits in the second source: that pair's wire is not memoised yet, and is derived
    from the GPU's segments then, with the right figures."""
    cache = PlanningCache()
    first = Extend(sources=(_u("a", 2, (0, 1)), _u("b", 2, (4, 5))), target=_u("t", 1, (2,)))
    second = Extend(sources=(_u("a", 2, (0, 1)), _u("b", 2, (1, 5))), target=_u("t", 1, (2,)))
    assert dst_key(first, first.target, 2, 1, 0) == dst_key(second, second.target, 2, 1, 0)
    for prim in (first, second):
        local, pair, buf = gpu_traffic.traffic(prim, cache)
        ref = derive_footprint(prim)
        assert (local, pair, buf) == (ref.local_bytes, ref.pair_bytes, ref.buffer_bytes)
        assert buf[1] > 0  # GPU 1's rows of the row-parallel tensors are packed
