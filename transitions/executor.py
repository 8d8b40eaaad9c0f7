"""The executor: moves live EMU state between layouts over the data channel, bit-exactly.

A worker's state for one unit is a ``RankState``: ONE flat byte buffer holding every shard of its
unit rank (every state kind, plus the unit's counters), each shard a typed view at a fixed offset
(16-byte aligned; page aligned from 64 KiB). Row-parallel weights are stored column-major, so every
TP shard of every tensor is one contiguous run. Flat buffers make the common moves zero-copy: pieces
that lie back to back on both sides travel straight from the old buffer into the new one, a bucket
whose pieces lie back to back on one side is read or written in place on that side, and on CPU a
run a new unit keeps from an old one on the same worker changes buffers as whole pages (mremap).

Two ways to drive it, one engine underneath (``_run_step``: pipelined rounds, at most
``max_bucket_bytes`` of buckets per pair per round, two rounds in flight; in each round receives and
in-place sends are posted before the buckets are packed; local copies run once the last round is
posted; bucket buffers come from a per-transition ``BucketPool`` and are reused once unpacked, since
first-touching fresh pages costs more than the packing itself):

- ``run_dag``: a ``transitions.global_dag.TransitionDAG``. Each worker runs the nodes that touch it
  in the DAG's order and derives its own pieces (``node_step``); targets are allocated when their
  node starts, sources freed by the node that frees them, Merges of parts already in final shape
  only relabel; local-only nodes right after a remote one run alongside its transfers. On CPU a
  unit cut from one the worker gives up is built from that unit's pages before the nodes sending
  from it, which then send from the new unit (``EarlyBuild``: a TP split sends one zero-copy message,
  and a failure gives the pages back), or else inside that unit's buffer once nothing reads it any
  more (``InPlace``). Either way: no new memory, no first touch of fresh pages. A large Extend
  fan-out runs as one broadcast per unit rank (``FanOut``).
  Time per node is measured next to the cost model's prediction.
- ``run_transition``: a plan computed from geometry alone (``plan_transition``), two-phase: the new
  state is built beside the old and swapped in by ``PendingTransition.commit``.

Either way a transition that stops halfway (a peer died, a timeout) loses no logical state unless its
last copy died: ``lost_state`` and ``agent.coordinator.uncovered_state`` say what needs the checkpoint.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

import torch

from planner.errors import SpecError
from planner.models import Head, ModelSpec, Parallel
from planner.plan import Layout
from transitions.channel import DataChannel, InFlight, P2POp
from transitions.emu import EMU, box_contains, box_intersection
from transitions.geometry import StateKind, check_layout, unit_shards
from transitions.global_dag import TransitionDAG
from transitions.primitives import Extend, Merge, Primitive, relabels
from transitions.primitives import pieces as prim_pieces

ALIGN_BYTES = 16
# slots this big start on a page boundary (CPU pages; harmless padding on GPUs): a run kept by a new
# unit then sits at the same offset within a page in the old buffer and the new one, so the pages
# themselves can change buffers (``_move_pages``) instead of their bytes being copied. Costs at most
# one page of padding per such slot (~0.3% of tiny-25m's buffers).
PAGE_BYTES = mmap.PAGESIZE
PAGE_ALIGN_MIN_BYTES = 64 << 10
# CPU buffers from this size are anonymous mappings of their own, page-aligned (``alloc_bytes``)
MAP_MIN_BYTES = 1 << 20
# runs from this size change buffers as pages; smaller ones are copied. Each moved run costs the new
# buffer up to two mappings (vm.max_map_count is 65530 by default; a refused move is copied instead)
MOVE_MIN_BYTES = 64 << 10
COUNTERS = "_meta.counters"  # per unit: version, optimizer step, minibatch position, spare
COUNTERS_KIND = "counters"
NUM_COUNTERS = 4
DEFAULT_BUCKET_BYTES = 8 << 20  # per pair per round; two rounds are in flight at once (pipelining)
DIRECT_MIN_BYTES = 128 << 10  # smaller contiguous runs go through a bucket: one message beats many
SPLIT_MIN_BYTES = 256 << 10  # a bucket this big ends where its pieces stop being adjacent at the destination
HUGE_MIN_BYTES = 2 << 20  # with huge pages: CPU buffers from here on are mapped with them
# Off: on the shared 2-core machine, tiny-25m TP1xDP2 -> TP2xDP2 took min 0.25 s vs 0.34 s with them
# but median 0.50 s vs 0.38 s (the kernel compacts memory at fault time, and stalls under pressure)
HUGE_PAGES = False
# CPU: a unit cut from another one on the same worker (a TP or PP Split/Merge keeping part of the
# shard) is built from the pages of the unit it is cut from (``EarlyBuild``: 182 MiB of tiny-25m in
# 232 mremaps, ~5-15 ms, where copying into fresh pages runs at 1.7-3 GB/s), or inside its buffer
# once nothing reads it any more (``InPlace``: compacting warm memory at 3-10 GB/s); the worker's
# peak memory drops by the new unit's size. Off on GPUs: the caching allocator hands out warm
# memory, and a block can neither give back its tail nor move its pages.
IN_PLACE = True
# Extend fan-outs run as broadcasts from this many bytes per unit rank: forming the groups costs
# 1-15 ms (every worker calls new_group); DP1 -> DP4 of 382 MB: gloo broadcast 0.60 s vs three
# point-to-point copies 0.73-0.78 s here, and NCCL pipelines broadcasts along a ring.
FAN_OUT_MIN_BYTES = 32 << 20

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, lengths) in the global tensor
Run = tuple[tuple[int, int], tuple[int, int]]  # (src byte range, dst byte range) of a zero-copy move


# --- placements -----------------------------------------------------------------------------------


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

    def same_state_as(self, other: StagePlacement) -> bool:
        return (self.model == other.model and self.head is other.head and self.kinds == other.kinds)


# --- flat per-rank state --------------------------------------------------------------------------


def alloc_bytes(num_bytes: int, device: torch.device, *, huge_pages: bool | None = None) -> torch.Tensor:
    """An uninitialised uint8 buffer. CPU buffers of ``MAP_MIN_BYTES`` or more are private anonymous
    mappings of their own, so they start on a page and their pages can be moved into another unit's
    buffer (``_move_pages``). With ``huge_pages`` (default ``HUGE_PAGES``) they are advised to use
    transparent huge pages: a fresh buffer's first touch (the kernel zeroing and mapping its pages) is
    what a transition's copies and receives pay for new state, and 2 MiB pages halve it in isolation
    (1.3 -> 2.7 GB/s). The tensor keeps the mapping alive."""
    if device.type != "cpu" or num_bytes < MAP_MIN_BYTES:
        return torch.empty(num_bytes, dtype=torch.uint8, device=device)
    region = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    huge = HUGE_PAGES if huge_pages is None else huge_pages
    if huge and num_bytes >= HUGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8)


@dataclass(frozen=True, kw_only=True, slots=True)
class Slot:
    """One shard inside a rank's flat buffer: a global box of one tensor's state kind."""

    tensor: str
    kind: str
    dtype: torch.dtype
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
        return self.dtype.itemsize

    @property
    def num_bytes(self) -> int:
        return self.numel * self.element_bytes


def dtype_of(kind: StateKind, model: ModelSpec) -> torch.dtype:
    if kind in (StateKind.PARAM, StateKind.GRAD):
        return {2: torch.bfloat16, 4: torch.float32}[model.bytes_per_param]
    return torch.float32


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return tuple(inv)


def _stored(t: torch.Tensor, storage_lengths: tuple[int, ...], order: tuple[int, ...]) -> torch.Tensor:
    """The logical view of a contiguous buffer ``t`` holding a box in storage ``order``."""
    t = t.view(storage_lengths)
    return t.permute(_inverse(order)) if order else t


def storage_view(view: torch.Tensor, slot: Slot) -> torch.Tensor:
    """A logical view of ``slot``'s tensor (or a box of it) with its dims in storage order."""
    return view.permute(slot.order) if slot.order else view


@lru_cache(maxsize=256)
def _storage_orders(model: ModelSpec, head: Head) -> dict[str, tuple[int, ...]]:
    """Per tensor, its storage order when not row-major: row-parallel weights go column-major."""
    return {t.name: (1, 0, *range(2, len(t.shape))) for t in model.tensors(head)
            if t.parallel is Parallel.ROW and len(t.shape) >= 2}


