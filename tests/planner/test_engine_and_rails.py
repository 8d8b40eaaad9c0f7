"""Two shapes of issue 16 pinned: the generation engine's serial time per decode step (paid once per
step whatever the batch, on GPU systems whose RL engines do not overlap it), and the inter-node DP
all-reduce over as many NICs as the group has members on a node."""

from __future__ import annotations

import dataclasses

import pytest
from planner_jobs import h200

from planner.cost import (
    DECODE_SEQUENCE_OVERHEAD_S,
    Links,
    OpClass,
    dp_rails,
    fixed_raw,
    microbatch_raw,
    stage_cost,
)
from planner.cost import PRIORS as EFF
from planner.hardware import GPU_DECODE_STEP_OVERHEAD_S, SYSTEMS, cluster_preset
from planner.models import LLAMA_31_8B
from planner.plan import Layout
from planner.workflow import ACTOR_GEN, ACTOR_TRAIN, Workload

W = Workload(prompts_per_step=64, prompt_tokens=256, response_tokens=500, max_response_tokens=2000)


def _decode_overhead(terms: list) -> float:  # type: ignore[type-arg]
    return sum(t[1] for t in terms if t[0] is OpClass.DECODE_OVERHEAD)


def test_the_decode_step_time_is_the_engines_and_the_presets_assume_none() -> None:
    assert pytest.approx(5.5e-3 - 256 * DECODE_SEQUENCE_OVERHEAD_S) == GPU_DECODE_STEP_OVERHEAD_S  # issue 10634
    assert pytest.approx(1.66e-3) == GPU_DECODE_STEP_OVERHEAD_S
    for name in ("h100", "h200", "a100", "mi250x", "cpu"):
        assert cluster_preset(name, 8 if name != "cpu" else 2).decode_step_overhead_s == 0.0
    assert all(s.cluster(s.gpus_per_node * (s.num_nodes or 1)).decode_step_overhead_s == 0.0 for s in SYSTEMS.values())
    # without it a decode step costs only its per-sequence engine time
    cl = h200(8)
    got = _decode_overhead(microbatch_raw(LLAMA_31_8B, ACTOR_GEN, Layout(1, 1), W, 8, False, cl, Links()))
    assert got == pytest.approx(500 * 8 * DECODE_SEQUENCE_OVERHEAD_S)


def test_the_decode_step_time_is_per_step_not_per_sequence() -> None:
    cl = dataclasses.replace(h200(8), decode_step_overhead_s=2e-3)
    free = dataclasses.replace(cl, decode_step_overhead_s=0.0)
    for b in (1, 4, 32):
        got = _decode_overhead(microbatch_raw(LLAMA_31_8B, ACTOR_GEN, Layout(1, 1), W, b, False, cl, Links()))
        assert got == pytest.approx(500 * (b * DECODE_SEQUENCE_OVERHEAD_S + 2e-3))
        base = _decode_overhead(microbatch_raw(LLAMA_31_8B, ACTOR_GEN, Layout(1, 1), W, b, False, free, Links()))
        assert got - base == pytest.approx(500 * 2e-3)  # the same for every concurrency
    # the tail's 1,500 steps past the mean pay it too, once per RL step
    tail = _decode_overhead(fixed_raw(LLAMA_31_8B, ACTOR_GEN, Layout(1, 1), W, cl, Links()))
    assert tail == pytest.approx(1500 * (DECODE_SEQUENCE_OVERHEAD_S + 2e-3))
    # per generated token it falls with concurrency: a wave of b sequences shares each step's time
    per_token = [_decode_overhead(microbatch_raw(LLAMA_31_8B, ACTOR_GEN, Layout(1, 1), W, b, False, cl, Links()))
                 / (b * 500) for b in (1, 4, 32)]
    assert per_token[0] > per_token[1] > per_token[2] > DECODE_SEQUENCE_OVERHEAD_S
    # training and inference have no decode steps
    assert _decode_overhead(microbatch_raw(LLAMA_31_8B, ACTOR_TRAIN, Layout(1, 1), W, 4, False, cl, Links())) == 0
    # a stage's seconds: waves x mean steps + tail steps, each step once
    g = 4
    with_it = stage_cost(LLAMA_31_8B, ACTOR_GEN, Layout(1, 1), W, micro_batch_size=16, grad_accum=g, recompute=False,
                         dp=1, cluster=cl, links=Links(), eff=EFF).seconds
    without = stage_cost(LLAMA_31_8B, ACTOR_GEN, Layout(1, 1), W, micro_batch_size=16, grad_accum=g, recompute=False,
                         dp=1, cluster=free, links=Links(), eff=EFF).seconds
    assert with_it - without == pytest.approx((g * 500 + 1500) * 2e-3)


def test_an_inter_node_dp_all_reduce_uses_one_nic_per_group_member_on_a_node() -> None:
    cl = h200(64)  # 8 GPUs per node, 50 GB/s of NIC per GPU
    assert [dp_rails(cl, Layout(t, p)) for t, p in ((1, 1), (2, 1), (1, 2), (4, 1), (8, 1), (4, 4))] == [
        8, 4, 4, 2, 1, 1]
    # whole members only: a TP4 replica on 6-GPU nodes leaves one group member per node
    six = dataclasses.replace(cl, gpus_per_node=6, num_nodes=4)
    assert [dp_rails(six, Layout(t, 1)) for t in (1, 2, 4, 8)] == [6, 3, 1, 1]
    assert all(type(dp_rails(six, Layout(t, 1))) is int for t in (1, 4))

    def all_reduce(layout: Layout, dp: int) -> tuple[float, float]:
        c = stage_cost(LLAMA_31_8B, ACTOR_TRAIN, layout, W, micro_batch_size=1, grad_accum=1, recompute=True,
                       dp=dp, cluster=cl, links=Links(dp_intra=False), eff=EFF)
        ar = [t for t in c.terms if t.op_class is OpClass.DP_ALLREDUCE_INTER]
        assert len(ar) == 1
        return ar[0].work, ar[0].peak_per_s

    nic = cl.inter_node_link.bytes_per_s
    (w1, p1), (w8, p8), (_w2, p2) = all_reduce(Layout(1, 1), 16), all_reduce(Layout(8, 1), 16), all_reduce(
        Layout(2, 1), 16)
    # a DP-only group (8 members per node) drives 8 NICs, TP2's groups 4 each, a TP8 group one
    assert (p1, p2, p8) == (8 * nic, 4 * nic, nic)
    # per gradient byte: 8x as fast as TP8's, whose GPU holds 1/8 of the bytes (the ring moves 1.875x)
    assert w1 == pytest.approx(8 * w8, rel=0.01)
    assert (w1 / p1) / (w8 / p8) == pytest.approx(1.0, rel=0.01)  # the same time for 8x the bytes
    # inside a node the NVLink term is one GPU's link, whatever the layout
    intra = stage_cost(LLAMA_31_8B, ACTOR_TRAIN, Layout(1, 1), W, micro_batch_size=1, grad_accum=1, recompute=True,
                       dp=8, cluster=cl, links=Links(), eff=EFF)
    assert [t.peak_per_s for t in intra.terms if t.op_class is OpClass.DP_ALLREDUCE_INTRA] == [
        cl.intra_node_link.bytes_per_s]
