"""transitions.exact_order's budget and the corners of its execution rule: the budget counts expansions
(none: nothing is searched, and nothing is claimed), a search the budget cuts says so, and the
production budget proves the optimum of 16-node DAGs whose proof needs fewer expansions than it
allows (the pruning keeps it there); durations of milliseconds and nodes on no GPU start as the
execution rule says (transitions.exact_order.makespan)."""

from __future__ import annotations

import itertools
import random

from order_oracle import fits

from transitions.exact_order import EXACT_BUDGET, EXACT_MAKESPAN_NODES, fastest_order, makespan, search_order
from transitions.primitives import Footprint


def _fp(alloc: dict[int, int] | None = None, free: dict[int, int] | None = None,
        gpus: tuple[int, ...] = ()) -> Footprint:
    alloc, free = alloc or {}, free or {}
    return Footprint(alloc_bytes=alloc, free_bytes=free, buffer_bytes={},
                     local_bytes=dict.fromkeys({*alloc, *free, *gpus}, 1), pair_bytes={})


def test_a_budget_of_nothing_searches_nothing() -> None:
    """Budget 0: no state is expanded, so no order is found and the search reports itself cut; the
    empty DAG needs no expansion (its empty order is the optimum). One node needs one."""
    one = [_fp(alloc={0: 1})]
    assert search_order(one, [], {}, 10, [1.0], budget=0) == (None, False)
    assert search_order([], [], {}, 10, [], budget=0) == ((), True)
    assert search_order(one, [], {}, 10, [1.0], budget=1) == ((0,), True)


def test_milliseconds_and_a_node_on_no_gpu() -> None:
    """A 0.25 s node beats a bound of 0.5 s; a node on no GPU (it waits on nothing but its
    predecessors) after a 1 s node ends at 1.5 s, and alone at 0.5 s."""
    assert fastest_order([_fp(alloc={0: 1})], [], {}, 10, [0.25], bound=0.5) == (0,)
    chain = [_fp(alloc={0: 1}), _fp()]
    assert makespan(chain, [(0, 1)], (0, 1), [1.0, 0.5]) == 1.5
    assert fastest_order(chain, [(0, 1)], {}, 10, [1.0, 0.5], bound=1.5 + 1e-9) == (0, 1)
    assert fastest_order(chain, [(0, 1)], {}, 10, [1.0, 0.5], bound=1.5) is None
    assert fastest_order([_fp()], [], {}, 10, [0.5], bound=0.75) == (0,)


def _instance(rng: random.Random, n: int) -> tuple[list[Footprint], list[tuple[int, int]], list[float]]:
    """n nodes on 3 GPUs (some on two), sparse data edges, durations of 0..7 units."""
    fps = []
    for _ in range(n):
        gpus = rng.sample(range(3), rng.choice((1, 1, 2)))
        fps.append(_fp(alloc={g: b for g in gpus if (b := rng.choice((0, 2, 3, 5)))},
                       free={g: b for g in gpus if (b := rng.choice((0, 0, 3, 4)))}, gpus=tuple(gpus)))
    durations = [float(rng.choice((0, 1, 2, 3, 5, 7))) for _ in range(n)]
    return fps, [(a, b) for a in range(n) for b in range(a + 1, n) if rng.random() < 0.08], durations


INITIAL, CAPACITY = {0: 4, 1: 4, 2: 4}, 14


def _sixteen_node_dags() -> list[tuple[list[Footprint], list[tuple[int, int]], list[float]]]:
    rng = random.Random(0)
    return [_instance(rng, EXACT_MAKESPAN_NODES) for _ in range(60)]


