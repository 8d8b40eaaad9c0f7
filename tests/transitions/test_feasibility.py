"""Memory feasibility (transitions.feasibility) on hand-made footprints: the greedy passes, the exact
search, the replayed order and their errors, with byte counts that land exactly on the capacity."""

from __future__ import annotations

import itertools
import random

import pytest
from order_oracle import fits

from planner.errors import InfeasibleError, SpecError
from transitions.feasibility import EXACT_NODE_LIMIT, _exact_order, order_by_memory, replay_order
from transitions.primitives import Footprint


def _fp(alloc: dict[int, int] | None = None, free: dict[int, int] | None = None,
        buffer: dict[int, int] | None = None) -> Footprint:
    alloc, free, buffer = alloc or {}, free or {}, buffer or {}
    return Footprint(alloc_bytes=alloc, free_bytes=free, buffer_bytes=buffer,
                     local_bytes=dict.fromkeys({*alloc, *free, *buffer}, 1), pair_bytes={})


def test_replay_order_gives_peaks_and_an_edge_from_the_release_each_acquisition_needed() -> None:
    """GPU 0 is full (10 of 10). Node 0 frees 6 there; node 1 allocates 4 and frees 4 (net nothing: no
    release); node 2 needs 4 + 1 of buffers and node 3 needs 1 on GPU 0 and 2 on GPU 1 (empty): each
    GPU 0 acquisition fits only with node 0's bytes, so each gets the edge from node 0, once; the
    GPU 1 one needs nothing freed."""
    fps = [_fp(free={0: 6}), _fp(alloc={0: 4}, free={0: 4}), _fp(alloc={0: 4}, buffer={0: 1}),
           _fp(alloc={0: 1, 1: 2})]
    got = replay_order(fps, [0, 1, 2, 3], {0: 10}, 10)
    assert got.order == (0, 1, 2, 3)
    assert got.resource_edges == ((0, 1), (0, 2), (0, 3))
    assert got.peak_bytes == {0: 10, 1: 2}  # 4 + 4 + 1 = 9 during node 2, 8 + 1 = 9 during node 3
    # with room to spare nothing waits on a release
    roomy = replay_order(fps, [0, 1, 2, 3], {0: 10}, 20)
    assert roomy.resource_edges == () and roomy.peak_bytes == got.peak_bytes
    # exactly enough room without node 0's bytes: node 2 (9 + 5 > 13 is false at used 4: 4 + 6 + 5 = 15)
    assert replay_order(fps, [0, 1, 2, 3], {0: 10}, 15).resource_edges == ()
    assert replay_order(fps, [0, 1, 2, 3], {0: 10}, 14).resource_edges == ((0, 2), (0, 3))


def test_replay_order_points_at_the_latest_release_on_the_gpu_and_counts_buffer_only_needs() -> None:
    """Two releases on GPU 0 (nodes 0 and 1); node 2's buffers alone (no allocation) need the room:
    its edge comes from node 1, the latest release."""
    fps = [_fp(free={0: 3}), _fp(free={0: 3}), _fp(buffer={0: 6})]
    got = replay_order(fps, [0, 1, 2], {0: 10}, 10)
    assert got.resource_edges == ((1, 2),) and got.peak_bytes == {0: 10}
    assert replay_order(fps, [1, 0, 2], {0: 10}, 10).resource_edges == ((0, 2),)


def _random_case(rng: random.Random) -> tuple[list[Footprint], list[tuple[int, int]], dict[int, int], int]:
    n, gpus = rng.randint(3, 7), rng.randint(1, 3)
    fps = []
    for _ in range(n):
        on = rng.sample(range(gpus), min(gpus, rng.choice((1, 1, 2))))
        fps.append(_fp(alloc={g: b for g in on if (b := rng.choice((0, 2, 4, 6)))},
                       free={g: b for g in on if (b := rng.choice((0, 0, 3, 6)))},
                       buffer={g: 1 for g in on if rng.random() < 0.2}))
    rank = rng.sample(range(n), n)
    edges = [(rank[a], rank[b]) for a in range(n) for b in range(a + 1, n) if rng.random() < 0.25]
    initial = {g: b for g in range(gpus) if (b := rng.choice((0, 4, 8, -1))) >= 0}
    return fps, edges, initial, max(initial.values(), default=0) + rng.choice((0, 2, 4, 6, 10))


