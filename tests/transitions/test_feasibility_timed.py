"""The duration-aware greedy pass of transitions.feasibility on hand-made footprints with room to spare
(nothing waits on memory, so the order is the pass's ranking alone): a release runs at once when it
delays no GPU; every other node ranks by the end it would have under the execution rule plus the idle
time it would leave on its GPUs; a node that adds no state anywhere and takes no time counts as a
release. order_by_memory keeps that order only where its makespan is strictly (beyond rounding) less
than the memory-only passes'; without durations it runs the memory-only passes alone."""

from __future__ import annotations

from transitions.feasibility import _greedy, order_by_memory
from transitions.primitives import Footprint

ROOM = 10**9


def _fp(alloc: dict[int, int] | None = None, free: dict[int, int] | None = None,
        buffer: dict[int, int] | None = None, local: dict[int, int] | None = None) -> Footprint:
    """A node on the GPUs where it allocates, frees or holds buffers (copying 1 byte locally there)."""
    alloc, free, buffer = alloc or {}, free or {}, buffer or {}
    return Footprint(alloc_bytes=alloc, free_bytes=free, buffer_bytes=buffer,
                     local_bytes=local or dict.fromkeys({*alloc, *free, *buffer}, 1), pair_bytes={})


def _timed(fps: list[Footprint], seconds: list[float], edges: list[tuple[int, int]] | None = None,
           stages: list[int] | None = None, initial: dict[int, int] | None = None) -> tuple[int, ...]:
    gpus = [tuple(sorted(fp.gpus)) for fp in fps]
    return _greedy(fps, edges or [], stages or [0] * len(fps), initial or {}, ROOM, "time", (seconds, gpus)).order


def test_a_release_that_delays_no_gpu_runs_first_even_a_long_one() -> None:
    """Node 1 frees 4 bytes on GPU 1 in 5 s; node 0 acquires 3 on GPU 2 at no cost in time: the release
    goes first (nothing is idle yet on GPU 1). As an acquisition it would rank by its end (5 > 0)."""
    release, acquire = _fp(free={1: 4}), _fp(alloc={2: 3})
    assert _timed([acquire, release], [0.0, 5.0], initial={1: 4}) == (1, 0)
    assert _timed([acquire, _fp(alloc={1: 4})], [0.0, 5.0]) == (0, 1)


def test_a_node_that_adds_no_state_and_takes_no_time_counts_as_a_release() -> None:
    """Node 1 allocates 3 and frees 3 on GPU 0 and holds a buffer on GPU 1, in no time: it adds nothing
    net anywhere, so it runs at once, before node 0 (a zero-time 1-byte acquisition of an earlier
    stage). The same node taking 0.5 s ranks as an acquisition, by its end, after one ending at 0.25 s;
    and node 0's 1 byte, allocated where nothing is freed, is state added (it waits for node 1)."""
    swap = _fp(alloc={0: 3}, free={0: 3}, buffer={1: 1})
    one_byte = _fp(alloc={2: 1})
    assert _timed([one_byte, swap], [0.0, 0.0], stages=[0, 1]) == (1, 0)
    assert _timed([swap, one_byte], [0.5, 0.25], stages=[0, 0]) == (1, 0)
    assert _timed([swap, one_byte], [0.0, 0.25], stages=[1, 0]) == (0, 1)


def test_a_node_waits_for_its_gpu_and_ranks_by_the_end_it_would_have_there() -> None:
    """Nodes 0 (4 s) and 1 (1 s) share GPU 0, node 2 (3 s) has GPU 1: node 1 ends first (1 s); then
    node 0 would start at 1 s and end at 5 s, node 2 end at 3 s, so node 2 goes before node 0."""
    fps = [_fp(alloc={0: 1}), _fp(alloc={0: 1}), _fp(alloc={1: 1})]
    assert _timed(fps, [4.0, 1.0, 3.0]) == (1, 2, 0)


