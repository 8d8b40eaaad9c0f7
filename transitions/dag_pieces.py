"""The pieces each worker moves for a DAG node, derived from the frozen DAG alone. Pure.

Every worker derives the pieces of the nodes that touch it (``node_pieces``) with
``transitions.pieces.share`` (the GPUs reading from it are in the node's footprint), in one fixed
order, so both ends of a pair agree on them, and so on the messages (``transitions.transfer_plan.messages``), without talking.
What a worker derives is kept by DAG content in a ``DagMemo`` owned by whoever runs DAGs (a worker
keeps one for its life, bounded to its last few DAGs).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from transitions.covers import counter_pieces
from transitions.global_dag import TransitionDAG
from transitions.pieces import share
from transitions.primitives import Primitive
from transitions.transfer_plan import Piece

T = TypeVar("T")


MEMO_DAGS = 8  # distinct DAGs (by content) whose derivations a worker keeps


@dataclass(slots=True)
class DagMemo:
    """What a worker derived from DAGs (pieces, steps, early builds), by DAG content: a DAG that comes
    again (every step's weight sync, a replan back, a benchmark) arrives by pickle as a new object
    with the same nodes and order, and is derived once. Holds the last ``max_dags`` DAGs' entries
    (least recently run dropped first); a DAG object is matched to its entries once (weak keys), so
    a lookup costs no hashing of nodes. Owned and emptied (``clear``) by whoever runs the DAGs."""

    max_dags: int = MEMO_DAGS
    by_dag: weakref.WeakKeyDictionary[TransitionDAG, dict[Any, Any]] = field(
        default_factory=weakref.WeakKeyDictionary)
    by_content: OrderedDict[tuple[Any, ...], dict[Any, Any]] = field(default_factory=OrderedDict)

    def get(self, dag: TransitionDAG, key: tuple[Any, ...], make: Callable[[], T]) -> T:
        memo = self.by_dag.get(dag)
        if memo is None:
            memo = self.by_dag[dag] = self._entries(dag)
        if key not in memo:
            memo[key] = make()
        return memo[key]  # type: ignore[no-any-return]

    def _entries(self, dag: TransitionDAG) -> dict[Any, Any]:
        """The entries of the DAG with ``dag``'s content (new ones if none), made most recent."""
        content = (dag.old_version, dag.new_version, dag.nodes, dag.order)
        memo = self.by_content.pop(content, None)
        if memo is None:
            memo = {}
            while len(self.by_content) >= self.max_dags:
                self.by_content.popitem(last=False)
        self.by_content[content] = memo
        return memo

    def clear(self) -> None:
        self.by_dag.clear()
        self.by_content.clear()


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
