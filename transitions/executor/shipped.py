"""What the driver already derived from a DAG, shipped to each worker so that it does not derive it again.

A driver that asked for a DAG's messages (``transitions.node_steps.dag_messages``: JobDriver.apply
does, for the bytes it reports) holds in its ``DagMemo`` every worker's step of every node and every
worker's early builds. A worker run of the same DAG from emptied planning caches derives its own
share of them again (5-15 ms of CPU per worker on tiny-25m's TP changes, four workers at once on a
shared host, before the opening barrier). ``pack`` takes one worker's entries out of the driver's
memo as bytes; the worker's ``seed`` puts them into its memo under the DAG it received, where
``_prepare`` finds them by the same keys (``("step", node, worker, max_bucket_bytes, early)`` and
``("early", worker)``). A key the worker would not ask for (another bucket size, early builds off on a
GPU) is simply never read: the worker derives that itself, so a shipped entry changes no step. The
derivation is the same pure code on the same DAG on both ends.

The records (pieces, messages, steps, slots) go as their field values through one constructor each
instead of dataclass pickling's per-object ``fields()`` walks: ~2x faster both ways.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from transitions.dag_pieces import DagMemo
from transitions.global_dag import TransitionDAG
from transitions.layout import Slot
from transitions.transfer_plan import Message, Piece, Step


def _builder(cls: type) -> tuple[tuple[str, ...], Callable[..., Any]]:
    names = tuple(f.name for f in fields(cls))

    def build(*values: Any) -> Any:
        obj: Any = object.__new__(cls)
        for name, value in zip(names, values):
            object.__setattr__(obj, name, value)
        return obj

    return names, build


_FAST = {cls: _builder(cls) for cls in (Piece, Message, Step, Slot)}


def _piece(*v: Any) -> Piece:
    return _FAST[Piece][1](*v)  # type: ignore[no-any-return]


def _message(*v: Any) -> Message:
    return _FAST[Message][1](*v)  # type: ignore[no-any-return]


def _step(*v: Any) -> Step:
    return _FAST[Step][1](*v)  # type: ignore[no-any-return]


def _slot(*v: Any) -> Slot:
    return _FAST[Slot][1](*v)  # type: ignore[no-any-return]


_BUILD = {Piece: _piece, Message: _message, Step: _step, Slot: _slot}  # module-level: picklable by name


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        build = _BUILD.get(type(obj))
        if build is None:
            return NotImplemented
        return build, tuple(getattr(obj, name) for name in _FAST[type(obj)][0])


def entries_for(dag: TransitionDAG, memo: DagMemo, worker: int) -> dict[tuple[Any, ...], Any]:
    """The entries of ``memo`` for ``dag`` that ``worker``'s run reads: its steps and early builds."""
    mine = memo.by_dag.get(dag)
    if not mine:
        return {}
    return {key: value for key, value in mine.items()
            if (key[0] == "step" and key[2] == worker) or (key[0] == "early" and key[1] == worker)}


def pack(dag: TransitionDAG, memo: DagMemo, worker: int) -> bytes | None:
    """``worker``'s entries of ``memo`` for ``dag`` as bytes (None: the memo holds none)."""
    entries = entries_for(dag, memo, worker)
    if not entries:
        return None
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(entries)
    return out.getvalue()


def seed(memo: DagMemo, dag: TransitionDAG, blob: bytes) -> int:
    """Put the shipped entries into ``memo`` under ``dag`` (entries it holds already stay); returns
    how many were shipped."""
    entries = pickle.loads(blob)  # noqa: S301 - from this job's own driver, as every command is
    for key, value in entries.items():
        memo.get(dag, key, _constant(value))
    return len(entries)


def _constant(value: Any) -> Callable[[], Any]:
    return lambda: value
