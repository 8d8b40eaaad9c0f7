"""The cost model's terms worked out by hand (planner/cost.py) on a small model whose sizes all differ
(4 layers, h=64, 8 heads of 16, 2 KV heads, f=96, vocab 1000) and a made-up cluster whose figures all
differ, so that a swapped link, class, peak or factor changes a number: generation (decode roofline
pair, prefill, KV reads with the second moment, per-sequence overhead, TP all-reduces and PP sends),
training and inference passes (old-log-prob forward, recomputation), the eager launch terms, the fixed
once-per-step terms (tail, refit, sleep copies), the optimizer step and the DP all-reduce with its
exposed share, the roofline, the 1F1B repeats and the assembled stage cost.

Per decoder layer the model holds q 8,192 + k 2,048 + v 2,048 + o 8,192 + MLP 18,432 + 2 norms 128 =
39,040 parameters (TP2: 4,096 + 1,024 + 1,024 + 4,096 + 9,216 + 128 = 19,584); the embedding 64,000;
the LM head and final norm 64,064 (TP2: 32,064), a value head and final norm 128."""

from __future__ import annotations

import pytest
from planner_jobs import INTER_LINK, INTRA_LINK, SMALL

from planner.cost import (
    DECODE_SEQUENCE_OVERHEAD_S,
    DP_BUCKET_PARAMS,
    Links,
    OpTerm,
    StageCost,
    _hops,
    _ring,
    backward_seconds,
    dp_exposed_fraction,
    dp_rails,
    fixed_raw,
    gemm_peak,
    microbatch_raw,
    microbatch_terms,
    raw_seconds,
    repeats,
    roofline,
    stage_cost,
    sync_raw,
    sync_terms,
)
from planner.eager import (
    COLLECTIVE_LAUNCHES,
    LAUNCHES_PER_LAYER,
    LAUNCHES_PER_PASS,
    LAUNCHES_PER_SAMPLE,
    PIPELINE_HOP_LAUNCHES,
    TP_LINEAR_LAUNCHES,
    optimizer_launches,
)
from planner.hardware import ClusterSpec, DeviceSpec
from planner.memory import params_per_gpu
from planner.models import Head, ModelSpec
from planner.op_classes import OpClass
from planner.plan import Layout
from planner.workflow import (
    ACTOR_GEN,
    ACTOR_TRAIN,
    CRITIC_TRAIN,
    REF_INF,
    ModelStage,
    Role,
    StageKind,
    Workload,
)

M = SMALL
LAYER, LAYER_TP2 = 39_040, 19_584
TOP, TOP_TP2, VALUE_TOP = 64_064, 32_064, 128
# p = 10, r = 20, longest 50 (a tail of 30), std 4: E[r^2] = 416
W = Workload(prompts_per_step=4, prompt_tokens=10, response_tokens=20, max_response_tokens=50,
             response_tokens_std=4.0)
DEV = DeviceSpec(name="d", memory_bytes=10**12, peak_flops_bf16=1e12, hbm_bytes_per_s=1e10,
                 host_bytes_per_s=3e9, gemm_half_tokens=0.0, gemm_half_width=0.0)
INTRA = INTRA_LINK
INTER = INTER_LINK
CL = ClusterSpec(device=DEV, num_nodes=2, gpus_per_node=4, intra_node_link=INTRA, inter_node_link=INTER,
                 refit_setup_s=0.25)
# the launch terms exist only on the eager device (keyed by the preset's name, "cpu")
EAGER = ClusterSpec(device=DeviceSpec(name="cpu", memory_bytes=10**12, peak_flops_bf16=1e12,
                                      hbm_bytes_per_s=1e10, gemm_half_tokens=0.0, gemm_half_width=0.0),
                    num_nodes=1, gpus_per_node=2, intra_node_link=INTRA, inter_node_link=INTER)
LAUNCH_RATE = 1 / 2e-6  # planner.eager.LAUNCH_OVERHEAD_S["cpu"]
INTER_LINKS = Links(tp_intra=False, pp_intra=False, dp_intra=False)
# a distinct efficiency per class, so that a term priced in the wrong class changes its seconds
EFF = {c: 0.11 + 0.037 * i for i, c in enumerate(OpClass)}


def _approx(got: list, want: list) -> None:  # type: ignore[type-arg]
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want, strict=True):
        assert g[0] is w[0], (g, w)
        assert g[1:] == pytest.approx(w[1:], rel=1e-12), (g, w)


def test_ring_and_tree_factors() -> None:
    assert [_ring(n) for n in (1, 2, 4)] == [0.0, 1.0, 1.5]
    # a small all-reduce's latency: 2 log2(n) hops, rounded up; none alone
    assert [_hops(n) for n in (1, 2, 3, 4, 8)] == [0.0, 2, 4, 4, 6]


