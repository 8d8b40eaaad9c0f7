"""The bulk paths of the cold geometry (transitions.geometry's ``make_shard`` and
``layout_rank_bytes``, transitions.layout's inline slot builder) give exactly what the plain
constructors and the per-rank shard sums give: fields, values, order, bytes, alignment."""

from __future__ import annotations

import inspect
import itertools
import math
from dataclasses import fields

import pytest

from planner.errors import SpecError
from planner.models import TINY_3M, Head, ModelSpec
from planner.plan import Layout
from planner.workflow import Role, StageKind
from transitions import geometry
from transitions.emu import UnitState, parts_nest
from transitions.geometry import (
    INFERENCE_KINDS,
    TRAINING_KINDS,
    Shard,
    StateKind,
    layout_rank_bytes,
    layouts_nest,
    make_shard,
    rank_shard_tuple,
    state_kinds,
    tensor_stages,
    tp_box,
    unit_rank_bytes,
)
from transitions.layout import (
    COUNTERS,
    COUNTERS_KIND,
    DTYPE_BYTES,
    NUM_COUNTERS,
    PAGE_BYTES,
    Slot,
    StagePlacement,
    align,
    dtype_of,
    rank_slots,
    slot_start,
)

# GQA with fewer kv heads than TP ranks at TP 4, an uneven vocab (5 over TP 2 and 4: empty chunks), a
# tied embedding (held by the first and the last PP stage), fp32 parameters
ODD = ModelSpec(name="odd", num_layers=4, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                ffn_hidden_size=8, vocab_size=5, tie_word_embeddings=True)
FP32 = ModelSpec(name="fp32", num_layers=3, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                 ffn_hidden_size=12, vocab_size=8, bytes_per_param=4)
KINDS = (INFERENCE_KINDS, TRAINING_KINDS, state_kinds(StageKind.TRAINING, keep_grads=True))


@pytest.fixture(autouse=True)
def _cold_geometry() -> None:
    """Every test derives its shards afresh: the memos are filled by whatever ran before."""
    for memo in (geometry.rank_shard_tuple, geometry._tp_rank_shards, geometry._common_shards,
                 geometry.layout_rank_bytes, geometry.layouts_nest):
        memo.cache_clear()


def test_make_shard_sets_every_field_as_the_dataclass_does() -> None:
    assert list(inspect.signature(make_shard).parameters) == [f.name for f in fields(Shard)]
    values = dict(tensor="w", kind=StateKind.MASTER, global_shape=(8, 6), offsets=(2, 0), lengths=(3, 6),
                  bytes_per_element=4)
    fast, slow = make_shard(**values), Shard(**values)  # type: ignore[arg-type]
    assert fast == slow and hash(fast) == hash(slow)
    assert {f.name: getattr(fast, f.name) for f in fields(Shard)} == values
    assert fast.num_bytes == 3 * 6 * 4


@pytest.mark.parametrize("model", [ODD, FP32, TINY_3M], ids=lambda m: m.name)
def test_a_ranks_shards_are_the_checked_shards_of_its_tp_boxes(model: ModelSpec) -> None:
    for head, kinds, (tp, pp) in itertools.product(Head, KINDS, [(1, 1), (2, 1), (4, 2), (2, 4), (1, 3)]):
        layout = Layout(tp, pp)
        if pp > model.num_layers:
            continue
        for rank in range(layout.size):
            tp_rank, pp_rank = layout.coords(rank)
            want = []
            for t in model.tensors(head):
                if pp_rank not in tensor_stages(t, model, pp):
                    continue
                offsets, lengths = tp_box(t, model, tp, tp_rank)
                if 0 in lengths:
                    continue
                want += [Shard(tensor=t.name, kind=k, global_shape=t.shape, offsets=offsets, lengths=lengths,
                               bytes_per_element=k.bytes_per_element(model)) for k in kinds]
            got = rank_shard_tuple(model, head, layout, rank, kinds)
            assert list(got) == want
            assert all(type(s) is Shard for s in got)


