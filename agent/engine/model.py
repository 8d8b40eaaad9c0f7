"""A Llama-style decoder built from ``planner.models.ModelSpec``, with parameter names exactly as
``ModelSpec.tensors()`` (Hugging Face layout), so safetensors checkpoints load by name.

RMSNorm, RoPE (HF rotate-half; Llama 3.1's ``llama3`` rope scaling), grouped-query attention, SwiGLU, tied or untied LM head, or a value
head (``score.weight``) for critics and reward models. One class also builds a pipeline stage: it
holds only the layers in ``layers`` plus the embedding (first stage) and norm + head (last stage), and
keeps the global layer index in parameter names. Attention reshapes with ``view(B, T, -1, head_dim)``
so the same code runs on tensor-parallel shards (each rank holds its share of heads).

Run: ``python -c "from agent.engine.model import *; print(Decoder(TINY_3M))"``
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from planner.errors import SpecError
from planner.models import Head, ModelSpec, Parallel

INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class KVCache:
    """Preallocated keys/values per layer, ``[B, local kv heads, max_tokens, head_dim]``.

    ``length`` counts filled positions; the owning ``Decoder`` advances it after each forward, so
    every pipeline stage keeps its own cache for its own layers.
    """

    def __init__(self, batch: int, max_tokens: int) -> None:
        self.batch = batch
        self.max_tokens = max_tokens
        self.length = 0
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, t, d = k.shape
        if layer not in self.k:
            self.k[layer] = k.new_zeros(b, h, self.max_tokens, d)
            self.v[layer] = v.new_zeros(b, h, self.max_tokens, d)
        end = self.length + t
        if end > self.max_tokens:
            raise ValueError(f"KV cache full: {end} tokens > max_tokens={self.max_tokens}")
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def inv_freq(spec: ModelSpec, device: torch.device | None = None) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim / 2]``, float32, with ``spec.rope_scaling`` applied as
    transformers does (``_compute_llama3_parameters``: same operations in the same order)."""
    half = spec.head_dim // 2
    inv = 1.0 / (spec.rope_theta ** (torch.arange(half, dtype=torch.float32, device=device) / half))
    rs = spec.rope_scaling
    if rs is None:
        return inv
    old_context = rs.original_max_position_embeddings
    low_freq_wavelen = old_context / rs.low_freq_factor
    high_freq_wavelen = old_context / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_freq_wavelen, inv / rs.factor, inv)  # long wavelengths: / factor
    smooth = (old_context / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(spec: ModelSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for positions ``[B, T]`` -> ``[B, 1, T, head_dim]`` (HF non-interleaved layout)."""
    ang = positions.float()[..., None] * inv_freq(spec, positions.device)  # [B, T, half]
    emb = torch.cat([ang, ang], dim=-1)[:, None]
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.spec, self.layer = spec, layer
        h, hd = spec.hidden_size, spec.head_dim
        self.q_proj = nn.Linear(h, spec.num_attention_heads * hd, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * hd, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * hd, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.num_attention_heads * hd, h, bias=False)
        if spec.qk_norm:
            self.q_norm = RMSNorm(hd, spec.rms_norm_eps)
            self.k_norm = RMSNorm(hd, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.spec.head_dim
        # -1: under tensor parallelism each rank holds only its share of the heads
        q = self.q_proj(x).view(b, t, -1, hd)
        k = self.k_proj(x).view(b, t, -1, hd)
        v = self.v_proj(x).view(b, t, -1, hd)
        if self.spec.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(spec.ffn_hidden_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Trunk(nn.Module):
    """Holds ``embed_tokens``, ``layers`` and ``norm`` so names read ``model.<...>`` as in HF."""

    def __init__(self, spec: ModelSpec, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        if first:
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        # a dict keyed by the global index keeps HF names on every pipeline stage
        self.layers = nn.ModuleDict({str(i): DecoderLayer(spec, i) for i in layers})
        if last:
            self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


def attention_mask_4d(attention_mask: torch.Tensor, num_queries: int) -> torch.Tensor:
    """Boolean ``[B, 1, Tq, Tk]``: causal over the last ``num_queries`` keys, pads masked out.

    Every query may attend to itself, so rows of left padding stay finite (they are never scored).
    """
    tk, dev = attention_mask.shape[1], attention_mask.device
    q_pos = torch.arange(tk - num_queries, tk, device=dev)[:, None]
    k_pos = torch.arange(tk, device=dev)[None, :]
    allowed = (k_pos <= q_pos)[None] & attention_mask.bool()[:, None, :]
    allowed = allowed | (k_pos == q_pos)[None]
    return allowed[:, None]


def positions_of(attention_mask: torch.Tensor, num_queries: int) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -num_queries:]


class Decoder(nn.Module):
    """The whole decoder, or one pipeline stage of it (``layers`` a sub-range)."""

    def __init__(self, spec: ModelSpec, head: Head = Head.LM, layers: range | None = None) -> None:
        super().__init__()
        layers = range(spec.num_layers) if layers is None else layers
        if layers.step != 1 or layers.start < 0 or layers.stop > spec.num_layers or not len(layers):
            raise SpecError("layers", f"{layers} is not a non-empty range inside 0..{spec.num_layers}")
        self.spec, self.head, self.layer_range = spec, head, layers
        self.is_first, self.is_last = layers.start == 0, layers.stop == spec.num_layers
        self.model = _Trunk(spec, layers, self.is_first, self.is_last)
        self.lm_head: nn.Linear | None = None
        self.score: nn.Linear | None = None
        if self.is_last:
            if head is Head.LM:
                if spec.tie_word_embeddings and not self.is_first:
                    raise SpecError("tie_word_embeddings", "a tied head needs embedding and head on one "
                                    "pipeline stage; use pp=1 or an untied model")
                self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
                if spec.tie_word_embeddings:
                    self.lm_head.weight = self.model.embed_tokens.weight
            else:
                self.score = nn.Linear(spec.hidden_size, 1, bias=False)
        self.cache: KVCache | None = None

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``x``: token ids ``[B, T]`` (first stage) or hidden states ``[B, T, H]``.

        ``attention_mask`` ``[B, Tk]`` covers cached and current tokens (1 = real, 0 = pad). Returns
        hidden states (inner stage), logits ``[B, T, V]`` (LM head) or values ``[B, T]`` (value head).
        """
        h = self.model.embed_tokens(x) if self.is_first else x
        t = h.shape[1]
        cos, sin = rope_tables(self.spec, positions_of(attention_mask, t))
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        mask = attention_mask_4d(attention_mask, t)
        for layer in self.model.layers.values():
            h = layer(h, cos, sin, mask, self.cache)
        if self.cache is not None:
            self.cache.length += t
        if not self.is_last:
            return h
        h = self.model.norm(h)
        if self.lm_head is not None:
            return self.lm_head(h)
        assert self.score is not None
        return self.score(h).squeeze(-1)

    # --- weights -------------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        """Names this (stage) module holds, in ``ModelSpec.tensors()`` order."""
        mine = set(dict(self.named_parameters()))
        return [t.name for t in self.spec.tensors(self.head) if t.name in mine]


def init_tensor(spec: ModelSpec, name: str, shape: tuple[int, ...], parallel: Parallel, seed: int) -> torch.Tensor:
    """Deterministic per-tensor init, independent of which stage or rank builds it."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g) * INIT_STD


def build_decoder(spec: ModelSpec, head: Head = Head.LM, layers: range | None = None, *, seed: int = 0,
                  weights: Mapping[str, torch.Tensor] | None = None,
                  dtype: torch.dtype = torch.float32) -> Decoder:
    """A decoder (stage) with deterministic random weights, or ``weights`` (full tensors by HF name)."""
    model = Decoder(spec, head, layers)
    specs = {t.name: t for t in spec.tensors(head)}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            ts = specs[name]
            src = weights.get(name) if weights is not None else None
            # a fresh value head on a pretrained trunk (critic from an LM checkpoint) is random by intent
            if src is None and weights is not None and name != "score.weight":
                raise SpecError("weights", f"checkpoint lacks {name}")
            if src is not None and tuple(src.shape) != ts.shape:
                raise SpecError("weights", f"{name} has shape {tuple(src.shape)}, model expects {ts.shape}")
            p.copy_(src if src is not None else init_tensor(spec, name, ts.shape, ts.parallel, seed))
    return model.to(dtype)


def load_safetensors(paths: Iterable[str], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read only ``names`` from HF-layout safetensors files (shards may split the tensors)."""
    from safetensors import safe_open

    wanted, out = set(names), {}
    for path in paths:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if key in wanted:
                    out[key] = f.get_tensor(key)
    return out


def save_safetensors(model: Decoder, path: str) -> None:
    """Write the (full, single-process) model in HF layout; a tied head is stored once."""
    from safetensors.torch import save_file

    state = model.state_dict()
    save_file({n: state[n].detach().contiguous() for n in model.tensor_names()}, path)