def test_an_op_term_costs_its_work_over_peak_times_efficiency_plus_its_hops_per_repetition() -> None:
    t = OpTerm(op_class=OpClass.TP_ALLREDUCE_INTER, work=6e9, peak_per_s=2e9, messages=4, latency_s=0.5, repeat=3)
    eff = {OpClass.TP_ALLREDUCE_INTER: 0.6}
    assert t.seconds(eff) == pytest.approx(3 * (6e9 / (2e9 * 0.6) + 4 * 0.5))
    s = t.scaled(7.0)
    assert (s.op_class, s.work, s.peak_per_s, s.messages, s.latency_s, s.repeat) == (
        OpClass.TP_ALLREDUCE_INTER, 6e9, 2e9, 4, 0.5, 7.0)
    assert raw_seconds((OpClass.TP_ALLREDUCE_INTER, 6e9, 2e9, 4.0, 0.5), eff) == pytest.approx(6e9 / 1.2e9 + 2)


def test_gemm_peak_falls_with_few_tokens_and_narrow_shards() -> None:
    dev = DeviceSpec(name="g", memory_bytes=10**12, peak_flops_bf16=1e15, hbm_bytes_per_s=1e12,
                     gemm_half_tokens=40.0, gemm_half_width=8.0)
    cl = ClusterSpec(device=dev, num_nodes=1, gpus_per_node=8, intra_node_link=INTRA, inter_node_link=INTER)
    # 160 tokens: 1 + 40/160 = 1.25; width 64/2 = 32 per GPU: 1 + 8/32 = 1.25
    assert gemm_peak(cl, M, Layout(2, 1), 160) == pytest.approx(1e15 / (1.25 * 1.25))
    assert gemm_peak(cl, M, Layout(1, 1), 40) == pytest.approx(1e15 / (2 * 1.125))
    assert gemm_peak(CL, M, Layout(4, 1), 1) == pytest.approx(1e12)  # no shape factor on this device


def test_generation_terms_on_one_gpu() -> None:
    b, p, r = 3, 10, 20
    w = 4 * LAYER + TOP  # the embedding is a gather, not a GEMM
    got = microbatch_raw(M, ACTOR_GEN, Layout(1, 1), W, b, False, CL, Links())
    _approx(got, [
        (OpClass.GEMM, 2.0 * w * b * r, 1e12, 0.0, 0.0),  # decode GEMMs (the roofline pair, first)
        (OpClass.MEMORY_BOUND, w * 2.0 * r, 1e10, 0.0, 0.0),  # each decode step reads the weights
        (OpClass.GEMM, 2.0 * w * b * p, 1e12, 0.0, 0.0),  # prefill
        (OpClass.ATTENTION_PREFILL, 2.0 * b * p**2 * 128 * 4, 1e12, 0.0, 0.0),
        # KV reads: b x (p r + E[r^2]/2) tokens of 2 x 4 layers x 2 heads x 16 x 2 B = 512 B
        (OpClass.ATTENTION_DECODE, b * (p * r + 416 / 2) * 512.0, 1e10, 0.0, 0.0),
        (OpClass.DECODE_OVERHEAD, b * r * DECODE_SEQUENCE_OVERHEAD_S, 1.0, 0.0, 0.0),
    ])
    terms = microbatch_terms(M, ACTOR_GEN, Layout(1, 1), W, b, False, CL, Links())
    assert [(t.op_class, t.work, t.peak_per_s, t.messages, t.latency_s, t.repeat) for t in terms] == [
        (*g, 1.0) for g in got]


