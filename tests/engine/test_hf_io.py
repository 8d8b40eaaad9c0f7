"""HF model directories: the engine's actor saved as one that transformers loads (same logits, and
generate works), a directory saved by transformers loaded into the engine (same logits), atomic
export, and refusals of what the engine's decoder cannot express."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from agent.engine.hf_io import read_hf_dir, save_hf_dir, spec_from_hf_config
from agent.engine.model import build_decoder, inv_freq, load_safetensors
from planner.errors import SpecError
from planner.models import ModelSpec, RopeScaling

transformers = pytest.importorskip("transformers")

LLAMA = ModelSpec(name="t-llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                  ffn_hidden_size=96, vocab_size=300, rope_theta=10_000.0, rms_norm_eps=1e-6)
QWEN3_TIED = ModelSpec(name="t-qwen3", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=1,
                       head_dim=32, ffn_hidden_size=96, vocab_size=300, tie_word_embeddings=True, qk_norm=True,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6)
QWEN2 = ModelSpec(name="t-qwen2", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                  ffn_hidden_size=96, vocab_size=300, qkv_bias=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6)


def _ids(vocab: int, b: int = 3, t: int = 11) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(7))


def _engine_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, torch.ones_like(ids))


def _greedy(model: torch.nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        nxt = _engine_logits(model, ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def _trained_like(spec: ModelSpec) -> torch.nn.Module:
    """Random weights with norms away from 1, so a misplaced norm or a dropped tensor shows."""
    model = build_decoder(spec, seed=3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.mul_(5.0)  # INIT_STD 0.02 -> 0.1: logits that differ between tokens
    return model


@pytest.mark.parametrize("spec", [LLAMA, QWEN3_TIED, QWEN2], ids=["llama", "qwen3-tied", "qwen2-bias"])
def test_actor_saved_as_hf_dir_loads_and_generates_in_transformers(tmp_path: Path, spec: ModelSpec) -> None:
    model = _trained_like(spec)
    out = save_hf_dir(tmp_path / "actor", spec, model.state_dict(), token_ids={"eos_token_id": 2})
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == ("Qwen3ForCausalLM" if spec.qk_norm else "Qwen2ForCausalLM" if spec.qkv_bias
                                 else "LlamaForCausalLM")
    if spec.qkv_bias:  # the biases travelled: transformers holds ours, not its zeros
        ours_b = model.state_dict()["model.layers.1.self_attn.k_proj.bias"]
        assert ours_b.abs().max() > 0 and torch.equal(hf.model.layers[1].self_attn.k_proj.bias, ours_b)
    ids = _ids(spec.vocab_size)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    ours = _engine_logits(model, ids)
    assert theirs.std() > 0.1  # not a degenerate comparison
    assert (theirs - ours).abs().max().item() < 1e-4
    with torch.no_grad():
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert torch.equal(gen, _greedy(model, ids, 6))


@pytest.mark.parametrize("kind", ["llama", "qwen3-tied", "qwen2"])
def test_dir_saved_by_transformers_loads_into_engine(tmp_path: Path, kind: str) -> None:
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=300, rms_norm_eps=1e-6)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=50_000.0)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**{k: v for k, v in common.items() if k != "head_dim"}, tie_word_embeddings=False)
    else:
        cfg = transformers.Qwen3Config(**common, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith(".bias"):  # transformers starts them at 0: a dropped bias would not show
                p.uniform_(-0.5, 0.5)
    hf.save_pretrained(tmp_path / "hf")
    loaded = read_hf_dir(tmp_path / "hf")
    spec = loaded.spec
    assert (spec.qk_norm, spec.qkv_bias, spec.tie_word_embeddings) == {
        "llama": (False, False, False), "qwen2": (False, True, False), "qwen3-tied": (True, False, True)}[kind]
    assert spec.num_kv_heads == 2 and spec.head_dim == 16
    model = build_decoder(spec, weights=load_safetensors(loaded.weight_files, [t.name for t in spec.tensors()]))
    ids = _ids(spec.vocab_size)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    assert (theirs - _engine_logits(model, ids)).abs().max().item() < 1e-4


def test_export_replaces_atomically_and_a_failed_write_leaves_the_old_one(tmp_path: Path, monkeypatch) -> None:
    spec = LLAMA
    first = build_decoder(spec, seed=1).state_dict()
    second = build_decoder(spec, seed=2).state_dict()
    tok = tmp_path / "src"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    out = save_hf_dir(tmp_path / "actor", spec, first, tokenizer_from=tok)
    assert (out / "tokenizer.json").exists()
    save_hf_dir(out, spec, second)
    got = load_safetensors(read_hf_dir(out).weight_files, ["lm_head.weight"])
    assert torch.equal(got["lm_head.weight"], second["lm_head.weight"])

    import safetensors.torch

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_hf_dir(out, spec, first)
    got = load_safetensors(read_hf_dir(out).weight_files, ["lm_head.weight"])
    assert torch.equal(got["lm_head.weight"], second["lm_head.weight"])  # the old export, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor", "src"]  # no temporary left behind


def test_what_the_decoder_cannot_express_is_refused_by_name(tmp_path: Path) -> None:
    base = json.loads(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300}))
    assert spec_from_hf_config(base, "x").num_kv_heads == 4  # MHA default, head_dim from hidden / heads
    with pytest.raises(SpecError, match="model_type.*'mistral'.*llama, qwen2, qwen3"):
        spec_from_hf_config({**base, "model_type": "mistral"}, "x")
    with pytest.raises(SpecError, match="attention_bias"):
        spec_from_hf_config({**base, "attention_bias": True}, "x")
    with pytest.raises(SpecError, match=r"rope_scaling\.rope_type: rope type 'yarn' is not supported "
                                        r"\(allowed: default, llama3\)"):
        spec_from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "x")
    with pytest.raises(SpecError, match=r"rope_parameters\.rope_type: rope type 'linear'"):
        spec_from_hf_config({**base, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
                            "x")
    with pytest.raises(SpecError, match="intermediate_size.*missing"):
        spec_from_hf_config({k: v for k, v in base.items() if k != "intermediate_size"}, "x")
    with pytest.raises(SpecError, match="no config.json"):
        read_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(base))
    with pytest.raises(SpecError, match="no \\*.safetensors"):
        read_hf_dir(tmp_path)


def test_a_sequence_classification_reward_model_loads_with_its_score_head(tmp_path: Path) -> None:
    """A learned reward model (reward-inf) from a HF *ForSequenceClassification directory: the engine's
    value at the last token is transformers' reward."""
    from planner.models import Head

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=300, num_labels=1, pad_token_id=0)
    torch.manual_seed(1)
    hf = transformers.LlamaForSequenceClassification(cfg).eval()
    hf.save_pretrained(tmp_path / "rm")
    loaded = read_hf_dir(tmp_path / "rm")
    names = [t.name for t in loaded.spec.tensors(Head.VALUE)]
    assert "score.weight" in names
    model = build_decoder(loaded.spec, Head.VALUE, weights=load_safetensors(loaded.weight_files, names))
    ids = _ids(300).clamp(min=1)  # no pad token inside: transformers scores the last token
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits[:, 0]
        ours = model(ids, torch.ones_like(ids))[:, -1]
    assert theirs.abs().max() > 1e-3 and (theirs - ours).abs().max().item() < 1e-4


