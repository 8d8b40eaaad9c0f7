"""The decoder: HF parameter names from ModelSpec, KV cache equal to full recompute, pipeline pieces
composing to the whole model, safetensors round trip, GQA/qk-norm/tied variants."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent.engine.model import KVCache, build_decoder, load_safetensors, save_safetensors
from planner.errors import SpecError
from planner.models import TINY_3M, Head, ModelSpec

SMALL = ModelSpec(name="s", num_layers=3, hidden_size=32, num_attention_heads=4, num_kv_heads=2, head_dim=8,
                  ffn_hidden_size=48, vocab_size=100, rope_theta=10_000.0)
QWEN_LIKE = ModelSpec(name="q", num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=1, head_dim=8,
                      ffn_hidden_size=48, vocab_size=100, qk_norm=True, tie_word_embeddings=True)


def batch(vocab: int, b: int = 3, t: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    return ids, mask


@pytest.mark.parametrize("spec", [TINY_3M, SMALL, QWEN_LIKE])
@pytest.mark.parametrize("head", [Head.LM, Head.VALUE])
def test_parameter_names_and_shapes_follow_modelspec(spec: ModelSpec, head: Head) -> None:
    model = build_decoder(spec, head)
    got = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    want = [(t.name, t.shape) for t in spec.tensors(head)]
    assert got == want
    assert sum(p.numel() for p in model.parameters()) == spec.num_params(head)


@pytest.mark.parametrize("spec", [SMALL, QWEN_LIKE])
def test_kv_cache_matches_full_forward(spec: ModelSpec) -> None:
    model = build_decoder(spec)
    ids, mask = batch(spec.vocab_size)
    full = model(ids, mask)
    model.cache = KVCache(ids.shape[0], ids.shape[1])
    parts = [model(ids[:, :5], mask[:, :5])] + [model(ids[:, i:i + 1], mask[:, :i + 1]) for i in range(5, 9)]
    model.cache = None
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


def test_padding_does_not_change_real_positions() -> None:
    model = build_decoder(SMALL)
    ids, mask = batch(SMALL.vocab_size)
    alone = model(ids[:1, 4:], mask[:1, 4:])
    padded = model(ids[:1], mask[:1])[:, 4:]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)


def test_pipeline_pieces_compose_to_the_whole_model() -> None:
    whole = build_decoder(SMALL, seed=4)
    first = build_decoder(SMALL, layers=range(0, 2), seed=4)
    last = build_decoder(SMALL, layers=range(2, 3), seed=4)
    ids, mask = batch(SMALL.vocab_size)
    assert torch.equal(last(first(ids, mask), mask), whole(ids, mask))
    assert first.tensor_names()[0] == "model.embed_tokens.weight"
    assert last.tensor_names()[0] == "model.layers.2.input_layernorm.weight"


def test_tied_head_across_pipeline_stages_is_rejected() -> None:
    with pytest.raises(SpecError, match="tie_word_embeddings"):
        build_decoder(QWEN_LIKE, layers=range(1, 2))


def test_safetensors_round_trip(tmp_path: Path) -> None:
    model = build_decoder(QWEN_LIKE, seed=2)
    path = str(tmp_path / "model.safetensors")
    save_safetensors(model, path)
    names = [t.name for t in QWEN_LIKE.tensors()]
    loaded = build_decoder(QWEN_LIKE, weights=load_safetensors([path], names), seed=99)
    ids, mask = batch(QWEN_LIKE.vocab_size)
    assert torch.equal(loaded(ids, mask), model(ids, mask))
    # a critic from an LM checkpoint: the trunk loads, the value head starts fresh
    critic = build_decoder(QWEN_LIKE, Head.VALUE, weights=load_safetensors([path], names))
    assert torch.equal(critic.model.layers["0"].mlp.up_proj.weight, model.model.layers["0"].mlp.up_proj.weight)
    with pytest.raises(SpecError, match="lacks"):
        build_decoder(QWEN_LIKE, weights={})
