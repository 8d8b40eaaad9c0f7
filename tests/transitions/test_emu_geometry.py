"""EMU geometry: PP stages, TP slices (even, uneven, GQA) and unit shards, with hand-checked offsets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import SpecError
from planner.models import LLAMA_31_8B, TINY_3M, Head, ModelSpec, Parallel, TensorSpec
from planner.plan import Layout
from planner.workflow import StageKind
from transitions.geometry import (
    StateKind,
    chunk_range,
    layer_stages,
    stage_layers,
    state_kinds,
    tensor_stage,
    tensor_stages,
    tp_box,
    tp_slice,
    unit_shards,
)

# 12 heads, 4 kv heads, vocab 10: TP 2, 3, 4 valid for q; vocab 10 is uneven over 3 and 4.
SMALL = ModelSpec(name="small", num_layers=4, hidden_size=24, num_attention_heads=12, num_kv_heads=4,
                  head_dim=2, ffn_hidden_size=36, vocab_size=10)


def _t(model: ModelSpec, name: str, head: Head = Head.LM) -> TensorSpec:
    return next(t for t in model.tensors(head) if t.name == name)


def test_layer_stages_balanced_and_contiguous() -> None:
    assert layer_stages(4, 2) == (0, 0, 1, 1)
    assert layer_stages(5, 2) == (0, 0, 0, 1, 1)
    assert layer_stages(80, 3).count(0) == 27 and layer_stages(80, 3).count(2) == 26
    for n, pp in [(7, 3), (80, 6), (32, 32)]:
        stages = layer_stages(n, pp)
        for s in range(pp):
            assert tuple(stage_layers(n, pp, s)) == tuple(i for i, x in enumerate(stages) if x == s)
    with pytest.raises(SpecError):
        layer_stages(4, 5)


def test_embedding_first_head_last() -> None:
    assert tensor_stage(_t(SMALL, "model.embed_tokens.weight"), SMALL, 2) == 0
    assert tensor_stage(_t(SMALL, "lm_head.weight"), SMALL, 2) == 1
    assert tensor_stage(_t(SMALL, "model.norm.weight"), SMALL, 2) == 1
    assert tensor_stage(_t(SMALL, "model.layers.2.mlp.up_proj.weight"), SMALL, 2) == 1
    tied = ModelSpec(name="tied", num_layers=2, hidden_size=8, num_attention_heads=2, num_kv_heads=1,
                     head_dim=4, ffn_hidden_size=8, vocab_size=6, tie_word_embeddings=True)
    assert tensor_stages(_t(tied, "model.embed_tokens.weight"), tied, 2) == (0, 1)


def test_chunk_range_matches_torch_chunk() -> None:
    # torch.chunk(range(10), 4) -> sizes 3,3,3,1; over 3 -> 4,4,2; 5 over 4 -> 2,2,1,0
    assert [chunk_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert [chunk_range(10, 3, r) for r in range(3)] == [(0, 4), (4, 4), (8, 2)]
    assert [chunk_range(5, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 0)]


def test_tp_slices_hand_checked() -> None:
    q = _t(SMALL, "model.layers.0.self_attn.q_proj.weight")  # (24, 24) column
    o = _t(SMALL, "model.layers.0.self_attn.o_proj.weight")  # (24, 24) row
    emb = _t(SMALL, "model.embed_tokens.weight")  # (10, 24) vocab
    norm = _t(SMALL, "model.layers.0.input_layernorm.weight")
    assert tp_slice(q, SMALL, 4, 1) == (slice(6, 12), slice(0, 24))
    assert tp_slice(o, SMALL, 3, 2) == (slice(0, 24), slice(16, 24))
    assert tp_slice(emb, SMALL, 3, 2) == (slice(8, 10), slice(0, 24))
    assert tp_slice(emb, SMALL, 4, 3) == (slice(9, 10), slice(0, 24))
    assert tp_slice(norm, SMALL, 4, 3) == (slice(0, 24),)


def test_gqa_kv_split_and_replication() -> None:
    k = _t(SMALL, "model.layers.0.self_attn.k_proj.weight")  # 4 kv heads x head_dim 2 = 8 rows
    assert [tp_box(k, SMALL, 2, r)[0][0] for r in range(2)] == [0, 4]  # 2 heads per rank
    # tp 12 > 4 kv heads: ranks 0-2 hold head 0 (rows 0..2), ranks 3-5 head 1, ...
    rows = [tp_slice(k, SMALL, 12, r)[0] for r in range(12)]
    assert rows[0] == rows[2] == slice(0, 2) and rows[3] == slice(2, 4) and rows[11] == slice(6, 8)


def test_unit_shards_kinds_and_bytes() -> None:
    layout = Layout(2, 2)
    kinds = state_kinds(StageKind.TRAINING)
    assert kinds == (StateKind.PARAM, StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
    assert state_kinds(StageKind.GENERATION) == (StateKind.PARAM,)
    shards = unit_shards(TINY_3M, Head.LM, layout, 3, kinds)  # tp_rank 1, pp_rank 1: layers 2,3 + head
    names = {s.tensor for s in shards}
    assert "lm_head.weight" in names and "model.embed_tokens.weight" not in names
    assert all(".layers.0." not in n and ".layers.1." not in n for n in names)
    head = [s for s in shards if s.tensor == "lm_head.weight"]
    assert [s.kind for s in head] == list(kinds)
    assert head[0].offsets == (256, 0) and head[0].lengths == (256, 256)
    assert head[0].num_bytes == 256 * 256 * 2 and head[1].num_bytes == 256 * 256 * 4
    # empty chunks are left out: vocab 5 over tp 4 leaves rank 3 no embedding rows
    tiny_vocab = ModelSpec(name="v5", num_layers=1, hidden_size=8, num_attention_heads=4, num_kv_heads=4,
                           head_dim=2, ffn_hidden_size=8, vocab_size=5)
    assert not any(s.tensor == "model.embed_tokens.weight"
                   for s in unit_shards(tiny_vocab, Head.LM, Layout(4, 1), 3))


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8, 16, 32]), pp=st.sampled_from([1, 2, 4, 8]))
def test_unit_covers_every_tensor_exactly(tp: int, pp: int) -> None:
    """Per tensor, the union of non-replicated boxes over a unit tiles the tensor exactly once."""
    model, layout = LLAMA_31_8B, Layout(tp, pp)
    covered: dict[str, int] = {}
    for rank in range(layout.size):
        for s in unit_shards(model, Head.VALUE, layout, rank):
            covered[s.tensor] = covered.get(s.tensor, 0) + s.numel
    for t in model.tensors(Head.VALUE):
        copies = tp if t.parallel is Parallel.REPLICATED else 1
        if t.num_heads == model.num_kv_heads and tp > model.num_kv_heads:
            copies = tp // model.num_kv_heads
        assert covered[t.name] == t.numel * copies, t.name


def test_chunks_equal_dtensor_shard_placement() -> None:
    """chunk_range is what DTensor's Shard placement computes for every size and rank (even and
    uneven); torch is imported only here, the geometry itself never imports it."""
    placement = pytest.importorskip("torch.distributed.tensor.placement_types")
    for size in range(0, 40):
        for chunks in (1, 2, 3, 4, 5, 8):
            for rank in range(chunks):
                length, offset = placement.Shard.local_shard_size_and_offset(size, chunks, rank)
                assert chunk_range(size, chunks, rank) == (int(offset), int(length)), (size, chunks, rank)
