"""planner/exhaustive.py, what its other tests left open (mutation testing, tests/mutate.py --module
planner/exhaustive.py: 15 of 169 mutants survived tests/planner, 40 more timed out): the search over
hand-sized candidates (the option tables replaced), where the optimum and the memory rule's verdicts
are worked out by hand: sum of resident bytes plus the largest transient against the usable bytes, at
exactly the limit and one byte under; the fastest row per memory pair of a stage kind and of a wave;
ties keep the first found; the efficiencies and the rules reach the option tables, the prediction
and the overhead."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import planner.exhaustive as exhaustive
from planner.errors import InfeasibleError
from planner.exhaustive import exhaustive_search
from planner.hardware import cluster_preset
from planner.models import model_preset
from planner.op_classes import Efficiencies, OpClass
from planner.options import OptionRules, StageOption
from planner.plan import Layout
from planner.prediction import predict, step_overhead_seconds
from planner.workflow import Workload, same_model_job, workflow_preset

# GRPO with a learned reward: actor-gen; ref-inf and reward-inf (one kind, one wave or two); actor-train
JOB = same_model_job(workflow_preset("grpo"), model_preset("tiny-25m"),
                     Workload(prompts_per_step=8, prompt_tokens=64, response_tokens=256))
CLUSTER = cluster_preset("h200", 4)


def _o(name: str, s: float, dp: int, res: int, trans: int) -> StageOption:
    return StageOption(model_stage=name, layout=Layout(1, 1), dp=dp, micro_batch_size=1, grad_accum=8 // dp,
                       recompute=False, seconds=s, resident_bytes=res, transient_bytes=trans)


class _Table:
    def __init__(self, options: list[StageOption]) -> None:
        self._options = options

    def options(self) -> list[StageOption]:
        return list(self._options)


def _fake(monkeypatch: pytest.MonkeyPatch, opts: dict[str, list[StageOption]], usable: float,
          seen: list | None = None) -> None:
    def option_table(job, ms, cluster, n, eff, rules):  # type: ignore[no-untyped-def]
        if seen is not None:
            seen.append((ms.name, n, eff, rules))
        return _Table(opts[ms.name])
    monkeypatch.setattr(exhaustive, "option_table", option_table)
    usable_of: Callable[[object], float] = lambda cluster: usable  # noqa: E731
    monkeypatch.setattr(exhaustive, "usable_bytes", usable_of)


def _dp(res, name: str) -> int:  # type: ignore[no-untyped-def]
    return next(sp.dp for sp in res.plan if sp.model_stage == name)


# generation: fast with 50 bytes transient, or slow with 5; inference: both members share one wave
# (1 s, max resident 10) or take two (2 s, 20); training 2 s. Fast generation + one inference wave +
# training: 4 s and 10 + 10 + 10 resident + 50 transient = 80 bytes; slow generation: 6 s, 35 bytes
MEMORY = {"actor-gen": [_o("actor-gen", 1.0, 4, 10, 50), _o("actor-gen", 3.0, 2, 10, 5)],
          "ref-inf": [_o("ref-inf", 1.0, 2, 10, 5)], "reward-inf": [_o("reward-inf", 1.0, 2, 10, 5)],
          "actor-train": [_o("actor-train", 2.0, 4, 10, 5)]}


@pytest.mark.parametrize(("usable", "seconds", "gen_dp"), [(80, 4.0, 4), (79, 6.0, 2), (1e6, 4.0, 4), (35, 6.0, 2)])
def test_the_memory_rule_is_resident_sum_plus_largest_transient(monkeypatch: pytest.MonkeyPatch, usable: float,
                                                                 seconds: float, gen_dp: int) -> None:
    _fake(monkeypatch, MEMORY, usable)
    res = exhaustive_search(JOB, CLUSTER)
    assert res.objective_s == pytest.approx(seconds + step_overhead_seconds(CLUSTER))
    assert (_dp(res, "actor-gen"), _dp(res, "ref-inf"), _dp(res, "reward-inf")) == (gen_dp, 2, 2)


def test_nothing_under_the_usable_bytes_is_infeasible(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(monkeypatch, MEMORY, 34)  # the smallest plan needs 35
    with pytest.raises(InfeasibleError):
        exhaustive_search(JOB, CLUSTER)


def test_a_stage_kind_keeps_its_fastest_row_per_memory_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    # a sleeping-like reward (no resident bytes): one wave (2 s on 2 + 2 GPUs) and two waves (0.5 + 0.25 s
    # on 4 GPUs each) hold the same 10 resident, 5 transient; the two waves, found second, are faster
    opts = {**MEMORY, "actor-gen": [_o("actor-gen", 1.0, 4, 10, 5)],
            "ref-inf": [_o("ref-inf", 0.5, 4, 10, 5), _o("ref-inf", 2.0, 2, 10, 5)],
            "reward-inf": [_o("reward-inf", 0.25, 4, 0, 5), _o("reward-inf", 2.0, 2, 0, 5)]}
    _fake(monkeypatch, opts, 1e6)
    res = exhaustive_search(JOB, CLUSTER)
    assert res.objective_s == pytest.approx(1.0 + 0.75 + 2.0 + step_overhead_seconds(CLUSTER))
    assert (_dp(res, "ref-inf"), _dp(res, "reward-inf")) == (4, 4)


def test_ties_keep_the_first_found(monkeypatch: pytest.MonkeyPatch) -> None:
    # inference: one wave (0.75 s) and two (0.5 + 0.25 s) tie at the same memory: the one wave, found
    # first, stays; generation: 1 s on 2 GPUs (5 transient) or on 4 (4 transient) tie across picks: the
    # candidates come fastest first, then fewest GPUs, so the 2-GPU one is found first and stays
    opts = {**MEMORY, "actor-gen": [_o("actor-gen", 1.0, 4, 10, 4), _o("actor-gen", 1.0, 2, 10, 5)],
            "ref-inf": [_o("ref-inf", 0.5, 4, 10, 5), _o("ref-inf", 0.75, 2, 10, 5)],
            "reward-inf": [_o("reward-inf", 0.25, 4, 0, 5), _o("reward-inf", 0.75, 2, 0, 5)]}
    _fake(monkeypatch, opts, 1e6)
    res = exhaustive_search(JOB, CLUSTER)
    assert res.objective_s == pytest.approx(1.0 + 0.75 + 2.0 + step_overhead_seconds(CLUSTER))
    assert (_dp(res, "actor-gen"), _dp(res, "ref-inf"), _dp(res, "reward-inf")) == (2, 2, 2)


def test_a_wave_keeps_its_fastest_combination_when_a_slower_one_comes_first() -> None:
    opts = {"x": [_o("x", 3.0, 1, 10, 5), _o("x", 2.0, 1, 10, 5)]}
    [row] = exhaustive._all_wave_rows(("x",), opts, 4, {})
    assert row[:3] == (2.0, 10, 5) and row[3] == (opts["x"][1],)


def test_the_efficiencies_and_rules_reach_every_part(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list = []
    _fake(monkeypatch, MEMORY, 1e6, seen)
    eff = Efficiencies({OpClass.STEP_OVERHEAD: 0.5, OpClass.GEMM: 0.2})
    rules = OptionRules(allow_recompute=True)
    res = exhaustive_search(JOB, CLUSTER, eff=eff, rules=rules)
    assert seen == [(ms.name, 4, eff, rules) for ms in JOB.workflow.model_stages]
    assert step_overhead_seconds(CLUSTER) > 0
    assert step_overhead_seconds(CLUSTER, eff) == pytest.approx(2 * step_overhead_seconds(CLUSTER))
    assert res.objective_s == pytest.approx(4.0 + step_overhead_seconds(CLUSTER, eff))
    assert res.prediction == predict(JOB, CLUSTER, res.plan, eff) != predict(JOB, CLUSTER, res.plan)
    assert res.plan.version == 1  # the default version
