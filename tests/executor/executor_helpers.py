"""Helpers for the executor tests: placements of tiny models and logical-state reassembly from dumps."""

from __future__ import annotations

from typing import Any

import torch

from planner.models import Head, ModelSpec
from planner.plan import Layout
from transitions.executor import StagePlacement
from transitions.geometry import INFERENCE_KINDS, TRAINING_KINDS

# a smaller real architecture than TINY_3M keeps multi-process tests fast on 2 cores
MICRO = ModelSpec(name="micro", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                  head_dim=16, ffn_hidden_size=176, vocab_size=96, rope_theta=10_000.0)


def placement(stage: str, tp: int, pp: int, gpu_sets: list[list[int]], *, model: ModelSpec = MICRO,
              training: bool = True, head: Head = Head.LM) -> StagePlacement:
    return StagePlacement(model_stage=stage, model=model, head=head,
                          kinds=TRAINING_KINDS if training else INFERENCE_KINDS, layout=Layout(tp, pp),
                          gpu_sets=tuple(tuple(g) for g in gpu_sets))


def logical_state(dumps: dict[int, Any]) -> dict[tuple[str, str, str], torch.Tensor]:
    """Reassemble every (stage, tensor, kind) from all workers' shards.

    Fails if two copies of the same element differ or if any element is held by nobody.
    """
    full: dict[tuple[str, str, str], torch.Tensor] = {}
    seen: dict[tuple[str, str, str], torch.Tensor] = {}
    for worker_dump in dumps.values():
        for stage, shards in worker_dump.items():
            for s in shards:
                key = (stage, s["tensor"], s["kind"])
                if key not in full:
                    full[key] = torch.zeros(s["global_shape"], dtype=s["data"].dtype)
                    seen[key] = torch.zeros(s["global_shape"], dtype=torch.bool)
                box = tuple(slice(o, o + k) for o, k in zip(s["offsets"], s["lengths"]))
                region, mask = full[key][box], seen[key][box]
                data = s["data"]
                # copies of one element held on several ranks/replicas must agree bit for bit
                if mask.any():
                    assert torch.equal(region[mask], data[mask]), f"{key}: copies disagree"
                region.copy_(data)
                mask.fill_(True)
    for key, mask in seen.items():
        assert bool(mask.all()), f"{key}: {int((~mask).sum())} elements held by no worker"
    return full


def assert_same_state(a: dict[tuple[str, str, str], torch.Tensor],
                      b: dict[tuple[str, str, str], torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        # bitwise: compare the raw bytes, so -0.0 vs 0.0 or NaN payloads would count as differences
        assert torch.equal(a[key].contiguous().view(torch.uint8), b[key].contiguous().view(torch.uint8)), key
