"""transitions.footprints held to what must hold whatever the derivation: over a whole transition, the
bytes each GPU holds go from its old units' to its new units' (allocations minus frees); every target
GPU receives, locally or over the wire, exactly the bytes its target holds there; bytes are sent only
from GPUs of a source to GPUs of a target; a Destroy frees and a Restore allocates its unit's bytes;
and the memo per relative shape serves each primitive on its own GPUs, whatever it held before."""

from __future__ import annotations

import random
from dataclasses import replace
from functools import lru_cache

from planner.errors import InfeasibleError
from planner.models import TINY_3M
from planner.plan import Layout
from planner.workflow import ACTOR_TRAIN
from transitions import footprints as fps
from transitions.emu import EMU
from transitions.footprints import canonical_footprint, derive_footprint, footprint, traffic, wire_buffers
from transitions.global_dag import TransitionDAG, build_transition, held_bytes
from transitions.planning_cache import DEFAULT_CACHE, PlanningCache
from transitions.primitives import (
    Destroy,
    Extend,
    Footprint,
    Merge,
    Primitive,
    Restore,
    Split,
    relabels,
    target_gpus,
)
from transitions.scenarios import random_scenario, stage_states

STATE = stage_states(TINY_3M, (ACTOR_TRAIN,))["actor-train"]


@lru_cache(maxsize=1)
def _dags(seeds: range = range(16), loss: float = 0.3) -> list[TransitionDAG]:
    """Exact DAGs of random plan changes (some with lost GPUs), built once for this file's tests."""
    out = []
    for seed in seeds:
        sc = random_scenario(random.Random(seed), loss_probability=loss)
        try:
            out.append(build_transition(sc.states, sc.cluster, sc.old, sc.new, lost_gpus=sc.lost_gpus, exact=True,
                                        cache=PlanningCache()))
        except (InfeasibleError, ValueError):
            continue
    return out


def _nonzero(d: dict[int, int]) -> dict[int, int]:
    return {g: v for g, v in d.items() if v}


def _check_fill(prim: Primitive, fp: Footprint) -> None:
    """Each target GPU gets, copied locally or received, exactly what its targets hold there; bytes
    leave only GPUs of a source and arrive only on GPUs of a target; nothing is sent to oneself."""
    need: dict[int, int] = {}
    for t in prim.targets:
        for g in target_gpus(prim, t):
            need[g] = need.get(g, 0) + t.bytes_on(g)
    got = dict(fp.local_bytes)
    for (s, d), n in fp.pair_bytes.items():
        assert s != d and n > 0 and type(n) is int
        assert any(u.holds(s) for u in prim.sources) and d in need
        got[d] = got.get(d, 0) + n
    assert _nonzero(got) == _nonzero(need)
    for g, n in fp.local_bytes.items():
        assert any(u.holds(g) for u in prim.sources) and type(n) is int


def test_every_target_gpu_receives_exactly_its_bytes_and_memory_is_conserved() -> None:
    dags = _dags()
    kinds: set[str] = set()
    for dag in dags:
        used = dict(held_bytes(dag.old_units))
        cache = PlanningCache()
        for prim in dag.nodes:
            fp = footprint(prim, cache)
            kinds.add(prim.kind.value + ("-relabel" if relabels(prim) else ""))
            _check_fill(prim, fp)
            assert all(v > 0 for v in (*fp.alloc_bytes.values(), *fp.free_bytes.values()))
            for g, v in fp.alloc_bytes.items():
                used[g] = used.get(g, 0) + v
            for g, v in fp.free_bytes.items():
                used[g] = used.get(g, 0) - v
            assert min(used.values(), default=0) >= 0
        assert _nonzero(used) == _nonzero(held_bytes(dag.new_units))
    assert len(dags) > 8 and {"split", "merge", "merge-relabel", "extend", "destroy"} <= kinds


def test_the_memo_serves_each_primitive_on_its_own_gpus() -> None:
    """One cache for every primitive of many transitions (replicas of one shape share an entry): each
    footprint equals the one derived from nothing, from every piece."""
    cache = PlanningCache()
    checked = 0
    for dag in _dags():
        for prim in dag.nodes:
            if isinstance(prim, Destroy | Restore):
                continue
            got = footprint(prim, cache)
            assert got == derive_footprint(prim)
            assert replace(traffic(prim, cache), buffer_bytes={}) == replace(got, buffer_bytes={})
            checked += 1
    assert checked > 40 and 0 < len(cache.footprints) < checked


