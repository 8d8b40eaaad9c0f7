"""The brute-force check the ordering tests judge an order by: a permutation of the DAG's nodes that
respects its edges and never puts a GPU over capacity when a node acquires there (a node's own
allocations and buffers on top of what is held). Written apart from transitions/feasibility.py and
transitions/exact_order.py so that it shares no code with what it judges."""

from __future__ import annotations

from transitions.primitives import Footprint


def fits(fps: list[Footprint], edges: list[tuple[int, int]], order: list[int] | tuple[int, ...],
         initial: dict[int, int], capacity: int) -> bool:
    where = {i: k for k, i in enumerate(order)}
    if sorted(order) != list(range(len(fps))) or any(where[a] > where[b] for a, b in edges):
        return False
    used = dict(initial)
    for i in order:
        fp = fps[i]
        if any(used.get(g, 0) + fp.alloc_bytes.get(g, 0) + fp.buffer_bytes.get(g, 0) > capacity
               for g in {*fp.alloc_bytes, *fp.buffer_bytes}):
            return False
        for g in {*fp.alloc_bytes, *fp.free_bytes}:
            used[g] = used.get(g, 0) + fp.alloc_bytes.get(g, 0) - fp.free_bytes.get(g, 0)
    return True
