"""Candidate tables: the affine read-off matches the cost and memory models row by row; frontier rules."""

from __future__ import annotations

import numpy as np
import pytest
from planner_jobs import h200, job

from planner.cost import PRIORS, Links, stage_cost
from planner.memory import transient_bytes
from planner.options import TRANSIENT_SLACK_BYTES, OptionRules, batch_sequences, frontier, option_table
from planner.plan import Layout


@pytest.mark.parametrize("algo,stage", [("ppo", "actor-gen"), ("ppo", "ref-inf"), ("ppo", "critic-train"),
                                        ("remax", "actor-gen-greedy")])
def test_rows_match_cost_and_memory_models(algo: str, stage: str) -> None:
    j = job(algo, prompts=64, response_tokens=2048, mini_batches=2 if algo == "ppo" else 1)
    cl = h200(32)
    ms = j.workflow.stage(stage)
    table = option_table(j, ms, cl, 32, PRIORS, OptionRules(allow_recompute=True))
    assert len(table) > 20
    rng = np.random.default_rng(0)
    for i in rng.choice(len(table), size=25, replace=False):
        o = table.option(int(i))
        gpn = cl.gpus_per_node
        links = Links(tp_intra=o.layout.tp <= gpn, pp_intra=o.layout.size <= gpn, dp_intra=o.num_gpus <= gpn)
        exact = stage_cost(j.model_of(ms), ms, o.layout, j.workload, micro_batch_size=o.micro_batch_size,
                           grad_accum=o.grad_accum, recompute=o.recompute, dp=o.dp, cluster=cl, links=links,
                           eff=PRIORS)
        assert o.seconds == pytest.approx(exact.seconds, rel=1e-9)
        t = transient_bytes(j.model_of(ms), ms, o.layout, j.workload, o.micro_batch_size, o.grad_accum,
                            o.recompute).total_bytes
        assert t <= o.transient_bytes <= t + TRANSIENT_SLACK_BYTES + 16
        assert o.dp * o.micro_batch_size * o.grad_accum == batch_sequences(j, ms)


def test_only_training_recomputes_and_tp_stays_in_a_node() -> None:
    j = job("ppo", prompts=64)
    cl = h200(32)
    for ms in j.workflow.model_stages:
        t = option_table(j, ms, cl, 32, PRIORS, OptionRules(allow_recompute=True))
        assert bool(t.recompute.any()) == (ms.kind.value == "training")
        assert int(t.tp.max()) <= cl.gpus_per_node
        wide = option_table(j, ms, cl, 32, PRIORS, OptionRules(allow_cross_node_tp=True))
        assert int(wide.tp.max()) > cl.gpus_per_node


def test_frontier_keeps_what_no_other_row_beats() -> None:
    j = job("ppo", prompts=64)
    ms = j.workflow.stage("actor-gen")
    full = option_table(j, ms, h200(16), 16, PRIORS)
    kept = frontier(full, tolerance=0.0)
    assert 0 < len(kept) < len(full)
    rows = list(zip(kept.gpus.tolist(), kept.resident.tolist(), kept.transient.tolist(), kept.seconds.tolist()))
    # every dropped row has a kept row with the same GPUs and resident bytes, no slower and no larger
    for i in range(len(full)):
        g, r, t, s = int(full.gpus[i]), int(full.resident[i]), int(full.transient[i]), float(full.seconds[i])
        assert any(kg == g and kr == r and kt <= t and ks <= s for kg, kr, kt, ks in rows)
    assert Layout(1, 1) in {Layout(int(a), int(b)) for a, b in zip(full.tp, full.pp)}


