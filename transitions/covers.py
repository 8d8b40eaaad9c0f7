"""Where every row of a target shard comes from, and the pieces that carry it. Pure.

Every target shard on a GPU is covered, along its split dimension, first by what a source already
holds on that same GPU (a local piece: never sent), then by the sources in order, starting at the
rank-aligned holder so that each source rank feeds its own counterpart. ``derive_target`` turns a
cover into pieces (``transitions.transfer_plan.Piece``: the one record of a box moved, placed in the
units' slots); ``counter_pieces`` adds the units' counters. Both ends of a pair derive the same
pieces in the same order without talking. A primitive whose sources do not hold all of a target
shard raises transitions.errors.CoverageError.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import lru_cache

from planner.models import Parallel, TensorSpec
from transitions.emu import EMU, Box, StateKey, UnitState
from transitions.errors import CoverageError
from transitions.geometry import Shard, _tensors, tensor_stages
from transitions.layout import COUNTERS, COUNTERS_KIND, NUM_COUNTERS, Slot
from transitions.primitives import Merge, Primitive
from transitions.rank_table import rank_table, unit_table
from transitions.transfer_plan import Piece, make_piece

Intervals = list[tuple[int, int]]
Cover = list[tuple[EMU, int, Box, int, int]]  # (source unit, source GPU, source box, lo, hi)


@lru_cache(maxsize=256)
def _tensor_index(state: UnitState) -> dict[str, TensorSpec]:
    return {t.name: t for t in _tensors(state.model, state.head)}


def _split_dim(t: TensorSpec) -> int:
    return 1 if t.parallel is Parallel.ROW else 0


def _subtract(need: Intervals, lo: int, hi: int) -> tuple[Intervals, Intervals]:
    """Split intervals ``need`` by [lo, hi): (covered pieces, what is still needed)."""
    got, rest = [], []
    for a, b in need:
        x, y = max(a, lo), min(b, hi)
        if x >= y:
            rest.append((a, b))
            continue
        got.append((x, y))
        if a < x:
            rest.append((a, x))
        if y < b:
            rest.append((y, b))
    return got, rest


def _remote_holders(src: EMU, tensor: TensorSpec, prefer_tp: int) -> Iterable[int]:
    """Source GPUs holding ``tensor``, rank-aligned first (TP rank ``prefer_tp`` mod tp), then rotating."""
    lay = src.layout
    for stage in tensor_stages(tensor, src.state.model, lay.pp):
        for i in range(lay.tp):
            yield src.gpus[lay.rank_of((prefer_tp + i) % lay.tp, stage)]


BoxOf = Callable[[StateKey], Box | None]  # a source rank's box of a (tensor, kind), None if it holds none


def _no_box(key: StateKey) -> Box | None:
    return None


def _box_of(unit: EMU, gpu: int) -> BoxOf:
    """``unit.boxes(gpu).get`` from its buffer's table: a part in final shape holds its final unit's."""
    home = unit
    while home.final is not None and home.holds(gpu):
        home = home.final
    if not home.holds(gpu):
        return _no_box
    state = home.state
    return rank_table(state.model, state.head, home.layout, home.gpus.index(gpu), state.kinds).box


def _take(cover: Cover, need: Intervals, src: EMU, gpu: int, box: Box | None, dim: int) -> Intervals:
    """What of ``need`` the source box ``box`` (of ``src`` on ``gpu``) covers goes into ``cover``;
    returns what is still needed."""
    if box is None:
        return need
    got, need = _subtract(need, box[0][dim], box[0][dim] + box[1][dim])
    cover += [(src, gpu, box, lo, hi) for lo, hi in got]
    return need


class _Boxes:
    """One ``covers`` call's memo of the sources' boxes per GPU and their holders per PP stage: a unit
    rank's boxes come from its buffer's table (transitions.rank_table: the same as ``EMU.boxes``,
    without a dict of every shard's), its holders from ``tensor_stages``; hashing a unit's state per
    shard cost more than the cover itself. Keyed by the source's position, alive for one call only."""

    __slots__ = ("boxes", "holders", "sources")

    def __init__(self, sources: tuple[EMU, ...]) -> None:
        self.sources = sources
        self.boxes: dict[tuple[int, int], BoxOf] = {}
        self.holders: dict[tuple[int, int | None, str, int], tuple[int, ...]] = {}

    def of(self, k: int, gpu: int) -> BoxOf:
        got = self.boxes.get((k, gpu))
        if got is None:
            got = self.boxes[(k, gpu)] = _box_of(self.sources[k], gpu)
        return got

    def holders_of(self, k: int, tensor: TensorSpec, tp_rank: int) -> tuple[int, ...]:
        # tensors of one layer (or the same non-layer tensor) sit on the same stages
        key = (k, tensor.layer, tensor.name if tensor.layer is None else "", tp_rank)
        got = self.holders.get(key)
        if got is None:
            got = self.holders[key] = tuple(_remote_holders(self.sources[k], tensor, tp_rank))
        return got


def _tensor_cover(shard: Shard, dim: int, tensor: TensorSpec, memo: _Boxes, gpu: int,
                  local: list[tuple[EMU, BoxOf]], tp_rank: int) -> tuple[Cover, Intervals]:
    """Where each row of ``shard`` comes from: same-GPU sources first, then remote ones rank-aligned."""
    key = shard.key
    cover: Cover = []
    need = [(shard.offsets[dim], shard.offsets[dim] + shard.lengths[dim])]
    for s, box_of in local:
        need = _take(cover, need, s, gpu, box_of(key), dim)
        if not need:
            return cover, need
    for k, s in enumerate(memo.sources):
        for g in memo.holders_of(k, tensor, tp_rank):
            need = _take(cover, need, s, g, memo.of(k, g)(key), dim)
            if not need:
                return cover, need
    return cover, need


def covers(target: EMU, sources: tuple[EMU, ...], gpu: int, shards: Iterable[Shard] | None = None
           ) -> list[tuple[Shard, int, Cover]]:
    """For every shard ``target`` holds on ``gpu`` (or those of them given, in its order): its split
    dim and where each of its rows comes from.

    The cover is computed once per tensor and reused for its other state kinds: sources hold every
    kind the target holds (same model-stage, or a training stage feeding a parameters-only one).
    CoverageError if no source holds some of a shard's rows.
    """
    index = _tensor_index(target.state)
    owner = target.final if target.final is not None else target
    tp_rank = owner.layout.coords(owner.rank_of(gpu))[0]
    memo = _Boxes(sources)
    local = [(s, memo.of(k, gpu)) for k, s in enumerate(sources) if s.holds(gpu)]
    out: list[tuple[Shard, int, Cover]] = []
    cover: Cover = []
    cover_tensor = ""
    dim = 0
    for shard in target.shards(gpu) if shards is None else shards:
        if shard.key[0] != cover_tensor:
            tensor = index[shard.key[0]]
            dim = _split_dim(tensor)
            cover_tensor = shard.key[0]
            cover, need = _tensor_cover(shard, dim, tensor, memo, gpu, local, tp_rank)
            if need:
                raise CoverageError(target.uid, gpu, shard.key, tuple(need))
        out.append((shard, dim, cover))
    return out


def derive_target(target: EMU, sources: tuple[EMU, ...], gpu: int, from_gpu: int | None = None,
                  covered: list[tuple[Shard, int, Cover]] | None = None) -> list[Piece]:
    """Pieces (local and remote) that fill everything ``target`` holds on ``gpu`` from ``sources``;
    with ``from_gpu``, only those read from that GPU. ``covered``: ``covers(target, sources, gpu)``
    when the caller has it already."""
    out: list[Piece] = []
    dst_slot_of = unit_table(target, gpu).slot  # slots made as pieces need them (transitions.rank_table)
    src_slots: dict[tuple[int, int], Callable[[tuple[str, str]], Slot]] = {}  # by (id(unit), GPU): no hashing
    uid = target.uid
    for shard, dim, cover in covers(target, sources, gpu) if covered is None else covered:
        offsets, lengths = shard.offsets, shard.lengths
        key = (shard.key[0], shard.key[1].value)
        dst_slot = dst_slot_of(key)
        for s, g, _, lo, hi in cover:
            if from_gpu is not None and g != from_gpu:
                continue
            slot_of = src_slots.get((id(s), g))
            if slot_of is None:
                slot_of = src_slots[(id(s), g)] = unit_table(s, g).slot
            offs, lens = list(offsets), list(lengths)
            offs[dim], lens[dim] = lo, hi - lo
            out.append(make_piece(g, gpu, slot_of(key), dst_slot, (tuple(offs), tuple(lens)), s.uid, uid))
    return out


def counter_pieces(prim: Primitive) -> list[Piece]:
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
            out.append(Piece(src_worker=src_gpu, dst_worker=g, src_slot=unit_table(src, src_gpu).slot(key),
                             dst_slot=unit_table(target, g).slot(key), box=((0,), (NUM_COUNTERS,)),
                             src_unit=src.uid, dst_unit=target.uid))
    return out
