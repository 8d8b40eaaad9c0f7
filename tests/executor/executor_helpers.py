"""Helpers for the executor tests: placements of tiny models, moving them as DAG runs, and
logical-state reassembly from dumps."""

from __future__ import annotations

from typing import Any

import torch

from agent.coordinator import LocalCoordinator, TransitionOutcome
from planner.models import Head, ModelSpec
from planner.plan import Layout
from transitions.executor.logical import logical_state as assemble
from transitions.geometry import INFERENCE_KINDS, TRAINING_KINDS
from transitions.layout import StagePlacement
from transitions.placement_dag import placement_cluster, placement_dag, placement_units

# a smaller real architecture than TINY_3M keeps multi-process tests fast on 2 cores
MICRO = ModelSpec(name="micro", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                  head_dim=16, ffn_hidden_size=176, vocab_size=96, rope_theta=10_000.0)


def placement(stage: str, tp: int, pp: int, gpu_sets: list[list[int]], *, model: ModelSpec = MICRO,
              training: bool = True, head: Head = Head.LM) -> StagePlacement:
    return StagePlacement(model_stage=stage, model=model, head=head,
                          kinds=TRAINING_KINDS if training else INFERENCE_KINDS, layout=Layout(tp, pp),
                          gpu_sets=tuple(tuple(g) for g in gpu_sets))


def init_placements(pool: LocalCoordinator, placements: list[StagePlacement], seed: int) -> None:
    """Random state (deterministic in ``seed``) in the units of ``placements`` at plan version 1."""
    pool.init_units(placement_units(placements), seed=seed)


def move(pool: LocalCoordinator, old: list[StagePlacement], new: list[StagePlacement], *, old_version: int = 1,
         **run: Any) -> TransitionOutcome:
    """Run the DAG moving ``old`` (at ``old_version``) to ``new`` on the pool's workers."""
    return pool.run_dag(placement_dag(old, new, old_version=old_version), placement_cluster(old, new), **run)


def logical_state(dumps: dict[int, Any]) -> dict[tuple[str, str, str], torch.Tensor]:
    """Reassemble every (stage, tensor, kind) from all workers' shards (the one assembly,
    transitions.executor.logical), strictly: fails if two copies of the same element differ or if
    any element is held by nobody."""
    return assemble(dumps, strict=True)


def assert_same_state(a: dict[tuple[str, str, str], torch.Tensor],
                      b: dict[tuple[str, str, str], torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        # bitwise: compare the raw bytes, so -0.0 vs 0.0 or NaN payloads would count as differences
        assert torch.equal(a[key].contiguous().view(torch.uint8), b[key].contiguous().view(torch.uint8)), key


# --- run inside workers (pool.call): DTensor views of moved shards ---------------------------------

WEIGHT_SCALE = 0.05  # keeps activations of random N(0, 1) weights in a sane range; same op on both sides


def reference_weights(model: ModelSpec, stage: str, seed: int) -> dict[str, torch.Tensor]:
    """The full fp32 master weights ``agent.worker.random_unit`` slices for ``seed`` (scaled)."""
    from agent.worker import logical_seed

    out = {}
    for t in model.tensors():
        gen = torch.Generator().manual_seed(logical_seed(seed, stage, t.name, "master"))
        full = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        out[t.name] = full if t.name.endswith("norm.weight") else full * WEIGHT_SCALE
    return out


def tp_forward(ctx: Any, *, stage: str, mesh_shape: tuple[int, ...], tokens: torch.Tensor) -> dict[str, Any]:
    """In every worker of the generation: parallelize the engine's decoder over the TP mesh, check that
    each DTensor's local shape/offset is the box this worker's moved shard holds, re-wrap the moved fp32
    master shards with DTensor.from_local, and run a forward pass. Returns logits and the checks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.parallel import parallelize_module

    from agent.engine.model import build_decoder
    from agent.engine.parallel import tp_plan
    from agent.worker import stage_unit

    names = ("dp", "tp") if len(mesh_shape) == 2 else ("tp",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)["tp"]
    state = stage_unit(ctx, stage)
    model = build_decoder(state.placement.model, state.placement.head)
    parallelize_module(model, mesh, tp_plan(model))
    checked = 0
    with torch.no_grad():
        for name, param in list(model.named_parameters()):
            slot = state.slots[(name, "master")]
            moved = state.view(name, "master")
            moved = moved if name.endswith("norm.weight") else moved * WEIGHT_SCALE
            if isinstance(param, DTensor):
                shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, param.placements)
                assert (tuple(shape), tuple(offset)) == (slot.lengths, slot.offsets), (name, shape, offset, slot)
                new = DTensor.from_local(moved.contiguous(), mesh, param.placements, shape=param.shape,
                                         stride=param.stride())
            else:
                assert slot.lengths == tuple(param.shape) and not any(slot.offsets), name
                new = moved.clone()
            module_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(new))
            checked += 1
        logits = model(tokens, torch.ones_like(tokens))
    return {"logits": logits, "checked": checked, "rank": state.rank}
