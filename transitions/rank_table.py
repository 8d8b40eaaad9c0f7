"""A unit rank's buffer as numbers: each tensor's box and each slot's byte offset, slots made on demand. Pure.

A 70B rank holds ~3,000 shards (80 decoder layers, four state kinds when training), yet a DAG's
derivation by runs of like layers (transitions.layer_runs) reads the boxes and slots of one layer
per run and of the fixed tensors, and of the other layers only where their slots sit (their byte
offsets). ``rank_table`` packs a rank's buffer exactly as transitions.layout's ``_layout_slots``
does (the counters first, then every held shard tensor-major, kinds in order, each 16-byte aligned,
page aligned from 64 KiB) but keeps only numbers: per tensor its box, per (tensor, kind) its slot's
byte offset. A ``Slot`` is made when a piece asks for it, equal in every field to the one
``_layout_slots`` makes; tests/transitions/test_rank_table.py holds the table to the shards and
slots over many models, layouts, ranks and kinds.
"""

from __future__ import annotations

from functools import lru_cache
from math import prod

from planner.errors import SpecError
from planner.models import Head, ModelSpec, TensorSpec
from planner.plan import Layout
from transitions.emu import EMU
from transitions.geometry import (
    StateKind,
    _box_rule,
    _tensors,
    check_layout,
    layer_stages,
    tensor_stages,
    tp_box,
)
from transitions.layout import (
    ALIGN_BYTES,
    COUNTERS,
    COUNTERS_KIND,
    DTYPE_BYTES,
    NUM_COUNTERS,
    PAGE_ALIGN_MIN_BYTES,
    PAGE_BYTES,
    Slot,
    _storage_orders,
    align,
    dtype_of,
    make_slot,
)

Box = tuple[tuple[int, ...], tuple[int, ...]]
NOT_HELD = -1
_COUNTERS_KEY = (COUNTERS, COUNTERS_KIND)


class RankTable:
    """One unit rank's buffer: ``boxes[t]`` the box of the model's ``t``-th tensor (None: not held on
    this rank: another PP stage's, or an empty chunk of an uneven split), ``offsets[t * K + k]`` the
    byte offset of its slot of the ``k``-th of the K kinds (NOT_HELD where none), ``size`` the
    buffer's bytes. Slots are made on first use and kept (``slot``)."""

    __slots__ = ("_made", "boxes", "kinds", "offsets", "position", "size", "specs")

    def __init__(self, specs: _ModelSlots, kinds: tuple[StateKind, ...], boxes: tuple[Box | None, ...],
                 offsets: list[int], size: int) -> None:
        self.specs, self.kinds = specs, kinds
        self.position = specs.position
        self.boxes, self.offsets, self.size = boxes, offsets, size
        self._made: dict[tuple[str, str], Slot] = {}

    def box(self, key: tuple[str, StateKind]) -> Box | None:
        """The box the rank holds of ``key`` = (tensor, kind); None if none: ``emu.rank_boxes(...).get``."""
        t = self.position.get(key[0])
        if t is None or key[1] not in self.kinds:
            return None
        return self.boxes[t]

    def slot(self, key: tuple[str, str]) -> Slot:
        """The slot of ``key`` = (tensor, kind name): ``layout._slot_index(...)[key]``; KeyError if none."""
        got = self._made.get(key)
        if got is None:
            got = self._made[key] = self._make(key)
        return got

    def _make(self, key: tuple[str, str]) -> Slot:
        if key == _COUNTERS_KEY:
            return make_slot(COUNTERS, COUNTERS_KIND, "int64", (NUM_COUNTERS,), (0,), (NUM_COUNTERS,), 0, ())
        name, kind_name = key
        t = self.position.get(name)
        k = _kind_index(self.kinds).get(kind_name)
        offset = NOT_HELD if t is None or k is None else self.offsets[t * len(self.kinds) + k]
        if offset == NOT_HELD:
            raise KeyError(key)
        offsets, lengths = self.boxes[t]  # type: ignore[index, misc]
        specs = self.specs
        return make_slot(name, kind_name, specs.dtypes[self.kinds[k]], specs.shapes[t], offsets, lengths,  # type: ignore[index]
                         offset, specs.orders[t])  # type: ignore[index]


class _ModelSlots:
    """What a slot takes from its model and head, per tensor position: shape, storage order; per kind its dtype."""

    __slots__ = ("dtypes", "orders", "position", "shapes")

    def __init__(self, model: ModelSpec, head: Head) -> None:
        tensors = _tensors(model, head)
        orders = _storage_orders(model, head)
        self.position = {t.name: i for i, t in enumerate(tensors)}
        self.shapes = [t.shape for t in tensors]
        self.orders = [orders.get(t.name, ()) for t in tensors]
        self.dtypes = {kind: dtype_of(kind, model) for kind in StateKind}


@lru_cache(maxsize=64)
def _model_slots(model: ModelSpec, head: Head) -> _ModelSlots:
    return _ModelSlots(model, head)


