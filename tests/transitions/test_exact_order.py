"""The builder's order on small DAGs is the makespan optimum (transitions.exact_order), checked against
every permutation; the greedy order stays where it is already optimal."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from order_oracle import fits

from planner.errors import InfeasibleError
from planner.hardware import ClusterSpec
from transitions.cost import DEFAULT_COMMUNICATOR_SETUP_S, primitive_seconds, schedule, transition_cost
from transitions.exact_order import EXACT_MAKESPAN_NODES, fastest_order, makespan, search_order
from transitions.feasibility import _greedy, order_by_memory
from transitions.global_dag import TransitionDAG, build_transition, primitive_count
from transitions.planning_cache import PlanningCache
from transitions.primitives import Footprint
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
    greedy = order_by_memory(fps, edges, list(dag.stage_order), dag.initial_bytes, dag.capacity_bytes,
                             durations=durations).order  # the builder's greedy prices with them too
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


def _span(fps: list[Footprint], edges: list[tuple[int, int]], order: tuple[int, ...], durations: list[float]) -> float:
    """The execution rule, written out again: a node starts once its data predecessors and the
    previous node on each of its GPUs have ended."""
    end: dict[int, float] = {}
    gpu_free: dict[int, float] = {}
    for i in order:
        start = max([end[a] for a, b in edges if b == i] + [gpu_free.get(g, 0.0) for g in fps[i].gpus] + [0.0])
        end[i] = start + durations[i]
        gpu_free.update({g: end[i] for g in fps[i].gpus})
    return max(end.values(), default=0.0)


def _random_instance(rng: random.Random) -> tuple[list[Footprint], list[tuple[int, int]], dict[int, int], list[float]]:
    """3..6 nodes on 2..3 GPUs (some on two GPUs, which ties their timelines), random data edges,
    small integer bytes (so that capacities land exactly on a node's need) and durations."""
    n, num_gpus = rng.randint(3, 6), rng.randint(2, 3)
    fps = []
    for _ in range(n):
        gpus = rng.sample(range(num_gpus), rng.choice((1, 1, 2)))
        alloc = {g: rng.choice((0, 2, 3, 5)) for g in gpus}
        fps.append(Footprint(alloc_bytes={g: b for g, b in alloc.items() if b},
                             free_bytes={g: b for g in gpus if (b := rng.choice((0, 0, 3, 4)))},
                             buffer_bytes={g: 1 for g in gpus if rng.random() < 0.3},
                             local_bytes={g: 1 for g in gpus}, pair_bytes={}))
    rank = rng.sample(range(n), n)  # a random topological order, so that node ids are not one
    edges = [(rank[a], rank[b]) for a in range(n) for b in range(a + 1, n) if rng.random() < 0.3]
    initial = {g: b for g in range(num_gpus) if (b := rng.choice((0, 4, 6, -1))) >= 0}  # some GPUs absent
    durations = [float(rng.choice((1, 2, 3, 5))) for _ in range(n)]
    return fps, edges, initial, durations


def test_fastest_order_is_the_optimum_of_every_permutation_on_random_footprints() -> None:
    """Hand-sized footprints, checked against every permutation: the search returns an order of least
    makespan that keeps the edges and the capacity (met exactly counts as fitting) when one is strictly
    below the bound, else None; across the instances both outcomes, and bounds that cut, occur."""
    rng = random.Random(5)
    found = refused = cut = 0
    for _ in range(300):
        fps, edges, initial, durations = _random_instance(rng)
        capacity = max(initial.values(), default=0) + rng.choice((0, 3, 5, 8, 12, 20))
        spans = [_span(fps, edges, p, durations) for p in itertools.permutations(range(len(fps)))
                 if fits(fps, edges, p, initial, capacity)]
        best = min(spans, default=None)
        bound = rng.choice((float("inf"), float("inf"), (best or 0.0) + 0.5, (best or 0.0) + 1e-13,
                            max(spans, default=0.0)))
        got = fastest_order(fps, edges, initial, capacity, durations, bound)
        if best is None or best >= bound - 1e-12:
            assert got is None
            refused += 1
            continue
        assert got is not None and fits(fps, edges, got, initial, capacity)
        assert _span(fps, edges, got, durations) == best == makespan(fps, edges, got, durations)
        found += 1
        cut += bound < float("inf")
    assert found >= 120 and refused >= 120 and cut >= 50


def test_a_destroy_on_a_full_gpu_runs_first_and_frees_the_room_exactly() -> None:
    """GPU 0 is full (10 of 10): the release (no allocation) fits, and after it the 10-byte
    acquisition fits exactly; the acquisition alone does not."""
    release = Footprint(alloc_bytes={}, free_bytes={0: 10}, buffer_bytes={}, local_bytes={}, pair_bytes={})
    acquire = Footprint(alloc_bytes={0: 8}, free_bytes={}, buffer_bytes={0: 2}, local_bytes={}, pair_bytes={})
    assert fastest_order([release, acquire], [], {0: 10}, 10, [1.0, 1.0]) == (0, 1)
    assert fastest_order([acquire, release], [], {0: 10}, 10, [1.0, 1.0]) == (1, 0)
    assert fastest_order([acquire], [], {0: 10}, 10, [1.0]) is None
    # on a GPU that holds nothing yet, an acquisition of exactly the capacity fits; two do not
    empty = Footprint(alloc_bytes={1: 10}, free_bytes={}, buffer_bytes={}, local_bytes={}, pair_bytes={})
    assert fastest_order([empty], [], {}, 10, [1.0]) == (0,)
    assert fastest_order([empty, empty], [], {}, 10, [1.0, 1.0]) is None


def test_the_empty_dag() -> None:
    assert makespan([], [], (), []) == 0.0
    assert fastest_order([], [], {}, 0, []) == ()
    # its makespan, 0, is not strictly below a bound of 0 or of a rounding error
    assert fastest_order([], [], {}, 0, [], bound=0.0) is None
    assert fastest_order([], [], {}, 0, [], bound=1e-12) is None


def test_acquisitions_fill_a_gpu_that_held_nothing_exactly_also_after_backtracking() -> None:
    """GPU 1 starts empty (absent from the initial bytes): a (4 bytes) and b (6) fill its 10 exactly,
    in either order. c needs b. The search first finds a, b, c (makespan 5), backtracks, and must
    still fit a after b to find b, a, c (makespan 4: c runs beside a)."""
    def fp(alloc: dict[int, int], gpus: tuple[int, ...]) -> Footprint:
        return Footprint(alloc_bytes=alloc, free_bytes={}, buffer_bytes={}, local_bytes=dict.fromkeys(gpus, 1),
                         pair_bytes={})
    a, b, c = fp({1: 4}, (1,)), fp({1: 6}, (1,)), fp({}, (0,))
    assert fastest_order([a, b], [], {}, 10, [1.0, 1.0]) == (0, 1)
    best = fastest_order([a, b, c], [(1, 2)], {}, 10, [1.0, 1.0, 3.0])
    assert best == (1, 0, 2) and makespan([a, b, c], [(1, 2)], best, [1.0, 1.0, 3.0]) == 4.0
    # 5 + 6 bytes do not fit in 10, whichever comes first
    assert fastest_order([fp({1: 5}, (1,)), b], [], {}, 10, [1.0, 1.0]) is None


def test_zero_duration_nodes_and_a_cut_search_against_every_permutation() -> None:
    """Destroys and local Merges take no time: the search places such a node at once when it adds no
    state and delays no GPU, and skips a set of placed nodes reached again with the same end times.
    Against every permutation (durations 0, 1, 2; releases and net releases among the nodes), the
    search still returns an order of least makespan. Cut to a few expansions, what it returns still
    fits and beats the bound, and it says it was cut; order_by_memory's order (greedy, with its
    duration-aware pass) always fits, and never runs slower than the memory-only order it replaces."""
    rng = random.Random(17)
    zero_best = cut = beaten = 0
    for _ in range(200):
        fps, edges, initial, _ = _random_instance(rng)
        durations = [float(rng.choice((0, 0, 1, 2))) for _ in fps]
        capacity = max(initial.values(), default=0) + rng.choice((3, 5, 8, 12))
        spans = [_span(fps, edges, p, durations) for p in itertools.permutations(range(len(fps)))
                 if fits(fps, edges, p, initial, capacity)]
        if not spans:
            continue
        best = min(spans)
        got, done = search_order(fps, edges, initial, capacity, durations)
        assert done and got is not None and fits(fps, edges, got, initial, capacity)
        assert _span(fps, edges, got, durations) == best
        zero_best += best == 0.0 or any(durations[i] == 0.0 for i in got)
        short, done = search_order(fps, edges, initial, capacity, durations, bound=max(spans) + 1, budget=2)
        if not done:
            cut += 1
            assert short is None or (fits(fps, edges, short, initial, capacity)
                                     and _span(fps, edges, short, durations) <= max(spans))
        try:
            memory_only = _greedy(fps, edges, [0] * len(fps), initial, capacity, "stage")
        except InfeasibleError:
            continue  # the other passes and the memory search: tested in test_feasibility.py
        timed = order_by_memory(fps, edges, [0] * len(fps), initial, capacity, durations=durations)
        assert fits(fps, edges, timed.order, initial, capacity)
        assert _span(fps, edges, timed.order, durations) <= _span(fps, edges, memory_only.order, durations)
        beaten += _span(fps, edges, timed.order, durations) < _span(fps, edges, memory_only.order, durations)
    assert zero_best >= 100 and cut >= 50 and beaten >= 1