# --- Llama 3.1's rope scaling (rope_type llama3) ----------------------------------------------------
# original context 32 tokens, stretched 8x: wavelengths above 32 are divided by 8, those between
# 32 / 4 = 8 and 32 interpolated; the sequences below run past 32 positions
ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
LLAMA31 = dataclasses.replace(LLAMA, name="t-llama31", rope_theta=500_000.0, rope_scaling=ROPE)


def test_llama3_rope_scaling_changes_the_frequencies() -> None:
    scaled, plain = inv_freq(LLAMA31), inv_freq(dataclasses.replace(LLAMA31, rope_scaling=None))
    changed = (scaled != plain).sum().item()
    assert 0 < changed < len(plain)  # low frequencies changed, the highest kept
    assert scaled[0] == plain[0] and torch.allclose(scaled[-1], plain[-1] / ROPE.factor)


def test_llama31_dir_saved_by_transformers_loads_into_engine(tmp_path: Path) -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=300, rms_norm_eps=1e-6,
                                   max_position_embeddings=256,
                                   rope_parameters={**rope, "rope_theta": 500_000.0})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(5.0)  # logits that differ between tokens, and between rope variants
    hf.save_pretrained(tmp_path / "hf")
    loaded = read_hf_dir(tmp_path / "hf")
    assert loaded.spec.rope_scaling == ROPE and loaded.spec.rope_theta == 500_000.0
    assert torch.equal(inv_freq(loaded.spec), hf.model.rotary_emb.inv_freq)  # bit for bit
    names = [t.name for t in loaded.spec.tensors()]
    model = build_decoder(loaded.spec, weights=load_safetensors(loaded.weight_files, names))
    plain = build_decoder(dataclasses.replace(loaded.spec, rope_scaling=None),
                          weights=load_safetensors(loaded.weight_files, names))
    ids = _ids(300, b=2, t=80)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    assert (theirs - _engine_logits(model, ids)).abs().max().item() < 1e-4
    assert (theirs - _engine_logits(plain, ids)).abs().max().item() > 1e-2  # unscaled rope would not pass