def test_generation_terms_across_nodes_with_tp_and_pp() -> None:
    b, p, r = 3, 10, 20
    # the slowest PP rank of 2 x 2 layers is the last (it holds the head): 2 x 19,584 + 32,064
    w = 2 * LAYER_TP2 + TOP_TP2
    act = 2 * 64  # one token's hidden state in bf16
    got = microbatch_raw(M, ACTOR_GEN, Layout(2, 2), W, b, False, CL, INTER_LINKS)
    kv = 2 * 2 * 1 * 16 * 2  # 2 layers, 1 KV head per TP rank
    _approx(got, [
        (OpClass.GEMM, 2.0 * w * b * r, 1e12, 0.0, 0.0),
        (OpClass.MEMORY_BOUND, w * 2.0 * r, 1e10, 0.0, 0.0),
        (OpClass.GEMM, 2.0 * w * b * p, 1e12, 0.0, 0.0),
        (OpClass.ATTENTION_PREFILL, 2.0 * b * p**2 * 64 * 2, 1e12, 0.0, 0.0),
        (OpClass.ATTENTION_DECODE, b * (p * r + 416 / 2) * kv, 1e10, 0.0, 0.0),
        (OpClass.DECODE_OVERHEAD, b * r * DECODE_SEQUENCE_OVERHEAD_S, 1.0, 0.0, 0.0),
        # prefill: 2 all-reduces per layer over b p tokens; decode: 2 per layer per step over b tokens;
        # ring over 2 ranks moves the whole buffer, a tree over 2 ranks takes 2 hops
        (OpClass.TP_ALLREDUCE_INTER, 2 * 2 * b * p * act * 1.0, 5e8, 2 * 2 * 2, 3e-4),
        (OpClass.TP_ALLREDUCE_INTER, 2 * 2 * r * b * act * 1.0, 5e8, 2 * 2 * r * 2, 3e-4),
        # the prompt once, then one token per step: 1 + r hops of b (p + r) tokens in all
        (OpClass.PP_SEND_INTER, b * (p + r) * act, 5e8, 1.0 + r, 3e-4),
    ])
    intra = microbatch_raw(M, ACTOR_GEN, Layout(2, 2), W, b, False, CL, Links())
    assert [t[0] for t in intra[-3:]] == [OpClass.TP_ALLREDUCE_INTRA] * 2 + [OpClass.PP_SEND_INTRA]
    assert {(t[2], t[4]) for t in intra[-3:]} == {(7e9, 1e-5)}


def test_training_passes_with_the_old_log_prob_forward_and_recomputation() -> None:
    b, s = 2, 30
    w = 4 * LAYER + TOP
    for recompute, passes in ((False, 4), (True, 5)):  # fwd + bwd (x2) + old-log-prob fwd (+ refwd)
        got = microbatch_raw(M, ACTOR_TRAIN, Layout(1, 1), W, b, recompute, CL, Links())
        _approx(got, [(OpClass.GEMM, passes * 2.0 * w * b * s, 1e12, 0.0, 0.0),
                      (OpClass.ATTENTION_PREFILL, passes * 2.0 * b * s**2 * 128 * 4, 1e12, 0.0, 0.0)])
    # the critic has no old-log-prob pass and a value head
    got = microbatch_raw(M, CRITIC_TRAIN, Layout(1, 1), W, b, False, CL, Links())
    assert got[0][1] == pytest.approx(3 * 2.0 * (4 * LAYER + VALUE_TOP) * b * s)


def test_training_and_inference_collectives_under_tp_and_pp() -> None:
    b, s, act = 2, 30, 128
    # TP2 x PP2 training: 2 all-reduces per layer per pass-equivalent of fwd, bwd and the old-log-prob
    # fwd (3, 4 with recomputation), over b s tokens; PP: activations, gradients and the old-log-prob
    # activations, each b s tokens
    for recompute, count in ((False, 2 * 3), (True, 2 * 4)):
        got = microbatch_raw(M, ACTOR_TRAIN, Layout(2, 2), W, b, recompute, CL, Links())
        assert [t[0] for t in got] == [OpClass.GEMM, OpClass.ATTENTION_PREFILL, OpClass.TP_ALLREDUCE_INTRA,
                                       OpClass.PP_SEND_INTRA]
        _approx(got[2:], [(OpClass.TP_ALLREDUCE_INTRA, count * 2 * b * s * act * 1.0, 7e9, count * 2 * 2, 1e-5),
                          (OpClass.PP_SEND_INTRA, 3 * b * s * act, 7e9, 3.0, 1e-5)])
    got = microbatch_raw(M, REF_INF, Layout(2, 2), W, b, False, CL, INTER_LINKS)
    w = 2 * LAYER_TP2 + TOP_TP2
    _approx(got, [(OpClass.GEMM, 2.0 * w * b * s, 1e12, 0.0, 0.0),
                  (OpClass.ATTENTION_PREFILL, 2.0 * b * s**2 * 64 * 2, 1e12, 0.0, 0.0),
                  (OpClass.TP_ALLREDUCE_INTER, 2 * 2 * b * s * act * 1.0, 5e8, 2 * 2 * 2, 3e-4),
                  (OpClass.PP_SEND_INTER, b * s * act, 5e8, 1.0, 3e-4)])


