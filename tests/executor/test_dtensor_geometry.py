"""The geometry the executor moves is exactly what DTensor and pipelining stages hold.

After a live transition (a DAG run), each worker parallelizes the RL engine's decoder (agent.engine) with
DTensor over the new TP mesh, checks every DTensor's local shape and global offset against the box
its moved shard holds, re-wraps the moved shards with DTensor.from_local and runs a forward pass
that must equal the unsharded model's. Pipelining: a PP stage's module holds exactly the tensors
the geometry gives that stage.
"""

from __future__ import annotations

import pytest
import torch
from executor_helpers import MICRO, init_placements, move, placement, reference_weights, tp_forward

from agent.coordinator import LocalCoordinator
from agent.engine.model import build_decoder
from planner.models import Head
from planner.plan import Layout
from transitions.geometry import stage_layers, unit_shards

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("executor-pool")]


@pytest.mark.parametrize(("old_sets", "tp", "new_sets", "mesh"), [
    ([[0]], 2, [[0, 1], [2, 3]], (2, 2)),  # TP1 -> TP2 x DP2 (Merge + Extend)
    ([[3, 2, 1, 0]], 2, [[2, 3], [0, 1]], (2, 2)),  # TP4 -> TP2 x DP2 (Split), replicas swapped
])
def test_moved_shards_rewrap_as_dtensors_and_forward_equals_unsharded(
        pool: LocalCoordinator, old_sets: list[list[int]], tp: int, new_sets: list[list[int]],
        mesh: tuple[int, ...]) -> None:
    seed = 123 + tp + len(old_sets[0])
    old = [placement("actor", len(old_sets[0]), 1, old_sets)]
    new = [placement("actor", tp, 1, new_sets)]
    init_placements(pool, old, seed=seed)
    assert move(pool, old, new).committed
    tokens = torch.randint(0, MICRO.vocab_size, (2, 7), generator=torch.Generator().manual_seed(seed))
    results = pool.call(tp_forward, stage="actor", mesh_shape=mesh, tokens=tokens)
    reference = build_decoder(MICRO, weights=reference_weights(MICRO, "actor", seed))
    with torch.no_grad():
        expected = reference(tokens, torch.ones_like(tokens))
    n_params = len(dict(reference.named_parameters()))
    for worker, res in results.items():
        assert res["checked"] == n_params
        # equal up to float reassociation of the row-parallel all-reduce
        torch.testing.assert_close(res["logits"], expected, rtol=1e-5, atol=1e-5, msg=f"worker {worker}")


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_pipeline_stage_modules_hold_the_geometry_tensors(pp: int) -> None:
    layout = Layout(1, pp)
    for pp_rank in range(pp):
        stage = build_decoder(MICRO, Head.LM, stage_layers(MICRO.num_layers, pp, pp_rank))
        held = {s.tensor for s in unit_shards(MICRO, Head.LM, layout, layout.rank_of(0, pp_rank))}
        assert held == set(stage.tensor_names()), (pp, pp_rank)
