"""Weight sync between layouts is a TransitionDAG run by the executor: its plan covers every
destination box once and keeps colocated same-layout syncs in place; real ranks move weights between different layouts
exactly, send exactly the plan's bytes, and a colocated same-layout sync sends nothing."""

from __future__ import annotations

import pytest
import torch
from engine_dist import run_workers

from agent.engine.model import build_decoder
from agent.engine.parallel import StageEngine
from agent.engine.sync import PARAMS, SyncPlan, move_training_state, plan_placement, sync_plan, sync_weights
from planner.models import Head, ModelSpec
from planner.plan import Layout, StagePlan
from transitions.dag_pieces import DagMemo
from transitions.geometry import tp_slice, unit_shards
from transitions.layout import COUNTERS
from transitions.node_steps import node_step
from transitions.transfer_plan import Message, Piece

SPEC = ModelSpec(name="t", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                 ffn_hidden_size=128, vocab_size=272, rope_theta=10_000.0)
FP32 = 4


def plan(name: str, tp: int, pp: int, *gpu_sets: tuple[int, ...]) -> StagePlan:
    return StagePlan(model_stage=name, layout=Layout(tp, pp), gpu_sets=tuple(gpu_sets), micro_batch_size=1)


def executor_plan(src: StagePlan, dst: StagePlan) -> SyncPlan:
    return sync_plan((plan_placement(SPEC, Head.LM, src, "b", PARAMS),),
                     (plan_placement(SPEC, Head.LM, dst, "b", PARAMS),))


def moves(p: SyncPlan) -> tuple[list[Message], list[Piece]]:
    """Every message (as its sender derives it) and every local piece of the sync's run."""
    memo, messages, local = DagMemo(), [], []
    for worker in sorted(p.dag.gpu_nodes):
        for node in p.dag.nodes_on(worker):
            step = node_step(p.dag, node, worker, memo, early=p.in_place)
            messages += [m for m in step.messages if m.src_worker == worker]
            local += [q for q in step.local if q.dst_worker == worker]
    return messages, local


def covered_bytes(dst: StagePlan) -> int:
    return FP32 * sum(s.numel for d in range(dst.dp) for u in range(dst.layout.size)
                      for s in unit_shards(SPEC, Head.LM, dst.layout, u))


def weight_bytes(p: SyncPlan) -> int:
    """Bytes of every weight piece (local or sent), counters left out."""
    messages, local = moves(p)
    pieces = [*local, *(q for m in messages for q in m.pieces)]
    return sum(q.num_bytes for q in pieces if q.dst_slot.tensor != COUNTERS)


@pytest.mark.parametrize(("src", "dst"), [
    (plan("a", 2, 1, (0, 1)), plan("b", 1, 2, (2, 3))),
    (plan("a", 2, 1, (0, 1), (2, 3)), plan("b", 1, 2, (1, 3))),
    (plan("a", 1, 2, (0, 1)), plan("b", 2, 2, (0, 1, 2, 3))),
])
def test_plan_covers_each_destination_box_once(src: StagePlan, dst: StagePlan) -> None:
    assert weight_bytes(executor_plan(src, dst)) == covered_bytes(dst)


def test_same_layout_colocated_moves_nothing() -> None:
    p = plan("a", 2, 2, (0, 1, 2, 3))
    messages, local = moves(executor_plan(p, p))
    assert not messages and not local  # every rank keeps its packed buffer


def test_replica_on_same_ranks_is_preferred() -> None:
    src = plan("a", 2, 1, (0, 1), (2, 3))
    dst = plan("b", 2, 1, (2, 3))
    assert executor_plan(src, dst).plan_bytes == 0


def test_other_ranks_send_only_what_they_lack() -> None:
    # destination PP2 on ranks 1 and 3: each keeps what its own TP source shard covers
    src, dst = plan("a", 2, 1, (0, 1), (2, 3)), plan("b", 1, 2, (1, 3))
    p = executor_plan(src, dst)
    local = sum(q.num_bytes for q in moves(p)[1] if q.dst_slot.tensor != COUNTERS)
    assert local > 0 and p.plan_bytes + local >= covered_bytes(dst)
    assert p.plan_bytes < covered_bytes(dst)


