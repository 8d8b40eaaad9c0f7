"""transitions.footprints' derivation from every piece, where it still serves: a primitive
transitions.gpu_traffic does not (a Split whose parts share a GPU) gets it, bucket memory included
or left out as asked; its byte counts are whole numbers (ints, as the per-GPU entries give)."""

from __future__ import annotations

from planner.models import TINY_3M
from planner.plan import Layout
from planner.workflow import ACTOR_TRAIN
from transitions import gpu_traffic
from transitions.emu import EMU
from transitions.footprints import _canonical_footprint, derive_footprint
from transitions.planning_cache import PlanningCache
from transitions.primitives import Extend, Footprint, Merge, Split
from transitions.scenarios import stage_states

TRAIN = stage_states(TINY_3M, (ACTOR_TRAIN,))["actor-train"]


def _u(uid: str, tp: int, gpus: tuple[int, ...]) -> EMU:
    return EMU(uid=uid, state=TRAIN, layout=Layout(tp, 1), gpus=gpus, version=1)


def _items(fp: Footprint) -> list[list[object]]:
    return [list(d.items()) for d in (fp.alloc_bytes, fp.free_bytes, fp.buffer_bytes, fp.local_bytes, fp.pair_bytes)]


def test_a_split_whose_parts_share_a_gpu_is_derived_from_every_piece() -> None:
    prim = Split(unit=_u("u", 2, (0, 1)), parts=(_u("p0", 1, (2,)), _u("p1", 1, (2,))))
    assert not gpu_traffic.applies(prim)
    full, bare = _canonical_footprint(prim, PlanningCache()), _canonical_footprint(prim, PlanningCache(), False)
    assert _items(full) == _items(derive_footprint(prim)) and set(full.buffer_bytes) == {0, 1, 2}
    assert _items(bare) == _items(derive_footprint(prim, False)) and not bare.buffer_bytes
    assert bare.pair_bytes == full.pair_bytes and set(full.pair_bytes) == {(0, 2), (1, 2)}


def test_bytes_derived_from_every_piece_are_ints() -> None:
    home = _u("m", 2, (0, 1))
    for prim in (Extend(sources=(_u("s", 1, (0,)),), target=_u("t", 2, (0, 3))),
                 Merge(parts=(_u("p0", 1, (0,)), _u("p1", 1, (2,))), unit=home)):
        fp = derive_footprint(prim)
        assert fp.local_bytes and fp.pair_bytes
        assert all(type(n) is int for d in (fp.local_bytes, fp.pair_bytes) for n in d.values())
