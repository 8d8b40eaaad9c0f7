"""Hugging Face ``config.json`` <-> ``ModelSpec``: pure (dicts in, dicts out; no torch, no files), so the
daemon can plan a job whose model is a HF directory and the engine builds the same architecture.

``spec_from_hf_config`` maps a Llama, Qwen2/Qwen2.5 or Qwen3 config (transformers 4 and 5 spellings)
onto a ``ModelSpec``; what the engine's decoder cannot express is refused by name, never approximated.
``hf_config`` writes one back. ``model_to_mapping`` / ``model_from_mapping`` carry a ``ModelSpec`` in a
job spec (JSON), checked field by field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from planner.errors import SpecError
from planner.models import ROPE_TYPES, ModelSpec, RopeScaling

# model_type -> architecture class written on save; all are the engine's decoder (Qwen2 adds q/k/v biases,
# Qwen3 q/k norms)
SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _field(cfg: Mapping[str, Any], where: str, key: str, default: Any = None) -> Any:
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is None:
        raise SpecError(f"{where}.{key}", "is missing")
    return default


def spec_from_hf_config(cfg: Mapping[str, Any], name: str, where: str = "config.json") -> ModelSpec:
    """The engine's ``ModelSpec`` for a HF ``config.json`` (transformers 4 and 5 spellings)."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED:
        raise SpecError(f"{where}.model_type", f"{model_type!r} is not a decoder the engine builds",
                        ", ".join(SUPPORTED))
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise SpecError(f"{where}.{key}", "biases are not part of the engine's decoder")
    if cfg.get("hidden_act", "silu") != "silu":
        raise SpecError(f"{where}.hidden_act", f"{cfg['hidden_act']!r} is not supported", "silu")
    if cfg.get("use_sliding_window"):
        raise SpecError(f"{where}.use_sliding_window", "sliding-window attention is not supported")
    rope_scaling = _rope_scaling(cfg, where)  # first: it refuses a rope_parameters that is not an object
    rope = dict(cfg.get("rope_parameters") or {})
    heads = int(_field(cfg, where, "num_attention_heads"))
    hidden = int(_field(cfg, where, "hidden_size"))
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    return ModelSpec(
        name=name,
        num_layers=int(_field(cfg, where, "num_hidden_layers")),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(_field(cfg, where, "intermediate_size")),
        vocab_size=int(_field(cfg, where, "vocab_size")),
        # both LlamaConfig and Qwen3Config default to untied heads
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        qkv_bias=model_type == "qwen2",
        rope_theta=float(rope.get("rope_theta") or cfg.get("rope_theta") or 10_000.0),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        bytes_per_param=4 if dtype == "float32" else 2,
    )


def _rope_scaling(cfg: Mapping[str, Any], where: str) -> RopeScaling | None:
    """The rope scaling of a config: transformers 5 keeps it in ``rope_parameters`` (with
    ``rope_theta``), 4 in ``rope_scaling`` (``rope_type``, or ``type`` in older files)."""
    for key in ("rope_parameters", "rope_scaling"):
        d = cfg.get(key)
        if d is not None and not isinstance(d, Mapping):
            raise SpecError(f"{where}.{key}", f"must be an object, got {d!r}")
        d = dict(d or {})
        if float(d.pop("partial_rotary_factor", 1.0) or 1.0) != 1.0:
            raise SpecError(f"{where}.{key}.partial_rotary_factor", "partial rotary embeddings are not supported", "1.0")
        d.pop("rope_theta", None)
        rope_type = d.get("rope_type", d.get("type")) or "default"
        if rope_type == "default":
            continue
        if rope_type not in ROPE_TYPES:
            raise SpecError(f"{where}.{key}.rope_type", f"rope type {rope_type!r} is not supported",
                            ", ".join(("default", *ROPE_TYPES)))
        # as transformers: a top-level original_max_position_embeddings wins, max_position_embeddings is the fallback
        omax = next((v for v in (cfg.get("original_max_position_embeddings"), d.get("original_max_position_embeddings"),
                                 cfg.get("max_position_embeddings")) if v is not None), None)
        return RopeScaling.from_mapping({**d, "original_max_position_embeddings": omax}, where=f"{where}.{key}")
    return None