def _align(n: int, to: int = ALIGN_BYTES) -> int:
    return -(-n // to) * to


def _slot_start(end_of_previous: int, num_bytes: int) -> int:
    """Where a slot of ``num_bytes`` starts after a buffer's previous slot ends (``rank_slots``)."""
    return _align(end_of_previous, PAGE_BYTES if num_bytes >= PAGE_ALIGN_MIN_BYTES else ALIGN_BYTES)


def rank_slots(placement: StagePlacement, rank: int) -> tuple[tuple[Slot, ...], int]:
    """The slots of unit rank ``rank`` in buffer order, and the buffer's size in bytes."""
    return _layout_slots(placement.model, placement.head, placement.layout, rank, placement.kinds)


@lru_cache(maxsize=1024)
def _layout_slots(model: ModelSpec, head: Head, layout: Layout, rank: int,
                  kinds: tuple[StateKind, ...]) -> tuple[tuple[Slot, ...], int]:
    """``rank_slots`` depends on the layout alone, not on where the unit sits: every replica and every
    part in final shape of one layout shares it (and it outlives the transition)."""
    slots: list[Slot] = []
    offset = 0
    entries: list[tuple[str, str, torch.dtype, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = [
        (COUNTERS, COUNTERS_KIND, torch.int64, (NUM_COUNTERS,), (0,), (NUM_COUNTERS,))
    ]
    for s in unit_shards(model, head, layout, rank, kinds):
        entries.append((s.tensor, s.kind.value, dtype_of(s.kind, model), s.global_shape, s.offsets, s.lengths))
    orders = _storage_orders(model, head)
    for tensor, kind, dtype, shape, offs, lens in entries:
        offset = _slot_start(offset, math.prod(lens) * dtype.itemsize)
        slot = Slot(tensor=tensor, kind=kind, dtype=dtype, global_shape=shape, offsets=offs, lengths=lens,
                    byte_offset=offset, order=orders.get(tensor, ()))
        slots.append(slot)
        offset += slot.num_bytes
    return tuple(slots), _align(offset)


@dataclass(slots=True)
class RankState:
    """The live state one worker holds for one model-stage: a flat buffer and typed views into it."""

    placement: StagePlacement
    replica: int
    rank: int
    flat: torch.Tensor  # uint8, 1-D
    slots: dict[tuple[str, str], Slot]

    @classmethod
    def allocate(cls, placement: StagePlacement, replica: int, rank: int,
                 device: torch.device) -> RankState:
        slots, size = rank_slots(placement, rank)
        # not zeroed: a transition, a random init or a checkpoint load writes every slot, and zeroing
        # would cost one more pass over the whole state (only the alignment padding stays undefined)
        flat = alloc_bytes(size, device)
        return cls(placement=placement, replica=replica, rank=rank, flat=flat,
                   slots={s.key: s for s in slots})

    def view(self, tensor: str, kind: str) -> torch.Tensor:
        slot = self.slots[(tensor, kind)]
        raw = self.flat[slot.byte_offset: slot.byte_offset + slot.num_bytes]
        return _stored(raw.view(slot.dtype), slot.storage_lengths, slot.order)

    @property
    def counters(self) -> torch.Tensor:
        return self.view(COUNTERS, COUNTERS_KIND)

    def shards(self) -> Iterable[tuple[Slot, torch.Tensor]]:
        for slot in self.slots.values():
            yield slot, self.view(slot.tensor, slot.kind)


# --- box arithmetic (pure) ------------------------------------------------------------------------


def contiguous_range(slot: Slot, box: Box) -> tuple[int, int] | None:
    """Byte range [start, end) of ``box`` inside the flat buffer holding ``slot``, if contiguous."""
    offsets, lens = box
    full, base = slot.lengths, slot.offsets
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
    size = slot.dtype.itemsize
    start = slot.byte_offset + linear * size
    return start, start + numel * size


# --- the plan (pure) -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """One box of one tensor's state kind copied from a source rank's buffer to a destination's."""

    src_worker: int
    dst_worker: int
    src_slot: Slot
    dst_slot: Slot
    box: Box
    src_unit: str = ""  # DAG runs: the EMU uids read and written ("" = the model-stage's old/new state)
    dst_unit: str = ""

    @property
    def num_bytes(self) -> int:
        return math.prod(self.box[1]) * self.src_slot.element_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class Message:
    """What one pair (src -> dst) exchanges in one round: one buffer of ``length`` bytes holding
    ``pieces`` at ``layout`` offsets. A side whose pieces sit back to back in its flat buffer (only
    alignment padding between them) uses that region as the buffer: no packing (``src_start``) or
    no unpacking (``dst_start``); a message direct on both sides is a plain zero-copy move."""

    src_worker: int
    dst_worker: int
    round: int
    tag: int
    pieces: tuple[Piece, ...]
    layout: tuple[int, ...]
    length: int
    src_start: int | None = None
    dst_start: int | None = None

    @property
    def num_bytes(self) -> int:
        return self.length

    @property
    def direct(self) -> bool:
        return self.src_start is not None and self.dst_start is not None


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    """The part of a transition that concerns one model-stage (one DAG node once the DAG drives it)."""

    model_stage: str
    primitive: str  # Split, Merge, Extend, Destroy, Move, Reshard, or a '+' joined combination
    local: tuple[Piece, ...]
    messages: tuple[Message, ...]
    predicted_s: float

    @property
    def num_rounds(self) -> int:
        return 1 + max((m.round for m in self.messages), default=-1)

    @property
    def bytes_moved(self) -> int:
        return sum(m.num_bytes for m in self.messages)


@dataclass(frozen=True, kw_only=True, slots=True)
class TransitionPlan:
    old: tuple[StagePlacement, ...]
    new: tuple[StagePlacement, ...]
    steps: tuple[Step, ...]
    max_bucket_bytes: int

    @property
    def predicted_s(self) -> float:
        return sum(s.predicted_s for s in self.steps)


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkModel:
    """The predicted L_tran of a step: rounds x latency + the busiest worker's bytes / bandwidth.
    Stands in for transitions' cost model until the DAG carries its own prediction."""

    bandwidth_bytes_per_s: float = 3.0e9  # gloo loopback p2p measured on this kind of machine
    latency_s: float = 2.0e-4
    copy_bandwidth_bytes_per_s: float = 12.0e9  # local copies (memcpy)

    def predict(self, local: tuple[Piece, ...], messages: tuple[Message, ...], num_rounds: int) -> float:
        sent: dict[int, int] = defaultdict(int)
        recv: dict[int, int] = defaultdict(int)
        copied: dict[int, int] = defaultdict(int)
        for m in messages:
            sent[m.src_worker] += m.num_bytes
            recv[m.dst_worker] += m.num_bytes
        for p in local:
            copied[p.dst_worker] += p.num_bytes
        busiest = max([*sent.values(), *recv.values(), 0]) / self.bandwidth_bytes_per_s
        return num_rounds * self.latency_s + busiest + max([*copied.values(), 0]) / self.copy_bandwidth_bytes_per_s


def primitive_of(old: StagePlacement, new: StagePlacement) -> str:
    """The primitive (or combination) a stage's change amounts to, in the paper's vocabulary."""
    if old.layout == new.layout:
        kept = set(old.gpu_sets) & set(new.gpu_sets)
        names = []
        if len(kept) < len(old.gpu_sets):
            names.append("Destroy")
        if len(kept) < len(new.gpu_sets):
            names.append("Extend")
        return "+".join(names) if names else "Keep"
    if new.layout.size < old.layout.size:
        return "Split"
    if new.layout.size > old.layout.size:
        return "Merge"
    return "Reshard"


def kept_in_place(old: StagePlacement, new: StagePlacement, worker: int) -> bool:
    """Whether ``worker`` keeps its buffer as is: same layout, same unit rank (any replica: replicas
    of one layout hold identical state at identical ranks)."""
    before, after = old.position(worker), new.position(worker)
    return (before is not None and after is not None and old.layout == new.layout
            and before[1] == after[1])


def _holders(old: StagePlacement) -> list[dict[tuple[str, str], list[tuple[Box, list[tuple[int, Slot]]]]]]:
    """Per old replica, per slot key: distinct boxes and every (worker, slot) holding each."""
    out = []
    for gpus in old.gpu_sets:
        per_key: dict[tuple[str, str], list[tuple[Box, list[tuple[int, Slot]]]]] = defaultdict(list)
        for rank, worker in enumerate(gpus):
            slots, _ = rank_slots(old, rank)
            for slot in slots:
                box = (slot.offsets, slot.lengths)
                for existing_box, holders in per_key[slot.key]:
                    if existing_box == box:
                        holders.append((worker, slot))
                        break
                else:
                    per_key[slot.key].append((box, [(worker, slot)]))
        out.append(per_key)
    return out


def _stage_pieces(old: StagePlacement, new: StagePlacement) -> list[Piece]:
    """Every piece each new rank needs, sourced locally where possible, else from the least loaded."""
    holders = _holders(old)
    load: dict[int, int] = defaultdict(int)  # bytes each source worker sends
    replica_load: list[int] = [0] * old.dp
    pieces: list[Piece] = []
    for gpus in new.gpu_sets:
        for rank, worker in enumerate(gpus):
            if kept_in_place(old, new, worker):
                continue  # the same unit rank stays on this worker: nothing copied
            slots, _ = rank_slots(new, rank)
            where = old.position(worker)
            # one source replica per destination rank: the one it sits in, else the least loaded
            src_replica = where[0] if where is not None else min(range(old.dp), key=lambda r: replica_load[r])
            for slot in slots:
                need = (slot.offsets, slot.lengths)
                covered = 0
                for box, owners in holders[src_replica][slot.key]:
                    part = box_intersection(box, need)
                    if part is None:
                        continue
                    local = [o for o in owners if o[0] == worker]
                    src_worker, src_slot = local[0] if local else min(owners, key=lambda o: load[o[0]])
                    piece = Piece(src_worker=src_worker, dst_worker=worker, src_slot=src_slot, dst_slot=slot,
                                  box=part)
                    if src_worker != worker:
                        load[src_worker] += piece.num_bytes
                        replica_load[src_replica] += piece.num_bytes
                    pieces.append(piece)
                    covered += math.prod(part[1])
                if covered != slot.numel:
                    raise SpecError(f"{new.model_stage}.layout",
                                    f"{slot.tensor}/{slot.kind}: old replica {src_replica} covers {covered} "
                                    f"of {slot.numel} elements")
    return pieces


def _back_to_back(prev: tuple[int, int], prev_slot: Slot, nxt: tuple[int, int], nxt_slot: Slot) -> bool:
    """Whether byte range ``nxt`` follows ``prev`` with nothing but alignment padding in between."""
    if nxt[0] == prev[1]:
        return True
    return (prev[1] == prev_slot.byte_offset + prev_slot.num_bytes and nxt[0] == nxt_slot.byte_offset
            and nxt[0] == _slot_start(prev[1], nxt_slot.num_bytes))


def _adjacent(pieces: list[Piece], side: str) -> tuple[int, tuple[int, ...], int] | None:
    """(start, offsets relative to start, length) if ``pieces`` lie back to back in one flat buffer
    on ``side`` ("src" or "dst"), in order; None otherwise."""
    units = {p.src_unit if side == "src" else p.dst_unit for p in pieces}
    if len(units) != 1:
        return None
    ranges: list[tuple[tuple[int, int], Slot]] = []
    for p in pieces:
        slot = p.src_slot if side == "src" else p.dst_slot
        r = contiguous_range(slot, p.box)
        if r is None:
            return None
        if ranges and not _back_to_back(ranges[-1][0], ranges[-1][1], r, slot):
            return None
        ranges.append((r, slot))
    start = ranges[0][0][0]
    return start, tuple(r[0] - start for r, _ in ranges), ranges[-1][0][1] - start


def _coalesce(pieces: list[Piece]) -> list[tuple[Run | None, list[Piece]]]:
    """Merge pieces contiguous on both sides into byte runs; a piece that is not stays alone (None)."""
    out: list[tuple[Run | None, list[Piece]]] = []
    for p in pieces:
        src = contiguous_range(p.src_slot, p.box)
        dst = contiguous_range(p.dst_slot, p.box)
        if src is None or dst is None:
            out.append((None, [p]))
            continue
        if out and out[-1][0] is not None:
            last = out[-1][1][-1]
            (s0, s1), (d0, d1) = out[-1][0]
            # only alignment padding may lie between runs, and the same amount on both sides
            if (last.src_unit, last.dst_unit) == (p.src_unit, p.dst_unit) and src[0] - s1 == dst[0] - d1 \
                    and _back_to_back((s0, s1), last.src_slot, src, p.src_slot) \
                    and _back_to_back((d0, d1), last.dst_slot, dst, p.dst_slot):
                out[-1] = (((s0, src[1]), (d0, dst[1])), out[-1][1] + [p])
                continue
        out.append(((src, dst), [p]))
    return out


def _split_piece(p: Piece, max_bytes: int) -> list[Piece]:
    """Split a piece along its first stored dimension so each part fits in a bucket (one row at least)."""
    d = p.src_slot.order[0] if p.src_slot.order else 0
    if p.num_bytes <= max_bytes or p.box[1][d] <= 1:
        return [p]
    row_bytes = p.num_bytes // p.box[1][d]
    rows = max(1, max_bytes // row_bytes)
    out = []
    for start in range(0, p.box[1][d], rows):
        n = min(rows, p.box[1][d] - start)
        offs, lens = list(p.box[0]), list(p.box[1])
        offs[d], lens[d] = offs[d] + start, n
        box = (tuple(offs), tuple(lens))
        out.append(Piece(src_worker=p.src_worker, dst_worker=p.dst_worker, src_slot=p.src_slot,
                         dst_slot=p.dst_slot, box=box, src_unit=p.src_unit, dst_unit=p.dst_unit))
    return out


def _messages(pieces: list[Piece], max_bucket_bytes: int) -> list[Message]:
    by_pair: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    for p in pieces:
        by_pair[(p.src_worker, p.dst_worker)].append(p)
    out: list[Message] = []
    for (src, dst), pair_pieces in sorted(by_pair.items()):
        direct: list[tuple[Run, list[Piece]]] = []
        packed: list[Piece] = []
        for run, members in _coalesce(pair_pieces):
            if run is not None and run[0][1] - run[0][0] >= DIRECT_MIN_BYTES:
                direct.append((run, members))
            else:
                for p in members:
                    packed.extend(_split_piece(p, max_bucket_bytes))
        tag = 0
        # direct runs need no buffer: all of them go in round 0, with the first bucket
        for run, members in direct:
            layout = tuple(contiguous_range(p.src_slot, p.box)[0] - run[0][0] for p in members)  # type: ignore[index]
            out.append(Message(src_worker=src, dst_worker=dst, round=0, tag=tag, pieces=tuple(members),
                               layout=layout, length=run[0][1] - run[0][0], src_start=run[0][0],
                               dst_start=run[1][0]))
            tag += 1
        buckets: list[list[Piece]] = [[]]
        size = 0
        adjacent, last = False, None  # whether the open bucket lies back to back in the destination
        for p in packed:
            # a bucket also closes where the pieces stop lying back to back in the destination (a
            # direct run sits in between): the destination then receives each bucket in place instead
            # of unpacking it, unless that would make the bucket too small to be worth a message
            here = contiguous_range(p.dst_slot, p.box)
            follows = (here is not None and last is not None and adjacent and last[2] == p.dst_unit
                       and _back_to_back(last[0], last[1], here, p.dst_slot))
            gap = bool(buckets[-1]) and size >= SPLIT_MIN_BYTES and not follows
            if buckets[-1] and (size + _align(p.num_bytes) > max_bucket_bytes or gap):
                buckets.append([])
                size = 0
            adjacent = here is not None and (follows or not buckets[-1])
            last = (here, p.dst_slot, p.dst_unit) if here is not None else None
            buckets[-1].append(p)
            size += _align(p.num_bytes)
        # rounds by volume: each round carries at most max_bucket_bytes of buckets per pair
        rnd, volume = 0, 0
        for bucket in (b for b in buckets if b):
            message = _bucket_message(src, dst, rnd, tag, bucket)
            if volume and volume + message.length > max_bucket_bytes:
                rnd, volume = rnd + 1, 0
                message = _bucket_message(src, dst, rnd, tag, bucket)
            volume += message.length
            out.append(message)
            tag += 1
    return out


def _bucket_message(src: int, dst: int, rnd: int, tag: int, bucket: list[Piece]) -> Message:
    """A packed bucket, laid out as the destination (else the source) holds it when its pieces sit
    back to back there, so that side skips its copy."""
    on_dst, on_src = _adjacent(bucket, "dst"), _adjacent(bucket, "src")
    if on_dst is not None:
        start, layout, length = on_dst
        same = on_src is not None and on_src[1:] == (layout, length)
        return Message(src_worker=src, dst_worker=dst, round=rnd, tag=tag, pieces=tuple(bucket), layout=layout,
                       length=length, src_start=on_src[0] if same and on_src else None, dst_start=start)
    if on_src is not None:
        start, layout, length = on_src
        return Message(src_worker=src, dst_worker=dst, round=rnd, tag=tag, pieces=tuple(bucket), layout=layout,
                       length=length, src_start=start)
    offsets, cursor = [], 0
    for p in bucket:
        offsets.append(cursor)
        cursor += _align(p.num_bytes)
    return Message(src_worker=src, dst_worker=dst, round=rnd, tag=tag, pieces=tuple(bucket),
                   layout=tuple(offsets), length=cursor)


def plan_transition(old: Iterable[StagePlacement], new: Iterable[StagePlacement],
                    max_bucket_bytes: int = DEFAULT_BUCKET_BYTES, link: LinkModel | None = None) -> TransitionPlan:
    """Steps moving every model-stage from ``old`` to ``new`` placements (same stages, same state)."""
    old_t, new_t = tuple(old), tuple(new)
    if max_bucket_bytes < 1024:
        raise SpecError("max_bucket_bytes", f"must be >= 1024, got {max_bucket_bytes}")
    old_by = {p.model_stage: p for p in old_t}
    new_by = {p.model_stage: p for p in new_t}
    if set(old_by) != set(new_by):
        raise SpecError("placements", f"old stages {sorted(old_by)} differ from new {sorted(new_by)}")
    link = link or LinkModel()
    steps = []
    for name in sorted(new_by):
        o, n = old_by[name], new_by[name]
        if not o.same_state_as(n):
            raise SpecError(f"{name}.model", "a transition keeps the model, head and state kinds")
        pieces = _stage_pieces(o, n)
        local = tuple(p for p in pieces if p.src_worker == p.dst_worker)
        messages = tuple(_messages([p for p in pieces if p.src_worker != p.dst_worker], max_bucket_bytes))
        rounds = 1 + max((m.round for m in messages), default=-1)
        steps.append(Step(model_stage=name, primitive=primitive_of(o, n), local=local, messages=messages,
                          predicted_s=link.predict(local, messages, rounds)))
    return TransitionPlan(old=old_t, new=new_t, steps=tuple(steps), max_bucket_bytes=max_bucket_bytes)


# --- running one worker's part ---------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class StepReport:
    model_stage: str
    primitive: str
    predicted_s: float
    measured_s: float
    bytes_sent: int
    bytes_received: int
    bytes_copied_locally: int
    peak_bucket_bytes: int  # transient buffer memory this worker held at once
    local_copy_s: float = 0.0  # part of measured_s spent copying shards already on this worker
    pack_s: float = 0.0  # part of measured_s spent packing buckets (sender side)
    unpack_s: float = 0.0  # part of measured_s spent unpacking buckets (receiver side)
    alongside: str = ""  # a local-only node run while this remote node's transfers were in flight
    in_place: bool = False  # built inside the buffer of the unit it was cut from, or from its pages
    bytes_remapped: int = 0  # of a unit built from another's pages: bytes that changed buffers uncopied


@dataclass(kw_only=True, slots=True)
class PendingTransition:
    """A worker's new state, built beside the old; nothing old is freed until ``commit``."""

    worker: int
    new_states: dict[str, RankState]
    dropped: list[str]
    reports: list[StepReport] = field(default_factory=list)

    def commit(self, states: dict[str, RankState]) -> None:
        """Swap the new state in; the old buffers (Destroy) are freed with their last reference."""
        for name in self.dropped:
            states.pop(name, None)
        states.update(self.new_states)
        self.new_states = {}


def _piece_view(state: RankState, slot: Slot, box: Box) -> torch.Tensor:
    full = state.view(slot.tensor, slot.kind)
    idx = tuple(slice(o - so, o - so + k) for o, so, k in zip(box[0], slot.offsets, box[1]))
    return full[idx]


def _bucket_layout(m: Message) -> list[tuple[Piece, int]]:
    return list(zip(m.pieces, m.layout))


def _typed(buf: torch.Tensor, offset: int, p: Piece) -> torch.Tensor:
    """Piece ``p`` at ``offset`` of a bucket, as a logical view. Its bytes lie in storage order, as
    both ends hold them (the order belongs to the tensor), so a bucket laid out as one side's buffer
    holds exactly that side's bytes."""
    order = p.src_slot.order
    lens = tuple(p.box[1][d] for d in order) if order else p.box[1]
    return _stored(buf[offset: offset + p.num_bytes].view(p.src_slot.dtype), lens, order)


def run_transition(plan: TransitionPlan, worker: int, states: dict[str, RankState], channel: DataChannel,
                   timeout_s: float | None = None,
                   on_round: Callable[[str, int], None] | None = None) -> PendingTransition:
    """Run ``worker``'s part of ``plan``: allocate its new ranks, copy locally, exchange messages.

    Raises ChannelBroken if any exchange fails; ``states`` is then untouched (abort = drop the pending).
    ``on_round(model_stage, round)`` is called before each round (progress reports, fault injection).
    """
    device = channel.device
    new_by = {p.model_stage: p for p in plan.new}
    old_by = {p.model_stage: p for p in plan.old}
    new_states: dict[str, RankState] = {}
    dropped: list[str] = []
    for name, placement in new_by.items():
        pos = placement.position(worker)
        held = states.get(name)
        if pos is None:
            if held is not None:
                dropped.append(name)
            continue
        if held is not None and kept_in_place(old_by[name], placement, worker):
            # same buffer, no copy; only its place in the plan (replica index) is updated
            new_states[name] = RankState(placement=placement, replica=pos[0], rank=pos[1], flat=held.flat,
                                         slots=held.slots)
            continue
        new_states[name] = RankState.allocate(placement, pos[0], pos[1], device)
    pending = PendingTransition(worker=worker, new_states=new_states, dropped=dropped)
    pool = BucketPool(device=device)
    # every member is there before anything moves: a missing one fails the transition at once
    channel.barrier(timeout_s)

    for step in plan.steps:
        def resolve(p: Piece, is_source: bool, name: str = step.model_stage) -> RankState:
            return states[name] if is_source else new_states[name]

        pending.reports.append(_run_step(step, worker, resolve, channel, timeout_s, on_round, pool)[0])
    return pending


Resolve = Callable[[Piece, bool], RankState]  # (piece, is_source) -> the rank state it reads/writes


@dataclass(slots=True)
class BucketPool:
    """The transient bucket buffers of one transition, reused across its rounds and nodes.

    A fresh buffer costs a first touch of every page (the kernel maps and zeroes them: ~1.3 GB/s
    here, 10x slower than copying into warm memory), so packing into new buckets each round costed
    more than the packing itself. A request takes the smallest free buffer that fits; only when none
    fits are the smaller free ones dropped and a new one allocated, so what the pool holds never
    exceeds the buffers in use at once (two rounds in flight). Dropped with the transition's driver.
    """

    device: torch.device
    free: list[torch.Tensor] = field(default_factory=list)
    held_bytes: int = 0  # in use or free
    peak_bytes: int = 0

    def take(self, num_bytes: int) -> torch.Tensor:
        fits = [b for b in self.free if b.numel() >= num_bytes]
        if fits:
            best = min(fits, key=lambda b: b.numel())
            self.free = [b for b in self.free if b is not best]
            return best
        self.held_bytes -= sum(b.numel() for b in self.free)
        self.free = []
        buf = alloc_bytes(num_bytes, self.device)
        self.held_bytes += num_bytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return buf

    def give(self, bufs: Iterable[torch.Tensor]) -> None:
        self.free.extend(bufs)


@dataclass(slots=True)
class _Round:
    """One posted round: its in-flight operations, the buckets to unpack, the pool buffers it holds."""

    handles: list[InFlight]
    unpack: list[tuple[Message, torch.Tensor]]
    buffers: list[torch.Tensor]
    pack_s: float = 0.0


def _post_round(step: Step, rnd: int, worker: int, resolve: Resolve, channel: DataChannel,
                counts: dict[str, int], pool: BucketPool) -> _Round:
    """Post this worker's part of round ``rnd`` (not waited for): first every receive and the sends
    read in place, so that zero-copy transfers run while the buckets are packed; then the packed sends.
    Each pair's sends keep the message order (its receiver posts in that order; gloo and NCCL match
    a pair's messages in order, and a mismatch aborts the process): a send read in place that follows
    a packed one to the same peer waits for the second batch."""
    ops: list[P2POp] = []
    packed: list[Message] = []
    out = _Round(handles=[], unpack=[], buffers=[])
    for m in step.messages:
        if m.round != rnd or worker not in (m.src_worker, m.dst_worker):
            continue
        if m.src_worker == worker:
            counts["sent"] += m.num_bytes
            if m.src_start is None or any(q.dst_worker == m.dst_worker for q in packed):
                packed.append(m)  # after a packed one to the same peer: keeps each pair's order
                continue
            buf = resolve(m.pieces[0], True).flat[m.src_start: m.src_start + m.length]
            ops.append(P2POp(peer=m.dst_worker, tensor=buf, is_send=True))
        else:
            counts["received"] += m.num_bytes
            if m.dst_start is not None:
                buf = resolve(m.pieces[0], False).flat[m.dst_start: m.dst_start + m.length]
            else:
                base = pool.take(m.num_bytes)
                out.buffers.append(base)
                buf = base[: m.num_bytes]
                out.unpack.append((m, buf))
            ops.append(P2POp(peer=m.src_worker, tensor=buf, is_send=False))
    out.handles.append(channel.start(ops))
    if packed:
        start = time.perf_counter()
        sends: list[P2POp] = []
        for m in packed:
            if m.src_start is not None:
                buf = resolve(m.pieces[0], True).flat[m.src_start: m.src_start + m.length]
                sends.append(P2POp(peer=m.dst_worker, tensor=buf, is_send=True))
                continue
            base = pool.take(m.num_bytes)
            out.buffers.append(base)
            buf = base[: m.num_bytes]
            for p, off in _bucket_layout(m):
                _typed(buf, off, p).copy_(_piece_view(resolve(p, True), p.src_slot, p.box))
            sends.append(P2POp(peer=m.dst_worker, tensor=buf, is_send=True))
        out.pack_s = time.perf_counter() - start
        out.handles.append(channel.start(sends))
    return out


def _run_step(step: Step, worker: int, resolve: Resolve, channel: DataChannel, timeout_s: float | None,
              on_round: Callable[[str, int], None] | None, pool: BucketPool | None = None,
              riders: Sequence[Step] = ()) -> tuple[StepReport, list[float]]:
    """Rounds are pipelined: round r+1 is posted before round r is waited for and unpacked, so at
    most two rounds of buckets live. Local copies, this step's and those of ``riders`` (local-only
    steps run alongside), are made once the last round is posted, while it is in flight. Returns the report and each rider's
    copy seconds (counted in the riders' reports, not in this one's measured time)."""
    start = time.perf_counter()
    pool = pool if pool is not None else BucketPool(device=channel.device)
    pool.peak_bytes = pool.held_bytes
    counts: dict[str, int] = defaultdict(int)
    in_flight: _Round | None = None
    copied, copy_s, pack_s, unpack_s = 0, 0.0, 0.0, 0.0
    rider_s: list[float] = []
    for rnd in range(step.num_rounds + 1):
        posted = None
        if rnd < step.num_rounds:
            if on_round is not None:
                on_round(step.model_stage, rnd)
            posted = _post_round(step, rnd, worker, resolve, channel, counts, pool)
            pack_s += posted.pack_s
        if rnd == max(step.num_rounds - 1, 0):
            # once every round is posted: copies overlap the last transfers and never hold back a
            # round the peers wait for (the sender's packing, not the copies, paces the receivers)
            copy_start = time.perf_counter()
            copied = _local_copies(step, worker, resolve)
            copy_s = time.perf_counter() - copy_start
            for rider in riders:
                rider_start = time.perf_counter()
                _local_copies(rider, worker, resolve)
                rider_s.append(time.perf_counter() - rider_start)
        if in_flight is not None:
            for handle in in_flight.handles:
                handle.wait(timeout_s)
            unpack_start = time.perf_counter()
            for m, buf in in_flight.unpack:
                for p, off in _bucket_layout(m):
                    _piece_view(resolve(p, False), p.dst_slot, p.box).copy_(_typed(buf, off, p))
            unpack_s += time.perf_counter() - unpack_start
            pool.give(in_flight.buffers)  # the round's buckets are free for the next rounds
        in_flight = posted
    report = StepReport(model_stage=step.model_stage, primitive=step.primitive, predicted_s=step.predicted_s,
                        measured_s=time.perf_counter() - start - sum(rider_s), bytes_sent=counts["sent"],
                        bytes_received=counts["received"], bytes_copied_locally=copied,
                        peak_bucket_bytes=pool.peak_bytes if counts["sent"] or counts["received"] else 0,
                        local_copy_s=copy_s, pack_s=pack_s, unpack_s=unpack_s)
    return report, rider_s


def _local_copies(step: Step, worker: int, resolve: Resolve) -> int:
    copied = 0
    for p in step.local:
        if p.dst_worker != worker:
            continue
        _piece_view(resolve(p, False), p.dst_slot, p.box).copy_(_piece_view(resolve(p, True), p.src_slot, p.box))
        copied += p.num_bytes
    return copied


# --- running a TransitionDAG ----------------------------------------------------------------------


def unit_placement(unit: EMU) -> tuple[StagePlacement, int]:
    """The placement whose rank layout a unit's buffers follow (a part in final shape follows its
    final unit), and how to find a GPU's rank in it: ``placement.gpu_sets[0].index(gpu)``."""
    home = unit.final if unit.final is not None else unit
    placement = StagePlacement(model_stage=home.model_stage, model=home.state.model, head=home.state.head,
                               kinds=home.state.kinds, layout=home.layout, gpu_sets=(home.gpus,))
    return placement, 0


@lru_cache(maxsize=4096)
def unit_slots(unit: EMU, gpu: int) -> dict[tuple[str, str], Slot]:
    """The slots of ``unit``'s buffer on ``gpu`` (pure: both ends of a transfer derive them alike)."""
    placement, _ = unit_placement(unit)
    slots, _ = rank_slots(placement, placement.gpu_sets[0].index(gpu))
    return {s.key: s for s in slots}


def allocate_unit(unit: EMU, gpu: int, device: torch.device) -> RankState:
    placement, _ = unit_placement(unit)
    return RankState(placement=placement, replica=0, rank=placement.gpu_sets[0].index(gpu),
                     flat=alloc_bytes(unit_buffer_bytes(unit, gpu), device), slots=dict(unit_slots(unit, gpu)))


_DAG_MEMO: weakref.WeakKeyDictionary[TransitionDAG, dict[Any, Any]] = weakref.WeakKeyDictionary()


def _memoised(dag: TransitionDAG, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """``make()``, derived once per DAG object and kept as long as it lives (pieces, early builds: a
    worker derives its peers' early builds from their pieces too, and nothing outlives the DAG)."""
    memo = _DAG_MEMO.get(dag)
    if memo is None:
        memo = _DAG_MEMO[dag] = {}
    if key not in memo:
        memo[key] = make()
    return memo[key]


def node_pieces(dag: TransitionDAG, node: int, worker: int) -> tuple[Piece, ...]:
    """The pieces ``worker`` sends, receives or copies locally for DAG node ``node``, in derivation
    order (transitions.primitives keeps it), counters first: they sit at the start of every buffer,
    so buckets stay back to back there. Pure; memoised per DAG object."""
    return _memoised(dag, ("pieces", node, worker), lambda: _node_pieces(dag, node, worker))  # type: ignore[no-any-return]


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


def node_step(dag: TransitionDAG, node: int, worker: int, max_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
              predicted_s: float = 0.0, early: bool = False) -> Step:
    """The messages and local copies ``worker`` takes part in for DAG node ``node``. Both ends of a
    pair derive the same ordered pieces, hence the same messages, without talking to each other.
    With ``early`` (every worker of the run alike), the pieces a worker reads from a unit it builds
    early (``early_builds``) come from the new unit instead, and the building node's copies into it
    are left out (the build makes them)."""
    prim = dag.nodes[node]
    out = list(node_pieces(dag, node, worker))
    if early:
        out = _redirected(dag, node, worker, out)
    local = tuple(p for p in out if p.src_worker == p.dst_worker)
    messages = tuple(_messages([p for p in out if p.src_worker != p.dst_worker], max_bucket_bytes))
    return Step(model_stage=_node_stage(prim), primitive=f"{prim.kind.value}#{node}", local=local,
                messages=messages, predicted_s=predicted_s)


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


def _apply_relabels(merges: list[Merge], worker: int, units: dict[str, RankState]) -> None:
    for merge in merges:
        mine = [p for p in merge.parts if p.holds(worker)]
        if mine and all(p.uid in units and p.final == merge.unit for p in mine):
            for part in mine:
                units[merge.unit.uid] = units.pop(part.uid)


def _node_stage(prim: Primitive) -> str:
    return (*prim.targets, *prim.frees, *prim.sources)[0].model_stage


def run_dag(dag: TransitionDAG, worker: int, units: dict[str, RankState], channel: DataChannel, *,
            predicted_s: Sequence[float] | None = None, max_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            timeout_s: float | None = None, on_round: Callable[[str, int], None] | None = None,
            in_place: bool | None = None, fan_out: bool | None = None) -> list[StepReport]:
    """Run the DAG nodes that touch ``worker``, in the DAG's order, on ``units`` (EMU uid -> state).

    Each worker runs its nodes one at a time in the global order, so pairs meet in the same node and
    memory follows the DAG's checked timeline: targets are allocated when their node starts, sources
    freed by the Destroy/Merge that frees them, buckets once unpacked. A part delivered in final shape
    is relabelled by its Merge, never copied. On CPU (``in_place``, default ``IN_PLACE``; the same on
    every worker of the run, since the receivers derive the senders' early builds) a unit cut from
    one this worker gives up is built from that unit's pages before the nodes reading it when they
    read only what it keeps (``early_builds``), else compacted inside that unit's buffer once the
    last node reading it here is done, where the DAG would free it (``in_place_plan``). Either way a
    failure finds the same copies alive as without it. An Extend fan-out runs as broadcasts over groups formed for it
    (``fan_outs``): with ``fan_out`` None, those copying at least ``FAN_OUT_MIN_BYTES`` per rank.
    Raises ChannelBroken on any communication failure;
    ``units`` then holds whatever existed at that point (old units are only freed after their readers).
    """
    device = channel.device
    in_place = (IN_PLACE if in_place is None else in_place) and device.type == "cpu"
    # derive every node's pieces and messages first: planning, not moving, stays out of the timings
    steps = {node: node_step(dag, node, worker, max_bucket_bytes,
                             predicted_s[node] if predicted_s is not None else 0.0, early=in_place)
             for node in dag.nodes_on(worker) if not relabels(dag.nodes[node])}
    order = list(dag.nodes_on(worker))
    builds = early_builds(dag, worker) if in_place else {}
    if fan_out is None:  # where it helps: copies big enough to pay for forming the groups
        fans = [f for f in fan_outs(dag) if unit_buffer_bytes(f.source, f.source.gpus[0]) >= FAN_OUT_MIN_BYTES]
    else:
        fans = fan_outs(dag) if fan_out else []
    broadcast = {fan.source.uid for fan in fans}  # read whole by a broadcast: never a donor
    plans: dict[int, InPlace] = {}
    if in_place:
        for node in order:
            plan = in_place_plan(dag, node, steps[node], worker, order, steps) \
                if node in steps and node not in builds else None
            if plan is not None and plan.donor not in broadcast:
                plans[node] = plan
    # every worker of the generation forms every group, in the same order (new_group is collective)
    groups = [[channel.new_group(tuple(sorted({src, *copies}))) for src, copies in fan.ranks] for fan in fans]
    try:
        return _run_dag(dag, worker, units, channel, steps, order, plans, timeout_s, on_round,
                        fans, groups, builds)
    finally:
        for group in (g for per_fan in groups for g in per_fan):
            channel.destroy_group(group)


def _run_dag(dag: TransitionDAG, worker: int, units: dict[str, RankState], channel: DataChannel,
             steps: dict[int, Step], order: list[int], plans: dict[int, InPlace], timeout_s: float | None,
             on_round: Callable[[str, int], None] | None, fans: list[FanOut],
             groups: list[list[Any]], builds: dict[int, EarlyBuild]) -> list[StepReport]:
    built: dict[str, _Built] = {}  # donor uid -> its early build, until the DAG frees the donor
    try:
        reports = _run_dag_nodes(dag, worker, units, channel, steps, order, plans, timeout_s, on_round,
                                 fans, groups, builds, built)
    except BaseException:
        for made in built.values():  # the donors hold their bytes again; the targets never existed
            if made.build.donor in units:
                made.undo()
                units.pop(made.build.target.uid, None)
        raise
    return reports


def _run_dag_nodes(dag: TransitionDAG, worker: int, units: dict[str, RankState], channel: DataChannel,
                   steps: dict[int, Step], order: list[int], plans: dict[int, InPlace], timeout_s: float | None,
                   on_round: Callable[[str, int], None] | None, fans: list[FanOut],
                   groups: list[list[Any]], builds: dict[int, EarlyBuild],
                   built: dict[str, _Built]) -> list[StepReport]:
    device = channel.device
    build_before: dict[int, list[EarlyBuild]] = defaultdict(list)
    for build in builds.values():
        build_before[build.readers[0]].append(build)
    stats: dict[str, _Built] = {}  # "kind#node" of a building node -> its build, for that node's report
    reports: list[StepReport] = []
    fan_of = {node: i for i, fan in enumerate(fans) for node in fan.nodes}
    # every member is there before anything moves (and NCCL's communicator exists before p2p)
    channel.barrier(timeout_s)
    # Merges whose parts all arrive in final shape move nothing and touch no GPU's timeline, so they
    # are in no worker's node list: each worker relabels its share as soon as it holds it
    # so are Merges that copy on other GPUs but only relabel here (a part that arrived in final shape
    # on a GPU the Merge's copies do not touch): without this the part would keep its name
    mine = set(order)
    relabel = [prim for i, prim in enumerate(dag.nodes)
               if isinstance(prim, Merge) and (relabels(prim) or i not in mine)]
    _apply_relabels(relabel, worker, units)
    pool = BucketPool(device=device)
    carried: set[int] = set()  # local-only nodes already run alongside an earlier remote node
    deferred: dict[int, list[InPlace]] = {}  # node -> in-place builds waiting for its transfers

    def resolve(p: Piece, is_source: bool) -> RankState:
        return units[p.src_unit if is_source else p.dst_unit]

    for index, node in enumerate(order):
        if node in carried:
            continue
        prim = dag.nodes[node]
        for build in build_before.get(node, ()):
            if build.donor in units and build.target.uid not in units:
                made = built[build.donor] = _build_early(build, units, dag)
                stats[f"{dag.nodes[build.node].kind.value}#{build.node}"] = made
        start = time.perf_counter()
        if node in fan_of:
            fan = fans[fan_of[node]]
            for report in _run_fan_out(fan, groups[fan_of[node]], worker, units, channel, timeout_s):
                report.predicted_s = steps[int(report.primitive.split("#")[1])].predicted_s
                reports.append(report)
            carried.update(fan.nodes)
            _apply_relabels(relabel, worker, units)
            continue
        if isinstance(prim, Merge):
            for part in prim.parts:
                if part.final == prim.unit and part.holds(worker) and part.uid in units:
                    units[prim.unit.uid] = units.pop(part.uid)  # already in final shape: relabel
        plan = plans.get(node)
        if plan is not None and not (plan.target.uid not in units and plan.donor in units
                                     and units[plan.donor].flat.numel() >= plan.target_bytes):
            plan = None  # not as planned here (a unit missing or built already): the ordinary path
        # an in-place target is built once the last node reading its donor here is done
        later = {plan.target.uid} if plan is not None else set()
        if plan is not None:
            deferred.setdefault(plan.build_after, []).append(plan)
        allocated = _allocate_targets(prim, worker, units, device, later)
        if node not in steps:
            continue  # a relabelling Merge: handled by _apply_relabels
        step = steps[node]
        riders = _riders(dag, order[index + 1:], steps, worker, units, prim, set(plans) | set(build_before)) \
            if _remote(step, worker) else []
        for rider in riders:
            allocated += _allocate_targets(dag.nodes[rider], worker, units, device)
        moving = step if plan is None else replace(
            step, local=tuple(p for p in step.local if p.dst_worker != worker or p.dst_unit not in later))

        try:
            report, rider_s = _run_step(moving, worker, resolve, channel, timeout_s, on_round, pool,
                                        [steps[r] for r in riders])
            for done in (node, *riders):
                for waiting in deferred.pop(done, []):
                    if waiting.target.uid in units or waiting.donor not in units:
                        continue  # not as planned here: the target was made otherwise
                    copied, compact_s = _build_in_place(waiting, worker, units)
                    report.in_place = True
                    report.bytes_copied_locally += copied
                    report.local_copy_s += compact_s
        except BaseException:
            for uid in allocated:  # half-filled: never mistake them for a surviving copy
                units.pop(uid, None)
            raise
        report.measured_s = time.perf_counter() - start - sum(rider_s)
        reports.append(report)
        # frees in the DAG's order, once every node that ran here is done reading
        for done, seconds in ((node, None), *zip(riders, rider_s)):
            for unit in dag.nodes[done].frees:
                if unit.holds(worker):
                    units.pop(unit.uid, None)  # Destroy (or a Merge's parts): the buffer goes with it
                    built.pop(unit.uid, None)  # an early build from it is final
            if seconds is not None:
                rider_step = steps[done]
                reports.append(StepReport(
                    model_stage=rider_step.model_stage, primitive=rider_step.primitive,
                    predicted_s=rider_step.predicted_s, measured_s=seconds, bytes_sent=0, bytes_received=0,
                    bytes_copied_locally=sum(p.num_bytes for p in rider_step.local if p.dst_worker == worker),
                    peak_bucket_bytes=0, local_copy_s=seconds, alongside=step.primitive))
                carried.add(done)
        _apply_relabels(relabel, worker, units)
    for old_uid, new_uid in dag.renamed:  # units that stay as they are take their new plan's name
        if old_uid in units:
            units[new_uid] = units.pop(old_uid)
    for report in reports:  # a building node's report carries its build, made before its readers
        extra = stats.get(report.primitive)
        if extra is not None:
            report.in_place = True
            report.measured_s += extra.seconds
            report.local_copy_s += extra.seconds
            report.bytes_copied_locally += extra.copied
            report.bytes_remapped += extra.moved_bytes
    return reports


def _allocate_targets(prim: Primitive, worker: int, units: dict[str, RankState],
                      device: torch.device, skip: set[str] | frozenset[str] = frozenset()) -> list[str]:
    allocated = [t.uid for t in prim.targets if t.holds(worker) and t.uid not in units and t.uid not in skip]
    for target in prim.targets:
        if target.uid in allocated:
            units[target.uid] = allocate_unit(target, worker, device)
    return allocated


def _remote(step: Step, worker: int) -> bool:
    return any(worker in (m.src_worker, m.dst_worker) for m in step.messages)


def _riders(dag: TransitionDAG, later: Sequence[int], steps: dict[int, Step], worker: int,
            units: dict[str, RankState], host: Primitive, in_place: set[int] | None = None) -> list[int]:
    """The local-only nodes right after a remote node in ``worker``'s order that may run while its
    transfers are in flight: they move nothing between workers, read only units this worker already
    holds whole (none the remote node writes), and relabel no part. Their targets are then allocated
    one node early (the transient cost of overlapping them: one node's targets beside the buckets);
    their frees still wait until the remote node is done reading."""
    written = {t.uid for t in host.targets}
    out: list[int] = []
    for node in later:
        prim = dag.nodes[node]
        step = steps.get(node)
        if step is None or _remote(step, worker) or not any(p.dst_worker == worker for p in step.local):
            break
        if in_place and node in in_place:
            break  # it overwrites its donor, which the remote node may still be reading
        if isinstance(prim, Merge) and any(p.final == prim.unit and p.holds(worker) for p in prim.parts):
            break
        reads = {p.src_unit for p in step.local if p.dst_worker == worker}
        if not reads <= set(units) or reads & written:
            break
        if any(t.holds(worker) and t.uid in units for t in prim.targets):
            break  # a target already exists here (written by an earlier node): keep the DAG's order
        written |= {t.uid for t in prim.targets}
        out.append(node)
    return out


# --- Extend fan-out by broadcast ----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class FanOut:
    """Several Extends copying one unit whole to other GPUs, run as one broadcast per unit rank from
    the source GPU to its copies. NCCL pipelines a broadcast along a ring, so the source's link
    carries the unit once instead of once per copy; gloo's broadcast also beat the point-to-point
    copies here (see ``FAN_OUT_MIN_BYTES``)."""

    nodes: tuple[int, ...]  # the Extend nodes it stands for, in execution order
    source: EMU
    targets: tuple[EMU, ...]  # one per node

    @property
    def ranks(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """Per unit rank: the source GPU and the GPUs of its copies (one broadcast group each)."""
        return tuple((g, tuple(t.gpus[r] for t in self.targets)) for r, g in enumerate(self.source.gpus))


def fan_outs(dag: TransitionDAG) -> list[FanOut]:
    """The Extend fan-outs of ``dag`` that a broadcast can run: two or more Extends of one whole unit
    into same-layout copies on other GPUs (parts excluded), and no node of any GPU involved in
    between them in the execution order, so no member waits on another node while the others are in
    the broadcast (which would deadlock). Pure, identical on every worker: groups are formed in this
    order."""
    pos = {n: i for i, n in enumerate(dag.order)}
    by_source: dict[str, list[int]] = defaultdict(list)
    for n, prim in enumerate(dag.nodes):
        if not isinstance(prim, Extend) or len(prim.sources) != 1:
            continue
        src, tgt = prim.sources[0], prim.target
        if (src.final is None and tgt.final is None and tgt.layout == src.layout and tgt.state == src.state
                and not set(tgt.gpus) & set(src.gpus)):
            by_source[src.uid].append(n)
    out = []
    for nodes in by_source.values():
        if len(nodes) < 2:
            continue
        nodes.sort(key=lambda n: pos[n])
        prims = [dag.nodes[n] for n in nodes]
        source = prims[0].sources[0]
        targets = tuple(prim.targets[0] for prim in prims)
        members = set(source.gpus).union(*(t.gpus for t in targets))
        if len(members) != len(source.gpus) * (1 + len(targets)):
            continue  # two copies share a GPU
        lo, hi, mine = pos[nodes[0]], pos[nodes[-1]], set(nodes)
        if any(lo < pos[m] < hi and m not in mine for w in members for m in dag.nodes_on(w)):
            continue
        out.append(FanOut(nodes=tuple(nodes), source=source, targets=targets))
    return out


def _run_fan_out(fan: FanOut, groups: Sequence[Any], worker: int, units: dict[str, RankState],
                 channel: DataChannel, timeout_s: float | None) -> list[StepReport]:
    """This worker's part of ``fan``: the source broadcasts its rank's whole buffer, each copy
    receives it into its new unit (same layout, so the same bytes in the same places, counters
    included). One report per Extend node this worker is in."""
    start = time.perf_counter()
    reports: list[StepReport] = []
    for (src_gpu, copies), group in zip(fan.ranks, groups):
        if worker == src_gpu:
            flat = units[fan.source.uid].flat
            channel.broadcast(flat, src_gpu, timeout_s=timeout_s, group=group)
            seconds = time.perf_counter() - start
            for i, node in enumerate(fan.nodes):  # the first carries the time, the others ran with it
                reports.append(StepReport(
                    model_stage=fan.source.model_stage, primitive=f"extend#{node}",
                    predicted_s=0.0, measured_s=seconds if i == 0 else 0.0, bytes_sent=flat.numel(),
                    bytes_received=0, bytes_copied_locally=0, peak_bucket_bytes=0,
                    alongside="" if i == 0 else f"broadcast extend#{fan.nodes[0]}"))
        elif worker in copies:
            i = copies.index(worker)
            target = fan.targets[i]
            units[target.uid] = state = allocate_unit(target, worker, channel.device)
            try:
                channel.broadcast(state.flat, src_gpu, timeout_s=timeout_s, group=group)
            except BaseException:
                units.pop(target.uid, None)  # half-filled: never mistake it for a copy
                raise
            reports.append(StepReport(
                model_stage=target.model_stage, primitive=f"extend#{fan.nodes[i]}", predicted_s=0.0,
                measured_s=time.perf_counter() - start, bytes_sent=0, bytes_received=state.flat.numel(),
                bytes_copied_locally=0, peak_bucket_bytes=0, alongside="broadcast"))
    return reports


# --- building a unit inside the buffer it is cut from (CPU) ---------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class InPlace:
    """A node whose target on one worker is built inside the buffer of ``donor``, after ``build_after``.

    Chosen only when the donor is freed by this node or a later one, every local piece of the node
    goes from the donor into the target, nothing is received into the target, the target's buffer is
    no larger, and copying the pieces forward in ``pieces`` order (target byte order), row by row,
    never overwrites a donor byte that is still to be read."""

    node: int
    donor: str
    target: EMU
    target_bytes: int
    pieces: tuple[Piece, ...]
    build_after: int  # compact once this node is done (the node itself, or the donor's last reader here)


@lru_cache(maxsize=4096)
def unit_buffer_bytes(unit: EMU, gpu: int) -> int:
    placement, _ = unit_placement(unit)
    return rank_slots(placement, placement.gpu_sets[0].index(gpu))[1]


def _forward_order(pieces: Sequence[Piece]) -> tuple[Piece, ...] | None:
    """``pieces`` in destination byte order if compacting them forward inside one buffer is safe:
    each destination is contiguous, starts at or before its source and advances no faster per row
    (rows along dim 0, each one contiguous run in the source), and ends before every later piece's
    source begins. None when any of that fails."""
    spans = []
    for p in pieces:
        dst = contiguous_range(p.dst_slot, p.box)
        if dst is None:
            return None
        # rows run along the first stored dim (a 1-D box: one element a row); each must be one run
        # in the source, since a row that overlaps its own destination is memmoved
        d = p.src_slot.order[0] if p.src_slot.order else 0
        lens = list(p.box[1])
        lens[d] = 1
        first_row = contiguous_range(p.src_slot, (p.box[0], tuple(lens)))
        if first_row is None:
            return None
        src_start, rows = first_row[0], p.box[1][d]
        pitch = math.prod(p.src_slot.storage_lengths[1:]) * p.src_slot.element_bytes
        if dst[0] > src_start or (dst[1] - dst[0]) // rows > pitch:
            return None
        spans.append((dst[0], dst[1], src_start, p))
    spans.sort(key=lambda x: x[0])
    later = math.inf
    for _, dst_end, src_start, _ in reversed(spans):
        if dst_end > later:
            return None
        later = min(later, src_start)
    return tuple(p for *_, p in spans)


def in_place_plan(dag: TransitionDAG, node: int, step: Step, worker: int, order: Sequence[int] = (),
                  steps: dict[int, Step] | None = None) -> InPlace | None:
    """Whether node ``node`` can build its target on ``worker`` inside the buffer of the unit it cuts
    it from (a Split or Merge keeping part of a shard), and how. The donor must be freed by the node
    itself, or (given ``worker``'s ``order`` and ``steps``) by a later node; the build then waits for
    the transfers of the last node that reads the donor here (``build_after``). A node that moves data
    itself must receive nothing into the target. Pure: from the DAG and the steps alone."""
    prim = dag.nodes[node]
    local = [p for p in step.local if p.dst_worker == worker]
    cut = _cut_here(prim, local, worker)
    if cut is None:
        return None
    donor, target = cut
    donor_uid, target_uid = donor.uid, target.uid
    if any(u.uid == donor_uid for u in prim.frees):
        build_after = node
    else:
        last = _last_reader(dag, node, donor_uid, target.uid, worker, order, steps)
        if last is None:
            return None
        build_after = last
    if any(m.dst_worker == worker and any(p.dst_unit == target_uid for p in m.pieces) for m in step.messages):
        return None  # a receive would land in the donor's buffer while the node still reads it
    size = unit_buffer_bytes(target, worker)
    if size > unit_buffer_bytes(donor, worker):
        return None
    ordered = _forward_order(local)
    if ordered is None:
        return None
    return InPlace(node=node, donor=donor_uid, target=target, target_bytes=size, pieces=ordered,
                   build_after=build_after)


def _cut_here(prim: Primitive, into: Sequence[Piece], worker: int) -> tuple[EMU, EMU] | None:
    """(donor, target) when ``into``, the pieces landing on ``worker`` for ``prim``, are all local
    copies from one unit held here into ``prim``'s only target here (a Split or Merge keeping part of
    a shard), and no part already in final shape is relabelled into that target (it would exist
    before the copies). None otherwise."""
    pairs = {(p.src_unit, p.dst_unit) for p in into}
    if len(pairs) != 1 or any(p.src_worker != worker for p in into):
        return None
    donor_uid, target_uid = next(iter(pairs))
    donor = next((u for u in prim.sources if u.uid == donor_uid and u.holds(worker)), None)
    mine = [t for t in prim.targets if t.holds(worker)]
    if donor is None or len(mine) != 1 or mine[0].uid != target_uid:
        return None
    if isinstance(prim, Merge) and any(part.final == mine[0] and part.holds(worker) for part in prim.parts):
        return None
    return donor, mine[0]


def _last_reader(dag: TransitionDAG, node: int, donor: str, target: str, worker: int, order: Sequence[int],
                 steps: dict[int, Step] | None) -> int | None:
    """When a later node in ``worker``'s order frees ``donor`` here: the last node up to it that reads
    the donor on this worker (``node`` itself if none does), after which the target can be built in
    the donor's buffer. None when no later node frees it, or a node in between touches the target or
    relabels the donor (the target must not exist, nor the donor change, before the build)."""
    if steps is None or node not in order:
        return None
    last = node
    for later in order[order.index(node) + 1:]:
        prim = dag.nodes[later]
        touched = {u.uid for u in (*prim.sources, *prim.targets)}
        if isinstance(prim, Merge):
            touched |= {part.uid for part in prim.parts}
        if target in touched or (isinstance(prim, Merge) and donor in {part.uid for part in prim.parts}):
            return None
        if later in steps and _reads(steps[later], worker, donor):
            last = later
        if any(u.uid == donor and u.holds(worker) for u in prim.frees):
            return last if not (later in steps and _reads(steps[later], worker, donor)) else None
    return None


def _reads(step: Step, worker: int, uid: str) -> list[Piece]:
    """The pieces of ``step`` that ``worker`` reads from unit ``uid`` (local copies and sends)."""
    out = [p for p in step.local if p.src_unit == uid and p.src_worker == worker]
    for m in step.messages:
        if m.src_worker == worker:
            out.extend(p for p in m.pieces if p.src_unit == uid)
    return out


def _compact_piece(p: Piece, donor: RankState, target: RankState) -> None:
    """Copy one piece from ``donor`` into ``target`` (a view of the donor's buffer), forward: a run
    contiguous on both sides is one memmove; strided rows go in chunks copied directly once their
    destination ends before their source begins, row by row (memmove) before that.
    ``_forward_order`` made every step safe: no write reaches a byte still to be read."""
    src = storage_view(_piece_view(donor, p.src_slot, p.box), p.src_slot)
    dst = storage_view(_piece_view(target, p.dst_slot, p.box), p.dst_slot)
    src_start, dst_start = src.data_ptr(), dst.data_ptr()
    if src_start == dst_start and src.is_contiguous():
        return  # already in place (the counters, at the start of every buffer)
    if src.is_contiguous():
        _memmove(dst_start, src_start, p.num_bytes)
        return
    size = src.element_size()
    pitch, row = src.stride(0) * size, dst.stride(0) * size
    rows, r = src.shape[0], 0
    while r < rows:
        direct = (src_start + r * pitch - dst_start - r * row) // row  # rows that cannot overlap
        if direct >= 1:
            k = min(rows - r, direct)
            dst[r:r + k].copy_(src[r:r + k])
        else:  # this row's destination overlaps its own source: memmove allows that
            k = 1
            _memmove(dst_start + r * row, src_start + r * pitch, src[r].numel() * size)
        r += k


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_LIBC.memmove.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_LIBC.memmove.restype = ctypes.c_void_p
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_LIBC.madvise.restype = ctypes.c_int
_MADV_DONTNEED = 4


def _memmove(dst: int, src: int, num_bytes: int) -> None:
    """libc memmove between two addresses of this process's CPU memory (overlap allowed)."""
    _LIBC.memmove(dst, src, num_bytes)


def release_tail(flat: torch.Tensor, keep: int) -> int:
    """Give the whole pages of ``flat`` past its first ``keep`` bytes back to the OS (CPU): the
    buffer a unit was compacted into keeps only what the new unit uses. Returns the bytes released."""
    if flat.device.type != "cpu" or not hasattr(mmap, "PAGESIZE"):
        return 0
    page = mmap.PAGESIZE
    start = -(-(flat.data_ptr() + keep) // page) * page
    end = (flat.data_ptr() + flat.numel()) // page * page
    if end - start < page:
        return 0
    if _LIBC.madvise(start, end - start, _MADV_DONTNEED) != 0:
        return 0  # memory stays held: correct, only less frugal
    return end - start


def _build_in_place(plan: InPlace, worker: int, units: dict[str, RankState]) -> tuple[int, float]:
    """Build ``plan``'s target as a view of its donor's buffer, compacted piece by piece in target
    byte order; then drop the donor and give its pages past the target back. A failure half-way
    leaves neither (both half-overwritten: no copy of anything). Returns bytes copied and seconds."""
    start = time.perf_counter()
    donor = units[plan.donor]
    placement, _ = unit_placement(plan.target)
    target = RankState(placement=placement, replica=0, rank=placement.gpu_sets[0].index(worker),
                       flat=donor.flat[: plan.target_bytes], slots=unit_slots(plan.target, worker))
    units[plan.target.uid] = target
    try:
        for p in plan.pieces:
            _compact_piece(p, donor, target)
    except BaseException:
        units.pop(plan.target.uid, None)
        units.pop(plan.donor, None)
        raise
    units.pop(plan.donor, None)
    release_tail(donor.flat, plan.target_bytes)
    return sum(p.num_bytes for p in plan.pieces), time.perf_counter() - start


# --- building a unit early, from the pages of the one it is cut from (CPU) ------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class EarlyBuild:
    """On ``worker``, node ``node`` cuts ``target`` from ``donor`` (a TP or PP Split/Merge keeping
    part of a shard), and the earlier nodes ``readers`` send from the donor only bytes the target
    keeps (a TP1 -> TP2 change sends the very half it keeps to the new replica). The target is then
    built right before the first reader and those reads come from it: its buffer is laid out as the
    receiver's, so the sends go out as one zero-copy message instead of packed strided halves.

    The build moves the donor's pages where a kept run sits at the same offset within a page on both
    sides (no byte copied; page-aligned slots make that the common case) and copies the rest, strided
    rows included. Until the DAG frees the donor, a failure moves the pages back (``_Built.undo``):
    what survives is what the DAG's order keeps."""

    node: int
    worker: int
    donor: str
    target: EMU
    readers: tuple[int, ...]  # nodes whose reads from the donor come from the target (incl. ``node``'s sends)
    frees_at: int  # the node that frees the donor here (``node`` or a later one)


def _original_units(dag: TransitionDAG) -> frozenset[str]:
    made = {t.uid for prim in dag.nodes for t in prim.targets}
    return frozenset(u.uid for prim in dag.nodes for u in prim.sources if u.uid not in made)


def early_builds(dag: TransitionDAG, worker: int) -> dict[int, EarlyBuild]:
    """The early builds (``EarlyBuild``) of ``worker``, by building node. Pure, memoised per DAG
    object: the receivers of a worker's sends derive the same, so both ends agree on the messages."""
    return _memoised(dag, ("early", worker), lambda: _early_builds(dag, worker))  # type: ignore[no-any-return]


def _early_builds(dag: TransitionDAG, worker: int) -> dict[int, EarlyBuild]:
    order = dag.nodes_on(worker)
    original = _original_units(dag)
    out: dict[int, EarlyBuild] = {}
    for i, node in enumerate(order):
        prim = dag.nodes[node]
        if relabels(prim) or sum(t.holds(worker) for t in prim.targets) != 1 or not any(
                u.holds(worker) and u.uid in original for u in prim.sources):
            continue  # not cut here from a unit held since the start (checked before deriving pieces)
        cut = _cut_here(prim, [p for p in node_pieces(dag, node, worker) if p.dst_worker == worker], worker)
        if cut is None or cut[0].uid not in original:
            continue  # something is received into it, it is cut from several units, or from a new one
        donor_uid, target = cut[0].uid, cut[1]
        target_uid = target.uid
        frees_at = next((n for n in order[i:] if any(u.uid == donor_uid and u.holds(worker)
                                                     for u in dag.nodes[n].frees)), None)
        if frees_at is None:
            continue
        boxes = {key: (slot.offsets, slot.lengths) for key, slot in unit_slots(target, worker).items()}
        readers: list[int] = []
        ok = True
        for n in order[: order.index(frees_at) + 1]:
            other = dag.nodes[n]
            reads = [p for p in node_pieces(dag, n, worker) if p.src_worker == worker and p.src_unit == donor_uid
                     and not (n == node and p.dst_worker == worker)]
            parts = {part.uid for part in other.parts} if isinstance(other, Merge) else set()
            if n != node and (target_uid in {u.uid for u in (*other.targets, *other.frees)} | parts
                              or donor_uid in parts or (n != frees_at and donor_uid in {u.uid for u in other.frees})):
                ok = False
                break
            if not reads:
                continue
            if not all(p.src_slot.key in boxes and box_contains(boxes[p.src_slot.key], p.box) for p in reads):
                ok = False
                break
            readers.append(n)
        if ok and readers and readers[0] != node:
            out[node] = EarlyBuild(node=node, worker=worker, donor=donor_uid, target=target,
                                   readers=tuple(readers), frees_at=frees_at)
    return out


def _redirected(dag: TransitionDAG, node: int, worker: int, pieces: list[Piece]) -> list[Piece]:
    """``pieces`` of ``node`` as run with early builds: reads from a donor built early come from its
    target, and ``worker``'s own copies into a target it builds early are dropped (done by the build)."""
    mine = early_builds(dag, worker).get(node)
    out = []
    for p in pieces:
        if mine is not None and p.src_worker == p.dst_worker == worker and p.dst_unit == mine.target.uid:
            continue
        for build in early_builds(dag, p.src_worker).values():
            if p.src_unit == build.donor and node in build.readers:
                p = replace(p, src_unit=build.target.uid, src_slot=unit_slots(build.target, p.src_worker)[p.src_slot.key])
                break
        out.append(p)
    return out


_LIBC.mremap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_LIBC.mremap.restype = ctypes.c_void_p
_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4


def _move_pages(dst: int, src: int, num_bytes: int) -> bool:
    """Move the pages of [src, src + num_bytes) to ``dst`` (both page-aligned): the memory changes
    address, no byte is copied, and ``src`` keeps an empty mapping (it reads zeros; nothing else may
    be mapped there meanwhile). False where the kernel refuses (Linux < 5.7, or memory that is not
    private and anonymous): the caller copies instead."""
    got = _LIBC.mremap(src, num_bytes, num_bytes, _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP, dst)
    return got == dst


def _move_or_copy(d: int, s: int, n: int, moved: list[tuple[int, int, int]], pages: bool = True) -> tuple[int, int]:
    """Put the ``n`` bytes at address ``s`` at address ``d``: with ``pages`` and both at the same
    offset within a page, the whole pages in between are moved (recorded in ``moved`` as (dst, src,
    bytes)) and the ragged ends copied; otherwise everything is copied. Returns (copied, moved)."""
    head = -d % PAGE_BYTES
    body = (n - head) // PAGE_BYTES * PAGE_BYTES if pages and n >= max(MOVE_MIN_BYTES, 2 * PAGE_BYTES) else 0
    if body and (s - d) % PAGE_BYTES == 0 and _move_pages(d + head, s + head, body):
        moved.append((d + head, s + head, body))
        if head:
            _memmove(d, s, head)
        if n - head - body:
            _memmove(d + head + body, s + head + body, n - head - body)
        return n - body, body
    _memmove(d, s, n)
    return n, 0


def _build_pieces(dag: TransitionDAG, node: int, worker: int, target: str
                  ) -> tuple[tuple[tuple[int, int, int], ...], tuple[Piece, ...]]:
    """What an early build of ``target`` on ``worker`` copies: byte runs contiguous on both sides as
    (donor offset, target offset, bytes), back-to-back ones merged, and the strided pieces. Pure."""
    runs: list[tuple[int, int, int]] = []
    strided: list[Piece] = []
    for p in node_pieces(dag, node, worker):
        if not (p.src_worker == p.dst_worker == worker and p.dst_unit == target):
            continue
        src, dst = contiguous_range(p.src_slot, p.box), contiguous_range(p.dst_slot, p.box)
        if src is None or dst is None:
            strided.append(p)
        elif runs and runs[-1][0] + runs[-1][2] == src[0] and runs[-1][1] + runs[-1][2] == dst[0]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + src[1] - src[0])
        else:
            runs.append((src[0], dst[0], src[1] - src[0]))
    return tuple(runs), tuple(strided)


@dataclass(slots=True)
class _Built:
    """An early build done, kept until the DAG frees its donor so a failure can undo it."""

    build: EarlyBuild
    target: RankState
    moved: list[tuple[int, int, int]] = field(default_factory=list)
    copied: int = 0
    seconds: float = 0.0

    @property
    def moved_bytes(self) -> int:
        return sum(n for _, _, n in self.moved)

    def undo(self) -> None:
        """Give the donor its pages back (the target, dropped by the caller, keeps empty ones)."""
        for dst, src, n in reversed(self.moved):
            if not _move_pages(src, dst, n):
                _memmove(src, dst, n)
        self.moved.clear()


def _build_early(build: EarlyBuild, units: dict[str, RankState], dag: TransitionDAG) -> _Built:
    start = time.perf_counter()
    worker = build.worker
    donor = units[build.donor]
    target = allocate_unit(build.target, worker, donor.flat.device)
    done = _Built(build=build, target=target)
    runs, strided = _build_pieces(dag, build.node, worker, build.target.uid)
    src, dst = donor.flat.data_ptr(), target.flat.data_ptr()
    # pages move only between mappings of our own (``alloc_bytes``), never in or out of malloc's heap
    pages = (target.flat.device.type == "cpu" and (src - dst) % PAGE_BYTES == 0
             and min(donor.flat.numel(), target.flat.numel()) >= MAP_MIN_BYTES)
    try:
        for s, d, n in runs:
            done.copied += _move_or_copy(dst + d, src + s, n, done.moved, pages)[0]
        for p in strided:
            _piece_view(target, p.dst_slot, p.box).copy_(_piece_view(donor, p.src_slot, p.box))
            done.copied += p.num_bytes
    except BaseException:
        done.undo()
        raise
    units[build.target.uid] = target
    done.seconds = time.perf_counter() - start
    return done


# --- what survives a failure (pure) ----------------------------------------------------------------


def lost_state(placements: Iterable[StagePlacement], dead_workers: Iterable[int]) -> dict[str, list[str]]:
    """Per model-stage, the tensors/kinds whose every copy sat on a dead worker (checkpoint needed).

    A stage with a surviving full replica loses nothing; otherwise a box is lost when no surviving
    rank of any replica covers it (replicas of one layout hold the same boxes at the same ranks).
    """
    dead = set(dead_workers)
    out: dict[str, list[str]] = {}
    for placement in placements:
        lost: list[str] = []
        alive_boxes: dict[tuple[str, str], set[Box]] = defaultdict(set)
        all_boxes: dict[tuple[str, str], set[Box]] = defaultdict(set)
        for gpus in placement.gpu_sets:
            for rank, worker in enumerate(gpus):
                for slot in rank_slots(placement, rank)[0]:
                    box = (slot.offsets, slot.lengths)
                    all_boxes[slot.key].add(box)
                    if worker not in dead:
                        alive_boxes[slot.key].add(box)
        for key, boxes in all_boxes.items():
            if not boxes <= alive_boxes[key]:
                lost.append(f"{key[0]}/{key[1]}")
        if lost:
            out[placement.model_stage] = sorted(lost)
    return out