@pytest.mark.parametrize("model", [ODD, FP32, TINY_3M], ids=lambda m: m.name)
def test_layout_rank_bytes_are_every_ranks_shard_bytes(model: ModelSpec) -> None:
    for head, kinds, tp, pp in itertools.product(Head, KINDS, (1, 2, 4), (1, 2, 3, 4)):
        layout = Layout(tp, pp)
        if pp > model.num_layers:
            continue
        try:
            want = tuple(unit_rank_bytes(model, head, layout, r, kinds) for r in range(layout.size))
        except SpecError:
            with pytest.raises(SpecError):
                layout_rank_bytes(model, head, layout, kinds)
            continue
        assert layout_rank_bytes(model, head, layout, kinds) == want
        assert sum(want) > 0


def test_layout_rank_bytes_by_hand_and_its_default_kinds() -> None:
    # ODD, PP 2, TP 1, parameters only (bf16): layers 0-1 on stage 0, 2-3 on stage 1; the tied
    # embedding (5 x 8) on both, the final norm (8) and no separate head on the last
    per_layer = sum(math.prod(t.shape) for t in ODD.tensors(Head.LM) if t.layer == 0)
    embed = 5 * 8
    assert layout_rank_bytes(ODD, Head.LM, Layout(1, 2)) == (2 * (2 * per_layer + embed),
                                                              2 * (2 * per_layer + embed + 8))
    with pytest.raises(SpecError):
        layout_rank_bytes(ODD, Head.LM, Layout(3, 1))  # 4 heads do not split over TP 3


