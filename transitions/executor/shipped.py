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

The steps go in a compact form of plain values, built and read in C where it can be: a table of the
slots (each distinct slot object once), a table of the pieces (their slots as table indices), and
each step with its messages as rows of field values, pieces as indices (fields read with one
``attrgetter`` per record type, objects rebuilt through their slot descriptors, no ``__init__``); the
rest (early builds) pickled as is. A plain-value payload pickles without a Python callback per
record: tiny-25m's TP merge (348 messages a worker) packed in ~0.5 ms a worker instead of ~2.6 ms.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import fields
from operator import attrgetter
from typing import Any

from transitions.dag_pieces import DagMemo
from transitions.global_dag import TransitionDAG
from transitions.layout import Slot
from transitions.transfer_plan import Message, Piece, Step

_FORMAT = 2  # bumped whenever the rows change: a worker refuses a blob of another format


def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _maker(cls: type) -> Callable[[tuple[Any, ...]], Any]:
    """A builder of ``cls`` from a row of its field values in field order (a frozen slots dataclass:
    each value set through its slot descriptor; the class validates nothing in ``__init__``)."""
    setters = tuple(cls.__dict__[name].__set__ for name in _names(cls))
    new = object.__new__

    def make(row: tuple[Any, ...]) -> Any:
        obj: Any = new(cls)
        for put, value in zip(setters, row):
            put(obj, value)
        return obj

    return make


_ROW = {cls: attrgetter(*_names(cls)) for cls in (Slot, Piece, Message, Step)}
_MAKE = {cls: _maker(cls) for cls in (Slot, Piece, Message, Step)}
# the fields holding records, by position in their row
_P_SLOTS = tuple(_names(Piece).index(n) for n in ("src_slot", "dst_slot"))
_M_PIECES = _names(Message).index("pieces")
_S_LOCAL, _S_MESSAGES = (_names(Step).index(n) for n in ("local", "messages"))


class _Encoder:
    """Slot and piece tables filled as the steps are encoded (each distinct object once)."""

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}
        self.slot_rows: list[tuple[Any, ...]] = []
        self.pieces: dict[int, int] = {}
        self.piece_rows: list[list[Any]] = []

    def slot(self, slot: Slot) -> int:
        i = self.slots.get(id(slot))
        if i is None:
            i = self.slots[id(slot)] = len(self.slot_rows)
            self.slot_rows.append(_ROW[Slot](slot))
        return i

    def piece(self, piece: Piece) -> int:
        i = self.pieces.get(id(piece))
        if i is None:
            i = self.pieces[id(piece)] = len(self.piece_rows)
            row = list(_ROW[Piece](piece))
            for k in _P_SLOTS:
                row[k] = self.slot(row[k])
            self.piece_rows.append(row)
        return i

    def step(self, step: Step) -> list[Any]:
        row = list(_ROW[Step](step))
        piece = self.piece
        row[_S_LOCAL] = [piece(p) for p in row[_S_LOCAL]]
        messages = []
        for m in row[_S_MESSAGES]:
            mrow = list(_ROW[Message](m))
            mrow[_M_PIECES] = [piece(p) for p in mrow[_M_PIECES]]
            messages.append(mrow)
        row[_S_MESSAGES] = messages
        return row


def _decode(payload: tuple[Any, ...]) -> dict[tuple[Any, ...], Any]:
    fmt, slot_rows, piece_rows, steps, others = payload
    if fmt != _FORMAT:
        raise ValueError(f"shipped steps of format {fmt}, this worker reads {_FORMAT}")
    make_slot, make_piece, make_message, make_step = (_MAKE[c] for c in (Slot, Piece, Message, Step))
    slots = [make_slot(r) for r in slot_rows]
    pieces = []
    for r in piece_rows:
        for k in _P_SLOTS:
            r[k] = slots[r[k]]
        pieces.append(make_piece(r))
    out: dict[tuple[Any, ...], Any] = dict(others)
    for key, row in steps.items():
        row[_S_LOCAL] = tuple(pieces[i] for i in row[_S_LOCAL])
        messages = []
        for mrow in row[_S_MESSAGES]:
            mrow[_M_PIECES] = tuple(pieces[i] for i in mrow[_M_PIECES])
            messages.append(make_message(mrow))
        row[_S_MESSAGES] = tuple(messages)
        out[key] = make_step(row)
    return out


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
    enc = _Encoder()
    steps = {key: enc.step(value) for key, value in entries.items() if type(value) is Step}
    others = {key: value for key, value in entries.items() if type(value) is not Step}
    return pickle.dumps((_FORMAT, enc.slot_rows, enc.piece_rows, steps, others), protocol=pickle.HIGHEST_PROTOCOL)


def seed(memo: DagMemo, dag: TransitionDAG, blob: bytes) -> int:
    """Put the shipped entries into ``memo`` under ``dag`` (entries it holds already stay); returns
    how many were shipped."""
    entries = _decode(pickle.loads(blob))  # noqa: S301 - from this job's own driver, as every command is
    for key, value in entries.items():
        memo.get(dag, key, _constant(value))
    return len(entries)


def _constant(value: Any) -> Callable[[], Any]:
    return lambda: value
