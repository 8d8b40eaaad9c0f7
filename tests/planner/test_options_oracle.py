"""Every row of a candidate table against the cost and memory models evaluated directly, and the table
against a brute-force enumeration (planner/options.py), on a small model and a two-node cluster whose
device makes decode compute-bound at large micro-batches and weight-read bound at small ones (so both
sides of the roofline are read off the lines), with TP across nodes and DP both inside and across
nodes, on a GPU-like device and on the eager one (whose optimizer launch terms sit before the DP
all-reduce). Plus the frontier's rules on hand-made tables. Found by mutation testing
(tests/mutate.py --module planner/options.py: 52 of 700 mutants survived the tests that sampled
rows of an H200 table, where decode is always weight-read bound and a model never fits one bucket)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from planner_jobs import INTER_LINK, INTRA_LINK, SMALL

from planner.cost import Links, OpClass, stage_cost
from planner.hardware import ClusterSpec, DeviceSpec
from planner.memory import HEADROOM_FRACTION, WORKSPACE_BYTES, resident_bytes, transient_bytes
from planner.options import (
    TRANSIENT_SLACK_BYTES,
    OptionRules,
    OptionTable,
    batch_sequences,
    frontier,
    option_table,
)
from planner.plan import Layout
from planner.workflow import Workload, same_model_job, workflow_preset

M = SMALL
W = Workload(prompts_per_step=8, samples_per_prompt=2, prompt_tokens=10, response_tokens=20,
             max_response_tokens=50, train_mini_batches_per_step=2)
JOB = same_model_job(workflow_preset("ppo"), M, W)
INTRA = INTRA_LINK
INTER = INTER_LINK
# decode GEMM / weight read per micro-batch = b x hbm/peak x eff(memory)/eff(gemm) = b x 0.25 x 2.01 here
ROOF = DeviceSpec(name="roof", memory_bytes=4 * 1024**3, peak_flops_bf16=4e10, hbm_bytes_per_s=1e10,
                  gemm_half_tokens=0.0, gemm_half_width=0.0)
EAGER = DeviceSpec(name="cpu", memory_bytes=4 * 1024**3, peak_flops_bf16=2e10, hbm_bytes_per_s=1e10,
                   gemm_half_tokens=0.0, gemm_half_width=0.0)
EFF = {c: 0.11 + 0.037 * i for i, c in enumerate(OpClass)}
WIDE = OptionRules(allow_recompute=True, allow_cross_node_tp=True)


def _cluster(device: DeviceSpec) -> ClusterSpec:
    return ClusterSpec(device=device, num_nodes=2, gpus_per_node=4, intra_node_link=INTRA, inter_node_link=INTER)


def _usable(cl: ClusterSpec) -> float:
    return cl.device.memory_bytes / (1 + HEADROOM_FRACTION) - WORKSPACE_BYTES


def _check_rows(table: OptionTable, stage: str, cl: ClusterSpec) -> None:
    ms = JOB.workflow.stage(stage)
    gpn = cl.gpus_per_node
    assert table.model_stage == stage
    assert table.recompute.dtype == np.bool_ and table.transient.dtype == np.int64
    assert table.tp.dtype == np.int64 and table.resident.dtype == np.int64
    for o in table.options():
        links = Links(tp_intra=o.layout.tp <= gpn, pp_intra=o.layout.size <= gpn, dp_intra=o.num_gpus <= gpn)
        exact = stage_cost(M, ms, o.layout, W, micro_batch_size=o.micro_batch_size, grad_accum=o.grad_accum,
                           recompute=o.recompute, dp=o.dp, cluster=cl, links=links, eff=EFF)
        assert o.seconds == pytest.approx(exact.seconds, rel=1e-9), o
        t = transient_bytes(M, ms, o.layout, W, o.micro_batch_size, o.grad_accum, o.recompute).total_bytes
        assert t <= o.transient_bytes <= t + TRANSIENT_SLACK_BYTES + 16, o
        assert o.resident_bytes == resident_bytes(M, ms, o.layout).total_bytes
        assert o.num_gpus == o.dp * o.layout.size


def _enumerated(stage: str, cl: ClusterSpec, n: int, rules: OptionRules, margins: list[float] | None = None
                ) -> set[tuple[int, ...]]:
    """Every (tp, pp, dp, b, g, recompute) the table should hold, by brute force over the rules: its
    resident and transient bytes (plus the table's slack) fit the usable memory. ``margins`` collects
    each candidate's distance to that bound."""
    ms = JOB.workflow.stage(stage)
    seqs = batch_sequences(JOB, ms)
    max_tp = n if rules.allow_cross_node_tp else min(n, cl.gpus_per_node)
    recs = (False, True) if rules.allow_recompute and ms.kind.value == "training" else (False,)
    out: set[tuple[int, ...]] = set()
    for tp, pp, dp, b, rec in itertools.product((1, 2, 4, 8), (1, 2, 4), range(1, n + 1), range(1, seqs + 1), recs):
        if tp > max_tp or pp > M.num_layers or tp * pp * dp > n or seqs % (dp * b):
            continue
        g = seqs // (dp * b)
        need = resident_bytes(M, ms, Layout(tp, pp)).total_bytes + transient_bytes(
            M, ms, Layout(tp, pp), W, b, g, rec).total_bytes + TRANSIENT_SLACK_BYTES
        if margins is not None:
            margins.append(abs(_usable(cl) - need))
        if need <= _usable(cl):
            out.add((tp, pp, dp, b, g, int(rec)))
    return out


def _rows(table: OptionTable) -> set[tuple[int, ...]]:
    return set(zip(table.tp.tolist(), table.pp.tolist(), table.dp.tolist(), table.b.tolist(), table.g.tolist(),
                   table.recompute.astype(int).tolist()))


@pytest.mark.parametrize("stage", ["actor-gen", "ref-inf", "actor-train", "critic-train"])
def test_every_row_is_the_models_own_figure_and_every_candidate_is_there(stage: str) -> None:
    cl = _cluster(ROOF)
    table = option_table(JOB, JOB.workflow.stage(stage), cl, 8, EFF, WIDE)
    _check_rows(table, stage, cl)
    assert _rows(table) == _enumerated(stage, cl, 8, WIDE)
    assert int(table.tp.max()) == 8  # TP across the two nodes, on the inter-node link
    assert int((table.gpus > 4).sum()) > 0 and int((table.gpus <= 4).sum()) > 0


@pytest.mark.parametrize("stage,room", [("actor-train", 2_800_000), ("ref-inf", 1_150_000), ("actor-gen", 360_000)])
def test_on_a_small_memory_exactly_the_candidates_that_fit_are_there(stage: str, room: int) -> None:
    # ``room`` bytes per GPU left after the 2 GiB workspace and 10% headroom: about half the candidates fit
    tight = DeviceSpec(name="tight", memory_bytes=int((WORKSPACE_BYTES + room) * (1 + HEADROOM_FRACTION)),
                       peak_flops_bf16=4e10, hbm_bytes_per_s=1e10, gemm_half_tokens=0.0, gemm_half_width=0.0)
    cl, roomy = _cluster(tight), _enumerated(stage, _cluster(ROOF), 8, WIDE)
    margins: list[float] = []
    want = _enumerated(stage, cl, 8, WIDE, margins)
    assert 0 < len(want) < len(roomy)  # the premise: the bound bites
    assert min(margins) > 64  # no candidate within the read-off's rounding of the bound
    table = option_table(JOB, JOB.workflow.stage(stage), cl, 8, EFF, WIDE)
    assert _rows(table) == want
    _check_rows(table, stage, cl)


def test_decode_crosses_the_roofline_inside_one_table() -> None:
    """The premise of the test above: at b = 1 the weight read dominates, at b = 16 the decode GEMMs."""
    from planner.cost import microbatch_raw, raw_seconds

    ms = JOB.workflow.stage("actor-gen")
    cl = _cluster(ROOF)
    for b, gemm_wins in ((1, False), (16, True)):
        gemm, mem = microbatch_raw(M, ms, Layout(1, 1), W, b, False, cl, Links())[:2]
        assert (raw_seconds(gemm, EFF) > raw_seconds(mem, EFF)) is gemm_wins


def test_rows_on_the_eager_device_price_its_launches_and_the_dp_all_reduce() -> None:
    cl = _cluster(EAGER)
    for stage in ("actor-train", "actor-gen"):
        table = option_table(JOB, JOB.workflow.stage(stage), cl, 8, EFF, WIDE)
        assert len(table) > 50
        _check_rows(table, stage, cl)


def test_tp_stays_in_a_node_unless_the_urgent_rules_allow_it() -> None:
    cl = _cluster(ROOF)
    table = option_table(JOB, JOB.workflow.stage("ref-inf"), cl, 8, EFF, OptionRules())
    assert _rows(table) == _enumerated("ref-inf", cl, 8, OptionRules())
    assert int(table.tp.max()) == 4


def test_nothing_fits_gives_an_empty_table_of_the_stage() -> None:
    tiny = DeviceSpec(name="tiny", memory_bytes=2 * 1024**3 // 1000, peak_flops_bf16=2e10, hbm_bytes_per_s=1e10)
    cl = ClusterSpec(device=tiny, num_nodes=1, gpus_per_node=2, intra_node_link=INTRA, inter_node_link=INTER)
    table = option_table(JOB, JOB.workflow.stage("actor-train"), cl, 2, EFF, WIDE)
    assert len(table) == 0 and table.model_stage == "actor-train"
    assert {k: getattr(table, k).dtype for k in ("tp", "recompute", "seconds", "transient")} == {
        "tp": np.int64, "recompute": np.bool_, "seconds": np.float64, "transient": np.int64}
    assert table.options() == []


def test_a_model_that_fits_one_gradient_bucket_hides_none_of_its_all_reduce() -> None:
    # M (~220k parameters) is one DP bucket: its all-reduce is wholly exposed, never more
    cl = _cluster(ROOF)
    table = option_table(JOB, JOB.workflow.stage("critic-train"), cl, 8, EFF)
    rows = [o for o in table.options() if o.dp == 2 and o.layout == Layout(1, 1)]
    assert rows
    for o in rows:
        one = stage_cost(M, JOB.workflow.stage("critic-train"), o.layout, W, micro_batch_size=o.micro_batch_size,
                         grad_accum=o.grad_accum, recompute=False, dp=1, cluster=cl, links=Links(), eff=EFF)
        # bf16 gradients of 4 x 39,040 + 64,000 + 128 parameters; a ring of 2 moves them once, in 2 hops
        all_reduce = (4 * 39_040 + 64_000 + 128) * 2 * 1.0 / (7e9 * EFF[OpClass.DP_ALLREDUCE_INTRA]) + 2 * 1e-5
        assert o.seconds - one.seconds == pytest.approx(W.train_mini_batches_per_step * all_reduce, rel=1e-9)


def test_batch_sequences_split_by_each_model_stage() -> None:
    assert batch_sequences(JOB, JOB.workflow.stage("actor-train")) == 8  # a mini-batch: 16 / 2
    assert batch_sequences(JOB, JOB.workflow.stage("critic-train")) == 8
    assert batch_sequences(JOB, JOB.workflow.stage("actor-gen")) == 16
    assert batch_sequences(JOB, JOB.workflow.stage("ref-inf")) == 16
    remax = same_model_job(workflow_preset("remax"), M, W)
    assert batch_sequences(remax, remax.workflow.stage("actor-gen-greedy")) == 8  # one rollout per prompt


def _table(gpus: list[int], resident: list[int], transient: list[int], seconds: list[float]) -> OptionTable:
    n = len(gpus)
    ints = np.arange(n, dtype=np.int64)  # the row number rides in tp, to read which rows are kept
    return OptionTable(model_stage="s", tp=ints, pp=np.ones(n, np.int64), dp=np.ones(n, np.int64),
                       b=np.ones(n, np.int64), g=np.ones(n, np.int64), recompute=np.zeros(n, bool),
                       seconds=np.array(seconds, float), gpus=np.array(gpus, np.int64),
                       resident=np.array(resident, np.int64), transient=np.array(transient, np.int64))


def test_the_frontier_keeps_a_row_only_for_clearly_less_transient_memory() -> None:
    # one group: row 1 is slower and needs as much as row 0 (dropped), row 2 slower and needs less (kept)
    t = _table([2, 2, 2], [5, 5, 5], [100, 100, 60], [1.0, 2.0, 3.0])
    assert sorted(frontier(t, tolerance=0.0).tp.tolist()) == [0, 2]
    # seconds within the tolerance's grid step count as equal: the one needing less memory wins alone
    near = _table([2, 2], [5, 5], [100, 60], [0.5, 0.5004])
    assert sorted(frontier(near, tolerance=0.0).tp.tolist()) == [0, 1]
    assert frontier(near).tp.tolist() == [1]
    # sub-second rows 2x apart stay apart on the grid (its floor is 1e-300 s, not 1 s)
    sub = _table([2, 2], [5, 5], [100, 60], [0.2, 0.4])
    assert sorted(frontier(sub).tp.tolist()) == [0, 1]


def test_the_frontier_compares_rows_only_within_their_group() -> None:
    # group A (2 GPUs) needs at most 90 B, group B (4 GPUs) at least 10: B's rows are not dominated by A's
    # even though A's fastest row needs more memory than all of B (the groups are offset by max + 1)
    t = _table([2, 2, 4, 4, 4], [5, 5, 5, 5, 7], [90, 80, 10, 20, 10], [1.0, 2.0, 1.5, 3.0, 9.0])
    kept = sorted(frontier(t, tolerance=0.0).tp.tolist())
    assert kept == [0, 1, 2, 4]  # row 3 is slower than row 2 and needs more; row 4 is its own group
    # group B's second row needs less than its first (kept); with groups offset by less than the largest
    # transient, group A's row (0 B + the offset) would undercut it and drop it
    t = _table([2, 4, 4], [5, 5, 5], [0, 10, 9], [1.0, 1.0, 2.0])
    assert sorted(frontier(t, tolerance=0.0).tp.tolist()) == [0, 1, 2]
    assert len(frontier(_table([], [], [], []))) == 0