def test_the_exact_search_finds_an_order_whenever_a_permutationfits() -> None:
    """Against every permutation: _exact_order returns a memory-feasible topological order exactly
    when one exists; order_by_memory then returns one too (greedy or exact); both outcomes occur."""
    rng = random.Random(3)
    found = none = 0
    for _ in range(250):
        fps, edges, initial, capacity = _random_case(rng)
        exists = any(fits(fps, edges, p, initial, capacity) for p in itertools.permutations(range(len(fps))))
        got = _exact_order(fps, edges, initial, capacity)
        assert (got is not None) == exists
        if got is None:
            none += 1
            if all(v <= capacity for v in initial.values()):
                with pytest.raises(InfeasibleError):
                    order_by_memory(fps, edges, [0] * len(fps), initial, capacity)
            continue
        found += 1
        assert fits(fps, edges, got, initial, capacity)
        mo = order_by_memory(fps, edges, [0] * len(fps), initial, capacity)
        assert fits(fps, edges, mo.order, initial, capacity)
    assert found >= 100 and none >= 100


def test_the_exact_search_tries_releases_first_and_gives_up_past_its_state_limit() -> None:
    acquire, release = _fp(alloc={0: 1}), _fp(free={0: 1})
    assert _exact_order([acquire, release], [], {0: 1}, 10) == [1, 0]
    assert _exact_order([release, acquire], [], {0: 1}, 10) == [0, 1]
    # a chain of 4: the search visits 4 sets before the last one (which it returns)
    chain = [_fp(alloc={0: 1}) for _ in range(4)]
    edges = [(0, 1), (1, 2), (2, 3)]
    assert _exact_order(chain, edges, {}, 10, max_states=4) == [0, 1, 2, 3]
    assert _exact_order(chain, edges, {}, 10, max_states=3) is None


def test_order_by_memory_refuses_an_unknown_policy_and_a_gpu_over_capacity_at_the_start() -> None:
    fps = [_fp(alloc={0: 1})]
    with pytest.raises(SpecError) as spec:
        order_by_memory(fps, [], [0], {}, 10, policy="fastest")
    assert spec.value.field == "policy"
    assert str(spec.value) == "policy: unknown policy 'fastest' (allowed: global, per_stage)"
    with pytest.raises(InfeasibleError, match=r"^transition infeasible: GPU 1 already holds 11 bytes") as over:
        order_by_memory(fps, [], [0], {0: 10, 1: 11}, 10)
    assert over.value.reasons == ("GPU 1: 11 bytes of state > capacity 10",)
    assert order_by_memory(fps, [], [0], {0: 9, 1: 10}, 10).peak_bytes == {0: 10, 1: 10}


def test_a_gpu_that_held_nothing_starts_at_zero() -> None:
    """GPU 2 is not in the initial bytes: 1 byte, then 1 more, peak at 2; 11 bytes there do not fit in
    10, and the error says all 10 are free."""
    assert order_by_memory([_fp(alloc={2: 1})], [], [0], {}, 10).peak_bytes == {2: 1}
    assert order_by_memory([_fp(alloc={2: 1}), _fp(alloc={2: 1})], [(0, 1)], [0, 0], {}, 10).peak_bytes == {2: 2}
    with pytest.raises(InfeasibleError, match=r"^transition infeasible: GPU 2 needs 11 bytes for node 0 but has 10 free"):
        order_by_memory([_fp(alloc={2: 11})], [], [0], {}, 10)


def test_buffers_alone_fit_exactly() -> None:
    """6 bytes of buffers and no allocation on a GPU holding 4 of 10: it fits, with nothing to spare."""
    assert order_by_memory([_fp(buffer={0: 6})], [], [0], {0: 4}, 10).peak_bytes == {0: 10}
    with pytest.raises(InfeasibleError):
        order_by_memory([_fp(buffer={0: 7})], [], [0], {0: 4}, 10)


def test_the_greedy_runs_releases_first_then_the_longest_remaining_path() -> None:
    """Rule 1: a release runs before an acquisition, even one of an earlier stage. Rule 2's tie
    breaker: among acquisitions of one stage, the longer remaining path (nodes, and bytes sent) first."""
    acquire, release = _fp(alloc={0: 1}), _fp(free={1: 1})
    assert order_by_memory([acquire, release], [], [0, 2], {1: 1}, 10).order == (1, 0)

    def chain_vs_pair(pair_bytes: int) -> tuple[int, ...]:
        """A (node 0) heads a chain of three nodes moving nothing; B (node 3) one successor that
        sends ``pair_bytes``. Every node allocates a byte on a GPU of its own."""
        fps = [_fp(alloc={g: 1}) for g in range(5)]
        fps[4] = Footprint(alloc_bytes={4: 1}, free_bytes={}, buffer_bytes={}, local_bytes={},
                           pair_bytes={(4, 5): pair_bytes})
        return order_by_memory(fps, [(0, 1), (1, 2), (3, 4)], [0] * 5, {}, 10).order
    assert chain_vs_pair(0)[0] == 0  # A's path: 3 nodes; B's: 2 nodes, nothing sent
    assert chain_vs_pair(2)[0] == 3  # B's path: 2 nodes + 2 bytes sent, longer than A's 3 nodes


