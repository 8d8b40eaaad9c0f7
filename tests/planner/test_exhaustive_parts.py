"""The exhaustive reference search's parts (planner/exhaustive.py): exact dominance pruning, the
fastest combination per memory pair of a wave, and what the result carries. Hand-sized candidates.
Found by mutation testing (tests/mutate.py --module planner/exhaustive.py: 33 of 169 mutants survived
the one property test that compared objectives only)."""

from __future__ import annotations

import pytest

from planner.errors import InfeasibleError
from planner.exhaustive import _all_wave_rows, _dominance_free, exhaustive_search
from planner.hardware import cluster_preset
from planner.infeasible import explain_infeasible
from planner.models import model_preset
from planner.options import StageOption
from planner.plan import Layout
from planner.prediction import predict, step_overhead_seconds
from planner.workflow import Workload, same_model_job, workflow_preset


def _opt(name: str, s: float, dp: int, res: int, trans: int) -> StageOption:
    return StageOption(model_stage=name, layout=Layout(1, 1), dp=dp, micro_batch_size=1, grad_accum=1,
                       recompute=False, seconds=s, resident_bytes=res, transient_bytes=trans)


def test_dominance_drops_what_another_candidate_beats_or_ties_in_everything() -> None:
    fast_big = _opt("a", 1.0, 4, 10, 10)
    tie = _opt("a", 1.0, 4, 10, 10)  # equal in every figure: one of the two is enough
    slow_small = _opt("a", 2.0, 2, 10, 10)  # slower, fewer GPUs: kept
    slow_more_resident = _opt("a", 2.0, 2, 12, 10)  # beaten by slow_small in all four: dropped
    slow_less_transient = _opt("a", 3.0, 4, 10, 5)  # slower but less transient: kept
    kept = _dominance_free([slow_more_resident, tie, slow_small, slow_less_transient, fast_big])
    assert kept == [fast_big, slow_small, slow_less_transient]
    only_resident = _dominance_free([_opt("a", 1.0, 2, 10, 10), _opt("a", 2.0, 2, 9, 10)])
    only_transient = _dominance_free([_opt("a", 1.0, 2, 10, 10), _opt("a", 2.0, 2, 10, 9)])
    assert len(only_resident) == len(only_transient) == 2  # one figure better is enough to stay


def test_a_wave_keeps_the_fastest_combination_per_memory_pair_within_its_gpus() -> None:
    opts = {"x": [_opt("x", 1.0, 2, 10, 5), _opt("x", 3.0, 1, 10, 5), _opt("x", 2.0, 1, 20, 5)],
            "y": [_opt("y", 2.0, 1, 10, 5), _opt("y", 1.5, 2, 10, 5)]}
    memo: dict = {}
    rows = _all_wave_rows(("x", "y"), opts, 3, memo)
    by_memory = {(r[1], r[2]): (r[0], tuple(o.seconds for o in r[3])) for r in rows}
    # (x 1.0 on 2 GPUs, y 2.0 on 1) in 2.0 s and (x 3.0, y 1.5 on 2) in 3.0 s both hold (10, 5): the faster
    # wins; x 2.0 with y 2.0 and x 2.0 with y 1.5 both hold (20, 5) in 2.0 s: the first found is kept;
    # x on 2 GPUs + y on 2 needs 4 of the 3: out
    assert by_memory == {(10, 5): (2.0, (1.0, 2.0)), (20, 5): (2.0, (2.0, 2.0))}
    assert memo[("x", "y")] is rows and _all_wave_rows(("x", "y"), {}, 0, memo) is rows  # memoised per wave
    ties = {"x": [_opt("x", 1.0, 1, 10, 5), _opt("x", 1.0, 1, 10, 5)]}
    [row] = _all_wave_rows(("x",), ties, 1, {})
    assert row[3] == (ties["x"][0],)  # equally fast: the first found is kept


JOB = same_model_job(workflow_preset("grpo", learned_reward=False), model_preset("tiny-25m"),
                     Workload(prompts_per_step=8, prompt_tokens=64, response_tokens=256))


def test_the_result_carries_its_version_pool_prediction_and_counts() -> None:
    cluster = cluster_preset("h200", 8)
    res = exhaustive_search(JOB, cluster, pool=[4, 5, 6, 7], version=9)
    assert res.plan.version == 9 and res.plan.gpus <= {4, 5, 6, 7}
    assert res.prediction == predict(JOB, cluster, res.plan)
    overhead = step_overhead_seconds(cluster)
    assert overhead > 0 and res.objective_s > overhead and res.urgent_options is False
    assert set(res.frontier_sizes) == {ms.name for ms in JOB.workflow.model_stages}
    assert res.candidates_considered == sum(res.frontier_sizes.values()) > len(res.frontier_sizes)
    # the objective is the waves' sum of slowest members plus the overhead: the prediction's stage times
    # of this plan (generation, inference, training one after another, one wave each) add up to it
    assert res.objective_s == pytest.approx(res.prediction.step_latency_s, rel=1e-6)


def test_nothing_fits_raises_the_explanation() -> None:
    big = same_model_job(workflow_preset("ppo"), model_preset("llama-3.3-70b"),
                         Workload(prompts_per_step=8, prompt_tokens=64, response_tokens=256))
    cluster = cluster_preset("h100", 2)
    with pytest.raises(InfeasibleError) as err:
        exhaustive_search(big, cluster)
    assert err.value.reasons == explain_infeasible(big, cluster, 2).reasons and err.value.reasons