def test_cached_lines_follow_efficiencies_and_workload() -> None:
    """Tables reuse per-layout lines across calls: a change of efficiencies or workload must not."""
    from planner.cost import Efficiencies, OpClass

    cl = h200(32)
    slow = Efficiencies({OpClass.GEMM: 0.2, OpClass.DP_ALLREDUCE_INTRA: 0.3})
    for j in (job("ppo", prompts=64, response_tokens=2048), job("ppo", prompts=64, response_tokens=3000)):
        ms = j.workflow.stage("actor-train")
        for eff in (PRIORS, slow, PRIORS):
            table = option_table(j, ms, cl, 32, eff)
            for i in range(0, len(table), max(1, len(table) // 10)):
                o = table.option(i)
                gpn = cl.gpus_per_node
                links = Links(tp_intra=o.layout.tp <= gpn, pp_intra=o.layout.size <= gpn, dp_intra=o.num_gpus <= gpn)
                exact = stage_cost(j.model_of(ms), ms, o.layout, j.workload, micro_batch_size=o.micro_batch_size,
                                   grad_accum=o.grad_accum, recompute=o.recompute, dp=o.dp, cluster=cl, links=links,
                                   eff=eff)
                assert o.seconds == pytest.approx(exact.seconds, rel=1e-9)


def test_lines_are_shared_across_node_counts_and_match_fresh_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout's line never reads the number of nodes, so a replan after nodes join or leave (the daemon's
    cluster grows with its highest node) reuses the lines: none is costed again, and every table is the
    one a cold cache builds. A change of node size or device still makes lines of its own."""
    import planner.options as options

    j = job("ppo", prompts=64, response_tokens=2176)
    made: list[object] = []
    real = options._layout_line

    def counted(*args: object) -> object:
        made.append(args[5])  # the cluster the line is made from
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(options, "_layout_line", counted)
    for ms in (j.workflow.stage("actor-train"), j.workflow.stage("actor-gen")):
        options._LINES_CACHE.clear()
        first = option_table(j, ms, h200(64), 32, PRIORS)
        assert made and all(c.num_nodes == 1 and c.gpus_per_node == 8 for c in made)  # type: ignore[attr-defined]
        made.clear()
        for gpus in (128, 72):
            again = option_table(j, ms, h200(gpus), 32, PRIORS)
            assert not made  # every line reused
            for col in ("tp", "pp", "dp", "b", "g", "recompute", "seconds", "gpus", "resident", "transient"):
                assert np.array_equal(getattr(again, col), getattr(first, col)), col
        options._LINES_CACHE.clear()
        cold = option_table(j, ms, h200(128), 32, PRIORS)
        assert made
        assert np.array_equal(cold.seconds, first.seconds) and np.array_equal(cold.transient, first.transient)
        made.clear()
        option_table(j, ms, h200(64, gpus_per_node=4), 32, PRIORS)  # another node size: lines of its own
        assert made and all(c.gpus_per_node == 4 for c in made)  # type: ignore[attr-defined]
        made.clear()


@pytest.mark.parametrize("stage", ["actor-gen", "ref-inf", "actor-train"])
def test_a_layout_line_reads_no_node_count(stage: str) -> None:
    """What sharing lines across node counts rests on: each layout's line, costed on clusters of 1, 4 and
    128 nodes, is the same tuple."""
    from planner.options import _layout_line
    from planner.search import usable_bytes

    j = job("ppo", prompts=64, response_tokens=2048)
    ms = j.workflow.stage(stage)
    fitted = 0
    for tp, pp, rec in ((1, 1, False), (2, 4, False), (8, 2, True), (4, 8, True)):
        got = {_layout_line(j.model_of(ms), ms, Layout(tp, pp), j.workload, rec, cl, PRIORS, usable_bytes(cl))
               for cl in (h200(8), h200(32), h200(1024))}
        assert len(got) == 1, (tp, pp, rec)
        fitted += None not in got
    assert fitted >= 3


def test_a_new_workload_reuses_the_workload_free_part_of_each_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A length drift re-costs every layout's line but not its resident bytes, optimizer step and DP
    all-reduce (no workload reads them): those are made once per model-stage, cluster and efficiencies,
    and the tables are the ones a cold cache builds."""
    import planner.options as options
    from planner.cost import Efficiencies, OpClass

    made: list[tuple[int, int]] = []
    real = options._unit_part

    def counted(model, ms, layout, *rest):  # type: ignore[no-untyped-def]
        made.append((layout.tp, layout.pp))
        return real(model, ms, layout, *rest)

    monkeypatch.setattr(options, "_unit_part", counted)
    options._UNITS_CACHE.clear()
    first, second = job("ppo", prompts=64, response_tokens=2000), job("ppo", prompts=64, response_tokens=2100)
    ms = first.workflow.stage("actor-train")
    option_table(first, ms, h200(32), 32, PRIORS, OptionRules(allow_recompute=True))
    layouts = len(made)
    assert layouts == len(set(made)) > 4  # once per (tp, pp): recomputation shares them
    warm = option_table(second, ms, h200(64), 32, PRIORS, OptionRules(allow_recompute=True))
    assert len(made) == layouts  # another workload, another node count: none made again
    option_table(second, ms, h200(32), 32, Efficiencies({OpClass.DP_ALLREDUCE_INTRA: 0.3}))
    assert len(made) > layouts  # other efficiencies: made for them
    options._LINES_CACHE.clear()
    options._UNITS_CACHE.clear()
    cold = option_table(second, ms, h200(64), 32, PRIORS, OptionRules(allow_recompute=True))
    for col in ("tp", "pp", "dp", "b", "g", "recompute", "seconds", "gpus", "resident", "transient"):
        assert np.array_equal(getattr(warm, col), getattr(cold, col)), col
    line = options._layout_line(second.model_of(ms), ms, Layout(2, 4), second.workload, False, h200(8), PRIORS, 1e12)
    assert line is not None and line[0] > 0 and len(line) == 19  # without a cache of parts: made on the spot
