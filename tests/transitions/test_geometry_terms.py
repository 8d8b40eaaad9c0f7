"""Mutation-killing tests for transitions/geometry.py: values worked out by hand."""

from __future__ import annotations

import pytest

from planner.errors import SpecError
from planner.models import Head, ModelSpec
from planner.plan import Layout
from planner.workflow import StageKind
from transitions.geometry import (
    Shard,
    StateKind,
    chunk_range,
    rank_shard_tuple,
    state_kinds,
    tensor_stages,
    tp_box,
    unit_rank_bytes,
    unit_shards,
)

# 4 heads, 2 kv heads of dim 2: k_proj is (4, 8); TP 4 puts 2 ranks on each kv head (GQA groups).
GQA = ModelSpec(name="gqa", num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2,
                head_dim=2, ffn_hidden_size=8, vocab_size=8)
TIED = ModelSpec(name="tied", num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2,
                 head_dim=2, ffn_hidden_size=8, vocab_size=8, tie_word_embeddings=True)


def _t(model: ModelSpec, name: str):  # type: ignore[no-untyped-def]
    return next(t for t in model.tensors(Head.LM) if t.name.endswith(name))


def _shard(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> Shard:
    return Shard(tensor="w", kind=StateKind.PARAM, global_shape=shape, offsets=offsets, lengths=lengths,
                 bytes_per_element=2)


def test_bytes_per_element_bf16_params_fp32_optimizer() -> None:
    assert StateKind.PARAM.bytes_per_element(GQA) == 2
    assert StateKind.GRAD.bytes_per_element(GQA) == 2
    assert StateKind.MASTER.bytes_per_element(GQA) == 4
    assert StateKind.EXP_AVG_SQ.bytes_per_element(GQA) == 4


def test_training_keeps_grads_only_when_asked() -> None:
    assert state_kinds(StageKind.TRAINING, keep_grads=True)[-1] is StateKind.GRAD
    assert len(state_kinds(StageKind.TRAINING, keep_grads=True)) == 5
    assert StateKind.GRAD not in state_kinds(StageKind.TRAINING)


def test_embedding_stages_tied_and_untied() -> None:
    assert tensor_stages(_t(GQA, "embed_tokens.weight"), GQA, 2) == (0,)
    assert tensor_stages(_t(TIED, "embed_tokens.weight"), TIED, 2) == (0, 1)
    assert tensor_stages(_t(TIED, "embed_tokens.weight"), TIED, 1) == (0,)


def test_even_chunks_are_ints() -> None:
    offset, length = chunk_range(6, 3, 1)
    assert (offset, length) == (2, 2) and type(offset) is int and type(length) is int


def test_gqa_group_box_is_integral() -> None:
    k = _t(GQA, "layers.0.self_attn.k_proj.weight")
    assert k.shape == (4, 8)
    offsets, lengths = tp_box(k, GQA, 4, 3)  # rank 3 of 4: second kv head (group of ranks 2, 3)
    assert offsets == (2, 0) and lengths == (2, 8)
    assert all(type(x) is int for x in offsets + lengths)


def test_tp_rank_outside_unit_is_refused() -> None:
    q = _t(GQA, "layers.0.self_attn.q_proj.weight")
    with pytest.raises(SpecError) as err:
        tp_box(q, GQA, 2, 2)
    assert err.value.field == "tp_rank" and "2 outside [0, 2)" in str(err.value)


def test_shard_rank_mismatch_is_refused() -> None:
    for shape, offsets, lengths in [((4, 4), (0,), (4,)), ((4,), (0,), (4, 4))]:
        with pytest.raises(SpecError) as err:
            _shard(shape, offsets, lengths)
        assert err.value.field == "shard.offsets" and "rank mismatch for w" in str(err.value)


def test_shard_bounds() -> None:
    assert _shard((4,), (0,), (4,)).lengths == (4,)  # whole dim, offset 0
    assert _shard((4,), (4,), (0,)).lengths == (0,)  # empty chunk at the end
    assert _shard((4, 3), (1, 0), (0, 3)).offsets == (1, 0)
    for offsets, lengths in [((3,), (2,)), ((-1,), (1,)), ((0,), (-1,)), ((0,), (5,))]:
        with pytest.raises(SpecError) as err:
            _shard((4,), offsets, lengths)
        assert err.value.field == "shard.lengths"
    with pytest.raises(SpecError) as err:
        _shard((4,), (3,), (2,))
    assert "w dim 0: [3, 5) outside [0, 4)" in str(err.value)


def test_a_cold_shard_lookup_checks_the_layout_and_rank_bytes_add_up() -> None:
    # rank_shard_tuple is memoised: clear it so this test's lookups run the layout check themselves
    rank_shard_tuple.cache_clear()
    with pytest.raises(SpecError) as tp_err:
        unit_shards(GQA, Head.LM, Layout(3, 1), 0)  # 3 does not divide 4 heads
    assert tp_err.value.field == "tp"
    with pytest.raises(SpecError) as pp_err:
        unit_shards(GQA, Head.LM, Layout(1, 3), 0)  # 3 stages for 2 layers
    assert pp_err.value.field == "pp"
    rank_shard_tuple.cache_clear()
    params = (StateKind.PARAM,)
    whole = unit_rank_bytes(GQA, Head.LM, Layout(1, 1), 0, params)
    assert whole == 2 * GQA.num_params(Head.LM)  # bf16: two bytes a parameter
    halves = [unit_rank_bytes(GQA, Head.LM, Layout(1, 2), r, params) for r in range(2)]
    assert sum(halves) == whole and min(halves) > 0  # PP stages split the layers, nothing repeated
    # training state: bf16 params plus fp32 master weights and two Adam moments, 2 + 3 * 4 bytes a parameter
    training = (StateKind.PARAM, StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ)
    assert unit_rank_bytes(GQA, Head.LM, Layout(1, 1), 0, training) == 14 * GQA.num_params(Head.LM)
