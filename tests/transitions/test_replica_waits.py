"""transitions/replica_order.py's waits and passes over hand-built classes: a class that does not fit
waits for a release on a GPU it is over on (``_greedy``, ``_blocked``), the resource edges its members
get (``_resource_edges``), the peak and unlock passes tried when the stage pass is blocked (``_keys``,
``_unlocks``), and the batches a class sharing GPUs is split into (``batched``).

Every expected order, edge and value is worked out by hand from the rules in the module docstring:
the per-unit greedy's (transitions.feasibility), over classes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from transitions.primitives import PrimitiveKind
from transitions.replica_order import (
    ClassOrder,
    _blocked,
    _keys,
    _resource_edges,
    _unlocks,
    batched,
    class_order,
    order_classes,
)
from transitions.replica_plan import ReplicaClass

sys.path.insert(0, str(Path(__file__).parent))
from test_replica_order_terms import _cls  # noqa: E402


def _staged(c: ReplicaClass, stage: str, first: int, preds: list[list[int]] | None = None) -> ReplicaClass:
    c.stage, c.first = stage, first
    if preds is not None:
        c.preds = np.array(preds, dtype=np.int64).reshape(c.size, -1)
    return c


def _run(classes: list[ReplicaClass], edges: list[tuple[int, int]], initial: list[int], capacity: int,
         first: list[int] | None = None) -> ClassOrder | None:
    return order_classes(classes, edges, np.array(initial, dtype=np.int64), capacity,
                         list(range(len(classes))) if first is None else first)


# --- waiting for a release ---------------------------------------------------------------------------

def test_a_class_that_does_not_fit_waits_for_a_release_on_its_gpu() -> None:
    """GPU 0 holds 50 of 100. A (stage 0) allocates 60 there: 110, so it waits; B (stage 1, GPU 1) runs,
    which readies R, a release of 30 on GPU 0; after it A fits (20 + 60). The per-class order used to
    give up at A (None); the edge R -> A is what the per-unit greedy records."""
    a, b, r = _cls([[0]], alloc={0: 60}), _cls([[1]], alloc={0: 10}, stage_order=1), _cls([[0]], free={0: 30})
    got = _run([a, b, r], [(1, 2)], [50, 0, 0, 0], 100)
    assert got is not None and got.order == [1, 2, 0] and got.resource_edges == [(2, 0)]
    # global node ids come from ``first``
    got = _run([a, b, r], [(1, 2)], [50, 0, 0, 0], 100, first=[10, 20, 30])
    assert got is not None and got.resource_edges == [(30, 10)]
    assert class_order([a, b, r], [(1, 2)], np.array([50, 0, 0, 0]), 100) == [1, 2, 0]


def test_a_release_on_another_gpu_or_too_small_leaves_it_waiting() -> None:
    a, b = _cls([[0]], alloc={0: 60}), _cls([[1]], alloc={0: 10}, stage_order=1)
    elsewhere = _cls([[1]], free={0: 30})
    assert _run([a, b, elsewhere], [(1, 2)], [50, 0, 0, 0], 100) is None
    assert class_order([a, b, elsewhere], [(1, 2)], np.array([50, 0, 0, 0]), 100) is None
    small = _cls([[0]], free={0: 9})  # 41 + 60 > 100: retried, and waits again
    assert _run([a, b, small], [(1, 2)], [50, 0, 0, 0], 100) is None
    exact = _cls([[0]], free={0: 10})  # 40 + 60 = 100 fits
    got = _run([a, b, exact], [(1, 2)], [50, 0, 0, 0], 100)
    assert got is not None and got.order == [1, 2, 0]


def test_a_class_retried_too_early_waits_again_for_the_next_release() -> None:
    """R1 frees 5 (A still does not fit: 45 + 60), R2, after B2, frees 30: A runs after R2, and its edge
    comes from R2, the last release on GPU 0 before it ran."""
    a = _cls([[0]], alloc={0: 60})
    b1, b2 = _cls([[1]], alloc={0: 1}, stage_order=1), _cls([[2]], alloc={0: 1}, stage_order=2)
    r1, r2 = _cls([[0]], free={0: 5}), _cls([[0]], free={0: 30})
    got = _run([a, b1, b2, r1, r2], [(1, 3), (2, 4)], [50, 0, 0, 0], 100)
    assert got is not None and got.order == [1, 3, 2, 4, 0]
    assert got.resource_edges == [(4, 0)]


def test_a_class_is_retried_after_a_release_on_any_gpu_it_is_over_on() -> None:
    """Two members on GPUs 0 and 1, both full (95). R1 (after B) frees 20 on GPU 1 and retries A: still
    over on GPU 0 (member 1 fits now), so it waits again; B2 (stage 2, after A's retry) readies R0,
    which frees GPU 0: A runs, and only member 0, which waited last on GPU 0, gets an edge (from R0).
    With R0 ready at once after R1 (releases go first), A is retried once, both members with an edge."""
    a = _cls([[0], [1]], alloc={0: 10})
    b, b2 = _cls([[2]], alloc={0: 1}, stage_order=1), _cls([[3]], alloc={0: 1}, stage_order=2)
    r1, r0 = _cls([[1]], free={0: 20}), _cls([[0]], free={0: 20})
    got = _run([a, b, r1, b2, r0], [(1, 2), (3, 4)], [95, 95, 0, 0], 100, first=[0, 2, 3, 4, 5])
    assert got is not None and got.order == [1, 2, 3, 4, 0]
    assert got.resource_edges == [(5, 0)]
    got = _run([a, b, r1, r0], [(1, 2), (2, 3)], [95, 95, 0, 0], 100, first=[0, 2, 3, 4])
    assert got is not None and got.order == [1, 2, 3, 0]
    assert got.resource_edges == [(4, 0), (3, 1)]


def test_only_a_class_that_frees_more_than_it_allocates_tries_a_waiting_one_again() -> None:
    """A waits on GPU 0 (member 1, on GPU 1, fits then). X fills GPU 1; Z, on GPU 0, frees what it
    allocates (a buffer only): no release, so A is not tried again then (else it would wait again, now
    on both GPUs). W readies R, which frees GPUs 0 and 1: A runs, and only member 0 waited (edge from
    R's member 0)."""
    a = _cls([[0], [1]], alloc={0: 10})
    x = _cls([[1]], alloc={0: 95}, stage_order=1)
    z = _cls([[0]], buf={0: 1}, stage_order=2)
    w = _cls([[2]], alloc={0: 1}, stage_order=3)
    r = _cls([[0], [1]], free={0: 50})
    got = _run([a, x, z, w, r], [(2, 3), (3, 4)], [95, 0, 0, 0], 100, first=[0, 2, 3, 4, 5])
    assert got is not None and got.order == [1, 2, 3, 4, 0]
    assert got.resource_edges == [(5, 0)]


def test_a_member_that_fitted_gets_no_resource_edge() -> None:
    """Only member 1 (GPU 1) was over; member 0 (GPU 0) had room: one edge, into member 1."""
    a = _cls([[0], [1]], alloc={0: 10})
    r = _cls([[1]], free={0: 20})
    b = _cls([[2]], alloc={0: 1}, stage_order=1)
    got = _run([a, r, b], [(2, 1)], [90, 95, 0, 0], 100, first=[0, 2, 3])
    assert got is not None and got.order == [2, 1, 0] and got.resource_edges == [(2, 1)]


def test_an_order_without_waits_has_no_resource_edges() -> None:
    got = _run([_cls([[0]], alloc={0: 10}), _cls([[0]], free={0: 5})], [], [0, 0, 0, 0], 100)
    assert got == ClassOrder(order=[1, 0], resource_edges=[])


# --- _blocked --------------------------------------------------------------------------------------

def test_blocked_names_the_gpus_over_capacity_and_each_members_first() -> None:
    """Members on (3, 1) and (2, 0), 10 bytes on each label; GPUs 0, 2, 3 hold 95 of 100: member 0 is
    over on GPU 3 only, member 1 on GPUs 2 and 0 (its first: 0)."""
    c = _cls([[3, 1], [2, 0]], alloc={0: 10, 1: 10})
    over, first = _blocked(c, np.array([95, 0, 95, 95]), 100)  # type: ignore[misc]
    assert over.tolist() == [0, 2, 3] and first.tolist() == [3, 0]
    assert _blocked(c, np.array([90, 90, 90, 90]), 100) is None
    # a label that allocates nothing is not checked, however full its GPU
    only0 = _cls([[3, 1], [2, 0]], alloc={0: 10})
    over, first = _blocked(only0, np.array([100, 100, 0, 95]), 100)  # type: ignore[misc]
    assert over.tolist() == [3] and first.tolist() == [3, -1]
    # the buffer counts too
    buffered = _cls([[0]], alloc={0: 5}, buf={0: 6})
    assert _blocked(buffered, np.array([90, 0, 0, 0]), 100) is not None
    assert _blocked(buffered, np.array([89, 0, 0, 0]), 100) is None


def test_blocked_members_sharing_a_gpu_count_all_their_allocations() -> None:
    """Members (0, 1) and (1, 2) allocate 10 on label 0: GPU 1 holds 95 and gets member 1's 10 (105):
    over; member 0 touches GPU 1 only through label 1, which allocates nothing: no GPU of its own."""
    c = _cls([[0, 1], [1, 2]], alloc={0: 10})
    assert not c.single
    over, first = _blocked(c, np.array([0, 95, 0, 0]), 100)  # type: ignore[misc]
    assert over.tolist() == [1] and first.tolist() == [-1, 1]
    byte = _cls([[0, 1], [1, 2]], alloc={0: 1})  # one byte over on GPU 1: member 1's
    over, first = _blocked(byte, np.array([0, 100, 0, 0]), 100)  # type: ignore[misc]
    assert over.tolist() == [1] and first.tolist() == [-1, 1]
    both = _cls([[0], [0]], alloc={0: 10}, buf={0: 3})  # 80 + 10 + 10 + 3 = 103
    over, first = _blocked(both, np.array([80, 0, 0, 0]), 100)  # type: ignore[misc]
    assert over.tolist() == [0] and first.tolist() == [0, 0]
    assert _blocked(both, np.array([77, 0, 0, 0]), 100) is None


# --- resource edges --------------------------------------------------------------------------------

def test_the_last_member_to_release_on_a_gpu_gives_the_edge() -> None:
    """R's two members both free 10 on GPU 0 (one after another): the edge comes from its second
    member (node 3); a release that frees no more than it allocates is no release."""
    a = _cls([[0]], alloc={0: 25})
    r = _cls([[0], [0]], free={0: 10})
    assert not r.single
    b = _cls([[1]], alloc={0: 1}, stage_order=1)
    got = _run([a, b, r], [(1, 2)], [90, 0, 0, 0], 100, first=[0, 1, 2])
    assert got is not None and got.order == [1, 2, 0] and got.resource_edges == [(3, 0)]
    waited = {0: np.array([0])}
    swap = _cls([[0]], alloc={0: 10}, free={0: 10})  # frees what it allocates: not a release
    assert _resource_edges([swap, a], [0, 1], {1: waited[0]}, [0, 1], 4) == []
    single = _cls([[0], [1]], free={0: 10})
    assert _resource_edges([single, a, a], [0, 1, 2], {1: np.array([1]), 2: np.array([0])}, [5, 7, 8], 4) \
        == [(6, 7), (5, 8)]
    assert _resource_edges([single, a], [0, 1], {1: np.array([-1])}, [5, 7], 2) == []  # (not GPU 1's)
    assert _resource_edges([single, a], [0, 1], {}, [5, 7], 2) == []
    assert _resource_edges([single, a, a], [0, 1, 2], {1: np.array([1]), 2: np.array([1])}, [0, 7, 8], 2) \
        == [(1, 7), (1, 8)]
    first_member = _cls([[0]], free={0: 10})
    assert _resource_edges([first_member, a], [0, 1], {1: np.array([0])}, [0, 1], 1) == [(0, 1)]
    assert _resource_edges([a, single], [0, 1], {0: np.array([0])}, [0, 1], 4) == []  # no release yet


# --- the peak and unlock passes --------------------------------------------------------------------

def test_a_blocked_stage_pass_is_retried_with_the_largest_demand_first() -> None:
    """Q (stage 0) allocates 40, P (stage 1) 10 with an 85-byte buffer. Stage order runs Q first, then P
    needs 40 + 95 > 100 and nothing is released: blocked. Largest demand first runs P (95), then Q."""
    p, q = _cls([[0]], alloc={0: 10}, buf={0: 85}, stage_order=1), _cls([[0]], alloc={0: 40})
    got = _run([p, q], [], [0, 0, 0, 0], 100)
    assert got is not None and got.order == [0, 1]
    assert _keys([p, q], [1.0, 1.0], "stage") == [(1, 1, -1.0, 0), (1, 0, -1.0, 1)]
    assert _keys([p, q], [1.0, 2.0], "peak") == [(1, -95, 1, -1.0, 0), (1, -40, 0, -2.0, 1)]
    assert _keys([_cls([[0]], touched=[])], [1.0], "peak") == [(0, 0, 0, -1.0, 0)]


def test_a_deadlock_of_the_first_two_passes_is_resolved_by_what_successors_free() -> None:
    """The 8B shape at 1,024 GPUs in miniature: GPU 0 holds 67 of 141. Y (the new actor-train replica)
    allocates 56 and heads the longer path (it moves more); X allocates 26 and D, after X, frees 52.
    Stage and peak order both run Y first (123), then X needs 149: blocked, and D waits for X. Most
    freed by successors first runs X (93), D (41), then Y (97)."""
    y = _staged(_cls([[0]], alloc={0: 56}, moved=10), "s", 0)
    x = _staged(_cls([[0]], alloc={0: 26}), "s", 1)
    d = _staged(_cls([[0]], free={0: 52}), "s", 2, [[1]])
    got = _run([y, x, d], [(1, 2)], [67, 0, 0, 0], 141)
    assert got is not None and got.order == [1, 2, 0] and got.resource_edges == []
    assert _unlocks([y, x, d]) == [0.0, 52.0, 0.0]
    assert _keys([y, x, d], [11.0, 2.0, 1.0], "unlock") == [(1, -0.0, 0, -11.0, 0), (1, -52.0, 0, -2.0, 1),
                                                            (0, -0.0, 0, -1.0, 2)]
    assert _run([y, x, d], [(1, 2)], [67, 0, 0, 0], 140) is not None  # 67 + 26 + ... still fits
    assert _run([y, x, d], [(1, 2)], [67, 0, 0, 0], 92) is None  # X alone needs 93


def test_unlocks_are_what_successors_free_net_per_member() -> None:
    """Stage s: A (2 members, nodes 0-1), B (node 2), D (2 members freeing 12 each, nodes 3-4) reading
    A's member 0 (twice: counted once) and A's member 1 and B; E (frees 4) after B; H (frees what it
    allocates) after A. A: (12 + 12) / 2; B: 12 + 4. Stage t's G (frees 8) follows its own node 0, F."""
    a = _staged(_cls([[0], [1]], alloc={0: 1}), "s", 0)
    b = _staged(_cls([[2]], alloc={0: 1}), "s", 2)
    d = _staged(_cls([[0], [1]], free={0: 12}), "s", 3, [[0, 0], [1, 2]])
    e = _staged(_cls([[2]], free={0: 4}), "s", 5, [[2]])
    h = _staged(_cls([[0]], alloc={0: 5}, free={0: 5}), "s", 6, [[0]])
    f = _staged(_cls([[3]], alloc={0: 1}), "t", 0)
    g = _staged(_cls([[3]], free={0: 8}), "t", 1, [[0]])
    assert _unlocks([a, b, d, e, h, f, g]) == [12.0, 16.0, 0.0, 0.0, 0.0, 8.0, 0.0]
    padded = _staged(_cls([[0]], free={0: 6}), "s", 3, [[-1, 1]])  # -1 pads a member's predecessors
    assert _unlocks([a, b, padded]) == [3.0, 0.0, 0.0]
    assert _unlocks([a, _staged(_cls([[0]], free={0: 6}), "s", 2, [[]])]) == [0.0, 0.0]


# --- batches ---------------------------------------------------------------------------------------

def test_members_sharing_gpus_are_split_into_batches_that_share_none() -> None:
    """Members on (0, 1), (1, 2), (2, 3), (4, 5): first fit puts 0, 2, 3 in one batch and 1 in
    another; a class sharing nothing stays as it is; node ids are renumbered in the new order."""
    lone = _cls([[6]], alloc={0: 1})
    chain = _cls([[0, 1], [1, 2], [2, 3], [4, 5]], alloc={0: 3}, free={1: 2})
    chain.unit = np.array([10, 11, 12, 13])
    chain.refs = np.array([[0], [1], [2], [3]])
    tail = _cls([[7], [8]], alloc={0: 1})
    out = batched([lone, chain, tail])
    assert out[0] is lone and out[-1] is tail
    assert [c.gpus.tolist() for c in out[1:3]] == [[[0, 1], [2, 3], [4, 5]], [[1, 2]]]
    assert [c.unit.tolist() for c in out[1:3]] == [[10, 12, 13], [11]]
    assert [c.refs.tolist() for c in out[1:3]] == [[[0], [2], [3]], [[1]]]
    assert [c.first for c in out] == [0, 1, 4, 5]
    assert all(c.single for c in out)
    for c in out[1:3]:
        assert c.canon is chain.canon and c.kind is PrimitiveKind.EXTEND and c.stage == chain.stage
        assert c.touched.tolist() == chain.touched.tolist() and c.g.tolist() == c.gpus.tolist()
        assert c.delta.tolist() == [3, -2] and c.acquire
    three = batched([_cls([[0], [0], [0]], alloc={0: 1})])
    assert [c.gpus.tolist() for c in three] == [[[0]], [[0]], [[0]]] and [c.first for c in three] == [0, 1, 2]
