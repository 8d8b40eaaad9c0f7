"""The pieces each worker moves for a DAG node, derived from the frozen DAG alone. Pure.

Every worker derives the pieces of the nodes that touch it (``node_pieces``) from
``transitions.primitives.pieces`` and the units' slots, in one fixed order, so both ends of a pair
agree on them, and so on the messages (``transitions.transfer_plan.messages``), without talking.
Derived pieces are kept per DAG object in a ``DagMemo`` owned by whoever runs DAGs (a worker keeps
one for its life; entries go with their DAG).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from transitions.global_dag import TransitionDAG
from transitions.layout import COUNTERS, COUNTERS_KIND, NUM_COUNTERS, unit_slots
from transitions.primitives import Merge, Primitive
from transitions.primitives import pieces as prim_pieces
from transitions.transfer_plan import Piece

T = TypeVar("T")


@dataclass(slots=True)
class DagMemo:
    """What a worker derived from a DAG (pieces, early builds), kept as long as that DAG object
    lives (weak keys) and no longer: a worker derives its peers' early builds from their pieces too,
    so each is derived once per run. Owned and emptied (``clear``) by whoever runs the DAGs."""

    entries: weakref.WeakKeyDictionary[TransitionDAG, dict[Any, Any]] = field(
        default_factory=weakref.WeakKeyDictionary)

    def get(self, dag: TransitionDAG, key: tuple[Any, ...], make: Callable[[], T]) -> T:
        memo = self.entries.get(dag)
        if memo is None:
            memo = self.entries[dag] = {}
        if key not in memo:
            memo[key] = make()
        return memo[key]  # type: ignore[no-any-return]

    def clear(self) -> None:
        self.entries.clear()


def node_pieces(dag: TransitionDAG, node: int, worker: int, memo: DagMemo) -> tuple[Piece, ...]:
    """The pieces ``worker`` sends, receives or copies locally for DAG node ``node``, in derivation
    order (transitions.primitives keeps it), counters first: they sit at the start of every buffer,
    so buckets stay back to back there."""
    return memo.get(dag, ("pieces", node, worker), lambda: _node_pieces(dag, node, worker))


def _node_pieces(dag: TransitionDAG, node: int, worker: int) -> tuple[Piece, ...]:
    prim = dag.nodes[node]
    units = {u.uid: u for u in (*prim.sources, *prim.targets)}
    out: list[Piece] = []
    for t in prim_pieces(prim, worker):
        src, dst = units[t.src_unit], units[t.dst_unit]
        key = (t.tensor, t.kind.value)
        out.append(Piece(src_worker=t.src_gpu, dst_worker=t.dst_gpu, src_slot=unit_slots(src, t.src_gpu)[key],
                         dst_slot=unit_slots(dst, t.dst_gpu)[key], box=(t.offsets, t.lengths),
                         src_unit=t.src_unit, dst_unit=t.dst_unit))
    return tuple([p for p in _counter_pieces(prim) if worker in (p.src_worker, p.dst_worker)] + out)


def _counter_pieces(prim: Primitive) -> list[Piece]:
    """The unit counters (version, step, minibatch position) each new share copies: from a source on
    the same GPU if any, else from the rank-aligned GPU of the first source. Derived for every target
    GPU in one fixed order, so both ends of a pair agree on it."""
    if not prim.sources:
        return []
    key = (COUNTERS, COUNTERS_KIND)
    out = []
    for target in prim.targets:
        for g in target.gpus:
            if isinstance(prim, Merge) and any(p.final == target and p.holds(g) for p in prim.parts):
                continue  # relabelled: the part's buffer, counters included, becomes the unit's
            local = [s for s in prim.sources if s.holds(g)]
            src = local[0] if local else prim.sources[0]
            src_gpu = g if local else src.gpus[target.gpus.index(g) % len(src.gpus)]
            out.append(Piece(src_worker=src_gpu, dst_worker=g, src_slot=unit_slots(src, src_gpu)[key],
                             dst_slot=unit_slots(target, g)[key], box=((0,), (NUM_COUNTERS,)),
                             src_unit=src.uid, dst_unit=target.uid))
    return out


def node_stage(prim: Primitive) -> str:
    """The model-stage a node belongs to."""
    return (*prim.targets, *prim.frees, *prim.sources)[0].model_stage