def test_the_production_budget_proves_16_node_optima_within_its_reach() -> None:
    """Of 60 random 16-node DAGs (seed 0), numbers 1, 9, 51 and 59 are proven within EXACT_BUDGET (their
    proofs take 45% to 63% of it: a weaker bound, a lost reduction or a count of two per expansion
    leaves them unproven); numbers 6, 13 and 55 need more (1.03x to 119x) and are reported cut (what
    they found, if anything, fits and is no faster than the optimum that ten times, for number 13 200
    times, the budget proves)."""
    dags = _sixteen_node_dags()
    for k in (1, 9, 51, 59):
        fps, edges, durations = dags[k]
        best, done = search_order(fps, edges, INITIAL, CAPACITY, durations)
        assert done and best is not None and fits(fps, edges, best, INITIAL, CAPACITY), k
    for k, more in ((6, 10), (55, 10), (13, 200)):
        fps, edges, durations = dags[k]
        cut, done = search_order(fps, edges, INITIAL, CAPACITY, durations)
        assert not done, k
        best, done = search_order(fps, edges, INITIAL, CAPACITY, durations, budget=more * EXACT_BUDGET)
        assert done and best is not None
        assert cut is None or (fits(fps, edges, cut, INITIAL, CAPACITY)
                               and makespan(fps, edges, best, durations) <= makespan(fps, edges, cut, durations))


def test_small_budgets_prove_what_they_reach_and_the_optimum_of_every_permutation() -> None:
    """200 random 6-node DAGs (seed 4), checked against every permutation: whatever a budget of 30, 35,
    40 or 50 expansions proves is the optimum (or that no order fits), a cut answer fits and is no
    faster, and the pruning proves at least as many as measured (56, 104, 148 and 189 of 200)."""
    rng = random.Random(4)
    proven = dict.fromkeys((30, 35, 40, 50), 0)
    for _ in range(200):
        fps, edges, durations = _instance(rng, 6)
        spans = [makespan(fps, edges, p, durations) for p in itertools.permutations(range(6))
                 if fits(fps, edges, p, INITIAL, CAPACITY)]
        for budget in proven:
            got, done = search_order(fps, edges, INITIAL, CAPACITY, durations, budget=budget)
            if got is not None:
                assert fits(fps, edges, got, INITIAL, CAPACITY)
                assert makespan(fps, edges, got, durations) >= min(spans)
            if done:
                assert (got is None) == (not spans)
                assert got is None or makespan(fps, edges, got, durations) == min(spans)
                proven[budget] += 1
    assert proven[30] >= 56 and proven[35] >= 104 and proven[40] >= 148 and proven[50] >= 189, proven


def test_a_zero_time_node_that_adds_state_is_not_forced_first() -> None:
    """GPU 0 holds 9 of 10 bytes. Node 0 adds 1 byte there in no time; node 1 needs 1 byte of buffers
    there for 1 s and node 2 (10 s on GPU 1) waits on it; node 3 frees 5 bytes on GPU 0 in 10 s. Run
    first, node 0 would fill GPU 0 until node 3 ends (makespan 21 s); node 1 first lets node 2 run
    beside node 3 (11 s), the optimum of every permutation."""
    fps = [_fp(alloc={0: 1}), Footprint(alloc_bytes={}, free_bytes={}, buffer_bytes={0: 1}, local_bytes={0: 1},
                                        pair_bytes={}), _fp(alloc={1: 1}), _fp(free={0: 5})]
    edges, durations = [(1, 2)], [0.0, 1.0, 10.0, 10.0]
    spans = [makespan(fps, edges, p, durations) for p in itertools.permutations(range(4))
             if fits(fps, edges, p, {0: 9}, 10)]
    best = fastest_order(fps, edges, {0: 9}, 10, durations)
    assert best is not None and fits(fps, edges, best, {0: 9}, 10)
    assert makespan(fps, edges, best, durations) == min(spans) == 11.0 < max(spans) == 21.0


def test_a_search_cut_by_its_budget_never_claims_a_proof() -> None:
    """150 random DAGs of 3..6 nodes (seed 9), each searched with budgets of 1..12 expansions: where the
    search says it completed, its answer is the optimum of every permutation (None: no order fits)."""
    rng = random.Random(9)
    claimed = 0
    for _ in range(150):
        fps, edges, durations = _instance(rng, rng.randint(3, 6))
        spans = [makespan(fps, edges, p, durations) for p in itertools.permutations(range(len(fps)))
                 if fits(fps, edges, p, INITIAL, CAPACITY)]
        for budget in range(1, 13):
            got, done = search_order(fps, edges, INITIAL, CAPACITY, durations, budget=budget)
            if done:
                claimed += 1
                assert (got is None) == (not spans)
                assert got is None or makespan(fps, edges, got, durations) == min(spans)
    assert claimed >= 100, claimed  # 139 searches complete within these budgets