def test_eager_launch_terms_of_training_inference_and_decode() -> None:
    b = 2
    plain4 = 4 * LAUNCHES_PER_LAYER + LAUNCHES_PER_PASS  # one forward over 4 layers: 222 launches
    # the actor's training: 2 forwards (the update's and the old-log-prob one), a backward of 2x
    got = microbatch_raw(M, ACTOR_TRAIN, Layout(1, 1), W, b, False, EAGER, Links())[2:]
    _approx(got, [(OpClass.LAUNCH_FORWARD, 2.0 * plain4, LAUNCH_RATE, 0.0, 0.0),
                  (OpClass.LAUNCH_BACKWARD, 2.0 * plain4, LAUNCH_RATE, 0.0, 0.0)])
    # with recomputation 3 forwards; TP2 adds the distributed calls of 3 + 2 forward-equivalents: 7 DTensor
    # linears per layer and 2 at the ends at 57 launches, 2 collectives per layer and 2 at the ends at 107
    dist_tp2 = (7 * 4 + 2) * TP_LINEAR_LAUNCHES + (2 * 4 + 2) * COLLECTIVE_LAUNCHES
    assert dist_tp2 == 2780
    got = microbatch_raw(M, ACTOR_TRAIN, Layout(2, 1), W, b, True, EAGER, Links())
    _approx(got[3:], [(OpClass.LAUNCH_FORWARD, 3.0 * plain4, LAUNCH_RATE, 0.0, 0.0),
                      (OpClass.LAUNCH_DISTRIBUTED, 5.0 * dist_tp2, LAUNCH_RATE, 0.0, 0.0),
                      (OpClass.LAUNCH_BACKWARD, 2.0 * plain4, LAUNCH_RATE, 0.0, 0.0)])
    # inference: one forward, no backward; PP2: one schedule step per pass, 2 layers per rank
    plain2 = 2 * LAUNCHES_PER_LAYER + LAUNCHES_PER_PASS
    got = microbatch_raw(M, REF_INF, Layout(1, 2), W, b, False, EAGER, Links())
    _approx(got[3:], [(OpClass.LAUNCH_FORWARD, 1.0 * plain2, LAUNCH_RATE, 0.0, 0.0),
                      (OpClass.LAUNCH_DISTRIBUTED, 1.0 * PIPELINE_HOP_LAUNCHES, LAUNCH_RATE, 0.0, 0.0)])
    assert [t[0] for t in microbatch_raw(M, REF_INF, Layout(1, 1), W, b, False, EAGER, Links())] == [
        OpClass.GEMM, OpClass.ATTENTION_PREFILL, OpClass.LAUNCH_FORWARD]
    # decode: r = 20 steps of a forward and its sampling; PP2: each step's schedule hop and half of the
    # last stage's logits broadcast
    got = microbatch_raw(M, ACTOR_GEN, Layout(1, 2), W, b, False, EAGER, Links())
    _approx(got[-2:], [(OpClass.LAUNCH_DECODE, 20.0 * (plain2 + LAUNCHES_PER_SAMPLE), LAUNCH_RATE, 0.0, 0.0),
                       (OpClass.LAUNCH_DISTRIBUTED, 20.0 * (PIPELINE_HOP_LAUNCHES + 0.5 * COLLECTIVE_LAUNCHES),
                        LAUNCH_RATE, 0.0, 0.0)])
    got = microbatch_raw(M, ACTOR_GEN, Layout(1, 1), W, b, False, EAGER, Links())
    assert got[-1][0] is OpClass.LAUNCH_DECODE  # no distributed calls on one rank
    assert not any(t[0].value.startswith("launch") for t in microbatch_raw(M, ACTOR_GEN, Layout(2, 2), W, b,
                                                                           False, CL, Links()))


def test_the_fixed_terms_tail_refit_and_sleep() -> None:
    # the tail: 30 steps past the mean at concurrency 1, over a mean context of
    # p + (r + (p + longest) - p) / 2 = 10 + (20 + 60 - 10) / 2 = 45 tokens
    w = 2 * LAYER_TP2 + TOP_TP2
    n = LAYER_TP2 * 2 + TOP_TP2  # params of the last (heaviest) rank, embedding on the first
    got = fixed_raw(M, ACTOR_GEN, Layout(2, 2), W, CL, Links(tp_intra=True, pp_intra=False))
    _approx(got, [
        (OpClass.MEMORY_BOUND, w * 2.0 * 30, 1e10, 0.0, 0.0),
        (OpClass.ATTENTION_DECODE, 45.0 * 30 * 128, 1e10, 0.0, 0.0),  # 2 layers x 1 KV head x 16 x 2 x 2 B
        (OpClass.DECODE_OVERHEAD, 30 * DECODE_SEQUENCE_OVERHEAD_S, 1.0, 0.0, 0.0),
        (OpClass.TP_ALLREDUCE_INTRA, 2 * 2 * 30 * 128 * 1.0, 7e9, 2 * 2 * 30 * 2, 1e-5),
        (OpClass.PP_SEND_INTER, 30 * 128.0, 5e8, 30.0 * 1, 3e-4),
        # the refit crosses the slower of the unit's links (PP is inter-node here), plus its set-up
        (OpClass.WEIGHT_SYNC, n * 2.0, 5e8, 1.0, 0.25),
    ])
    # no tail when every response has the mean length; the refit alone, over the intra-node link
    flat = Workload(prompts_per_step=4, prompt_tokens=10, response_tokens=20)
    _approx(fixed_raw(M, ACTOR_GEN, Layout(1, 1), flat, CL, Links()),
            [(OpClass.WEIGHT_SYNC, (4 * LAYER + 64_000 + TOP) * 2.0, 7e9, 1.0, 0.25)])
    # a sleeping inference stage copies its weights out and back each step; nothing else is fixed
    sleeper = ModelStage("ref-inf", Role.REFERENCE, StageKind.INFERENCE, sleeps=True)
    _approx(fixed_raw(M, sleeper, Layout(1, 1), W, CL, Links()),
            [(OpClass.HOST_COPY, 2.0 * (4 * LAYER + 64_000 + TOP) * 2, 3e9, 0.0, 0.0)])
    assert fixed_raw(M, REF_INF, Layout(1, 1), W, CL, Links()) == []
    assert fixed_raw(M, ACTOR_TRAIN, Layout(1, 1), W, CL, Links()) == []


