"""Where a unit's state lives in a worker's flat buffer: placements, slots and byte ranges. Pure.

A worker's state for one unit rank is ONE flat byte buffer holding every shard of that rank (every
state kind, plus the unit's counters), each shard a ``Slot``: a box of one tensor's state kind at a
fixed byte offset (16-byte aligned; page aligned from 64 KiB, so that pages can change buffers).
Row-parallel weights are stored column-major, so every TP shard of every tensor is one contiguous
run. Both ends of any transfer derive the same slots from the layout alone, without talking.

Dtypes are names ("bfloat16", "float32", "int64") with their item sizes: the arithmetic here needs
no torch; ``transitions.executor.buffers`` maps the names to torch dtypes.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from functools import lru_cache

from planner.errors import SpecError
from planner.models import Head, ModelSpec, Parallel
from planner.plan import Layout
from transitions.emu import EMU
from transitions.geometry import StateKind, _tensors, check_layout, rank_shard_tuple

ALIGN_BYTES = 16
# slots this big start on a page boundary (CPU pages; harmless padding on GPUs): a run kept by a new
# unit then sits at the same offset within a page in the old buffer and the new one, so the pages
# themselves can change buffers instead of their bytes being copied. Costs at most one page of
# padding per such slot (~0.3% of tiny-25m's buffers).
PAGE_BYTES = mmap.PAGESIZE
PAGE_ALIGN_MIN_BYTES = 64 << 10
COUNTERS = "_meta.counters"  # per unit: plan version, optimizer steps, RL steps done, data position
COUNTERS_KIND = "counters"
NUM_COUNTERS = 4
# the element types a slot can hold, by name, and their sizes in bytes
DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4, "int64": 8}

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, lengths) in the global tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlacement:
    """Where one model-stage's units live: layout, one worker set per DP replica (unit rank order)."""

    model_stage: str
    model: ModelSpec
    head: Head
    kinds: tuple[StateKind, ...]
    layout: Layout
    gpu_sets: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        check_layout(self.model, self.layout)
        if not self.kinds or len(set(self.kinds)) != len(self.kinds):
            raise SpecError(f"{self.model_stage}.kinds", f"must be non-empty and distinct, got {self.kinds}",
                            ", ".join(k.value for k in StateKind))
        if not self.gpu_sets:
            raise SpecError(f"{self.model_stage}.gpu_sets", "needs at least one replica")
        for i, gpus in enumerate(self.gpu_sets):
            if len(gpus) != self.layout.size:
                raise SpecError(f"{self.model_stage}.gpu_sets[{i}]",
                                f"has {len(gpus)} workers, layout {self.layout} needs {self.layout.size}")
        flat = [g for s in self.gpu_sets for g in s]
        if len(set(flat)) != len(flat):
            raise SpecError(f"{self.model_stage}.gpu_sets", f"a worker appears twice: {self.gpu_sets}")

    @property
    def dp(self) -> int:
        return len(self.gpu_sets)

    @property
    def workers(self) -> frozenset[int]:
        return frozenset(g for s in self.gpu_sets for g in s)

    def position(self, worker: int) -> tuple[int, int] | None:
        """(replica, unit rank) of ``worker``, or None if it holds no unit of this stage."""
        for replica, gpus in enumerate(self.gpu_sets):
            if worker in gpus:
                return replica, gpus.index(worker)
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Slot:
    """One shard inside a rank's flat buffer: a global box of one tensor's state kind."""

    tensor: str
    kind: str
    dtype: str  # a key of DTYPE_BYTES
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    byte_offset: int
    # storage order of the dims (empty: row-major). A row-parallel weight is stored dim 1 first, so a
    # TP shard of it (a range of columns) is one contiguous run, as a column-parallel one's rows are:
    # TP changes then move runs (pages, even) instead of gathering strided half-rows. A property of
    # the tensor, so the two ends of any piece agree; ``RankState.view`` gives the logical view.
    order: tuple[int, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (self.tensor, self.kind)

    @property
    def storage_lengths(self) -> tuple[int, ...]:
        return tuple(self.lengths[d] for d in self.order) if self.order else self.lengths

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def num_bytes(self) -> int:
        return self.numel * self.element_bytes


_new = object.__new__
# the slots' own setters, in field order (what a frozen dataclass's ``__init__`` reaches through
# object.__setattr__): ``_layout_slots`` sets every field of its ~1,500 slots per rank with them
_PUT = tuple(vars(Slot)[name].__set__ for name in ("tensor", "kind", "dtype", "global_shape", "offsets", "lengths",
                                                 "byte_offset", "order"))


def make_slot(tensor: str, kind: str, dtype: str, global_shape: tuple[int, ...], offsets: tuple[int, ...],
              lengths: tuple[int, ...], byte_offset: int, order: tuple[int, ...]) -> Slot:
    """``Slot(...)`` of these fields, built without the dataclass ``__init__`` (a frozen dataclass's
    costs ~2.5x this; Slot validates nothing), as ``_layout_slots`` builds every slot of a rank (~1,500
    of a 70B PP2 rank) inline. tests/transitions/test_fast_constructors.py checks both set every field."""
    slot = _new(Slot)
    for put, value in zip(_PUT, (tensor, kind, dtype, global_shape, offsets, lengths, byte_offset, order)):
        put(slot, value)
    return slot


def dtype_of(kind: StateKind, model: ModelSpec) -> str:
    """The element type a state kind is stored in: parameters and gradients in the model's dtype,
    master weights and optimizer moments in float32."""
    if kind in (StateKind.PARAM, StateKind.GRAD):
        return {2: "bfloat16", 4: "float32"}[model.bytes_per_param]
    return "float32"


@lru_cache(maxsize=256)
def _storage_orders(model: ModelSpec, head: Head) -> dict[str, tuple[int, ...]]:
    """Per tensor, its storage order when not row-major: row-parallel weights go column-major."""
    return {t.name: (1, 0, *range(2, len(t.shape))) for t in _tensors(model, head)
            if t.parallel is Parallel.ROW and len(t.shape) >= 2}


def align(n: int, to: int = ALIGN_BYTES) -> int:
    return -(-n // to) * to


def slot_start(end_of_previous: int, num_bytes: int) -> int:
    """Where a slot of ``num_bytes`` starts after a buffer's previous slot ends (``rank_slots``)."""
    return align(end_of_previous, PAGE_BYTES if num_bytes >= PAGE_ALIGN_MIN_BYTES else ALIGN_BYTES)


def rank_slots(placement: StagePlacement, rank: int) -> tuple[tuple[Slot, ...], int]:
    """The slots of unit rank ``rank`` in buffer order, and the buffer's size in bytes."""
    return _layout_slots(placement.model, placement.head, placement.layout, rank, placement.kinds)


@lru_cache(maxsize=1024)
def _layout_slots(model: ModelSpec, head: Head, layout: Layout, rank: int,
                  kinds: tuple[StateKind, ...]) -> tuple[tuple[Slot, ...], int]:
    """``rank_slots`` depends on the layout alone, not on where the unit sits: every replica and every
    part in final shape of one layout shares it. Keyed by value (frozen specs), bounded: a pure
    function's memo, not state anyone must empty."""
    orders = _storage_orders(model, head)
    # per state kind: its name, dtype and item size (one lookup per shard instead of three)
    per_kind = {kind: (kind.value, dtype_of(kind, model), DTYPE_BYTES[dtype_of(kind, model)]) for kind in kinds}
    offset = slot_start(0, NUM_COUNTERS * DTYPE_BYTES["int64"])
    slots = [make_slot(COUNTERS, COUNTERS_KIND, "int64", (NUM_COUNTERS,), (0,), (NUM_COUNTERS,), offset, ())]
    offset += NUM_COUNTERS * DTYPE_BYTES["int64"]
    prod, new = math.prod, _new
    put_tensor, put_kind, put_dtype, put_shape, put_offsets, put_lengths, put_byte_offset, put_order = _PUT
    for s in rank_shard_tuple(model, head, layout, rank, kinds):
        kind, dtype, item = per_kind[s.kind]
        lens = s.lengths
        nbytes = prod(lens) * item
        to = PAGE_BYTES if nbytes >= PAGE_ALIGN_MIN_BYTES else ALIGN_BYTES  # slot_start, inlined
        offset = -(-offset // to) * to
        slot = new(Slot)
        put_tensor(slot, s.tensor)
        put_kind(slot, kind)
        put_dtype(slot, dtype)
        put_shape(slot, s.global_shape)
        put_offsets(slot, s.offsets)
        put_lengths(slot, lens)
        put_byte_offset(slot, offset)
        put_order(slot, orders.get(s.tensor, ()))
        slots.append(slot)
        offset += nbytes
    return tuple(slots), align(offset)


def unit_placement(unit: EMU) -> StagePlacement:
    """The placement whose rank layout a unit's buffers follow (a part in final shape follows its
    final unit); a GPU's rank in it is ``placement.gpu_sets[0].index(gpu)``."""
    home = unit.final if unit.final is not None else unit
    return StagePlacement(model_stage=home.model_stage, model=home.state.model, head=home.state.head,
                          kinds=home.state.kinds, layout=home.layout, gpu_sets=(home.gpus,))


@lru_cache(maxsize=4096)
def unit_slots(unit: EMU, gpu: int) -> dict[tuple[str, str], Slot]:
    """The slots of ``unit``'s buffer on ``gpu`` (pure: both ends of a transfer derive them alike)."""
    home = unit.final if unit.final is not None else unit
    state = home.state
    return _slot_index(state.model, state.head, home.layout, home.gpus.index(gpu), state.kinds)


@lru_cache(maxsize=256)
def _slot_index(model: ModelSpec, head: Head, layout: Layout, rank: int, kinds: tuple[StateKind, ...]
                ) -> dict[tuple[str, str], Slot]:
    """A rank's slots by key: one per layout rank, whichever units (replicas, parts) follow it. Bounded
    (each entry indexes one rank's ~3,000 slots at 70B, held by ``_layout_slots`` anyway)."""
    return {(s.tensor, s.kind): s for s in _layout_slots(model, head, layout, rank, kinds)[0]}


@lru_cache(maxsize=4096)
def unit_buffer_bytes(unit: EMU, gpu: int) -> int:
    placement = unit_placement(unit)
    return rank_slots(placement, placement.gpu_sets[0].index(gpu))[1]


def contiguous_range(slot: Slot, box: Box) -> tuple[int, int] | None:
    """Byte range [start, end) of ``box`` inside the flat buffer holding ``slot``, if contiguous."""
    offsets, lens = box
    full, base = slot.lengths, slot.offsets
    if len(lens) == 2:  # most tensors: the same test unrolled (a hot path of the DAG's derivation)
        if slot.order:
            d0, d1 = slot.order
        else:
            d0, d1 = 0, 1
        n1, k0, k1 = full[d1], lens[d0], lens[d1]
        if k1 != n1 and k0 != 1:  # a partial inner dim needs a single outer row
            return None
        size = slot.element_bytes
        start = slot.byte_offset + ((offsets[d0] - base[d0]) * n1 + offsets[d1] - base[d1]) * size
        return start, start + k0 * k1 * size
    if slot.order:  # the same question in storage order
        offsets, lens = tuple(offsets[d] for d in slot.order), tuple(lens[d] for d in slot.order)
        full, base = slot.storage_lengths, tuple(base[d] for d in slot.order)
    # row-major: contiguous iff every dim after the last partial one is full and every dim before it
    # has length 1 (a whole shard, a run of whole rows, or part of one row)
    last = len(lens) - 1
    while last >= 0 and lens[last] == full[last]:
        last -= 1
    for d in range(last):
        if lens[d] != 1:
            return None
    linear, numel = 0, 1
    for o, so, n, k in zip(offsets, base, full, lens):
        linear = linear * n + o - so
        numel *= k
    size = slot.element_bytes
    start = slot.byte_offset + linear * size
    return start, start + numel * size
