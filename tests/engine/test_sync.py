"""Weight sync between layouts: the pure plan covers every destination box exactly once and keeps
colocated same-layout syncs local; 4 real ranks move weights between different layouts exactly."""

from __future__ import annotations

import pytest
import torch
from engine_dist import run_workers

from agent.engine.model import build_decoder
from agent.engine.parallel import StageEngine
from agent.engine.sync import sync_plan, sync_weights
from planner.models import Head, ModelSpec
from planner.plan import Layout, StagePlan
from transitions.geometry import tp_slice, unit_shards

SPEC = ModelSpec(name="t", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                 ffn_hidden_size=128, vocab_size=272, rope_theta=10_000.0)


def plan(name: str, tp: int, pp: int, *gpu_sets: tuple[int, ...]) -> StagePlan:
    return StagePlan(model_stage=name, layout=Layout(tp, pp), gpu_sets=tuple(gpu_sets), micro_batch_size=1)


def covered(dst: StagePlan) -> int:
    return sum(s.numel for d in range(dst.dp) for u in range(dst.layout.size)
               for s in unit_shards(SPEC, Head.LM, dst.layout, u))


@pytest.mark.parametrize(("src", "dst"), [
    (plan("a", 2, 1, (0, 1)), plan("b", 1, 2, (2, 3))),
    (plan("a", 2, 1, (0, 1), (2, 3)), plan("b", 1, 2, (1, 3))),
    (plan("a", 1, 2, (0, 1)), plan("b", 2, 2, (0, 1, 2, 3))),
])
def test_plan_covers_each_destination_box_once(src: StagePlan, dst: StagePlan) -> None:
    transfers = sync_plan(SPEC, Head.LM, src, dst)
    assert sum(t.numel for t in transfers) == covered(dst)


def test_same_layout_colocated_moves_nothing_remote() -> None:
    p = plan("a", 2, 2, (0, 1, 2, 3))
    transfers = sync_plan(SPEC, Head.LM, p, p)
    assert transfers and all(t.is_local for t in transfers)


def test_replica_on_same_ranks_is_preferred() -> None:
    src = plan("a", 2, 1, (0, 1), (2, 3))
    dst = plan("b", 2, 1, (2, 3))
    assert all(t.is_local for t in sync_plan(SPEC, Head.LM, src, dst))


def sync_worker(rank: int, world: int, layouts: tuple[tuple[int, int, tuple[tuple[int, ...], ...]], ...]) -> dict:
    (stp, spp, sg), (dtp, dpp, dg) = layouts
    src = StageEngine("actor-train", SPEC, Head.LM, plan("actor-train", stp, spp, *sg), seed=5)
    dst = StageEngine("actor-gen", SPEC, Head.LM, plan("actor-gen", dtp, dpp, *dg), seed=9)
    stats = sync_weights(src, dst)
    ok = True
    if dst.coord is not None:
        full = build_decoder(SPEC, Head.LM, seed=5).state_dict()
        specs = {t.name: t for t in SPEC.tensors()}
        for n, local in dst.local_tensors():
            ok &= bool(torch.equal(local, full[n][tp_slice(specs[n], SPEC, dtp, dst.coord.tp_rank)]))
    return {"ok": ok, **stats}


@pytest.mark.multiprocess
def test_sync_between_layouts_is_exact() -> None:
    layouts = ((2, 1, ((0, 1), (2, 3))), (1, 2, ((1, 3), (0, 2))))
    results = run_workers(sync_worker, 4, layouts)
    assert all(r["ok"] for r in results)
    moved = sum(r["recv_elems"] + r["copied_elems"] for r in results)
    assert moved == covered(plan("b", 1, 2, (1, 3), (0, 2)))
    assert sum(r["copied_elems"] for r in results) > 0  # colocated boxes never cross the wire