def test_per_stage_runs_stage_by_stage_releases_first_and_cannot_wait() -> None:
    acquire1, release1, acquire0 = _fp(alloc={0: 1}), _fp(free={1: 1}), _fp(alloc={2: 1})
    got = order_by_memory([acquire1, release1, acquire0], [], [1, 1, 0], {1: 1}, 10, policy="per_stage")
    assert got.order == (2, 1, 0) and got.resource_edges == ()
    # the global order runs the release first of all
    assert order_by_memory([acquire1, release1, acquire0], [], [1, 1, 0], {1: 1}, 10).order == (1, 2, 0)
    with pytest.raises(InfeasibleError, match=r"GPU 0 needs 3 bytes for node 0 but has 2 free") as err:
        order_by_memory([_fp(alloc={0: 3}), _fp(free={0: 8})], [], [0, 1], {0: 8}, 10, policy="per_stage")
    assert err.value.reasons == ("GPU 0: 3 bytes needed, 2 of 10 free (per-stage order cannot wait)",)


def test_an_acquisition_that_does_not_fit_waits_for_the_release_and_gets_its_edge() -> None:
    """GPU 0 holds 8 of 10. P (node 0, tried first: as long a path as Q's, a lower id) needs 3: blocked.
    Q (node 1) needs 2, fits; D (node 2, after Q) frees 8; then P fits, with a resource edge D -> P,
    and its successor E (node 3) runs."""
    idle = Footprint(alloc_bytes={}, free_bytes={}, buffer_bytes={}, local_bytes={}, pair_bytes={})
    fps = [_fp(alloc={0: 3}), _fp(alloc={0: 2}), _fp(free={0: 8}), idle]
    got = order_by_memory(fps, [(1, 2), (0, 3)], [0] * 4, {0: 8}, 10)
    assert got.order == (1, 2, 0, 3) and got.resource_edges == ((2, 0),) and got.peak_bytes == {0: 10}


_IDLE = [Footprint(alloc_bytes={}, free_bytes={}, buffer_bytes={}, local_bytes={}, pair_bytes={})] * 23


def test_the_second_pass_runs_the_largest_transient_demand_first() -> None:
    """X (stage 0) allocates 6 of 10; Y (stage 1) 2 plus 7 of buffers. Stage order (X first) leaves no
    room for Y; the largest demand first (Y, then X) fits. 23 idle nodes put the DAG past the exact
    search's size, so only the greedy passes can order it."""
    fps = [_fp(alloc={0: 6}), _fp(alloc={0: 2}, buffer={0: 7}), *_IDLE]
    got = order_by_memory(fps, [], [0, 1] + [0] * 23, {}, 10)
    assert got.order[-2:] == (1, 0) and got.peak_bytes == {0: 9}


def test_the_third_pass_runs_first_what_unlocks_a_release() -> None:
    """GPU 0 holds 8 of 10; P (node 0) and Q (node 1) need 2 each, D (after Q) frees 8, E (after P)
    nothing, so that P's path is as long as Q's. Stage order and largest demand both run P first (the
    lower id) and leave Q no room; running Q first (it unlocks D's 8 bytes) fits: Q, D, P, E."""
    fps = [_fp(alloc={0: 2}), _fp(alloc={0: 2}), _fp(free={0: 8}), *_IDLE]
    got = order_by_memory(fps, [(1, 2), (0, 3)], [0] * 26, {0: 8}, 10)
    assert got.order[-4:] == (1, 2, 0, 3) and got.peak_bytes == {0: 10}