def sync_worker(rank: int, world: int, layouts: tuple[tuple[int, int, tuple[tuple[int, ...], ...]], ...]) -> dict:
    (stp, spp, sg), (dtp, dpp, dg) = layouts
    src = StageEngine("actor-train", SPEC, Head.LM, plan("actor-train", stp, spp, *sg), seed=5)
    dst = StageEngine("actor-gen", SPEC, Head.LM, plan("actor-gen", dtp, dpp, *dg), seed=9)
    report = sync_weights(src, dst)
    ok = True
    if dst.coord is not None:
        full = build_decoder(SPEC, Head.LM, seed=5).state_dict()
        specs = {t.name: t for t in SPEC.tensors()}
        for n, local in dst.local_tensors():
            ok &= bool(torch.equal(local, full[n][tp_slice(specs[n], SPEC, dtp, dst.coord.tp_rank)]))
    return {"ok": ok, "sent": report.bytes_sent, "received": report.bytes_received,
            "copied": report.bytes_copied_locally, "plan_bytes": report.plan_bytes,
            "predicted_s": report.predicted_s, "measured_s": report.measured_s}


@pytest.mark.multiprocess
def test_sync_between_layouts_is_exact_and_sends_the_plan() -> None:
    layouts = ((2, 1, ((0, 1), (2, 3))), (1, 2, ((1, 3), (0, 2))))
    results = run_workers(sync_worker, 4, layouts)
    assert all(r["ok"] for r in results)
    plan_bytes = executor_plan(plan("a", 2, 1, (0, 1), (2, 3)), plan("b", 1, 2, (1, 3), (0, 2))).plan_bytes
    assert plan_bytes > 0 and all(r["plan_bytes"] == plan_bytes for r in results)
    assert sum(r["sent"] for r in results) == sum(r["received"] for r in results) == plan_bytes
    assert sum(r["copied"] for r in results) > 0  # colocated boxes never cross the wire
    assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in results)


@pytest.mark.multiprocess
def test_colocated_same_layout_sync_sends_nothing() -> None:
    results = run_workers(sync_worker, 2, ((2, 1, ((0, 1),)), (2, 1, ((0, 1),))))
    assert all(r["ok"] for r in results)  # the weights still arrive (from the packed buffer)
    assert all(r["sent"] == r["received"] == r["copied"] == r["plan_bytes"] == 0 for r in results)


def full_moment(name: str, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """A deterministic stand-in for one AdamW moment of a whole tensor (the same on every rank)."""
    index = [t.name for t in SPEC.tensors()].index(name)  # not hash(): string hashes differ per process
    return torch.rand(shape, generator=torch.Generator().manual_seed(index * 3 + salt)) + salt


def replan_worker(rank: int, world: int) -> dict:
    specs = {t.name: t for t in SPEC.tensors()}
    src = StageEngine("actor-train", SPEC, Head.LM, plan("actor-train", 2, 1, (0, 1)), seed=5, lr=1e-3)
    assert src.coord is not None
    for kind, salt in (("exp_avg", 1), ("exp_avg_sq", 2)):
        for n, local in src.local_tensors(kind):
            local.copy_(full_moment(n, specs[n].shape, salt)[tp_slice(specs[n], SPEC, 2, src.coord.tp_rank)])
    # the new layout puts PP stage 0 on rank 1: nothing stays in place
    dst = StageEngine("actor-train", SPEC, Head.LM, plan("actor-train", 1, 2, (1, 0)), seed=9, lr=1e-3)
    report = move_training_state(src, dst, optimizer_steps=7)
    assert dst.module is not None
    full = build_decoder(SPEC, Head.LM, seed=5).state_dict()
    ok = all(torch.equal(t, full[n]) for n, t in dst.local_tensors())
    for kind, salt in (("exp_avg", 1), ("exp_avg_sq", 2)):
        ok &= all(torch.equal(t, full_moment(n, specs[n].shape, salt)) for n, t in dst.local_tensors(kind))
    steps = {int(dst.optimizer_state(p)["step"]) for p in dst.module.parameters()}
    return {"ok": ok, "steps": steps, "sent": report.bytes_sent, "plan_bytes": report.plan_bytes}


@pytest.mark.multiprocess
def test_replan_moves_weights_moments_and_step_through_the_executor() -> None:
    results = run_workers(replan_worker, 2)
    assert all(r["ok"] for r in results)
    assert all(r["steps"] == {7} for r in results)  # carried in the executor's unit counters
    assert sum(r["sent"] for r in results) == results[0]["plan_bytes"] > 0