def test_llama31_actor_exported_loads_in_transformers_with_its_rope_scaling(tmp_path: Path) -> None:
    model = _trained_like(LLAMA31)
    out = save_hf_dir(tmp_path / "actor", LLAMA31, model.state_dict())
    assert read_hf_dir(out).spec == dataclasses.replace(LLAMA31, name="actor", bytes_per_param=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3" and hf.config.max_position_embeddings == 256
    assert torch.equal(inv_freq(LLAMA31), hf.model.rotary_emb.inv_freq)
    ids = _ids(LLAMA31.vocab_size, b=2, t=80)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    assert theirs.std() > 0.1 and (theirs - _engine_logits(model, ids)).abs().max().item() < 1e-4


@pytest.mark.parametrize(("scaling", "match"), [
    ({"rope_type": "dynamic", "factor": 2.0}, r"rope_scaling\.rope_type: rope type 'dynamic' is not supported"),
    ({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     r"rope_scaling\.original_max_position_embeddings: is missing"),
    ({"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
     r"rope_scaling\.factor: is missing"),
    ({**ROPE.to_dict(), "high_freq_factor": 1.0}, r"high_freq_factor: must be greater than low_freq_factor=1\.0"),
    ({**ROPE.to_dict(), "factor": 0.5}, r"^x\.rope_scaling\.factor: must be >= 1"),
    ({**ROPE.to_dict(), "factor": "8"}, r"factor: must be a finite number"),
    ({**ROPE.to_dict(), "beta_fast": 32}, r"rope_scaling\.beta_fast: is not a parameter of rope type 'llama3'"),
])
def test_a_bad_rope_scaling_is_one_clear_error(scaling: dict, match: str) -> None:
    base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 300}  # no max_position_embeddings to fall back on
    with pytest.raises(SpecError, match=match):
        spec_from_hf_config({**base, "rope_scaling": scaling}, "x", where="x")


def test_a_rope_scaling_on_model_spec_is_validated() -> None:
    with pytest.raises(SpecError, match=r"model\.rope_scaling\.rope_type: 'yarn' is not supported \(allowed: llama3\)"):
        RopeScaling(rope_type="yarn", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=4096)
    with pytest.raises(SpecError, match=r"model\.rope_scaling: must be a RopeScaling"):
        dataclasses.replace(LLAMA, rope_scaling=ROPE.to_dict())  # type: ignore[arg-type]