@lru_cache(maxsize=64)
def _kind_index(kinds: tuple[StateKind, ...]) -> dict[str, int]:
    """Each kind's position in ``kinds``, by its name (as slots name it)."""
    return {kind.value: k for k, kind in enumerate(kinds)}


@lru_cache(maxsize=64)
def _rules(model: ModelSpec, head: Head) -> tuple[tuple[int, ...], tuple[TensorSpec, ...]]:
    """Per tensor the index of its box rule (geometry._box_rule: what ``tp_box`` reads), and one tensor
    of each rule: every layer repeats a few."""
    index: dict[object, int] = {}
    first: list[TensorSpec] = []
    of_rule: list[int] = []
    for tensor in _tensors(model, head):
        rule = _box_rule(tensor)
        k = index.get(rule)
        if k is None:
            k = index[rule] = len(first)
            first.append(tensor)
        of_rule.append(k)
    return tuple(of_rule), tuple(first)


@lru_cache(maxsize=256)
def _tp_boxes(model: ModelSpec, head: Head, tp: int, tp_rank: int) -> tuple[Box | None, ...]:
    """Per tensor, the box TP rank ``tp_rank`` of ``tp`` holds of it (None: an empty chunk); one
    ``tp_box`` per rule, shared by its tensors."""
    of_rule, first = _rules(model, head)
    boxes: list[Box | None] = []
    for tensor in first:
        box = tp_box(tensor, model, tp, tp_rank)
        boxes.append(None if 0 in box[1] else box)
    return tuple([boxes[k] for k in of_rule])


@lru_cache(maxsize=256)
def _stage_holds(model: ModelSpec, head: Head, pp: int, pp_rank: int) -> tuple[bool, ...]:
    """Per tensor, whether PP stage ``pp_rank`` of ``pp`` holds it (geometry.rank_shard_tuple's rule)."""
    stages = layer_stages(model.num_layers, pp)
    return tuple(stages[t.layer] == pp_rank if t.layer is not None else pp_rank in tensor_stages(t, model, pp)
                 for t in _tensors(model, head))


@lru_cache(maxsize=2048)
def rank_table(model: ModelSpec, head: Head, layout: Layout, rank: int, kinds: tuple[StateKind, ...]) -> RankTable:
    """The buffer of unit-local ``rank`` of a ``layout`` unit, as ``_layout_slots`` packs it. Keyed
    by value, bounded (a 70B training rank's table is ~3,000 ints and ~720 box references)."""
    check_layout(model, layout)
    if not 0 <= rank < layout.size:
        raise SpecError("rank", f"{rank} outside unit of {layout.size} GPUs ({layout})")
    tp_rank, pp_rank = layout.coords(rank)
    tp_boxes = _tp_boxes(model, head, layout.tp, tp_rank)
    sizes = _tp_sizes(model, head, layout.tp, tp_rank, kinds)
    holds = _stage_holds(model, head, layout.pp, pp_rank)
    width = len(kinds)
    boxes = tuple([box if held else None for box, held in zip(tp_boxes, holds)])
    offsets = [NOT_HELD] * (len(boxes) * width)
    offset = align(0) + NUM_COUNTERS * DTYPE_BYTES["int64"]  # after the counters' slot, as _layout_slots
    for t, held in enumerate(holds):
        entries = sizes[t]
        if not held or entries is None:
            continue
        at = t * width
        for nbytes, to in entries:
            offset = -(-offset // to) * to
            offsets[at] = offset
            offset += nbytes
            at += 1
    return RankTable(_model_slots(model, head), kinds, boxes, offsets, align(offset))


@lru_cache(maxsize=256)
def _tp_sizes(model: ModelSpec, head: Head, tp: int, tp_rank: int, kinds: tuple[StateKind, ...]
              ) -> tuple[tuple[tuple[int, int], ...] | None, ...]:
    """Per tensor, per kind the bytes of TP rank ``tp_rank``'s slot of it and the alignment it starts
    at (``layout.slot_start``'s: a page from PAGE_ALIGN_MIN_BYTES, else ALIGN_BYTES); None: an empty
    chunk. Once per box rule (``_rules``)."""
    items = [DTYPE_BYTES[dtype_of(kind, model)] for kind in kinds]
    of_rule, first = _rules(model, head)
    sizes: list[tuple[tuple[int, int], ...] | None] = []
    for tensor in first:
        offsets, lengths = tp_box(tensor, model, tp, tp_rank)
        numel = prod(lengths)
        sizes.append(None if numel == 0 else tuple(
            (numel * item, PAGE_BYTES if numel * item >= PAGE_ALIGN_MIN_BYTES else ALIGN_BYTES) for item in items))
    return tuple([sizes[k] for k in of_rule])


def unit_table(unit: EMU, gpu: int) -> RankTable:
    """The table of ``unit``'s buffer on ``gpu`` (a part in final shape: its final unit's, as
    layout.unit_slots); ``gpu`` must be one of the unit's."""
    home = unit.final if unit.final is not None else unit
    state = home.state
    return rank_table(state.model, state.head, home.layout, home.gpus.index(gpu), state.kinds)
