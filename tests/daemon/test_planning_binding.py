"""The daemon's planner binding: its start-up warm-up (bounded, logged, in ``status``) and each node's
part of a transition (the DAG nodes touching that node's GPUs)."""

from __future__ import annotations

import json

from nereusd.planning import WARM_PP, PlannerBinding, cluster_for, job_spec
from tests.daemon.conftest import DaemonHandle, wait_for
from transitions import rank_table
from transitions.emu import job_states
from transitions.global_dag import build_transition

SPEC = {"model": "tiny-3m", "algo": "grpo", "device": "cpu", "gpus_per_node": 2,
        "workload": {"prompts_per_step": 8, "prompt_tokens": 32, "response_tokens": 64}}


def test_warm_up_does_what_its_budget_allows() -> None:
    binding = PlannerBinding()
    plan = binding.search(SPEC, frozenset(range(4)), 1).plan
    steps = binding.warm_up(budget_s=600.0, running=[(SPEC, plan)])  # a budget no machine runs out of
    assert set(steps) == {"imports_ms", "small_decision_ms", "running_plans", "running_ranks", "running_plans_ms",
                          "running_tables_ms", "running_factors_ms"}
    assert steps["running_ranks"] == sum(sp.layout.size for sp in plan.stages)  # one unit's ranks per stage
    # (the imports may all be done already: 0 ms)
    assert steps["running_plans"] == 1 and steps["small_decision_ms"] > 0 and steps["running_plans_ms"] > 0
    assert steps["running_tables_ms"] > 0 and steps["running_factors_ms"] > 0
    # over budget from the start: the imports only (what a daemon on an overloaded machine does)
    assert set(PlannerBinding().warm_up(budget_s=0.0, running=[(SPEC, plan)])) == {"imports_ms"}


def test_warm_up_derives_the_rank_table_factors_of_every_degree_the_search_may_pick() -> None:
    """After the warm-up, a target unit of any TP (up to a node) and PP (up to WARM_PP) degree finds
    its rank tables' factors derived: lookups only (whatever layout the next decision picks)."""
    spec = {**SPEC, "gpus_per_node": 4}
    pool = frozenset(range(8))
    plan = PlannerBinding().search(spec, pool, 1).plan
    for f in (rank_table._tp_boxes, rank_table._tp_sizes, rank_table._stage_holds):
        f.cache_clear()
    PlannerBinding().warm_up(budget_s=600.0, running=[(spec, plan)])
    misses = [f.cache_info().misses for f in (rank_table._tp_boxes, rank_table._tp_sizes, rank_table._stage_holds)]
    keys = {(s.model, s.head, s.kinds) for s in job_states(job_spec(spec)).values()}
    model = next(iter(keys))[0]
    assert min(model.num_layers, len(pool), WARM_PP) >= 4 and model.valid_tp(4)  # the degrees below are real
    for m, head, kinds in keys:
        for tp in (1, 2, 4):
            for r in range(tp):
                rank_table._tp_boxes(m, head, tp, r)
                rank_table._tp_sizes(m, head, tp, r, kinds)
        for pp in (1, 2, 4):
            for r in range(pp):
                rank_table._stage_holds(m, head, pp, r)
    assert [f.cache_info().misses for f in (rank_table._tp_boxes, rank_table._tp_sizes,
                                            rank_table._stage_holds)] == misses


def test_a_decision_after_the_warm_up_is_the_one_without_it() -> None:
    """The warm-up fills value memos only: the next decision of the running job (its search, its
    transition's DAG, record and parts) is the same with or without it."""
    pool, grown = frozenset(range(4)), frozenset(range(6))
    later = {**SPEC, "workload": {**SPEC["workload"], "response_tokens": 96}}

    def decide(binding: PlannerBinding) -> tuple[object, ...]:
        running = binding.search(SPEC, pool, 1).plan
        new = binding.search(later, grown, 2)
        sketch = binding.transition(later, running, new.plan, grown, lambda g: f"n{g // 2}")
        assert sketch.detail is not None
        return new.plan, new.prediction, sketch.predicted_s, sketch.bytes_moved, sketch.dag, sketch.parts, \
            sketch.detail()

    cold = PlannerBinding()
    warm = PlannerBinding()
    warm.warm_up(budget_s=600.0, running=[(SPEC, warm.search(SPEC, pool, 1).plan)])
    assert len(warm.planning_cache.footprints) > 0  # it did derive (and memoise) something
    assert decide(warm) == decide(cold)


def test_each_node_part_lists_the_dag_nodes_on_its_gpus() -> None:
    binding = PlannerBinding()
    old = binding.search(SPEC, frozenset(range(2)), 1).plan
    pool = frozenset(range(6))
    new = binding.search(SPEC, pool, 2).plan
    sketch = binding.transition(SPEC, old, new, pool, lambda g: f"n{g // 2}")
    dag = build_transition(job_spec(SPEC), cluster_for(SPEC, pool), old, new)  # deterministic: the same DAG
    expected: dict[str, set[int]] = {}
    for g in sorted(new.gpus | old.gpus):
        expected.setdefault(f"n{g // 2}", set()).update(dag.nodes_on(g))
    assert {n: p["dag_nodes"] for n, p in sketch.parts.items()} == {n: sorted(s) for n, s in expected.items()}
    assert {n: p["gpus"] for n, p in sketch.parts.items()} == {
        n: sorted(g for g in new.gpus | old.gpus if f"n{g // 2}" == n) for n in expected}
    # the record's head counts the primitives; its body (every primitive) comes from ``detail``
    kinds = [p.kind.value for p in dag.nodes]
    assert sketch.dag["primitives"] == {k: kinds.count(k) for k in sorted(set(kinds))}
    assert sketch.dag["num_nodes"] == len(dag.nodes) and "nodes" not in sketch.dag
    assert sketch.detail is not None
    body = sketch.detail()
    assert len(body["nodes"]) == len(dag.nodes) and body["order"] == list(dag.order)


