"""The pieces each worker moves for a DAG node, derived from the frozen DAG alone. Pure.

Every worker derives the pieces of the nodes that touch it (``node_pieces``) with
``transitions.pieces.share`` (the GPUs reading from it are in the node's footprint), in one fixed
order, so both ends of a pair agree on them, and so on the messages (``transitions.transfer_plan.messages``), without talking.
Derived pieces are kept per DAG object in a ``DagMemo`` owned by whoever runs DAGs (a worker keeps
one for its life; entries go with their DAG).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from transitions.covers import counter_pieces
from transitions.global_dag import TransitionDAG
from transitions.pieces import share
from transitions.primitives import Primitive
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
    order (transitions.covers keeps it), counters first: they sit at the start of every buffer,
    so buckets stay back to back there."""
    return memo.get(dag, ("pieces", node, worker), lambda: _node_pieces(dag, node, worker))


def _node_pieces(dag: TransitionDAG, node: int, worker: int) -> tuple[Piece, ...]:
    prim = dag.nodes[node]
    # the GPUs reading from this worker: the DAG's own footprint of the node says (no memo needed)
    reading = {d for s, d in dag.footprints[node].pair_bytes if s == worker}
    out = share(prim, worker, reading)
    return tuple([p for p in counter_pieces(prim) if worker in (p.src_worker, p.dst_worker)] + out)


def node_stage(prim: Primitive) -> str:
    """The model-stage a node belongs to."""
    return (*prim.targets, *prim.frees, *prim.sources)[0].model_stage
