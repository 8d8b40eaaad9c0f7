"""transitions.pieces: whose cache finds a GPU's readers, and what moves nothing. Pure."""

from __future__ import annotations

from planner.models import TINY_3M
from planner.plan import Layout
from planner.workflow import ACTOR_TRAIN
from transitions.emu import EMU
from transitions.pieces import pieces, share, transfers
from transitions.planning_cache import PlanningCache
from transitions.primitives import Destroy, Merge, Restore, Split
from transitions.scenarios import stage_states

STATE = stage_states(TINY_3M, (ACTOR_TRAIN,))["actor-train"]


def _unit(uid: str, layout: Layout, gpus: tuple[int, ...], final: EMU | None = None) -> EMU:
    return EMU(uid=uid, state=STATE, layout=layout, gpus=gpus, version=1, final=final)


WHOLE = _unit("whole", Layout(1, 1), (0,))
# a TP1 unit on GPU 0 split into the two halves of a TP2 unit on GPUs 0 and 1: GPU 0 copies its own
# half and sends the other to GPU 1
TP2 = _unit("tp2", Layout(2, 1), (0, 1))
SPLIT = Split(unit=WHOLE, parts=(_unit("half0", Layout(1, 1), (0,), final=TP2),
                                 _unit("half1", Layout(1, 1), (1,), final=TP2)))


def _empty(cache: PlanningCache) -> bool:
    return not any(cache.sizes().values())


def test_a_gpus_share_finds_its_readers_in_the_cache_it_is_given_by_traffic_only() -> None:
    cache = PlanningCache()
    mine = pieces(SPLIT, 0, cache)
    assert {p.dst_worker for p in mine} == {0, 1} and all(p.src_worker == 0 for p in mine)
    assert len(cache.footprints) == 1
    assert all(key[0] == "traffic" for key in cache.footprints._data)  # no bucket memory derived
    other = PlanningCache()
    sent = transfers(SPLIT, 0, other)
    assert sent and {(p.src_worker, p.dst_worker) for p in sent} == {(0, 1)}
    assert len(other.footprints) == 1


def test_every_piece_needs_no_cache() -> None:
    cache = PlanningCache()
    every = pieces(SPLIT, None, cache)
    assert {(p.src_worker, p.dst_worker) for p in every} == {(0, 0), (0, 1)}
    assert _empty(cache)


def test_what_moves_nothing_has_no_pieces_and_touches_no_cache() -> None:
    unit = _unit("m", Layout(2, 1), (0, 1))
    merge = Merge(parts=tuple(_unit(f"p{g}", Layout(1, 1), (g,), final=unit) for g in (0, 1)), unit=unit)
    restore = Restore(target=unit, url="file:///ckpt", tag="t")
    for prim in (merge, restore, Destroy(unit=unit)):
        cache = PlanningCache()
        assert pieces(prim, 0, cache) == [] == pieces(prim, None, cache)
        assert _empty(cache)
        assert share(prim, None, set()) == [] == share(prim, 0, {1})
