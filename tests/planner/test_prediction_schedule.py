"""The plan prediction's own arithmetic (planner/prediction.py): the step's critical path over kinds
and shared GPUs, the link patterns among replicas, the slowest replica, the overhead, and the memory
verdicts. Values worked out by hand. Found by mutation testing (tests/mutate.py --module
planner/prediction.py: 43 of 237 mutants survived tests that saw only whole-step figures)."""

from __future__ import annotations

import pytest

from planner.cost import PRIORS, Links
from planner.hardware import cluster_preset
from planner.memory import MemoryBreakdown
from planner.models import model_preset
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.prediction import (
    Prediction,
    _distinct_links,
    predict,
    predict_stage,
    schedule,
    step_overhead_seconds,
)
from planner.workflow import Workload, same_model_job, workflow_preset

ONE = Layout(1, 1)
JOB = same_model_job(workflow_preset("ppo"), model_preset("tiny-3m"),
                     Workload(prompts_per_step=8, prompt_tokens=32, response_tokens=64))


def _sp(name: str, *gpu_sets: tuple[int, ...], layout: Layout = ONE) -> StagePlan:
    return StagePlan(model_stage=name, layout=layout, gpu_sets=gpu_sets, micro_batch_size=1)


def test_the_critical_path_serialises_shared_gpus_and_overlaps_disjoint_ones() -> None:
    plan = GlobalPlan(version=1, stages=(
        _sp("actor-gen", (0,), (1,), (2,), (3,)),
        _sp("ref-inf", (0,), (1,)), _sp("reward-inf", (2,), (3,)),  # disjoint: side by side
        _sp("critic-inf", (1,), (2,)),  # shares GPU 1 with ref and GPU 2 with reward: after both
        _sp("actor-train", (0,), (1,)), _sp("critic-train", (2,), (3,))))
    seconds = {"actor-gen": 5.0, "ref-inf": 1.0, "reward-inf": 3.0, "critic-inf": 2.0,
               "actor-train": 4.0, "critic-train": 6.0}
    t, starts, kinds = schedule(JOB, plan, seconds)
    assert starts == {"actor-gen": 0.0, "ref-inf": 5.0, "reward-inf": 5.0, "critic-inf": 8.0,
                      "actor-train": 10.0, "critic-train": 10.0}
    assert kinds == {"generation": 5.0, "inference": 5.0, "training": 6.0} and t == 16.0


def test_a_kind_without_members_takes_no_time() -> None:
    grpo = same_model_job(workflow_preset("grpo", learned_reward=False), model_preset("tiny-3m"), JOB.workload)
    plan = GlobalPlan(version=1, stages=(_sp("actor-gen", (0,)), _sp("ref-inf", (0,)), _sp("actor-train", (0,))))
    t, starts, kinds = schedule(grpo, plan, {"actor-gen": 2.0, "ref-inf": 0.5, "actor-train": 1.5})
    assert (t, starts["actor-train"], kinds["inference"]) == (4.0, 2.5, 0.5)


def test_link_patterns_among_replicas() -> None:
    cluster = cluster_preset("cpu", 6, gpus_per_node=2)
    inside = _sp("actor-train", (0, 1), (2, 3), layout=Layout(2, 1))
    assert _distinct_links(inside, cluster) == {Links(tp_intra=True, pp_intra=True, dp_intra=False)}
    one_node = _sp("actor-train", (0,), (1,))
    assert _distinct_links(one_node, cluster) == {Links(tp_intra=True, pp_intra=True, dp_intra=True)}
    crossing = _sp("actor-train", (0, 1), (3, 4), layout=Layout(2, 1))  # the second TP pair spans nodes 1-2
    assert _distinct_links(crossing, cluster) == {Links(tp_intra=True, pp_intra=True, dp_intra=False),
                                                    Links(tp_intra=False, pp_intra=True, dp_intra=False)}
    pp = _sp("actor-train", (0, 1), (2, 4), layout=Layout(1, 2))  # stages on one node / on two
    assert _distinct_links(pp, cluster) == {Links(tp_intra=True, pp_intra=True, dp_intra=False),
                                              Links(tp_intra=True, pp_intra=False, dp_intra=False)}


def test_a_stage_takes_its_slowest_replica() -> None:
    cluster = cluster_preset("cpu", 6, gpus_per_node=2)
    crossing = _sp("actor-train", (0, 1), (3, 4), layout=Layout(2, 1))
    inside = _sp("actor-train", (0, 1), (2, 3), layout=Layout(2, 1))
    slow, fast = predict_stage(JOB, cluster, crossing, PRIORS), predict_stage(JOB, cluster, inside, PRIORS)
    assert slow.seconds > fast.seconds  # the pair over the slower inter-node link sets the stage's time


def test_the_overhead_and_the_memory_verdicts() -> None:
    cluster = cluster_preset("h100", 8)
    assert step_overhead_seconds(cluster) == pytest.approx(cluster.step_overhead_s) and cluster.step_overhead_s > 0
    assert step_overhead_seconds(cluster_preset("cpu", 2)) == 0.0
    plan = GlobalPlan(version=1, stages=tuple(_sp(ms.name, (0,), (1,)) for ms in JOB.workflow.model_stages))
    p = predict(JOB, cluster, plan)
    assert p.step_latency_s == pytest.approx(sum(p.kind_seconds.values()))  # the kinds and the overhead
    assert p.kind_seconds["overhead"] == p.overhead_s == pytest.approx(cluster.step_overhead_s)
    over = MemoryBreakdown(params_bytes=150)
    at = Prediction(step_latency_s=1.0, stage_seconds={}, stage_start_s={}, kind_seconds={}, breakdown={},
                    terms={}, peak_memory_bytes={0: 100, 1: 90}, memory={"a": over, "b": MemoryBreakdown(params_bytes=100)},
                    memory_capacity_bytes=100)
    assert at.max_peak_memory_bytes == 100 and at.feasible  # exactly at capacity fits
    assert at.memory_over() == {"a": 50}
    empty = Prediction(step_latency_s=0.0, stage_seconds={}, stage_start_s={}, kind_seconds={}, breakdown={},
                       terms={}, peak_memory_bytes={}, memory={}, memory_capacity_bytes=0)
    assert empty.max_peak_memory_bytes == 0 and empty.feasible
    d = at.to_dict()
    assert (d["max_peak_memory_bytes"], d["feasible"], d["memory"]["a"]["params_bytes"]) == (100, True, 150)


def test_the_stored_form_names_every_figure() -> None:
    plan = GlobalPlan(version=1, stages=tuple(_sp(ms.name, (0,), (1,)) for ms in JOB.workflow.model_stages))
    d = predict(JOB, cluster_preset("h100", 8), plan).to_dict()
    assert list(d) == ["step_latency_s", "stage_seconds", "stage_start_s", "kind_seconds", "breakdown",
                       "max_peak_memory_bytes", "memory_capacity_bytes", "memory", "feasible", "overhead_s"]


def test_recomputation_and_a_small_overhead_are_priced() -> None:
    import dataclasses

    cluster = cluster_preset("h100", 8)
    plain = _sp("actor-train", (0,), (1,))
    again = dataclasses.replace(plain, recompute=True)
    assert predict_stage(JOB, cluster, again, PRIORS).seconds > predict_stage(JOB, cluster, plain, PRIORS).seconds
    half = dataclasses.replace(cluster, step_overhead_s=0.5)
    assert step_overhead_seconds(half) == pytest.approx(0.5)  # under a second is still an overhead