def hf_config(spec: ModelSpec, *, dtype: str = "float32", max_position_embeddings: int | None = None,
              token_ids: Mapping[str, int | None] | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``spec``, readable by transformers 4 (``rope_theta``, ``rope_scaling``,
    ``torch_dtype``) and 5 (``rope_parameters``, ``dtype``). ``max_position_embeddings`` defaults to
    4096, or to the stretched context ``factor * original_max_position_embeddings`` of a scaled rope."""
    model_type = "qwen3" if spec.qk_norm else "qwen2" if spec.qkv_bias else "llama"
    rs = spec.rope_scaling
    if max_position_embeddings is None:
        max_position_embeddings = 4096 if rs is None else int(rs.factor * rs.original_max_position_embeddings)
    scaling = rs.to_dict() if rs is not None else None
    return {
        "architectures": [SUPPORTED[model_type]],
        "model_type": model_type,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        **({"rope_scaling": scaling} if scaling else {}),
        "rope_parameters": {"rope_theta": spec.rope_theta, **(scaling or {"rope_type": "default"})},
        "tie_word_embeddings": spec.tie_word_embeddings,
        "max_position_embeddings": max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        "dtype": dtype,
        **dict(token_ids or {}),
    }


# --- a ModelSpec inside a job spec ---------------------------------------------------------------------
_INT_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim", "ffn_hidden_size",
               "vocab_size", "bytes_per_param", "grad_bytes_per_param")
_BOOL_FIELDS = ("tie_word_embeddings", "qk_norm", "qkv_bias")
_FLOAT_FIELDS = ("rope_theta", "rms_norm_eps")
ARCHITECTURE_KEYS = ("name", *_INT_FIELDS, *_BOOL_FIELDS, *_FLOAT_FIELDS, "rope_scaling")


def model_to_mapping(spec: ModelSpec) -> dict[str, Any]:
    """``spec`` as plain JSON data (the inverse of ``model_from_mapping``)."""
    out = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    out["rope_scaling"] = spec.rope_scaling.to_dict() if spec.rope_scaling is not None else None
    return out


def model_from_mapping(d: Mapping[str, Any], where: str = "model") -> ModelSpec:
    """A ``ModelSpec`` from JSON data: unknown or missing keys, wrong types and bad values are one
    SpecError naming the key (bools are not ints, ints not bools, floats finite)."""
    if not isinstance(d, Mapping):
        raise SpecError(where, f"must be a preset name or an architecture object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(ARCHITECTURE_KEYS))
    if unknown:
        raise SpecError(f"{where}.{unknown[0]}", "is not an architecture key", ", ".join(ARCHITECTURE_KEYS))
    kw: dict[str, Any] = {}
    for key in ARCHITECTURE_KEYS:
        if key not in d or d[key] is None:
            if key in ("name", *_INT_FIELDS[:7]):
                raise SpecError(f"{where}.{key}", "is missing")
            continue
        v = d[key]
        if key == "name":
            if not isinstance(v, str) or not 0 < len(v) <= 128:
                raise SpecError(f"{where}.name", f"must be a name of 1-128 characters, got {v!r}")
        elif key in _INT_FIELDS:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 1 << 24:
                raise SpecError(f"{where}.{key}", f"must be a positive integer, got {v!r}")
        elif key in _BOOL_FIELDS:
            if not isinstance(v, bool):
                raise SpecError(f"{where}.{key}", f"must be true or false, got {v!r}")
        elif key in _FLOAT_FIELDS:
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise SpecError(f"{where}.{key}", f"must be a positive finite number, got {v!r}")
            v = float(v)
        else:  # rope_scaling
            if not isinstance(v, Mapping):
                raise SpecError(f"{where}.rope_scaling", f"must be an object or null, got {v!r}")
            v = RopeScaling.from_mapping(v, where=f"{where}.rope_scaling")
        kw[key] = v
    return ModelSpec(**kw)
