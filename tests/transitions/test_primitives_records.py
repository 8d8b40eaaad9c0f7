"""The primitive records (transitions.primitives) on their own: what each reads, makes and frees, which
GPUs a footprint occupies, when a Merge only relabels, and which GPUs of a target a primitive fills."""

from __future__ import annotations

from planner.models import ModelSpec
from planner.plan import Layout
from planner.workflow import ACTOR_TRAIN
from transitions.emu import EMU
from transitions.primitives import (
    Destroy,
    Extend,
    Footprint,
    Merge,
    PrimitiveKind,
    Restore,
    Split,
    moves_nothing,
    relabels,
    target_gpus,
)
from transitions.scenarios import stage_states

TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=8, num_attention_heads=2, num_kv_heads=2,
                 head_dim=4, ffn_hidden_size=16, vocab_size=8)
STATE = stage_states(TINY, (ACTOR_TRAIN,))["actor-train"]


def _unit(name: str, tp: int, gpus: tuple[int, ...], final: EMU | None = None) -> EMU:
    return EMU(uid=name, state=STATE, layout=Layout(tp, 1), gpus=gpus, version=1, final=final)


def test_a_footprint_occupies_every_gpu_it_touches_and_moves_its_pair_bytes() -> None:
    fp = Footprint(alloc_bytes={1: 10}, free_bytes={2: 5}, buffer_bytes={9: 4}, local_bytes={3: 7},
                   pair_bytes={(4, 5): 11, (5, 6): 13})
    # buffers are held only while another effect runs on that GPU: GPU 9 is not a FIFO resource
    assert fp.gpus == frozenset({1, 2, 3, 4, 5, 6})
    assert fp.moved_bytes == 24
    empty = Footprint(alloc_bytes={}, free_bytes={}, buffer_bytes={}, local_bytes={}, pair_bytes={})
    assert empty.gpus == frozenset() and empty.moved_bytes == 0


def test_each_primitive_reads_makes_and_frees_its_own_units() -> None:
    a, b, c = _unit("a", 2, (0, 1)), _unit("b", 1, (0,)), _unit("c", 1, (1,))
    split = Split(unit=a, parts=(b, c))
    assert (split.sources, split.targets, split.frees, split.kind) == ((a,), (b, c), (), PrimitiveKind.SPLIT)
    merge = Merge(parts=(b, c), unit=a)
    assert (merge.sources, merge.targets, merge.frees, merge.kind) == ((b, c), (a,), (b, c), PrimitiveKind.MERGE)
    ext = Extend(sources=(b, c), target=a)
    assert (ext.sources, ext.targets, ext.frees, ext.kind) == ((b, c), (a,), (), PrimitiveKind.EXTEND)
    gone = Destroy(unit=a)
    assert (gone.sources, gone.targets, gone.frees, gone.kind) == ((), (), (a,), PrimitiveKind.DESTROY)
    back = Restore(target=a, url="file:///ckpt", tag="v1")
    assert (back.sources, back.targets, back.frees, back.kind) == ((), (a,), (), PrimitiveKind.RESTORE)
    assert [k.value for k in PrimitiveKind] == ["split", "merge", "extend", "destroy", "restore"]


def test_a_merge_relabels_only_when_every_part_is_already_in_final_shape() -> None:
    unit = _unit("u", 2, (0, 1))
    in_shape = (_unit("p0", 1, (0,), final=unit), _unit("p1", 1, (1,), final=unit))
    assert relabels(Merge(parts=in_shape, unit=unit)) and moves_nothing(Merge(parts=in_shape, unit=unit))
    mixed = (in_shape[0], _unit("p1", 1, (1,)))
    assert not relabels(Merge(parts=mixed, unit=unit)) and not moves_nothing(Merge(parts=mixed, unit=unit))
    other = _unit("v", 2, (0, 1))
    elsewhere = (_unit("q0", 1, (0,), final=other), _unit("q1", 1, (1,), final=other))
    assert not relabels(Merge(parts=elsewhere, unit=unit))
    # a Split of the same units is not a Merge: it moves bytes
    assert not relabels(Split(unit=unit, parts=in_shape)) and not moves_nothing(Split(unit=unit, parts=in_shape))
    assert not moves_nothing(Extend(sources=in_shape, target=unit))
    assert moves_nothing(Destroy(unit=unit)) and moves_nothing(Restore(target=unit, url="u", tag="t"))


def test_a_merge_fills_only_the_gpus_its_in_shape_parts_do_not_hold() -> None:
    unit = _unit("u", 4, (0, 1, 2, 3))
    other = _unit("v", 4, (0, 1, 2, 3))  # same GPUs and layout, another unit
    parts = (_unit("p0", 1, (0,), final=unit), _unit("p1", 1, (1,)), _unit("p2", 1, (2,), final=unit),
             _unit("p3", 1, (3,), final=other))
    assert target_gpus(Merge(parts=parts, unit=unit), unit) == [1, 3]
    assert target_gpus(Extend(sources=parts, target=unit), unit) == [0, 1, 2, 3]
    assert target_gpus(Restore(target=unit, url="u", tag="t"), unit) == [0, 1, 2, 3]