def test_the_daemon_reports_its_planner_warm_up(daemon: DaemonHandle) -> None:
    daemon.start()
    took = wait_for(lambda: daemon.admin("status").get("planner_warm_up_ms"), 20, "the warm-up's time in status")
    assert took > 0
    events = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
    names = [e.get("event") for e in events]
    assert "planner-warm-up" in names and "imports_ms" in events[names.index("planner-warm-up")]["steps"]
    # warmed before serving: "serving" (and READY) come after the warm-up, with its time
    assert "serving" in names and names.index("serving") > names.index("planner-warm-up")
    assert events[names.index("serving")]["warm_up_ms"] == took


def test_predictions_are_memoised_on_all_they_are_made_of(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The controller predicts the running plan after each calibration and again when it decides: one
    predict. A plan the search found is not predicted again, even on a pool with more nodes (a
    prediction reads no node count); another spec, plan or efficiencies is predicted afresh."""
    import planner.prediction
    from nereusd.planning import _efficiency_key
    from planner.cost import Efficiencies, OpClass

    real = planner.prediction.predict
    calls: list[int] = []

    def counted(job, cluster, plan, eff):  # type: ignore[no-untyped-def]
        calls.append(cluster.num_nodes)
        return real(job, cluster, plan, eff)

    monkeypatch.setattr(planner.prediction, "predict", counted)
    binding = PlannerBinding()
    pool = frozenset(range(4))
    found = binding.search(SPEC, pool, 1)
    wider = frozenset(range(8))  # two nodes more: a larger cluster
    got = binding.predict(SPEC, wider, found.plan)
    assert calls == [] and got == found.prediction
    assert got == real(job_spec(SPEC), cluster_for(SPEC, wider), found.plan, binding._eff(SPEC))
    longer = {**SPEC, "workload": {**SPEC["workload"], "response_tokens": 96}}
    first = binding.predict(longer, pool, found.plan)
    assert binding.predict(longer, pool, found.plan) is first and calls == [2]
    assert first == real(job_spec(longer), cluster_for(longer, pool), found.plan, binding._eff(longer))
    binding.efficiency[_efficiency_key(SPEC)] = Efficiencies({OpClass.GEMM: 0.3})  # as a calibration leaves it
    slower = binding.predict(longer, pool, found.plan)
    assert calls == [2, 2] and slower != first
    other = binding.search(SPEC, frozenset(range(2)), 2).plan
    binding.predict(longer, pool, other)
    assert calls == [2, 2, 2]


def test_the_prediction_memo_is_bounded() -> None:
    from nereusd.planning import PREDICTIONS_KEPT

    binding = PlannerBinding()
    plan = binding.search(SPEC, frozenset(range(2)), 1).plan
    for tokens in range(40, 40 + 2 * PREDICTIONS_KEPT):
        binding.predict({**SPEC, "workload": {**SPEC["workload"], "response_tokens": tokens}}, frozenset(range(2)), plan)
    assert len(binding._predictions) == PREDICTIONS_KEPT
    newest = {**SPEC, "workload": {**SPEC["workload"], "response_tokens": 39 + 2 * PREDICTIONS_KEPT}}
    assert next(reversed(binding._predictions))[0] == json.dumps(newest, sort_keys=True)


def test_calibration_prices_the_plan_from_its_last_prediction(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A calibration step reads the plan's terms under the efficiencies of before: the running plan's
    last re-prediction (the memo's) when it has one, else one predict; the fit is the same either way."""
    import planner.calibration
    from nereusd.planning import _efficiency_key
    from nereusd.wire import protocol

    real = planner.calibration.predict
    calls: list[int] = []
    monkeypatch.setattr(planner.calibration, "predict", lambda *a: calls.append(1) or real(*a))
    pool = frozenset(range(4))
    plan = PlannerBinding().search(SPEC, pool, 1).plan
    msg = protocol.Measurement(job_id="j", node="n0", step=3, plan_version=1, step_latency_s=9.0,
                               stage_times_s={sp.model_stage: 1.0 for sp in plan.stages}, response_tokens=64)
    cold = PlannerBinding()
    cold.calibrate(SPEC, msg, plan)
    assert calls == [1]
    warm = PlannerBinding()
    warm.predict(SPEC, pool, plan)  # the running plan re-predicted, as after the last calibration
    warm.calibrate(SPEC, msg, plan)
    assert calls == [1]
    key = _efficiency_key(SPEC)
    assert dict(warm.efficiency[key]) == dict(cold.efficiency[key])
    assert warm.efficiency[key].stage_fit.observations == cold.efficiency[key].stage_fit.observations  # type: ignore[attr-defined]
