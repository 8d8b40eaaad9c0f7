"""transitions.layout term by term: slot alignment, buffer order and sizes, storage orders, the
contiguity of boxes in a slot, and the checks of a StagePlacement. Expected values are worked out by
hand from the layout rules (16-byte alignment, page alignment from 64 KiB, column-major row-parallel
weights), not read back from the code."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.errors import SpecError
from planner.models import Head, ModelSpec
from planner.plan import Layout
from transitions.emu import EMU
from transitions.geometry import INFERENCE_KINDS, StateKind
from transitions.layout import (
    PAGE_BYTES,
    Slot,
    StagePlacement,
    align,
    contiguous_range,
    dtype_of,
    rank_slots,
    slot_start,
    unit_placement,
)
from transitions.placement_dag import unit_state

# 1 layer, hidden 4, 2 heads (1 KV head) of 2, ffn 6, vocabulary 3: every tensor is a few bf16 bytes
SMALL = ModelSpec(name="small", num_layers=1, hidden_size=4, num_attention_heads=2, num_kv_heads=1, head_dim=2,
                  ffn_hidden_size=6, vocab_size=3)
ALL_KINDS = "param, master, exp_avg, exp_avg_sq, grad"


def _placement(**kw: object) -> StagePlacement:
    args: dict[str, object] = dict(model_stage="s", model=SMALL, head=Head.LM, kinds=INFERENCE_KINDS,
                                   layout=Layout(2, 1), gpu_sets=((0, 1), (4, 5)))
    args.update(kw)
    return StagePlacement(**args)  # type: ignore[arg-type]


def test_align_rounds_up_to_the_multiple() -> None:
    assert [align(n) for n in (0, 1, 15, 16, 17, 33)] == [0, 16, 16, 16, 32, 48]
    assert align(5, 4) == 8 and align(8, 4) == 8
    # a slot under 64 KiB starts on 16 bytes, one of 64 KiB or more on a page
    assert slot_start(17, (64 << 10) - 1) == 32
    assert slot_start(17, 64 << 10) == PAGE_BYTES


@pytest.mark.parametrize(("kw", "field", "text"), [
    (dict(kinds=()), "s.kinds", "s.kinds: must be non-empty and distinct, got () (allowed: " + ALL_KINDS + ")"),
    (dict(kinds=(StateKind.PARAM, StateKind.PARAM)), "s.kinds",
     "s.kinds: must be non-empty and distinct, got (<StateKind.PARAM: 'param'>, <StateKind.PARAM: 'param'>)"
     " (allowed: " + ALL_KINDS + ")"),
    (dict(gpu_sets=()), "s.gpu_sets", "s.gpu_sets: needs at least one replica"),
    (dict(gpu_sets=((0, 1), (2,))), "s.gpu_sets[1]", "s.gpu_sets[1]: has 1 workers, layout tp2/pp1 needs 2"),
    (dict(gpu_sets=((0, 1), (2, 1))), "s.gpu_sets", "s.gpu_sets: a worker appears twice: ((0, 1), (2, 1))"),
])
def test_a_placement_refuses_bad_kinds_and_worker_sets(kw: dict[str, object], field: str, text: str) -> None:
    with pytest.raises(SpecError) as err:
        _placement(**kw)
    assert err.value.field == field
    assert str(err.value).replace(str(Layout(2, 1)), "tp2/pp1") == text


def test_a_placement_finds_its_workers() -> None:
    p = _placement()
    assert p.dp == 2 and p.workers == frozenset({0, 1, 4, 5})
    assert [p.position(w) for w in (0, 1, 4, 5, 2)] == [(0, 0), (0, 1), (1, 0), (1, 1), None]


def test_dtypes_follow_the_kind_and_the_model() -> None:
    fp32 = replace(SMALL, bytes_per_param=4)
    assert [dtype_of(k, SMALL) for k in StateKind] == ["bfloat16", "float32", "float32", "float32", "bfloat16"]
    assert [dtype_of(k, fp32) for k in StateKind] == ["float32"] * 5


def test_the_slots_of_a_whole_unit_in_buffer_order() -> None:
    p = _placement(layout=Layout(1, 1), gpu_sets=((3,),))
    slots, size = rank_slots(p, 0)
    L = "model.layers.0."
    # (tensor, byte offset, lengths, order) worked out by hand: bf16, 16-byte starts
    expected = [
        ("_meta.counters", 0, (4,), ()),  # 4 int64: 32 bytes
        ("model.embed_tokens.weight", 32, (3, 4), ()),  # 24 bytes, ends at 56
        (L + "input_layernorm.weight", 64, (4,), ()),  # 8, ends at 72
        (L + "self_attn.q_proj.weight", 80, (4, 4), ()),  # 32 -> 112
        (L + "self_attn.k_proj.weight", 112, (2, 4), ()),  # 16 -> 128
        (L + "self_attn.v_proj.weight", 128, (2, 4), ()),  # 16 -> 144
        (L + "self_attn.o_proj.weight", 144, (4, 4), (1, 0)),  # 32 -> 176, row-parallel
        (L + "post_attention_layernorm.weight", 176, (4,), ()),  # 8 -> 184
        (L + "mlp.gate_proj.weight", 192, (6, 4), ()),  # 48 -> 240
        (L + "mlp.up_proj.weight", 240, (6, 4), ()),  # 48 -> 288
        (L + "mlp.down_proj.weight", 288, (4, 6), (1, 0)),  # 48 -> 336, row-parallel
        ("model.norm.weight", 336, (4,), ()),  # 8 -> 344
        ("lm_head.weight", 352, (3, 4), ()),  # 24 -> 376
    ]
    assert [(s.tensor, s.byte_offset, s.lengths, s.order) for s in slots] == expected
    assert size == 384
    assert slots[0].kind == "counters" and slots[0].dtype == "int64" and slots[0].num_bytes == 32
    assert {s.dtype for s in slots[1:]} == {"bfloat16"} and {s.kind for s in slots[1:]} == {"param"}


def test_the_slots_of_a_tp_rank_hold_its_rows_in_every_kind() -> None:
    p = _placement(kinds=(StateKind.PARAM, StateKind.MASTER))
    slots, _ = rank_slots(p, 1)
    q = [(s.kind, s.dtype, s.global_shape, s.offsets, s.lengths) for s in slots
         if s.tensor == "model.layers.0.self_attn.q_proj.weight"]
    assert q == [("param", "bfloat16", (4, 4), (2, 0), (2, 4)), ("master", "float32", (4, 4), (2, 0), (2, 4))]


def test_a_unit_and_a_part_place_their_buffers_by_the_final_unit() -> None:
    p = _placement(layout=Layout(2, 1), gpu_sets=((6, 7),))
    state = unit_state(p)
    final = EMU(uid="s@v2#0", state=state, layout=Layout(2, 1), gpus=(6, 7), version=2)
    part = EMU(uid="s@v2#0.p", state=state, layout=Layout(1, 1), gpus=(7,), version=2, final=final)
    for unit in (final, part):
        u = unit_placement(unit)
        assert (u.model_stage, u.model, u.head, u.kinds, u.layout, u.gpu_sets) == (
            "s", SMALL, Head.LM, INFERENCE_KINDS, Layout(2, 1), ((6, 7),))


def _slot(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...], *, order: tuple[int, ...] = (),
          dtype: str = "bfloat16", byte_offset: int = 100) -> Slot:
    return Slot(tensor="t", kind="param", dtype=dtype, global_shape=shape, offsets=offsets, lengths=lengths,
                byte_offset=byte_offset, order=order)


def test_contiguous_ranges_of_a_row_major_matrix_shard() -> None:
    s = _slot((8, 6), (2, 3), (4, 3))  # rows 2..5, columns 3..5: 3 elements a row, bf16, from byte 100
    assert contiguous_range(s, ((2, 3), (2, 3))) == (100, 112)  # two whole rows
    assert contiguous_range(s, ((3, 4), (1, 2))) == (108, 112)  # row 1 of the shard, columns 1..2
    assert contiguous_range(s, ((5, 3), (1, 1))) == (118, 120)  # its last element
    assert contiguous_range(s, ((3, 4), (2, 2))) is None  # partial rows, two of them
    assert contiguous_range(s, ((2, 4), (3, 2))) is None


def test_contiguous_ranges_of_a_column_major_matrix_shard() -> None:
    s = _slot((4, 6), (0, 3), (4, 3), order=(1, 0), byte_offset=0)  # stored column by column, 4 rows each
    assert contiguous_range(s, ((0, 4), (4, 2))) == (8, 24)  # columns 4..5, whole
    assert contiguous_range(s, ((1, 4), (2, 1))) == (10, 14)  # rows 1..2 of column 4
    assert contiguous_range(s, ((1, 4), (2, 2))) is None


def test_contiguous_ranges_of_vectors_and_3d_shards() -> None:
    v = _slot((10,), (4,), (6,), dtype="float32", byte_offset=64)
    assert contiguous_range(v, ((5,), (3,))) == (68, 80)
    s = _slot((5, 3, 4), (1, 0, 0), (3, 3, 4), dtype="float32", byte_offset=0)  # 12 floats per outer index
    assert contiguous_range(s, ((2, 0, 0), (2, 3, 4))) == (48, 144)  # two whole outer blocks
    assert contiguous_range(s, ((3, 1, 0), (1, 2, 4))) == (4 * (24 + 4), 4 * (24 + 4 + 8))  # rows of one block
    assert contiguous_range(s, ((2, 1, 2), (1, 1, 2))) == (4 * (12 + 4 + 2), 4 * (12 + 4 + 4))  # part of a row
    assert contiguous_range(s, ((1, 0, 0), (2, 3, 2))) is None  # partial last dim under two blocks
    assert contiguous_range(s, ((1, 0, 0), (2, 2, 4))) is None  # partial middle dim under two blocks
    assert contiguous_range(s, ((1, 1, 0), (1, 2, 2))) is None  # partial last dim under two rows
    # a stored-order 3D shard: dims 1, 0, 2; storage lengths (2, 4, 2), storage base (2, 0, 0)
    t = _slot((4, 6, 2), (0, 2, 0), (4, 2, 2), order=(1, 0, 2), dtype="float32", byte_offset=0)
    assert contiguous_range(t, ((0, 3, 0), (4, 1, 2))) == (32, 64)
    assert contiguous_range(t, ((1, 3, 0), (2, 1, 2))) == (40, 56)
    assert contiguous_range(t, ((1, 2, 0), (2, 2, 2))) is None