def _unit(uid: str, layout: Layout, gpus: tuple[int, ...], final: EMU | None = None) -> EMU:
    return EMU(uid=uid, state=STATE, layout=layout, gpus=gpus, version=1, final=final)


def test_gpu_labels_follow_first_appearance() -> None:
    # an Extend's target is labelled first, then its sources; a Split's unit, then its parts
    src = _unit("a", Layout(2, 1), (5, 6))
    ext = Extend(sources=(src,), target=_unit("b", Layout(2, 1), (2, 5)))
    fp, gpus = canonical_footprint(ext, PlanningCache())
    assert gpus == [2, 5, 6]
    # GPU 2 (target rank 0) reads source rank 0 from GPU 5, GPU 5 (target rank 1) reads rank 1 from GPU 6
    assert set(fp.pair_bytes) == {(1, 0), (2, 1)}
    assert footprint(ext).pair_bytes == {(5, 2): fp.pair_bytes[(1, 0)], (6, 5): fp.pair_bytes[(2, 1)]}
    merged = _unit("m", Layout(2, 1), (7, 3))
    part = _unit("p", Layout(1, 1), (3,), final=merged)
    split = Split(unit=_unit("u", Layout(2, 1), (3, 9)), parts=(part,))
    assert canonical_footprint(split, PlanningCache())[1] == [3, 9, 7]


def test_a_primitive_at_another_place_gets_its_own_gpus_from_the_memo() -> None:
    cache = PlanningCache()
    a = Extend(sources=(_unit("s", Layout(2, 1), (0, 1)),), target=_unit("t", Layout(1, 1), (2,)))
    b = Extend(sources=(_unit("s2", Layout(2, 1), (4, 5)),), target=_unit("t2", Layout(1, 1), (6,)))
    fa, fb = footprint(a, cache), footprint(b, cache)
    assert len(cache.footprints) == 1
    assert set(fa.pair_bytes) == {(0, 2), (1, 2)} and set(fb.pair_bytes) == {(4, 6), (5, 6)}
    assert list(fa.pair_bytes.values()) == list(fb.pair_bytes.values())
    assert fa.alloc_bytes == {2: STATE_BYTES} and fb.alloc_bytes == {6: STATE_BYTES}
    assert fb == derive_footprint(b)
    # the traffic alone, memoised apart: no bucket memory, and the full footprint still has its own after it
    fresh = PlanningCache()
    ta = traffic(a, fresh)
    assert ta.buffer_bytes == {} and fa.buffer_bytes and replace(fa, buffer_bytes={}) == ta
    assert footprint(a, fresh) == fa


STATE_BYTES = _unit("whole", Layout(1, 1), (0,)).bytes_on(0)


def test_destroy_frees_and_restore_allocates_the_units_bytes() -> None:
    unit = _unit("u", Layout(2, 1), (4, 1))
    shares = {4: unit.bytes_on(4), 1: unit.bytes_on(1)}
    assert all(shares.values())
    gone = footprint(Destroy(unit=unit))
    assert (gone.alloc_bytes, gone.free_bytes, gone.pair_bytes, gone.local_bytes) == ({}, shares, {}, {})
    back = footprint(Restore(target=unit, url="file:///ckpt", tag="step-1"))
    assert (back.alloc_bytes, back.free_bytes, back.pair_bytes, back.buffer_bytes) == (shares, {}, {}, {})
    assert canonical_footprint(Destroy(unit=unit), PlanningCache())[1] == [4, 1]
    restore = Restore(target=unit, url="file:///ckpt", tag="t")
    assert wire_buffers(Destroy(unit=unit)) == {} == wire_buffers(restore)
    assert derive_footprint(Destroy(unit=unit)) == gone and derive_footprint(restore) == back  # nothing to cover


def test_a_merge_of_parts_in_final_shape_moves_and_allocates_nothing() -> None:
    unit = _unit("m", Layout(2, 1), (0, 1))
    parts = tuple(_unit(f"p{g}", Layout(1, 1), (g,), final=unit) for g in (0, 1))
    merge = Merge(parts=parts, unit=unit)
    assert relabels(merge)
    empty = Footprint(alloc_bytes={}, free_bytes={}, buffer_bytes={}, local_bytes={}, pair_bytes={})
    assert footprint(merge, PlanningCache()) == empty == derive_footprint(merge)
    assert wire_buffers(merge) == {}