def _slow_slots(model: ModelSpec, head: Head, layout: Layout, rank: int,
                kinds: tuple[StateKind, ...]) -> tuple[tuple[Slot, ...], int]:
    """The slot builder as the plain dataclass and ``slot_start`` give it."""
    orders = {t.name: (1, 0, *range(2, len(t.shape))) for t in model.tensors(head)
              if t.parallel.value == "row" and len(t.shape) >= 2}
    entries: list[tuple[str, str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = [
        (COUNTERS, COUNTERS_KIND, "int64", (NUM_COUNTERS,), (0,), (NUM_COUNTERS,))]
    entries += [(s.tensor, s.kind.value, dtype_of(s.kind, model), s.global_shape, s.offsets, s.lengths)
                for s in rank_shard_tuple(model, head, layout, rank, kinds)]
    out, offset = [], 0
    for tensor, kind, dtype, shape, offs, lens in entries:
        nbytes = math.prod(lens) * DTYPE_BYTES[dtype]
        offset = slot_start(offset, nbytes)
        out.append(Slot(tensor=tensor, kind=kind, dtype=dtype, global_shape=shape, offsets=offs, lengths=lens,
                        byte_offset=offset, order=orders.get(tensor, ())))
        offset += nbytes
    return tuple(out), align(offset)


@pytest.mark.parametrize("model", [ODD, FP32, TINY_3M], ids=lambda m: m.name)
def test_the_inline_slot_builder_is_the_plain_one(model: ModelSpec) -> None:
    for head, kinds, (tp, pp) in itertools.product(Head, KINDS, [(1, 1), (2, 1), (4, 2), (2, 3)]):
        layout = Layout(tp, pp)
        placement = StagePlacement(model_stage="s", model=model, head=head, kinds=kinds, layout=layout,
                                   gpu_sets=(tuple(range(layout.size)),))
        for rank in range(layout.size):
            got = rank_slots(placement, rank)
            assert got == _slow_slots(model, head, layout, rank, kinds)
            assert all(type(s) is Slot for s in got[0])
    big = rank_slots(StagePlacement(model_stage="s", model=TINY_3M, head=Head.LM, kinds=TRAINING_KINDS,
                                    layout=Layout(1, 1), gpu_sets=((0,),)), 0)[0]
    assert any(s.byte_offset % PAGE_BYTES == 0 and s.num_bytes >= 64 << 10 and s.byte_offset for s in big)
    assert any(s.byte_offset % PAGE_BYTES and s.byte_offset % 16 == 0 for s in big)


# one kv head for every query head group, at most 8 ranks: TP 8 puts 8 ranks on one kv head
GQA1 = ModelSpec(name="gqa1", num_layers=6, hidden_size=16, num_attention_heads=8, num_kv_heads=1, head_dim=2,
                 ffn_hidden_size=24, vocab_size=16)


def test_layouts_nest_is_parts_nest() -> None:
    layouts = [Layout(tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 3, 4, 6)]
    nest = apart = refused = 0
    for model, head, sub, final in itertools.product([ODD, GQA1, TINY_3M], Head, layouts, layouts):
        state = UnitState(model_stage="s", stage_kind=StageKind.TRAINING, role=Role.ACTOR, model=model, head=head,
                          kinds=TRAINING_KINDS)
        try:
            want: bool | str = parts_nest(state, sub, final)
        except SpecError as e:
            want = e.field
        try:
            got: bool | str = layouts_nest(model, head, sub, final)
        except SpecError as e:
            got = e.field
        assert got == want, (model.name, head, sub, final)
        nest += want is True
        apart += want is False
        refused += isinstance(want, str)
    assert nest and apart and refused


def test_layouts_nest_by_hand() -> None:
    # TP 2 inside TP 1 (a whole tensor holds both halves); PP 2 layers {0,1},{2,3} inside PP 1
    assert layouts_nest(ODD, Head.LM, Layout(1, 1), Layout(2, 2))
    # PP 3 of 6 layers: {0,1},{2,3},{4,5}; PP 1 parts of a PP 3 unit hold everything
    assert layouts_nest(GQA1, Head.LM, Layout(1, 1), Layout(1, 3))
    # the k/v heads of GQA1 (one kv head): TP 8 ranks each hold the whole head, inside TP 2's too
    assert layouts_nest(GQA1, Head.LM, Layout(2, 1), Layout(8, 1))
    # ODD's vocab of 5 over TP 4 ([0,2) [2,4) [4,5) [5,5)) does not nest in TP 2's ([0,3) [3,5))
    assert not layouts_nest(ODD, Head.LM, Layout(2, 1), Layout(4, 1))
    # PP 4 of 4 layers in PP 2 ({0,1},{2,3}; the tied embedding on stages 0 and 3 -> 0 and 1) nests; PP 4
    # of 6 layers ({0,1},{2,3},{4},{5}) in PP 2 ({0,1,2},{3,4,5}) does not: layer 3 maps to stage 0
    assert layouts_nest(ODD, Head.LM, Layout(1, 2), Layout(1, 4))
    assert not layouts_nest(GQA1, Head.LM, Layout(1, 2), Layout(1, 4))
    with pytest.raises(SpecError, match="does not split"):
        layouts_nest(ODD, Head.LM, Layout(2, 1), Layout(1, 1))
    with pytest.raises(SpecError, match="does not split"):
        layouts_nest(ODD, Head.LM, Layout(1, 2), Layout(1, 3))


@pytest.mark.parametrize(("model", "layout", "rank"), [(TINY_3M, Layout(2, 1), 1), (ODD, Layout(4, 1), 3)],
                         ids=["tiny-3m", "odd-empty-embedding-chunk"])
def test_heads_share_the_shards_of_the_tensors_they_hold_alike(model: ModelSpec, layout: Layout, rank: int) -> None:
    lm = rank_shard_tuple(model, Head.LM, layout, rank, TRAINING_KINDS)
    value = rank_shard_tuple(model, Head.VALUE, layout, rank, TRAINING_KINDS)
    own = {t.name for t in model.tensors(Head.LM)} ^ {t.name for t in model.tensors(Head.VALUE)}
    assert own and not any(s.tensor in own for s in lm if s.tensor in {v.tensor for v in value})
    by_key = {s.key: s for s in value}
    shared = [s for s in lm if s.key in by_key]
    assert len(shared) == len(lm) - sum(s.tensor in own for s in lm) > 0
    assert all(by_key[s.key] is s for s in shared)  # one object per shard, whichever head asked first
