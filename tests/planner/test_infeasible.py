"""Why nothing fits (planner/infeasible.py): each reason's bound is a true lower bound, attained by a
layout, and said with its exact bytes; the resident-combination bound and its waves; the search raises
this explanation. Found by mutation testing (tests/mutate.py --module planner/infeasible.py: 36% of
its mutants killed before, no test named it)."""

from __future__ import annotations

import re

import pytest

from planner.errors import InfeasibleError
from planner.hardware import cluster_preset
from planner.infeasible import _bounds, _partitions, explain_infeasible
from planner.memory import peak_total, resident_bytes, transient_bytes
from planner.models import model_preset
from planner.plan import Layout
from planner.search import search
from planner.workflow import StageKind, Workload, same_model_job, workflow_preset

GB = 1e9


def _job(model: str, algo: str = "ppo"):  # type: ignore[no-untyped-def]
    return same_model_job(workflow_preset(algo), model_preset(model),
                          Workload(prompts_per_step=64, prompt_tokens=512, response_tokens=1024))


def _layouts(model, n: int) -> list[Layout]:  # type: ignore[no-untyped-def]
    """Every TP x PP the planner can give a unit on n GPUs (powers of two, TP dividing the heads)."""
    out = []
    tp = 1
    while tp <= n:
        pp = 1
        while tp * pp <= n and pp <= model.num_layers:
            if model.valid_tp(tp):
                out.append(Layout(tp, pp))
            pp *= 2
        tp *= 2
    return out


def _peak(job, ms, layout: Layout) -> int:  # type: ignore[no-untyped-def]
    """A layout's own peak at the smallest batch: one sequence, recomputation for training."""
    model = job.model_of(ms)
    r = resident_bytes(model, ms, layout).total_bytes
    t = transient_bytes(model, ms, layout, job.workload, 1, 1, ms.kind is StageKind.TRAINING).total_bytes
    return peak_total(r, t)


@pytest.mark.parametrize("items", [[], ["a"], ["a", "b"], ["a", "b", "c"], ["a", "b", "c", "d"],
                                   ["a", "b", "c", "d", "e"]])
def test_partitions_are_every_set_partition_once(items: list[str]) -> None:
    parts = _partitions(items)
    bell = {0: 1, 1: 1, 2: 2, 3: 5, 4: 15, 5: 52}
    assert len(parts) == bell[len(items)]
    canon = {frozenset(frozenset(block) for block in p) for p in parts}
    assert len(canon) == len(parts)  # no partition twice
    for p in parts:
        assert sorted(x for block in p for x in block) == items and all(p)  # each item once, no empty block


def test_bounds_are_the_smallest_peak_resident_and_transient_over_every_layout() -> None:
    job = _job("llama-3.1-8b")
    for ms in job.workflow.model_stages:
        for n in (1, 2, 8):
            own, res, trans, layout = _bounds(job, ms, n)
            model = job.model_of(ms)
            peaks = {lay: _peak(job, ms, lay) for lay in _layouts(model, n)}
            assert own == min(peaks.values()), (ms.name, n)
            residents = {lay: resident_bytes(model, ms, lay).total_bytes for lay in peaks}
            assert res == min(residents.values()) and residents[layout] == res  # attained by its layout
            assert trans == min(transient_bytes(model, ms, lay, job.workload, 1, 1,
                                                ms.kind is StageKind.TRAINING).total_bytes for lay in peaks)
    assert _bounds(job, job.workflow.model_stages[0], 0) == (0, 0, 0, None)  # no GPU: no layout


def test_a_stage_that_cannot_fit_alone_is_named_with_its_bound_and_bytes_over() -> None:
    job, cluster = _job("llama-3.3-70b"), cluster_preset("h100", 8)
    err = explain_infeasible(job, cluster, 8)
    assert str(err).splitlines()[0] == "no plan fits in memory on 8 x h100-80gb"
    capacity = cluster.device.memory_bytes
    expected = []
    for ms in job.workflow.model_stages:
        own = min(_peak(job, ms, lay) for lay in _layouts(job.model_of(ms), 8))
        if own > capacity:
            expected.append(f"{ms.name}: needs at least {own / GB:.1f} GB per GPU even alone on 8 GPUs, "
                            f"{(own - capacity) / GB:.1f} GB ({own - capacity} bytes) over the "
                            f"{capacity / GB:.0f} GB of a h100-80gb")
    assert [r.split(":")[0] for r in expected] == ["actor-train", "critic-train"]
    assert list(err.reasons) == expected


def test_stages_that_fit_alone_but_not_together_get_the_resident_sum() -> None:
    job, cluster = _job("llama-3.3-70b"), cluster_preset("h100", 32)
    err = explain_infeasible(job, cluster, 32)
    [reason] = err.reasons
    m = re.fullmatch(r"(\S+): with every stage's resident state \((.*)\) a GPU needs at least ([\d.]+) GB, "
                     r"([\d.]+) GB \((\d+) bytes\) over the 80 GB of a h100-80gb", reason)
    assert m, reason
    # the stage named holds the largest resident bound over the job's GPUs
    residents = {ms.name: _bounds(job, ms, 32)[1] for ms in job.workflow.model_stages}
    assert m.group(1) == max(residents, key=lambda k: residents[k]) == "actor-train"
    need = int(m.group(5)) + cluster.device.memory_bytes
    assert (m.group(3), m.group(4)) == (f"{need / GB:.1f}", f"{(need - cluster.device.memory_bytes) / GB:.1f}")
    # one description per stage kind, in the workflow's order (gen; inference; training), each wave's worst
    waves = m.group(2).split("; ")
    assert [w.split(" ")[0] for w in waves] == ["actor-gen", "ref-inf", "actor-train"]
    # the bound is the sum of each kind's best split plus the largest transient: recomputed from its parts
    described = sum(float(x) for x in re.findall(r" ([\d.]+) GB \(TP", m.group(2)))
    transient = max(_bounds(job, ms, 32)[2] for ms in job.workflow.model_stages)
    assert peak_total(int(described * GB), transient) == pytest.approx(need, rel=0.01)


def test_a_wave_never_has_more_members_than_gpus() -> None:
    # PPO's three inference stages on 2 GPUs: a wave of all three would give each 0 GPUs
    [reason] = explain_infeasible(_job("llama-3.1-8b"), cluster_preset("h100", 2), 2).reasons
    assert "(None)" not in reason and " 0.0 GB" not in reason, reason


def test_when_the_bounds_fit_the_reason_says_the_budgets_do_not_combine() -> None:
    job, cluster = _job("llama-3.3-70b"), cluster_preset("h100", 64)
    [reason] = explain_infeasible(job, cluster, 64).reasons
    m = re.fullmatch(r"the model-stages' resident state and GPU budgets do not combine on 64 GPUs of 80 GB "
                     r"\(lower bound ([\d.]+) GB per GPU\)", reason)
    assert m and float(m.group(1)) * GB < cluster.device.memory_bytes, reason


def test_the_search_raises_this_explanation() -> None:
    job, cluster = _job("llama-3.3-70b"), cluster_preset("h100", 8)
    with pytest.raises(InfeasibleError) as err:
        search(job, cluster)
    assert err.value.reasons == explain_infeasible(job, cluster, 8).reasons
