"""The plan search (planner/search.py) against the exhaustive search where memory binds, and its parts
by hand: GPU assignment on whole and partial pools (exact GPU sets, TP kept in a node, TP crossing
nodes only when no node has room), the transient quantisation above MAX_TRANSIENT_LEVELS, the pool
check's words, and what a result reports. Found by mutation testing (tests/mutate.py --module
planner/search.py: its tests compared plans on H200 presets, where a tiny model's memory never binds,
pools were whole and no table had 256 transient sizes)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from planner_jobs import INTER_LINK, INTRA_LINK, SMALL

from planner.errors import InfeasibleError, SpecError
from planner.exhaustive import exhaustive_search
from planner.hardware import ClusterSpec, DeviceSpec
from planner.memory import HEADROOM_FRACTION, WORKSPACE_BYTES, plan_memory
from planner.models import ModelSpec
from planner.op_classes import PRIORS, OpClass
from planner.options import OptionRules, OptionTable, StageOption, frontier, option_table
from planner.plan import Layout
from planner.prediction import predict
from planner.search import (
    MAX_TRANSIENT_LEVELS,
    URGENT_RULES,
    SearchResult,
    _quantize_transients,
    assign,
    check_pool,
    order_pool,
    search,
)
from planner.workflow import JobSpec, Workload, same_model_job, workflow_preset

M = SMALL
INTRA = INTRA_LINK
INTER = INTER_LINK


def _cluster(room: int, gpus: int, per_node: int) -> ClusterSpec:
    """``room`` bytes per GPU for model state after the workspace and headroom."""
    dev = DeviceSpec(name="d", memory_bytes=int((WORKSPACE_BYTES + room) * (1 + HEADROOM_FRACTION)),
                     peak_flops_bf16=4e10, hbm_bytes_per_s=1e10, gemm_half_tokens=0.0, gemm_half_width=0.0)
    return ClusterSpec(device=dev, num_nodes=gpus // per_node, gpus_per_node=per_node, intra_node_link=INTRA,
                       inter_node_link=INTER)


def _eff(seed: int) -> dict[OpClass, float]:
    rng = np.random.default_rng(seed)
    return {c: float(PRIORS[c] * rng.uniform(0.5, 1.5)) for c in OpClass}


# (algorithm, GPUs, GPUs per node, bytes of room per GPU, response tokens, efficiency seed): memory
# from plenty to so little that only sharded or few-sequence layouts fit, on whole and 2-GPU nodes
CASES = [("grpo", 4, 2, 3_000_000, 20, 0), ("grpo", 4, 4, 2_000_000, 40, 1), ("ppo", 4, 2, 3_000_000, 20, 2),
         ("ppo", 4, 4, 4_000_000, 30, 3), ("remax", 4, 2, 2_000_000, 20, 4), ("grpo", 2, 2, 4_000_000, 60, 5),
         ("ppo", 2, 2, 6_000_000, 20, 6), ("remax", 4, 4, 3_000_000, 30, 7), ("grpo", 4, 2, 2_000_000, 20, 8),
         ("ppo", 4, 2, 2_000_000, 20, 9), ("grpo", 4, 4, 50_000_000, 20, 10)]


def _exhaustive(j: JobSpec, cl: ClusterSpec, eff: dict[OpClass, float], rules: OptionRules) -> SearchResult | None:
    try:
        return exhaustive_search(j, cl, eff=eff, rules=rules)
    except InfeasibleError:
        return None


@pytest.mark.parametrize("algo,gpus,per_node,room,response,seed", CASES)
def test_the_search_finds_the_exhaustive_optimum_where_memory_binds(algo: str, gpus: int, per_node: int, room: int,
                                                                    response: int, seed: int) -> None:
    w = Workload(prompts_per_step=4, samples_per_prompt=2, prompt_tokens=10, response_tokens=response,
                 max_response_tokens=2 * response)
    j = same_model_job(workflow_preset(algo), M, w)
    cl, eff = _cluster(room, gpus, per_node), _eff(seed)
    # the reference: the exhaustive optimum under the first of the urgent rules that has a plan
    found = next(((k, r) for k, rules in enumerate(URGENT_RULES) if (r := _exhaustive(j, cl, eff, rules))), None)
    if found is None:
        with pytest.raises(InfeasibleError):
            search(j, cl, eff=eff)
        return
    urgent, ref = found
    res = search(j, cl, eff=eff)
    assert res.urgent_options == (urgent > 0)
    # the exhaustive optimum is exact; the frontier's 0.2% grid per model-stage may cost a little
    assert ref.objective_s * (1 - 1e-9) <= res.objective_s <= ref.objective_s * 1.01
    peaks, _ = plan_memory(j, res.plan)
    assert max(peaks.values()) <= cl.device.memory_bytes
    assert res.prediction.feasible


def test_memory_binds_in_the_oracle_cases() -> None:
    """The premise of the test above: with less room the plans change (or none fits), in most cases."""
    changed = 0
    for algo, gpus, per_node, room, response, seed in CASES[:-1]:
        w = Workload(prompts_per_step=4, samples_per_prompt=2, prompt_tokens=10, response_tokens=response,
                     max_response_tokens=2 * response)
        j = same_model_job(workflow_preset(algo), M, w)
        roomy = search(j, _cluster(10**9, gpus, per_node), eff=_eff(seed))
        try:
            tight = search(j, _cluster(room, gpus, per_node), eff=_eff(seed))
        except InfeasibleError:
            changed += 1
            continue
        changed += tight.objective_s > roomy.objective_s * (1 + 1e-6)
    assert changed == len(CASES) - 1  # every case but the roomy last one


def test_a_result_reports_its_version_and_every_candidate_it_considered() -> None:
    w = Workload(prompts_per_step=4, samples_per_prompt=2, prompt_tokens=10, response_tokens=20)
    j = same_model_job(workflow_preset("ppo"), M, w)
    cl = _cluster(10**9, 4, 2)
    assert search(j, cl).plan.version == 1
    res = search(j, cl, version=7)
    assert res.plan.version == 7
    # critic-inf and reward-inf share one table (same model, head and kind), each counted once per stage
    full = {ms.name: option_table(j, ms, cl, 4, PRIORS) for ms in j.workflow.model_stages}
    assert res.candidates_considered == sum(len(t) for t in full.values())
    assert res.frontier_sizes == {name: len(frontier(t)) for name, t in full.items()}


def test_model_stages_of_different_models_do_not_share_a_table() -> None:
    # a reward model four times the critic's size, on memory that fits the critic's layouts but not all of
    # the reward model's: priced from the critic's table, the plan would not fit or not be the optimum
    bigger = ModelSpec(name="m2", num_layers=4, hidden_size=128, num_attention_heads=8, num_kv_heads=2,
                       head_dim=16, ffn_hidden_size=192, vocab_size=1000, tie_word_embeddings=False,
                       rope_theta=10_000.0)
    w = Workload(prompts_per_step=4, samples_per_prompt=2, prompt_tokens=10, response_tokens=20)
    j = same_model_job(workflow_preset("ppo"), M, w)
    j = type(j)(workflow=j.workflow, models={**j.models, next(r for r in j.models if r.value == "reward"): bigger},
                workload=w)
    cl, eff = _cluster(4_000_000, 4, 2), _eff(3)
    ref = _exhaustive(j, cl, eff, URGENT_RULES[0])
    assert ref is not None
    res = search(j, cl, eff=eff)
    assert ref.objective_s * (1 - 1e-9) <= res.objective_s <= ref.objective_s * 1.01
    peaks, _ = plan_memory(j, res.plan)
    assert max(peaks.values()) <= cl.device.memory_bytes
    assert res.candidates_considered == sum(len(option_table(j, ms, cl, 4, eff)) for ms in j.workflow.model_stages)


def test_the_result_is_priced_with_the_efficiencies_given_and_the_step_overhead() -> None:
    w = Workload(prompts_per_step=4, samples_per_prompt=2, prompt_tokens=10, response_tokens=20)
    j = same_model_job(workflow_preset("grpo"), M, w)
    eff = {**_eff(4), OpClass.STEP_OVERHEAD: 0.5}
    plain = _cluster(10**9, 4, 2)
    with_overhead = dataclasses.replace(plain, step_overhead_s=2.0)
    a, b = search(j, plain, eff=eff), search(j, with_overhead, eff=eff)
    assert b.objective_s - a.objective_s == pytest.approx(2.0 / 0.5)  # the overhead at its efficiency
    assert b.prediction == predict(j, with_overhead, b.plan, eff)


def test_the_pool_check_says_what_is_missing() -> None:
    cl = _cluster(10**9, 4, 2)
    with pytest.raises(SpecError) as info:
        check_pool(cl, [])
    assert str(info.value) == "pool: no GPUs to plan on (allowed: >= 1 GPU)"
    assert check_pool(cl, None) == (0, 1, 2, 3)
    assert check_pool(cl, [3, 1, 1]) == (1, 3)  # equal partial nodes: node order, unique ids
    # a GPU outside the cluster is named, the first one found in id order (the last id is 3)
    for pool, bad in (([0, 4], 4), ([-1, 0], -1), ([0, 1, 7], 7), ([0, 9, 5], 5)):
        with pytest.raises(SpecError) as info:
            order_pool(pool, cl)
        assert str(info.value) == f"pool: GPU {bad} is not in the cluster (allowed: 0..3)"
    assert order_pool([0, 3], cl) == (0, 3)


def _opt(name: str, tp: int, pp: int, dp: int) -> StageOption:
    return StageOption(model_stage=name, layout=Layout(tp, pp), dp=dp, micro_batch_size=1, grad_accum=1,
                       recompute=False, seconds=1.0, resident_bytes=0, transient_bytes=0)


def _sets(plan, name: str) -> tuple[tuple[int, ...], ...]:  # type: ignore[no-untyped-def]
    return next(sp.gpu_sets for sp in plan if sp.model_stage == name)


def test_assign_on_whole_nodes_slices_the_pool_largest_units_first() -> None:
    j = same_model_job(workflow_preset("grpo"), M, Workload(prompts_per_step=4, prompt_tokens=10, response_tokens=20))
    pool = tuple(range(8))
    # one inference wave of two members: ref-inf's TP2 units go first, then reward's single GPUs
    choices = {"generation": ((_opt("actor-gen", 1, 1, 8),),),
               "inference": ((_opt("reward-inf", 1, 1, 4), _opt("ref-inf", 2, 1, 2)),),
               "training": ((_opt("actor-train", 2, 2, 2),),)}
    plan = assign(j, pool, choices, 3, 4)
    assert plan.version == 3
    assert [sp.model_stage for sp in plan] == ["actor-gen", "ref-inf", "reward-inf", "actor-train"]
    assert _sets(plan, "ref-inf") == ((0, 1), (2, 3))
    assert _sets(plan, "reward-inf") == ((4,), (5,), (6,), (7,))
    assert _sets(plan, "actor-train") == ((0, 1, 2, 3), (4, 5, 6, 7))  # every wave starts from the whole pool
    assert _sets(plan, "actor-gen") == tuple((g,) for g in range(8))
    # a node size that is not a power of two takes the per-node path: the same sets here
    assert _sets(assign(j, tuple(range(6)), {"inference": ((_opt("ref-inf", 2, 1, 3),),)}, 1, 3), "ref-inf") == (
        (0, 1), (3, 4), (2, 5))  # the third unit crosses the nodes' last free GPUs


def test_assign_on_a_partial_pool_keeps_tp_groups_in_a_node() -> None:
    j = same_model_job(workflow_preset("grpo"), M, Workload(prompts_per_step=4, prompt_tokens=10, response_tokens=20))
    # node 1 whole (4-7), node 0 with 0, 1 and 2: not whole nodes, so units take GPUs node by node
    pool = order_pool([0, 1, 2, 4, 5, 6, 7], _cluster(10**9, 8, 4))
    assert pool == (4, 5, 6, 7, 0, 1, 2)
    choices = {"inference": ((_opt("ref-inf", 2, 1, 2), _opt("reward-inf", 1, 1, 3)),)}
    plan = assign(j, pool, choices, 1, 4)
    assert _sets(plan, "ref-inf") == ((4, 5), (6, 7))
    assert _sets(plan, "reward-inf") == ((0,), (1,), (2,))
    # TP2 units on nodes of 3 and 2 free GPUs: the first fits node 0 exactly, the second takes node 1's
    # two (a node with exactly TP GPUs left is used, not skipped), the third crosses what is left
    pool = (0, 1, 2, 4, 5)
    plan = assign(j, pool, {"inference": ((_opt("ref-inf", 2, 1, 2),),)}, 1, 4)
    assert _sets(plan, "ref-inf") == ((0, 1), (4, 5))
    plan = assign(j, (0, 1, 4, 5, 6), {"inference": ((_opt("ref-inf", 1, 2, 2), _opt("reward-inf", 1, 1, 1)),)}, 1, 4)
    assert _sets(plan, "ref-inf") == ((0, 1), (4, 5))  # each PP unit's ranks on one node
    assert _sets(plan, "reward-inf") == ((6,),)


def test_assign_crosses_nodes_only_when_no_node_has_room() -> None:
    j = same_model_job(workflow_preset("grpo"), M, Workload(prompts_per_step=4, prompt_tokens=10, response_tokens=20))
    # TP4 on nodes with 3 and 3 free GPUs: no node has room, the group takes node 0's three and one more
    plan = assign(j, (0, 1, 2, 4, 5, 6), {"inference": ((_opt("ref-inf", 4, 1, 1), _opt("reward-inf", 1, 1, 2)),)},
                  1, 4)
    assert _sets(plan, "ref-inf") == ((0, 1, 2, 4),)
    assert _sets(plan, "reward-inf") == ((5,), (6,))
    # two fragmented TP2 ranks of one PP unit over nodes with one free GPU each
    plan = assign(j, (0, 4, 8, 12), {"inference": ((_opt("ref-inf", 2, 2, 1),),)}, 1, 4)
    assert _sets(plan, "ref-inf") == ((0, 4, 8, 12),)
    with pytest.raises(AssertionError) as info:
        assign(j, (0, 1, 4), {"inference": ((_opt("ref-inf", 2, 1, 2),),)}, 1, 4)
    assert str(info.value) == "a wave asked for more GPUs than the pool has"


def test_assign_on_one_partial_node_and_pp_ranks_off_node_boundaries() -> None:
    j = same_model_job(workflow_preset("grpo"), M, Workload(prompts_per_step=4, prompt_tokens=10, response_tokens=20))
    plan = assign(j, (0, 1, 2), {"inference": ((_opt("ref-inf", 1, 1, 3),),)}, 1, 4)
    assert _sets(plan, "ref-inf") == ((0,), (1,), (2,))
    # a PP unit whose first rank sits mid-node (GPU 1): its next rank looks on that node first
    plan = assign(j, (1, 2, 5, 6), {"inference": ((_opt("ref-inf", 1, 2, 2),),)}, 1, 4)
    assert _sets(plan, "ref-inf") == ((1, 2), (5, 6))


def _front(name: str, transient: np.ndarray, seconds: np.ndarray) -> OptionTable:
    n = transient.size
    return OptionTable(model_stage=name, tp=np.ones(n, np.int64), pp=np.ones(n, np.int64), dp=np.ones(n, np.int64),
                       b=np.ones(n, np.int64), g=np.ones(n, np.int64), recompute=np.zeros(n, bool),
                       seconds=seconds, gpus=np.ones(n, np.int64), resident=np.zeros(n, np.int64),
                       transient=transient.astype(np.int64))


def test_transients_are_rounded_up_to_at_most_the_level_cap() -> None:
    a = np.arange(1, 401) * 1000  # 400 distinct sizes between two tables
    b = np.arange(1, 201) * 1000 + 500
    fronts = {"a": _front("a", a, 1.0 / a), "b": _front("b", b, 1.0 / b)}
    out = _quantize_transients(fronts)
    levels = np.unique(np.concatenate([t.transient for t in out.values()]))
    assert 200 < levels.size <= MAX_TRANSIENT_LEVELS  # quantiles of 600 sizes: about the cap, not far fewer
    assert set(levels.tolist()) <= set(np.concatenate([a, b]).tolist())  # levels are sizes seen
    for name, raw in (("a", a), ("b", b)):
        t = out[name]
        assert t.model_stage == name
        # every row kept is rounded up to the least level at or above it (never down: plans stay feasible)
        for tr, s in zip(t.transient.tolist(), t.seconds.tolist()):
            orig = int(round(1.0 / s))
            assert tr == min(lv for lv in levels.tolist() if lv >= orig)
        assert len(t) < raw.size  # rows rounded to one level are merged by the frontier
    assert levels.max() == 400_000  # the largest size is a level
    few = {"a": _front("a", a[:100], 1.0 / a[:100]), "b": _front("b", b[:100], 1.0 / b[:100])}
    same = _quantize_transients(few)
    assert all(same[k] is few[k] for k in few)  # 200 sizes: nothing changes
    at_cap = {"a": _front("a", a[:128], 1.0 / a[:128]), "b": _front("b", b[:128], 1.0 / b[:128])}
    assert all(_quantize_transients(at_cap)[k] is at_cap[k] for k in at_cap)  # 256 sizes: still nothing
