"""Model architectures (Llama-style decoders) and their tensor inventory.

Each tensor carries the rule that says how tensor parallelism splits it; the EMU geometry
(transitions/) and the RL engine (agent/) both derive their shards from these rules, so what the
planner counts, what transitions move and what the engine holds are one thing. Names follow the
Hugging Face layout so safetensors checkpoints load by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from planner.errors import SpecError, unknown_preset


class Parallel(str, Enum):
    """How tensor parallelism splits a tensor (weights are [out_features, in_features])."""

    COLUMN = "column"  # dim 0 split: q/k/v/gate/up projections, lm_head (over the vocabulary)
    ROW = "row"  # dim 1 split: o_proj, down_proj
    VOCAB = "vocab"  # dim 0 split of the embedding table (vocabulary-parallel)
    REPLICATED = "replicated"  # norms, scalar/value heads


class Head(str, Enum):
    """What sits on top of the decoder: the LM head (actor, reference) or a scalar head."""

    LM = "lm"
    VALUE = "value"  # critic value head and reward-model score head: one output per token


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    parallel: Parallel
    layer: int | None  # decoder layer index; None for embedding, final norm and heads
    # for GQA-aware splits of k/v: the number of heads along dim 0 (None = not head-structured)
    num_heads: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


ROPE_TYPES = ("llama3",)  # rope scalings the engine's rotary embedding applies


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeScaling:
    """Llama 3.1's rope scaling (HF ``rope_type: llama3``): inverse frequencies whose wavelength is
    longer than ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those
    shorter than ``original_max_position_embeddings / high_freq_factor`` kept, those between smoothly
    interpolated. Only the rotary embedding changes; parameter counts and memory do not."""

    rope_type: str = "llama3"
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        _check_rope_scaling(self.rope_type, self.factor, self.low_freq_factor, self.high_freq_factor,
                            self.original_max_position_embeddings, "model.rope_scaling")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any], where: str = "model.rope_scaling") -> RopeScaling:
        """From a HF-style dict (``rope_type`` or the older ``type``); a missing or unknown key is refused."""
        rope_type = d.get("rope_type", d.get("type"))
        if rope_type not in ROPE_TYPES:
            raise SpecError(f"{where}.rope_type", f"{rope_type!r} is not supported", ", ".join(ROPE_TYPES))
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if d.get(k) is None]
        if missing:
            raise SpecError(f"{where}.{missing[0]}", f"is missing (rope type {rope_type!r} needs {', '.join(keys)})")
        unknown = sorted(set(d) - {"rope_type", "type", *keys})
        if unknown:
            raise SpecError(f"{where}.{unknown[0]}", f"is not a parameter of rope type {rope_type!r}",
                            ", ".join(keys))
        omax = d["original_max_position_embeddings"]
        if isinstance(omax, float) and omax.is_integer():
            omax = int(omax)  # 8192.0 from a JSON writer that does not keep ints
        _check_rope_scaling(rope_type, d["factor"], d["low_freq_factor"], d["high_freq_factor"], omax, where)
        return cls(rope_type=rope_type, factor=d["factor"], low_freq_factor=d["low_freq_factor"],
                   high_freq_factor=d["high_freq_factor"], original_max_position_embeddings=omax)

    def to_dict(self) -> dict[str, Any]:
        """The HF spelling (``rope_scaling`` of transformers 4, the extra keys of 5's ``rope_parameters``)."""
        return {"rope_type": self.rope_type, "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


def _check_rope_scaling(rope_type: Any, factor: Any, low: Any, high: Any, omax: Any, where: str) -> None:
    if rope_type not in ROPE_TYPES:
        raise SpecError(f"{where}.rope_type", f"{rope_type!r} is not supported", ", ".join(ROPE_TYPES))
    for key, v in (("factor", factor), ("low_freq_factor", low), ("high_freq_factor", high)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise SpecError(f"{where}.{key}", f"must be a finite number, got {v!r}")
    if factor < 1:
        raise SpecError(f"{where}.factor", f"must be >= 1, got {factor}")
    if low <= 0:
        raise SpecError(f"{where}.low_freq_factor", f"must be > 0, got {low}")
    if high <= low:
        raise SpecError(f"{where}.high_freq_factor", f"must be greater than low_freq_factor={low}, got {high}")
    if isinstance(omax, bool) or not isinstance(omax, int) or omax < 1:
        raise SpecError(f"{where}.original_max_position_embeddings", f"must be an integer >= 1, got {omax!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3 normalises q and k per head
    qkv_bias: bool = False  # Qwen2 / Qwen2.5: the q, k and v projections carry biases (o_proj and the MLP do not)
    rope_theta: float = 500_000.0
    rope_scaling: RopeScaling | None = None  # None = plain RoPE; Llama 3.1/3.3 use RopeScaling (llama3)
    rms_norm_eps: float = 1e-5
    bytes_per_param: int = 2  # bf16 weights
    # gradient buffer of a training replica: 2 = bf16 (16 B/param with Adam); 4 = fp32 main grads as
    # Megatron-LM's DDP keeps them by default (accumulate_allreduce_grads_in_fp32): 18 B/param
    grad_bytes_per_param: int = 2

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
                      "ffn_hidden_size", "vocab_size"):
            if getattr(self, field) < 1:
                raise SpecError(f"model.{field}", f"must be >= 1, got {getattr(self, field)}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise SpecError("model.rope_scaling", f"must be a RopeScaling or None, got {type(self.rope_scaling).__name__}")
        if self.qk_norm and self.qkv_bias:
            raise SpecError("model.qkv_bias", "q/k norms (Qwen3) and q/k/v biases (Qwen2) together are no published "
                            "architecture")
        if self.grad_bytes_per_param not in (2, 4):
            raise SpecError("model.grad_bytes_per_param", f"must be 2 (bf16) or 4 (fp32), got {self.grad_bytes_per_param}")
        if self.num_attention_heads % self.num_kv_heads:
            raise SpecError(
                "model.num_kv_heads",
                f"{self.num_kv_heads} does not divide num_attention_heads={self.num_attention_heads}",
            )

    # --- tensor inventory ---------------------------------------------------------------------------
    def tensors(self, head: Head = Head.LM) -> tuple[TensorSpec, ...]:
        """Every parameter tensor, in order (embedding, layers, final norm, head)."""
        h, hd = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_attention_heads * hd, self.num_kv_heads * hd
        out: list[TensorSpec] = [
            TensorSpec("model.embed_tokens.weight", (self.vocab_size, h), Parallel.VOCAB, None)
        ]
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            out += [
                TensorSpec(p + "input_layernorm.weight", (h,), Parallel.REPLICATED, i),
            ]
            for proj, rows, heads in (("q_proj", q_out, self.num_attention_heads), ("k_proj", kv_out, self.num_kv_heads),
                                      ("v_proj", kv_out, self.num_kv_heads)):
                out.append(TensorSpec(p + f"self_attn.{proj}.weight", (rows, h), Parallel.COLUMN, i, heads))
                if self.qkv_bias:  # split over TP with its projection's output rows
                    out.append(TensorSpec(p + f"self_attn.{proj}.bias", (rows,), Parallel.COLUMN, i, heads))
            out.append(TensorSpec(p + "self_attn.o_proj.weight", (h, q_out), Parallel.ROW, i, self.num_attention_heads))
            if self.qk_norm:
                out += [
                    TensorSpec(p + "self_attn.q_norm.weight", (hd,), Parallel.REPLICATED, i),
                    TensorSpec(p + "self_attn.k_norm.weight", (hd,), Parallel.REPLICATED, i),
                ]
            out += [
                TensorSpec(p + "post_attention_layernorm.weight", (h,), Parallel.REPLICATED, i),
                TensorSpec(p + "mlp.gate_proj.weight", (self.ffn_hidden_size, h), Parallel.COLUMN, i),
                TensorSpec(p + "mlp.up_proj.weight", (self.ffn_hidden_size, h), Parallel.COLUMN, i),
                TensorSpec(p + "mlp.down_proj.weight", (h, self.ffn_hidden_size), Parallel.ROW, i),
            ]
        out.append(TensorSpec("model.norm.weight", (h,), Parallel.REPLICATED, None))
        if head is Head.LM:
            if not self.tie_word_embeddings:
                out.append(TensorSpec("lm_head.weight", (self.vocab_size, h), Parallel.COLUMN, None))
        else:
            out.append(TensorSpec("score.weight", (1, h), Parallel.REPLICATED, None))
        return tuple(out)

    def num_params(self, head: Head = Head.LM) -> int:
        return sum(t.numel for t in self.tensors(head))

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token, whole model, bf16: 2 (k and v) * L * kv_heads * head_dim * 2."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param

    # --- layout validation -------------------------------------------------------------------------
    def check_tp(self, tp: int) -> None:
        """TP must divide the attention heads; k/v heads are split when tp <= kv heads and
        replicated in groups (GQA) when kv heads divide tp."""
        if tp < 1 or self.num_attention_heads % tp:
            raise SpecError("tp", f"{tp} does not divide num_attention_heads={self.num_attention_heads}",
                            _divisors_text(self.num_attention_heads))
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise SpecError("tp", f"{tp} and num_kv_heads={self.num_kv_heads} do not divide one another")
        if self.ffn_hidden_size % tp:
            raise SpecError("tp", f"{tp} does not divide ffn_hidden_size={self.ffn_hidden_size}")

    def check_pp(self, pp: int) -> None:
        if pp < 1 or pp > self.num_layers:
            raise SpecError("pp", f"{pp} must be between 1 and num_layers={self.num_layers}")

    def valid_tp(self, tp: int) -> bool:
        try:
            self.check_tp(tp)
        except SpecError:
            return False
        return True


def _divisors_text(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


# --- presets: architecture from each model's published config.json --------------------------------
# Llama 3.1 and 3.3 (config.json "rope_scaling"): 8k pretraining context stretched to 128k
LLAMA3_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
LLAMA_31_8B = ModelSpec(name="llama-3.1-8b", num_layers=32, hidden_size=4096, num_attention_heads=32,
                        num_kv_heads=8, head_dim=128, ffn_hidden_size=14336, vocab_size=128256,
                        rope_scaling=LLAMA3_ROPE)
QWEN3_14B = ModelSpec(name="qwen3-14b", num_layers=40, hidden_size=5120, num_attention_heads=40,
                      num_kv_heads=8, head_dim=128, ffn_hidden_size=17408, vocab_size=151936,
                      qk_norm=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
QWEN3_32B = ModelSpec(name="qwen3-32b", num_layers=64, hidden_size=5120, num_attention_heads=64,
                      num_kv_heads=8, head_dim=128, ffn_hidden_size=25600, vocab_size=151936,
                      qk_norm=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
LLAMA_33_70B = ModelSpec(name="llama-3.3-70b", num_layers=80, hidden_size=8192, num_attention_heads=64,
                         num_kv_heads=8, head_dim=128, ffn_hidden_size=28672, vocab_size=128256,
                         rope_scaling=LLAMA3_ROPE)
# Qwen2.5 (config.json: q/k/v biases, no q/k norms)
QWEN25_7B = ModelSpec(name="qwen2.5-7b", num_layers=28, hidden_size=3584, num_attention_heads=28,
                      num_kv_heads=4, head_dim=128, ffn_hidden_size=18944, vocab_size=152064,
                      qkv_bias=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
QWEN25_32B = ModelSpec(name="qwen2.5-32b", num_layers=64, hidden_size=5120, num_attention_heads=40,
                       num_kv_heads=8, head_dim=128, ffn_hidden_size=27648, vocab_size=152064,
                       qkv_bias=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
# Tiny real architectures for CPU runs (randomly initialised; no weights can be downloaded here).
TINY_3M = ModelSpec(name="tiny-3m", num_layers=4, hidden_size=256, num_attention_heads=8, num_kv_heads=4,
                    head_dim=32, ffn_hidden_size=688, vocab_size=512, tie_word_embeddings=False,
                    rope_theta=10_000.0)
TINY_25M = ModelSpec(name="tiny-25m", num_layers=8, hidden_size=512, num_attention_heads=8, num_kv_heads=4,
                     head_dim=64, ffn_hidden_size=1536, vocab_size=2048, rope_theta=10_000.0)
# The RL engine's CPU learning model (agent.engine.loop's default), with a byte-level vocabulary
# (259 ids, padded to 264 so that it splits over TP = 2 and 4): a preset, so that the daemon plans
# the very model the engine runs.
TINY_BYTE = ModelSpec(name="tiny-byte", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                      head_dim=16, ffn_hidden_size=128, vocab_size=264, rope_theta=10_000.0)

MODELS: dict[str, ModelSpec] = {m.name: m for m in (LLAMA_31_8B, QWEN3_14B, QWEN3_32B, LLAMA_33_70B, QWEN25_7B,
                                                   QWEN25_32B, TINY_3M, TINY_25M, TINY_BYTE)}
# Published parameter counts (model cards), for the 1% check in the tests.
PUBLISHED_PARAMS: dict[str, float] = {
    "llama-3.1-8b": 8.03e9,
    "qwen3-14b": 14.8e9,
    "qwen3-32b": 32.8e9,
    "llama-3.3-70b": 70.6e9,
    "qwen2.5-7b": 7.61e9,
    "qwen2.5-32b": 32.5e9,
}


def model_preset(name: str) -> ModelSpec:
    key = name.lower()
    if key not in MODELS:
        raise unknown_preset("model", name, list(MODELS))
    return MODELS[key]
