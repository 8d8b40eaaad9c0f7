"""The builder's order on small DAGs is the makespan optimum (transitions.exact_order), checked against
every permutation; the greedy order stays where it is already optimal."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from planner.errors import InfeasibleError
from planner.hardware import ClusterSpec
from transitions.cost import DEFAULT_COMMUNICATOR_SETUP_S, primitive_seconds, schedule, transition_cost
from transitions.exact_order import EXACT_MAKESPAN_NODES, fastest_order, makespan
from transitions.feasibility import order_by_memory
from transitions.global_dag import TransitionDAG, build_transition, primitive_count
from transitions.planning_cache import PlanningCache
from transitions.scenarios import random_scenario


def _fits(dag: TransitionDAG, order: tuple[int, ...]) -> bool:
    used = dag.initial_bytes
    for i in order:
        fp = dag.footprints[i]
        for g in fp.gpus:
            if used.get(g, 0) + fp.alloc_bytes.get(g, 0) + fp.buffer_bytes.get(g, 0) > dag.capacity_bytes:
                return False
        for g in fp.gpus:
            used[g] = used.get(g, 0) + fp.alloc_bytes.get(g, 0) - fp.free_bytes.get(g, 0)
    return True


def _brute(dag: TransitionDAG, durations: list[float]) -> float:
    """The least makespan over every permutation that keeps the data edges and fits in memory."""
    spans = []
    for perm in itertools.permutations(range(len(dag.nodes))):
        where = {i: k for k, i in enumerate(perm)}
        if all(where[a] < where[b] for a, b in dag.data_edges) and _fits(dag, perm):
            _, end, _ = schedule(dag.with_order(perm), durations)
            spans.append(max(end))
    return min(spans)


def _small_tight_dags(seed: int) -> Iterator[tuple[TransitionDAG, ClusterSpec]]:
    """Random changes of 3..6 unit-level nodes, memory tight enough that the order matters."""
    rng = random.Random(seed)
    cache = PlanningCache()
    while True:
        sc = random_scenario(rng, max_stages=3)
        try:
            if not 3 <= primitive_count(sc.states, sc.old, sc.new) <= 6:
                continue
            roomy = build_transition(sc.states, sc.cluster, sc.old, sc.new, capacity_bytes=1 << 50, cache=cache)
            if not roomy.bytes_moved:
                continue
            capacity = int(max(roomy.peak_bytes.values()) * rng.uniform(0.85, 1.0))
            yield build_transition(sc.states, sc.cluster, sc.old, sc.new, capacity_bytes=capacity,
                                   cache=cache), sc.cluster
        except InfeasibleError:
            continue


def _spans(dag: TransitionDAG, cluster: ClusterSpec) -> tuple[list[float], float, float, tuple[int, ...]]:
    """(durations, shipped makespan, greedy makespan, greedy order)."""
    durations = [primitive_seconds(fp, cluster, DEFAULT_COMMUNICATOR_SETUP_S) for fp in dag.footprints]
    fps, edges = list(dag.footprints), list(dag.data_edges)
    greedy = order_by_memory(fps, edges, list(dag.stage_order), dag.initial_bytes, dag.capacity_bytes).order
    return durations, makespan(fps, edges, dag.order, durations), makespan(fps, edges, greedy, durations), greedy


def test_small_dags_ship_the_makespan_optimum_that_fits() -> None:
    for dag, cluster in itertools.islice(_small_tight_dags(11), 10):
        assert len(dag.nodes) <= EXACT_MAKESPAN_NODES
        durations, shipped, greedy_span, greedy = _spans(dag, cluster)
        assert _fits(dag, dag.order)
        assert abs(shipped - _brute(dag, durations)) <= 1e-9 * shipped
        # the cost model prices the shipped order: its L_tran is that makespan
        assert abs(transition_cost(dag, cluster).seconds - shipped) <= 1e-9 * shipped
        assert shipped <= greedy_span
        if shipped == greedy_span:
            assert dag.order == greedy  # the greedy order is kept unless strictly beaten


def test_a_greedy_order_far_from_the_optimum_is_replaced() -> None:
    """Among the random instances one's memory-only greedy order is slower than the optimum (the
    bench's 200 instances have one at 2x): the builder ships the optimum instead."""
    for dag, cluster in itertools.islice(_small_tight_dags(7), 200):
        durations, shipped, greedy_span, greedy = _spans(dag, cluster)
        if greedy_span > shipped * (1 + 1e-9):
            assert dag.order != greedy and _fits(dag, dag.order)
            assert abs(shipped - _brute(dag, durations)) <= 1e-9 * shipped
            return
    raise AssertionError("no instance of 200 had a greedy order slower than the optimum")


def test_fastest_order_respects_its_bound_and_memory() -> None:
    dag, _ = next(_small_tight_dags(3))
    fps, edges = list(dag.footprints), list(dag.data_edges)
    durations = [1.0 + i for i in range(len(fps))]
    best = fastest_order(fps, edges, dag.initial_bytes, dag.capacity_bytes, durations)
    assert best is not None and sorted(best) == list(range(len(fps))) and _fits(dag, best)
    span = makespan(fps, edges, best, durations)
    assert abs(span - _brute(dag, durations)) <= 1e-9 * span
    # nothing beats the optimum: bounded by it, the search finds no order
    assert fastest_order(fps, edges, dag.initial_bytes, dag.capacity_bytes, durations, bound=span) is None
    # with no room for any acquisition, no order fits
    assert fastest_order(fps, edges, dag.initial_bytes, 0, durations) is None
