"""The bulk constructors of slots and pieces (``make_slot``, ``make_piece``: built without the frozen
dataclasses' ``__init__``, for speed) make exactly the objects the dataclasses do: every field set,
equal, with the same hash; a field added to either dataclass fails here until its constructor sets it."""

from __future__ import annotations

import inspect
from dataclasses import fields

from transitions.layout import Slot, make_slot
from transitions.transfer_plan import Piece, make_piece


def test_make_slot_sets_every_field_as_the_dataclass_does() -> None:
    assert list(inspect.signature(make_slot).parameters) == [f.name for f in fields(Slot)]
    values = dict(tensor="w", kind="param", dtype="bfloat16", global_shape=(8, 6), offsets=(2, 0), lengths=(3, 6),
                  byte_offset=4096, order=(1, 0))
    fast, slow = make_slot(**values), Slot(**values)  # type: ignore[arg-type]
    assert fast == slow and hash(fast) == hash(slow)
    assert {f.name: getattr(fast, f.name) for f in fields(Slot)} == values
    assert fast.num_bytes == slow.num_bytes == 3 * 6 * 2


def test_make_piece_sets_every_field_as_the_dataclass_does() -> None:
    assert list(inspect.signature(make_piece).parameters) == [f.name for f in fields(Piece)]
    a = make_slot("w", "param", "float32", (8,), (0,), (8,), 0, ())
    b = make_slot("w", "param", "float32", (8,), (4,), (4,), 256, ())
    values = dict(src_worker=3, dst_worker=5, src_slot=a, dst_slot=b, box=((4,), (4,)), src_unit="u1", dst_unit="u2")
    fast, slow = make_piece(**values), Piece(**values)  # type: ignore[arg-type]
    assert fast == slow and hash(fast) == hash(slow)
    assert {f.name: getattr(fast, f.name) for f in fields(Piece)} == values
    assert fast.num_bytes == 16 and fast.dst_offsets == (0,)