def test_the_tail_of_a_one_gpu_replica_and_of_a_reward_generation_stage() -> None:
    got = fixed_raw(M, ACTOR_GEN, Layout(1, 1), W, EAGER, Links())
    assert [t[0] for t in got] == [OpClass.MEMORY_BOUND, OpClass.ATTENTION_DECODE, OpClass.DECODE_OVERHEAD,
                                   OpClass.LAUNCH_DECODE, OpClass.WEIGHT_SYNC]
    plain4 = 4 * LAUNCHES_PER_LAYER + LAUNCHES_PER_PASS
    assert got[3][1] == pytest.approx(30 * (plain4 + LAUNCHES_PER_SAMPLE))


def test_dp_exposed_share_is_what_the_last_backward_cannot_hide_and_at_least_the_last_bucket() -> None:
    assert dp_exposed_fraction(0.0, 5.0, 10**9) == 0.0
    big = 2 * DP_BUCKET_PARAMS  # the last bucket is half the gradients
    assert dp_exposed_fraction(10.0, 4.0, big) == pytest.approx(0.6)
    assert dp_exposed_fraction(10.0, 8.0, big) == pytest.approx(0.5)
    assert dp_exposed_fraction(10.0, 0.0, big) == pytest.approx(1.0)
    assert dp_exposed_fraction(10.0, 8.0, DP_BUCKET_PARAMS // 2) == 1.0  # one bucket: nothing hidden
    assert dp_exposed_fraction(10.0, 8.0, 0) == 1.0


def test_the_optimizer_step_and_the_dp_all_reduce() -> None:
    n = 4 * LAYER + 64_000 + TOP
    assert sync_raw(M, REF_INF, Layout(1, 1), 4, CL, Links()) == []
    assert sync_terms(M, ACTOR_GEN, Layout(1, 1), 4, CL, Links()) == ()
    # Adam reads and writes 16 B per parameter; no all-reduce alone
    _approx(sync_raw(M, ACTOR_TRAIN, Layout(1, 1), 1, CL, Links()),
            [(OpClass.MEMORY_BOUND, 2.0 * n * 16, 1e10, 0.0, 0.0)])
    # DP4 over the inter-node link: a ring moves 1.5x the bf16 gradients, a tree of 4 takes 4 hops; the
    # group's 4 members on each 4-GPU node drive 4 NICs at once (planner.cost.dp_rails)
    got = sync_raw(M, ACTOR_TRAIN, Layout(1, 1), 4, CL, Links(dp_intra=False))
    _approx(got, [(OpClass.MEMORY_BOUND, 2.0 * n * 16, 1e10, 0.0, 0.0),
                  (OpClass.DP_ALLREDUCE_INTER, n * 2 * 1.5, 4 * 5e8, 4.0, 3e-4)])
    # TP2 replicas: 2 of a group's members per node, 2 NICs; a TP4 replica fills the node: one NIC
    n2 = params_per_gpu(M, Head.LM, Layout(2, 1))
    _approx(sync_raw(M, ACTOR_TRAIN, Layout(2, 1), 4, CL, Links(dp_intra=False))[-1:],
            [(OpClass.DP_ALLREDUCE_INTER, n2 * 2 * 1.5, 2 * 5e8, 4.0, 3e-4)])
    n4 = params_per_gpu(M, Head.LM, Layout(4, 1))
    _approx(sync_raw(M, ACTOR_TRAIN, Layout(4, 1), 4, CL, Links(dp_intra=False))[-1:],
            [(OpClass.DP_ALLREDUCE_INTER, n4 * 2 * 1.5, 5e8, 4.0, 3e-4)])
    assert [dp_rails(CL, Layout(t, p)) for t, p in ((1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (4, 2))] == [
        4, 2, 2, 1, 1, 1]
    got = sync_raw(M, ACTOR_TRAIN, Layout(1, 1), 2, CL, Links())
    _approx(got[-1:], [(OpClass.DP_ALLREDUCE_INTRA, n * 2 * 1.0, 7e9, 2.0, 1e-5)])
    # eager: the optimizer's launches between the update and the all-reduce (which stays last)
    plain, dist = optimizer_launches(M, Layout(2, 1))
    got = sync_raw(M, ACTOR_TRAIN, Layout(2, 1), 2, EAGER, Links())
    assert [t[0] for t in got] == [OpClass.MEMORY_BOUND, OpClass.LAUNCH_BACKWARD, OpClass.LAUNCH_DISTRIBUTED,
                                   OpClass.DP_ALLREDUCE_INTRA]
    assert (got[1][1], got[2][1]) == (plain, dist)
    assert [t[0] for t in sync_raw(M, ACTOR_TRAIN, Layout(1, 1), 1, EAGER, Links())] == [
        OpClass.MEMORY_BOUND, OpClass.LAUNCH_BACKWARD]
    terms = sync_terms(M, ACTOR_TRAIN, Layout(1, 1), 4, CL, Links(dp_intra=False))
    assert [(t.op_class, t.work, t.messages) for t in terms] == [
        (OpClass.MEMORY_BOUND, 2.0 * n * 16, 0.0), (OpClass.DP_ALLREDUCE_INTER, n * 2 * 1.5, 4.0)]


def test_the_roofline_keeps_the_slower_of_the_decode_pair() -> None:
    gemm = OpTerm(op_class=OpClass.GEMM, work=10.0, peak_per_s=1.0)
    mem = OpTerm(op_class=OpClass.MEMORY_BOUND, work=10.0, peak_per_s=1.0)
    other = OpTerm(op_class=OpClass.ATTENTION_DECODE, work=1.0, peak_per_s=1.0)
    eff = {OpClass.GEMM: 0.5, OpClass.MEMORY_BOUND: 0.25, OpClass.ATTENTION_DECODE: 1.0}
    assert roofline((gemm, mem, other), eff) == (mem, other)  # 40 s of reads hide 20 s of GEMMs
    eff[OpClass.MEMORY_BOUND] = 1.0
    assert roofline((gemm, mem, other), eff) == (gemm, other)
    eff[OpClass.MEMORY_BOUND] = 0.5  # a tie keeps the GEMM
    assert roofline((gemm, mem, other), eff) == (gemm, other)
    assert roofline((gemm, other), eff) == (gemm, other)
    assert roofline((mem, other), eff) == (mem, other)


def test_repeats_count_the_bubble_and_the_mini_batches() -> None:
    w2 = Workload(prompts_per_step=4, prompt_tokens=10, response_tokens=20, train_mini_batches_per_step=2)
    assert repeats(ACTOR_TRAIN, Layout(1, 3), 4, w2) == (2 * (4 + 2), 2.0)
    assert repeats(REF_INF, Layout(1, 3), 4, w2) == (4 + 2, 1.0)


def test_backward_seconds_is_what_the_dp_all_reduce_hides_behind() -> None:
    b, s = 2, 30
    w = 4 * LAYER + TOP
    assert backward_seconds(M, REF_INF, Layout(1, 1), W, b, False, CL, EFF) == 0.0
    for recompute, passes in ((False, 2), (True, 3)):
        want = (passes * 2.0 * w * b * s / (1e12 * EFF[OpClass.GEMM])
                + passes * 2.0 * b * s**2 * 128 * 4 / (1e12 * EFF[OpClass.ATTENTION_PREFILL]))
        assert backward_seconds(M, ACTOR_TRAIN, Layout(1, 1), W, b, recompute, CL, EFF) == pytest.approx(want)


def test_stage_cost_assembles_repeats_roofline_exposed_all_reduce_and_fixed_terms() -> None:
    b, m, mini, dp = 2, 3, 2, 4
    w2 = Workload(prompts_per_step=8, prompt_tokens=10, response_tokens=20, max_response_tokens=50,
                  train_mini_batches_per_step=mini)
    layout, links = Layout(1, 2), Links(dp_intra=False)
    c = stage_cost(M, ACTOR_TRAIN, layout, w2, micro_batch_size=b, grad_accum=m, recompute=False, dp=dp,
                   cluster=CL, links=links, eff=EFF)
    mb = sum(raw_seconds(t, EFF) for t in microbatch_raw(M, ACTOR_TRAIN, layout, w2, b, False, CL, links))
    update, ar = sync_raw(M, ACTOR_TRAIN, layout, dp, CL, links)
    n = 2 * LAYER + TOP  # the last PP rank
    bwd = backward_seconds(M, ACTOR_TRAIN, layout, w2, b, False, CL, EFF)
    exposed = dp_exposed_fraction(raw_seconds(ar, EFF), bwd, n)
    assert exposed == 1.0  # so small a model fits one bucket: nothing hidden
    rep = (m + 2 - 1) * mini
    want = rep * mb + mini * (raw_seconds(update, EFF) + exposed * raw_seconds(ar, EFF))
    assert c.seconds == pytest.approx(want, rel=1e-12)
    assert c.bubble_s == pytest.approx(mb * (2 - 1) * mini, rel=1e-12)
    assert sorted(t.repeat for t in c.terms) == sorted([float(rep)] * 3 + [float(mini)] * 2)  # GEMM, attention, PP sends
    # generation: the roofline drops the cheaper of the decode pair; the tail and refit are added once
    g = stage_cost(M, ACTOR_GEN, Layout(1, 1), w2, micro_batch_size=b, grad_accum=2, recompute=False, dp=dp,
                   cluster=CL, links=Links(), eff=EFF)
    raw = microbatch_raw(M, ACTOR_GEN, Layout(1, 1), w2, b, False, CL, Links())
    pair = max(raw_seconds(raw[0], EFF), raw_seconds(raw[1], EFF))
    fixed = sum(raw_seconds(t, EFF) for t in fixed_raw(M, ACTOR_GEN, Layout(1, 1), w2, CL, Links()))
    assert g.seconds == pytest.approx(2 * (pair + sum(raw_seconds(t, EFF) for t in raw[2:])) + fixed, rel=1e-12)
    assert g.bubble_s == 0.0
    assert [t.op_class for t in g.terms].count(OpClass.GEMM) == 1  # the decode GEMMs are hidden


def test_stage_cost_hides_part_of_a_large_models_all_reduce_behind_its_backward() -> None:
    big = ModelSpec(name="big", num_layers=8, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
                    head_dim=128, ffn_hidden_size=14336, vocab_size=32000, tie_word_embeddings=False,
                    rope_theta=10_000.0)
    w1 = Workload(prompts_per_step=16, prompt_tokens=512, response_tokens=512)
    eff = {**EFF, OpClass.DP_ALLREDUCE_INTER: 0.9}
    kw = dict(micro_batch_size=4, grad_accum=1, recompute=False, cluster=CL, links=Links(dp_intra=False), eff=eff)
    one = stage_cost(big, CRITIC_TRAIN, Layout(1, 1), w1, dp=1, **kw)  # type: ignore[arg-type]
    four = stage_cost(big, CRITIC_TRAIN, Layout(1, 1), w1, dp=4, **kw)  # type: ignore[arg-type]
    ar = sync_raw(big, CRITIC_TRAIN, Layout(1, 1), 4, CL, Links(dp_intra=False))[-1]
    bwd = backward_seconds(big, CRITIC_TRAIN, Layout(1, 1), w1, 4, False, CL, eff)
    full = raw_seconds(ar, eff)
    share = dp_exposed_fraction(full, bwd, params_per_gpu(big, Head.VALUE, Layout(1, 1)))
    assert 0.0 < share < 1.0  # the premise: part hidden, part exposed
    assert four.seconds - one.seconds == pytest.approx(share * full, rel=1e-9)
    assert four.terms[-1].repeat == pytest.approx(share)


def test_by_class_spreads_the_bubble_out_of_the_classes() -> None:
    t1 = OpTerm(op_class=OpClass.GEMM, work=6.0, peak_per_s=1.0)
    t2 = OpTerm(op_class=OpClass.PP_SEND_INTRA, work=2.0, peak_per_s=1.0)
    t3 = OpTerm(op_class=OpClass.GEMM, work=2.0, peak_per_s=1.0)
    eff = {OpClass.GEMM: 1.0, OpClass.PP_SEND_INTRA: 1.0}
    c = StageCost(seconds=10.0, terms=(t1, t2, t3), bubble_s=2.5)
    assert c.by_class(eff) == pytest.approx({"gemm": 8.0 * 0.75, "pp_send_intra": 2.0 * 0.75,
                                             "pipeline_bubble": 2.5})
    assert StageCost(seconds=10.0, terms=(t1, t2), bubble_s=0.0).by_class(eff) == {"gemm": 6.0,
                                                                                    "pp_send_intra": 2.0}


M5 = ModelSpec(name="m5", num_layers=5, hidden_size=64, num_attention_heads=8, num_kv_heads=2, head_dim=16,
               ffn_hidden_size=96, vocab_size=1000, tie_word_embeddings=False, rope_theta=10_000.0)


def test_the_gemm_parameters_are_the_slowest_pp_ranks_with_uneven_stages() -> None:
    # 5 layers over PP2: 3 on the first rank, 2 and the head on the last. The LM head (64,064) outweighs
    # a layer, so the last rank is slowest; a value head (128) does not, so the first rank is.
    b, s = 1, 30
    lm = microbatch_raw(M5, REF_INF, Layout(1, 2), W, b, False, CL, Links())[0]
    assert lm[1] == pytest.approx(2.0 * (2 * LAYER + TOP) * b * s)
    critic = ModelStage("critic-inf", Role.CRITIC, StageKind.INFERENCE)
    value = microbatch_raw(M5, critic, Layout(1, 2), W, b, False, CL, Links())[0]
    assert value[1] == pytest.approx(2.0 * (3 * LAYER) * b * s)
    one = microbatch_raw(M5, critic, Layout(1, 1), W, b, False, CL, Links())[0]
    assert one[1] == pytest.approx(2.0 * (5 * LAYER + VALUE_TOP) * b * s)


def test_a_tp_decode_step_on_the_eager_device_carries_its_distributed_calls() -> None:
    # TP2, 4 layers: 7 DTensor linears per layer and 2 at the ends, 2 collectives per layer and 2 at the ends
    got = microbatch_raw(M, ACTOR_GEN, Layout(2, 1), W, 3, False, EAGER, Links())
    assert got[-1][0] is OpClass.LAUNCH_DISTRIBUTED
    assert got[-1][1] == pytest.approx(20.0 * ((7 * 4 + 2) * TP_LINEAR_LAUNCHES + (2 * 4 + 2) * COLLECTIVE_LAUNCHES))


def test_the_tail_over_four_tp_ranks_and_four_pp_stages_and_a_one_token_tail() -> None:
    # TP4 x PP4 of 4 layers: 1 layer per rank; ring over 4 ranks moves 1.5x; a tail step crosses 3 PP hops
    got = fixed_raw(M, ACTOR_GEN, Layout(4, 4), W, CL, Links())
    tp_term = next(t for t in got if t[0] is OpClass.TP_ALLREDUCE_INTRA)
    assert tp_term[1:4] == pytest.approx((2 * 1 * 30 * 128 * 1.5, 7e9, 2 * 1 * 30 * 4))
    pp_term = next(t for t in got if t[0] is OpClass.PP_SEND_INTRA)
    assert pp_term[1:4] == pytest.approx((30 * 128.0, 7e9, 30.0 * 3))
    one = Workload(prompts_per_step=4, prompt_tokens=10, response_tokens=20, max_response_tokens=21)
    got = fixed_raw(M, ACTOR_GEN, Layout(1, 1), one, CL, Links())
    assert [t[0] for t in got] == [OpClass.MEMORY_BOUND, OpClass.ATTENTION_DECODE, OpClass.DECODE_OVERHEAD,
                                   OpClass.WEIGHT_SYNC]
    assert got[0][1] == pytest.approx((4 * LAYER + TOP) * 2.0)


def test_on_the_eager_device_only_the_dp_all_reduce_is_partly_hidden() -> None:
    # the optimizer's launch terms sit between the update and the all-reduce: only the last term is scaled
    b, dp = 2, 2
    c = stage_cost(M, ACTOR_TRAIN, Layout(2, 1), W, micro_batch_size=b, grad_accum=2, recompute=False, dp=dp,
                   cluster=EAGER, links=Links(), eff=EFF)
    sync = sync_raw(M, ACTOR_TRAIN, Layout(2, 1), dp, EAGER, Links())
    assert len(sync) == 4
    bwd = backward_seconds(M, ACTOR_TRAIN, Layout(2, 1), W, b, False, EAGER, EFF)
    n = params_per_gpu(M, Head.LM, Layout(2, 1))
    exposed = dp_exposed_fraction(raw_seconds(sync[-1], EFF), bwd, n)
    assert [(t.op_class, t.repeat) for t in c.terms[-4:]] == [
        (OpClass.MEMORY_BOUND, 1.0), (OpClass.LAUNCH_BACKWARD, 1.0), (OpClass.LAUNCH_DISTRIBUTED, 1.0),
        (OpClass.DP_ALLREDUCE_INTRA, exposed)]


def test_by_class_with_a_small_bubble_and_a_short_stage() -> None:
    t1 = OpTerm(op_class=OpClass.GEMM, work=0.6, peak_per_s=1.0)
    t2 = OpTerm(op_class=OpClass.PP_SEND_INTRA, work=0.2, peak_per_s=1.0)
    eff = {OpClass.GEMM: 1.0, OpClass.PP_SEND_INTRA: 1.0}
    got = StageCost(seconds=0.8, terms=(t1, t2), bubble_s=0.2).by_class(eff)
    assert got == pytest.approx({"gemm": 0.45, "pp_send_intra": 0.15, "pipeline_bubble": 0.2})
    # nothing ran: no classes, and no bubble to spread (no division by the zero total)
    assert StageCost(seconds=0.0, terms=(), bubble_s=0.5).by_class(eff) == {}
