"""Model specs (planner/models.py): the whole tensor inventory of a small model written out by hand in
Hugging Face's names (plain, Qwen3's q/k norms, Qwen2's q/k/v biases, tied embeddings, a value head),
every refusal word for word at its boundary (sizes, GQA, TP degrees, PP depth, rope scaling), and the
preset lookup. Found by mutation testing (tests/mutate.py --module planner/models.py: 214 of 483
mutants survived tests that counted parameters and read no names, shapes, splits or messages)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from planner.errors import SpecError
from planner.models import (
    LLAMA_31_8B,
    MODELS,
    Head,
    ModelSpec,
    Parallel,
    RopeScaling,
    TensorSpec,
    _divisors_text,
    model_preset,
)

C, R, V, X = Parallel.COLUMN, Parallel.ROW, Parallel.VOCAB, Parallel.REPLICATED
# 2 layers, h=8, 4 heads of 2 (q 8), 2 KV heads (kv 4), f=12, vocab 10
M = ModelSpec(name="m", num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
              ffn_hidden_size=12, vocab_size=10)


def _layer(i: int, *, bias: bool = False, qk_norm: bool = False) -> list[TensorSpec]:
    p = f"model.layers.{i}."
    out = [TensorSpec(p + "input_layernorm.weight", (8,), X, i)]
    for proj, rows, heads in (("q_proj", 8, 4), ("k_proj", 4, 2), ("v_proj", 4, 2)):
        out.append(TensorSpec(p + f"self_attn.{proj}.weight", (rows, 8), C, i, heads))
        if bias:
            out.append(TensorSpec(p + f"self_attn.{proj}.bias", (rows,), C, i, heads))
    out.append(TensorSpec(p + "self_attn.o_proj.weight", (8, 8), R, i, 4))
    if qk_norm:
        out += [TensorSpec(p + "self_attn.q_norm.weight", (2,), X, i), TensorSpec(p + "self_attn.k_norm.weight", (2,), X, i)]
    return out + [TensorSpec(p + "post_attention_layernorm.weight", (8,), X, i),
                  TensorSpec(p + "mlp.gate_proj.weight", (12, 8), C, i),
                  TensorSpec(p + "mlp.up_proj.weight", (12, 8), C, i),
                  TensorSpec(p + "mlp.down_proj.weight", (8, 12), R, i)]


EMBED = TensorSpec("model.embed_tokens.weight", (10, 8), V, None)
NORM = TensorSpec("model.norm.weight", (8,), X, None)
LM_HEAD = TensorSpec("lm_head.weight", (10, 8), C, None)
SCORE = TensorSpec("score.weight", (1, 8), X, None)


def test_the_tensor_inventory_in_hugging_face_names() -> None:
    assert M.tensors() == (EMBED, *_layer(0), *_layer(1), NORM, LM_HEAD)
    assert M.tensors(Head.LM) == M.tensors()
    assert M.tensors(Head.VALUE) == (EMBED, *_layer(0), *_layer(1), NORM, SCORE)
    tied = dataclasses.replace(M, tie_word_embeddings=True)
    assert tied.tensors() == (EMBED, *_layer(0), *_layer(1), NORM)
    assert tied.tensors(Head.VALUE)[-1] == SCORE
    qwen3 = dataclasses.replace(M, qk_norm=True)
    assert qwen3.tensors() == (EMBED, *_layer(0, qk_norm=True), *_layer(1, qk_norm=True), NORM, LM_HEAD)
    qwen2 = dataclasses.replace(M, qkv_bias=True)
    assert qwen2.tensors() == (EMBED, *_layer(0, bias=True), *_layer(1, bias=True), NORM, LM_HEAD)


def test_parameter_counts_and_kv_bytes() -> None:
    layer = 8 + 64 + 32 + 32 + 64 + 8 + 3 * 96  # norms, q, k, v, o, MLP
    assert sum(t.numel for t in M.tensors() if t.layer == 0) == layer
    assert M.num_params() == 80 + 2 * layer + 8 + 80
    assert M.num_params(Head.VALUE) == 80 + 2 * layer + 8 + 8
    assert TensorSpec("t", (3, 4, 5), X, None).numel == 60 and TensorSpec("s", (), X, None).numel == 1
    assert M.kv_bytes_per_token == 2 * 2 * 2 * 2 * 2  # k and v, 2 layers, 2 KV heads, head_dim 2, bf16


def _refusal(fn: Any, *args: Any, **kw: Any) -> str:
    with pytest.raises(SpecError) as info:
        fn(*args, **kw)
    return str(info.value)


@pytest.mark.parametrize("field", ["num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
                                   "ffn_hidden_size", "vocab_size"])
def test_every_size_must_be_at_least_one(field: str) -> None:
    one = dataclasses.replace(M, num_layers=1, hidden_size=1, num_attention_heads=1, num_kv_heads=1, head_dim=1,
                              ffn_hidden_size=1, vocab_size=1)
    assert one.num_params() > 0  # all ones is a model
    assert _refusal(dataclasses.replace, one, **{field: 0}) == f"model.{field}: must be >= 1, got 0"


def test_model_level_refusals() -> None:
    assert _refusal(dataclasses.replace, M, rope_scaling={"factor": 8.0}) == (
        "model.rope_scaling: must be a RopeScaling or None, got dict")
    assert _refusal(dataclasses.replace, M, qk_norm=True, qkv_bias=True) == (
        "model.qkv_bias: q/k norms (Qwen3) and q/k/v biases (Qwen2) together are no published architecture")
    assert dataclasses.replace(M, grad_bytes_per_param=4).grad_bytes_per_param == 4
    assert _refusal(dataclasses.replace, M, grad_bytes_per_param=3) == (
        "model.grad_bytes_per_param: must be 2 (bf16) or 4 (fp32), got 3")
    assert _refusal(dataclasses.replace, M, num_kv_heads=3) == "model.num_kv_heads: 3 does not divide num_attention_heads=4"


def test_tp_and_pp_degrees() -> None:
    big = dataclasses.replace(M, num_attention_heads=8, num_kv_heads=2, ffn_hidden_size=12)
    assert [tp for tp in range(0, 10) if big.valid_tp(tp)] == [1, 2, 4]
    assert _refusal(big.check_tp, 0) == "tp: 0 does not divide num_attention_heads=8 (allowed: 1, 2, 4, 8)"
    assert _refusal(big.check_tp, 3) == "tp: 3 does not divide num_attention_heads=8 (allowed: 1, 2, 4, 8)"
    assert _refusal(big.check_tp, 8) == "tp: 8 does not divide ffn_hidden_size=12"
    odd = dataclasses.replace(M, num_attention_heads=12, num_kv_heads=4, ffn_hidden_size=24)
    assert _refusal(odd.check_tp, 6) == "tp: 6 and num_kv_heads=4 do not divide one another"
    assert [tp for tp in range(1, 13) if odd.valid_tp(tp)] == [1, 2, 4, 12]
    gqa = dataclasses.replace(M, num_attention_heads=8, num_kv_heads=2, ffn_hidden_size=16)
    assert gqa.valid_tp(8)  # KV heads replicated in groups: 2 divides 8
    M.check_pp(1)
    M.check_pp(2)
    for pp in (0, 3):
        assert _refusal(M.check_pp, pp) == f"pp: {pp} must be between 1 and num_layers=2"
    assert _divisors_text(12) == "1, 2, 3, 4, 6, 12" and _divisors_text(1) == "1"


ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}


def test_rope_scaling_from_a_hf_mapping_and_back() -> None:
    r = RopeScaling.from_mapping(ROPE)
    assert (r.rope_type, r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings) == (
        "llama3", 8.0, 1.0, 4.0, 8192)
    assert r.to_dict() == ROPE
    older = {**{k: v for k, v in ROPE.items() if k != "rope_type"}, "type": "llama3",
             "original_max_position_embeddings": 8192.0}
    r2 = RopeScaling.from_mapping(older)
    assert r2 == r and type(r2.original_max_position_embeddings) is int  # 8192.0 read as 8192
    assert RopeScaling.from_mapping({**ROPE, "factor": 1}).factor == 1  # factor 1 is allowed


@pytest.mark.parametrize("change,text", [
    ({"rope_type": "yarn"}, "m.r.rope_type: 'yarn' is not supported (allowed: llama3)"),
    ({"rope_type": None}, "m.r.rope_type: None is not supported (allowed: llama3)"),
    ({"factor": None}, "m.r.factor: is missing (rope type 'llama3' needs factor, low_freq_factor, high_freq_factor, "
                       "original_max_position_embeddings)"),
    ({"high_freq_factor": None}, "m.r.high_freq_factor: is missing (rope type 'llama3' needs factor, low_freq_factor, "
                                 "high_freq_factor, original_max_position_embeddings)"),
    ({"beta": 1, "alpha": 2}, "m.r.alpha: is not a parameter of rope type 'llama3' (allowed: factor, low_freq_factor, "
                              "high_freq_factor, original_max_position_embeddings)"),
    ({"factor": True}, "m.r.factor: must be a finite number, got True"),
    ({"low_freq_factor": "1"}, "m.r.low_freq_factor: must be a finite number, got '1'"),
    ({"high_freq_factor": float("inf")}, "m.r.high_freq_factor: must be a finite number, got inf"),
    ({"factor": 0.99}, "m.r.factor: must be >= 1, got 0.99"),
    ({"low_freq_factor": 0.0}, "m.r.low_freq_factor: must be > 0, got 0.0"),
    ({"high_freq_factor": 1.0}, "m.r.high_freq_factor: must be greater than low_freq_factor=1.0, got 1.0"),
    ({"original_max_position_embeddings": 0}, "m.r.original_max_position_embeddings: must be an integer >= 1, got 0"),
    ({"original_max_position_embeddings": True},
     "m.r.original_max_position_embeddings: must be an integer >= 1, got True"),
    ({"original_max_position_embeddings": 8192.5},
     "m.r.original_max_position_embeddings: must be an integer >= 1, got 8192.5"),
])
def test_a_bad_rope_scaling_names_its_key(change: dict[str, Any], text: str) -> None:
    d = {k: v for k, v in {**ROPE, **change}.items() if v is not None or k == "rope_type"}
    if change.get("rope_type", "x") is None:
        d = {k: v for k, v in d.items() if k != "rope_type"}
    assert _refusal(RopeScaling.from_mapping, d, where="m.r") == text


def test_a_rope_scaling_built_directly_is_checked_too() -> None:
    assert _refusal(RopeScaling, factor=2.0, low_freq_factor=2.0, high_freq_factor=1.0,
                    original_max_position_embeddings=8) == (
        "model.rope_scaling.high_freq_factor: must be greater than low_freq_factor=2.0, got 1.0")
    assert _refusal(RopeScaling, rope_type="linear", factor=2.0, low_freq_factor=1.0, high_freq_factor=2.0,
                    original_max_position_embeddings=8) == (
        "model.rope_scaling.rope_type: 'linear' is not supported (allowed: llama3)")
    assert RopeScaling.from_mapping(ROPE).to_dict()["rope_type"] == "llama3"
    assert RopeScaling.from_mapping({k: v for k, v in ROPE.items()}).rope_type == "llama3"


def test_model_presets_by_name_in_any_case() -> None:
    assert model_preset("Llama-3.1-8B") is LLAMA_31_8B
    assert _refusal(model_preset, "gpt-5") == f"model: unknown preset 'gpt-5' (allowed: {', '.join(sorted(MODELS))})"


def test_rope_scaling_defaults_and_its_smallest_context() -> None:
    assert RopeScaling.from_mapping({**ROPE, "original_max_position_embeddings": 1}).original_max_position_embeddings == 1
    assert _refusal(RopeScaling.from_mapping, {**ROPE, "factor": 0.5}) == "model.rope_scaling.factor: must be >= 1, got 0.5"