def test_when_nothing_can_run_the_error_names_the_first_blocked_node_by_priority() -> None:
    """Node 0 (stage 1) and node 1 (stage 0) both need 5 bytes where 2 are free, and nothing frees
    any: the error names node 1, first by stage order, though node 0 has the lower id."""
    fps = [_fp(alloc={0: 5}), _fp(alloc={1: 5})]
    with pytest.raises(InfeasibleError, match=r"^transition infeasible: GPU 1 needs 5 bytes for node 1 but has 2 free") as err:
        order_by_memory(fps, [], [1, 0], {0: 8, 1: 8}, 10)
    assert err.value.reasons == ("GPU 1: 5 bytes needed, 2 of 10 free (no executable release frees it)",)


def test_a_release_of_one_byte_unblocks_a_waiting_acquisition() -> None:
    """GPU 0 holds 9 of 10; P (node 0, tried first) needs 2: blocked. Q (node 1, on GPU 1) runs, then
    D (after Q) frees a single byte on GPU 0: a release, so P is retried, fits exactly, and waits on D."""
    idle = Footprint(alloc_bytes={}, free_bytes={}, buffer_bytes={}, local_bytes={}, pair_bytes={})
    fps = [_fp(alloc={0: 2}), _fp(alloc={1: 1}), _fp(free={0: 1}), idle]
    got = order_by_memory(fps, [(1, 2), (0, 3)], [0] * 4, {0: 9}, 10)
    assert got.order == (1, 2, 0, 3) and got.resource_edges == ((2, 0),) and got.peak_bytes == {0: 10, 1: 1}


def test_replay_order_edges_on_another_gpu_and_at_the_threshold() -> None:
    """The rule per GPU: an acquisition gets the edge when it would not fit without the bytes the
    latest release there freed (used + freed + need > capacity)."""
    fps = [_fp(free={1: 1}), _fp(alloc={1: 1})]
    assert replay_order(fps, [0, 1], {0: 0, 1: 10}, 10).resource_edges == ((0, 1),)  # a one-byte release
    assert replay_order(fps, [0, 1], {0: 0, 1: 10}, 11).resource_edges == ()
    buffers = [_fp(free={0: 3}), _fp(buffer={0: 6})]  # 7 + 3 + 6 = 16: over 15, not over 16
    assert replay_order(buffers, [0, 1], {0: 10}, 15).resource_edges == ((0, 1),)
    assert replay_order(buffers, [0, 1], {0: 10}, 16).resource_edges == ()


def test_a_net_zero_node_is_no_release() -> None:
    """As in the one-byte case, P (node 0) waits for D's byte; N (node 3, after D, an earlier stage so
    it runs before P is retried) allocates and frees one byte: not a release, so P's edge is D's."""
    idle = Footprint(alloc_bytes={}, free_bytes={}, buffer_bytes={}, local_bytes={}, pair_bytes={})
    fps = [_fp(alloc={0: 2}), _fp(alloc={1: 1}), _fp(free={0: 1}), _fp(alloc={0: 1}, free={0: 1}), idle, idle]
    got = order_by_memory(fps, [(1, 2), (2, 3), (0, 4), (4, 5)], [1, 1, 1, 0, 1, 1], {0: 9}, 10)
    assert got.order == (1, 2, 3, 0, 4, 5) and got.resource_edges == ((2, 0),)


def test_the_exact_search_orders_what_every_greedy_pass_blocks_up_to_its_size() -> None:
    """GPU 0 holds 8 of 10. P (node 0) and Q (node 1) need 2 each; D (after Q) frees 8 on GPU 0, D'
    (after P) 8 on GPU 1. Every pass runs P first (ties on stage, path, demand and bytes unlocked) and
    leaves Q no room; only Q, D, P, D' fits. With idle nodes up to EXACT_NODE_LIMIT the exact search
    finds it; one more and the error of the first pass stands."""
    core = [_fp(alloc={0: 2}), _fp(alloc={0: 2}), _fp(free={0: 8}), _fp(free={1: 8})]
    edges = [(1, 2), (0, 3)]
    idle = Footprint(alloc_bytes={}, free_bytes={}, buffer_bytes={}, local_bytes={}, pair_bytes={})
    fits = order_by_memory([*core, *[idle] * (EXACT_NODE_LIMIT - 4)], edges, [0] * EXACT_NODE_LIMIT,
                           {0: 8, 1: 8}, 10)
    assert [i for i in fits.order if i < 4] == [1, 2, 0, 3]
    with pytest.raises(InfeasibleError, match=r"GPU 0 needs 2 bytes for node 1 but has 0 free"):
        order_by_memory([*core, *[idle] * (EXACT_NODE_LIMIT - 3)], edges, [0] * (EXACT_NODE_LIMIT + 1),
                        {0: 8, 1: 8}, 10)