def test_a_merge_frees_its_parts_and_allocates_the_unit_minus_what_stays() -> None:
    """TP1 parts on GPUs 0 and 2 merged into a TP2 unit on 0 and 1: the part on 0 stays in final shape
    (neither freed nor allocated there), the part on 2 is freed, GPU 1 gets its rank from GPUs 0 and 2."""
    unit = _unit("m", Layout(2, 1), (0, 1))
    stays = _unit("p0", Layout(1, 1), (0,), final=unit)
    moves = _unit("p2", Layout(1, 1), (2,))
    merge = Merge(parts=(stays, moves), unit=unit)
    fp = footprint(merge, PlanningCache())
    assert fp.alloc_bytes == {1: unit.bytes_on(1)}
    assert fp.free_bytes == {2: STATE_BYTES}
    assert set(fp.pair_bytes) <= {(0, 1), (2, 1)} and sum(fp.pair_bytes.values()) == unit.bytes_on(1)
    assert fp.local_bytes == {}
    assert fp == derive_footprint(merge)
    assert fp.buffer_bytes and traffic(merge, PlanningCache()) == replace(fp, buffer_bytes={})  # packed rows


def test_units_sharing_a_gpu_add_up_there() -> None:
    """Two parts on one GPU: a Split allocates both there, a Merge frees both."""
    unit = _unit("u", Layout(2, 1), (0, 1))
    split = Split(unit=unit, parts=(_unit("p", Layout(1, 1), (0,)), _unit("q", Layout(1, 1), (0,))))
    assert footprint(split, PlanningCache()).alloc_bytes == {0: 2 * STATE_BYTES}
    merge = Merge(parts=(_unit("p", Layout(1, 1), (2,)), _unit("q", Layout(1, 1), (2,))), unit=unit)
    fp = footprint(merge, PlanningCache())
    assert fp.free_bytes == {2: 2 * STATE_BYTES}
    assert fp.alloc_bytes == {0: unit.bytes_on(0), 1: unit.bytes_on(1)}


def test_smaller_buckets_never_hold_more() -> None:
    """Two consecutive rounds of packed bytes: at most all of them (one round of an unbounded bucket)."""
    held_any = 0
    for dag in _dags():
        for prim in dag.nodes:
            if not isinstance(prim, Merge | Split | Extend) or relabels(prim):
                continue
            whole = wire_buffers(prim, 1 << 40)
            small = wire_buffers(prim, 256)
            assert all(0 < v <= whole.get(g, 0) for g, v in small.items())
            assert set(whole) <= prim_gpus(prim)
            held_any += bool(small)
            if isinstance(prim, Merge):
                full = derive_footprint(prim)
                assert full.buffer_bytes == (wire_buffers(prim) if full.pair_bytes else {})
                assert traffic(prim, PlanningCache()) == replace(full, buffer_bytes={})
    assert held_any > 5


def prim_gpus(prim: Primitive) -> set[int]:
    return {g for u in (*prim.sources, *prim.targets) for g in u.gpus}


def test_the_default_cache_serves_callers_without_one() -> None:
    a = Extend(sources=(_unit("s", Layout(2, 1), (0, 1)),), target=_unit("t9", Layout(2, 1), (8, 9)))
    assert footprint(a) == footprint(a, PlanningCache()) == derive_footprint(a)
    assert DEFAULT_CACHE.footprints.get(fps._shape_key(a)[0]) is not None


def test_labels_map_onto_their_gpus() -> None:
    labelled = Footprint(alloc_bytes={0: 1}, free_bytes={1: 2}, buffer_bytes={0: 3}, local_bytes={1: 4},
                         pair_bytes={(1, 0): 5, (0, 1): 6})
    assert fps.on_gpus(labelled, [7, 3]) == Footprint(alloc_bytes={7: 1}, free_bytes={3: 2}, buffer_bytes={7: 3},
                                                      local_bytes={3: 4}, pair_bytes={(3, 7): 5, (7, 3): 6})
