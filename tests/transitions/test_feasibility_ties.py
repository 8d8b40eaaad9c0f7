"""The tie-breakers of the second and third greedy passes of transitions.feasibility, on hand-made
footprints with room to spare (nothing waits, so the order is the priority's alone). Both rank
releases before acquisitions; the ``peak`` pass then runs the largest transient demand first (a
node's most, over its GPUs, of state allocated plus buffers held), the ``unlock`` pass the node whose
successors free the most net bytes first; then stage, the longest remaining path, the node id."""

from __future__ import annotations

from transitions.feasibility import _greedy
from transitions.primitives import Footprint

ROOM = 10**9


def _fp(alloc: dict[int, int] | None = None, free: dict[int, int] | None = None,
        buffer: dict[int, int] | None = None, pairs: dict[tuple[int, int], int] | None = None) -> Footprint:
    """A node on the GPUs where it allocates, frees or holds buffers (it copies 1 byte locally there)."""
    alloc, free, buffer = alloc or {}, free or {}, buffer or {}
    return Footprint(alloc_bytes=alloc, free_bytes=free, buffer_bytes=buffer,
                     local_bytes=dict.fromkeys({*alloc, *free, *buffer}, 1), pair_bytes=pairs or {})


def _order(fps: list[Footprint], priority: str, edges: list[tuple[int, int]] | None = None) -> tuple[int, ...]:
    return _greedy(fps, edges or [], [0] * len(fps), {}, ROOM, priority).order


def test_the_peak_pass_counts_state_and_buffers_only_where_they_are() -> None:
    # 50 allocated on GPU 1 beats 10 allocated on GPU 0
    assert _order([_fp(alloc={0: 10}), _fp(alloc={1: 50})], "peak") == (1, 0)
    # 50 of buffers alone on GPU 1 ties with 50 of state on GPU 0: the lower id first
    assert _order([_fp(alloc={0: 50}), _fp(buffer={1: 50})], "peak") == (0, 1)
    assert _order([_fp(buffer={0: 50}), _fp(alloc={1: 50})], "peak") == (0, 1)
    # 49 + 1 on one GPU ties with 50 on another
    assert _order([_fp(alloc={0: 50}), _fp(alloc={1: 49}, buffer={1: 1})], "peak") == (0, 1)
    assert _order([_fp(alloc={0: 49}, buffer={0: 1}), _fp(alloc={1: 50})], "peak") == (0, 1)


def test_a_node_on_no_gpu_has_no_demand() -> None:
    """Two releases (nothing acquired): a node with no GPUs at all and one that frees on GPU 0 both
    demand nothing, so the lower id runs first, in either numbering."""
    assert _order([_fp(free={0: 10}), _fp()], "peak") == (0, 1)
    assert _order([_fp(), _fp(free={0: 10})], "peak") == (0, 1)


def test_a_successor_that_frees_nothing_unlocks_nothing() -> None:
    """Node 1's successor (node 2) allocates and frees nothing net, so nodes 0 and 1 tie on unlocked
    bytes; node 0 sends 100 bytes (longer remaining path: 101 against 1 + 1), so it runs first."""
    fps = [_fp(alloc={0: 10}, pairs={(0, 1): 100}), _fp(alloc={0: 10}), _fp(alloc={1: 5})]
    assert _order(fps, "unlock", [(1, 2)]) == (0, 1, 2)
    # a successor that frees 7 net (8 freed, 1 allocated) puts node 1 first
    fps[2] = _fp(alloc={1: 1}, free={1: 8})
    assert _order(fps, "unlock", [(1, 2)]) == (1, 0, 2)


def test_equal_demand_or_unlock_goes_to_the_longest_remaining_path() -> None:
    """Nodes 0 and 1 acquire 10 each; node 1 has a successor (node 2, 1 byte), so its remaining path
    is longer (2 against 1) and it runs first in both passes; node 2 (demand 1) after node 0."""
    fps = [_fp(alloc={0: 10}), _fp(alloc={1: 10}), _fp(alloc={2: 1})]
    assert _order(fps, "peak", [(1, 2)]) == (1, 0, 2)
    assert _order(fps, "unlock", [(1, 2)]) == (1, 0, 2)