def test_the_idle_time_a_node_leaves_counts_against_it() -> None:
    """Node 0 (1 s on GPU 0) runs first; node 2 frees on GPU 0 after it. Right after node 0 on its GPU
    node 2 delays nothing and runs at once; spread over GPUs 0 and 1 it would leave GPU 1 idle for 1 s
    (end 1.5 s + 1 s idle), so node 1 (2 s on GPU 1, from 0 s: no idle) goes before it."""
    fps = [_fp(alloc={0: 1}), _fp(alloc={1: 1}), _fp(free={0: 1})]
    assert _timed(fps, [1.0, 2.0, 0.5], edges=[(0, 2)], initial={0: 5, 1: 5}) == (0, 2, 1)
    fps[2] = _fp(free={0: 1, 1: 1})
    assert _timed(fps, [1.0, 2.0, 0.5], edges=[(0, 2)], initial={0: 5, 1: 5}) == (0, 1, 2)


def test_equal_ends_go_to_the_longest_remaining_path() -> None:
    """Nodes 0 and 1 would both end at 1 s, from 0 s, in the same stage; node 1 has a successor (node
    2), so its remaining path is longer and it runs first."""
    fps = [_fp(alloc={0: 1}), _fp(alloc={1: 1}), _fp(alloc={2: 1})]
    assert _timed(fps, [1.0, 1.0, 1.0], edges=[(1, 2)]) == (1, 0, 2)
    assert _timed(fps, [1.0, 1.0, 1.0], edges=[(0, 2)]) == (0, 1, 2)


def test_a_rank_that_moved_since_it_was_queued_is_taken_again() -> None:
    """Nodes 0 (1 s) and 1 (1.5 s) share GPU 0, node 2 (2 s) has GPU 1: after node 0, node 1 would end
    at 2.5 s, no longer before node 2 (2 s), which goes first."""
    fps = [_fp(alloc={0: 1}), _fp(alloc={0: 1}), _fp(alloc={1: 1})]
    assert _timed(fps, [1.0, 1.5, 2.0]) == (0, 2, 1)


def test_order_by_memory_keeps_the_timed_order_only_where_it_is_strictly_faster() -> None:
    """Node 0 (stage 0, 5 s) and node 1 (stage 1, 1 s) share GPU 0; node 2 needs node 1 and takes 5 s on
    GPU 1. Stage order runs node 0 first (makespan 11 s); the timed pass runs node 1 first (6 s)."""
    fps = [_fp(alloc={0: 1}), _fp(alloc={0: 1}), _fp(alloc={1: 1})]
    args = (fps, [(1, 2)], [0, 1, 1], {}, ROOM)
    assert order_by_memory(*args).order == (0, 1, 2)
    assert order_by_memory(*args, durations=[5.0, 1.0, 5.0]).order == (1, 0, 2)
    # 0.75 s, 0.25 s and 1e-12 s: stage order ends at 1 s + 1e-12 s, the timed order (node 1, node 2,
    # node 0) at 1 s: faster by a rounding error only, so the stage order stays
    assert _timed(fps, [0.75, 0.25, 1e-12], edges=[(1, 2)], stages=[0, 1, 1]) == (1, 2, 0)
    assert order_by_memory(*args, durations=[0.75, 0.25, 1e-12]).order == (0, 1, 2)
    # a node on no GPU (it waits on nothing) running as long as the stage order (11 s): both orders end
    # at 11 s, so the stage order stays
    four = (fps + [_fp()], [(1, 2)], [0, 1, 1, 0], {}, ROOM)
    assert order_by_memory(*four).order == (3, 0, 1, 2)  # no state added: the release rank
    assert _timed(four[0], [5.0, 1.0, 5.0, 11.0], edges=[(1, 2)], stages=[0, 1, 1, 0]) == (3, 1, 0, 2)
    assert order_by_memory(*four, durations=[5.0, 1.0, 5.0, 11.0]).order == (3, 0, 1, 2)
    # side by side on GPUs 0 and 1, both orders end at 2 s: the stage order (stage 0 first) stays
    side = [_fp(alloc={0: 1}), _fp(alloc={1: 1})]
    assert _timed(side, [1.0, 2.0]) == (0, 1)
    assert order_by_memory(side, [], [1, 0], {}, ROOM, durations=[1.0, 2.0]).order == (1, 0)


def test_order_by_memory_with_durations_on_the_empty_and_the_one_node_dag() -> None:
    assert order_by_memory([], [], [], {}, ROOM, durations=[]).order == ()
    got = order_by_memory([_fp(alloc={0: 3})], [], [0], {0: 1}, ROOM, durations=[2.0])
    assert got.order == (0,) and got.peak_bytes == {0: 4}
