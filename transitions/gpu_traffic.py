"""A Split's, Merge's or Extend's traffic and bucket memory, derived per target GPU and memoised there. Pure.

What a target GPU ``d`` receives depends on the units alone, not on which GPUs they sit on: its
shards and slots follow from the target's layout and ``d``'s rank, its covers (transitions.covers)
from each source's layout, ``d``'s rank in it (the local pieces) and the ranks of the holders tried.
So a primitive's footprint splits into one entry per target GPU, found by that GPU's *relative key*
(every unit's state, layout, the rank map of its ``final`` and ``d``'s position in it): the bytes
copied on ``d`` and received from each source position (``DstTraffic``). The bucket memory splits
the same way: the bucketizer (transitions.transfer_plan.messages) handles each (src, dst) pair on its
own, so a pair's rounds of packed bytes (``PairWire``) are a function of ``d``'s key and the sender's
positions in the sources. An entry is derived by runs of like layers (transitions.layer_runs: one
layer's covers and pieces per run, byte totals times the run's length) and each pair's rounds by
streaming that layer over the run (transitions.wire_stream, repeating periods skipped); where a
model's layers or slots do not allow it, from every piece as before. Where every unit (and final)
has one TP degree and the model's TP boxes are regular (``tp_frame``), the ranks of a TP group are
symmetric: a key is taken relative to ``d``'s TP rank (every position moved back by it), so one
derivation serves the whole group, its roles moved to each GPU's. The entries reproduce
``footprints``' own derivation exactly, dict insertion order included;
tests/transitions/test_gpu_traffic.py and test_gpu_traffic_frame.py compare them with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from planner.models import Head, ModelSpec, Parallel
from transitions import transfer_plan
from transitions.covers import Cover, covers, derive_target
from transitions.emu import EMU
from transitions.geometry import Shard, tp_box
from transitions.layer_runs import Segment, by_layer, piece_steps, segments
from transitions.layout import COUNTERS, COUNTERS_KIND, NUM_COUNTERS, contiguous_range
from transitions.planning_cache import PlanningCache
from transitions.primitives import Extend, Merge, Primitive, Split, target_gpus
from transitions.rank_table import _rules, unit_table
from transitions.transfer_plan import Piece, messages
from transitions.wire_stream import PairStream, Rec, per_round

Role = tuple[int, int]  # (source index, position in its GPUs): a source GPU relative to the units
Covers = list[tuple[Shard, int, Cover]]  # transitions.covers.covers of one target GPU


@dataclass(frozen=True, slots=True)
class DstTraffic:
    """What one target GPU copies locally (None: no local piece) and receives per source role, in
    the order ``footprints._traffic`` meets them; ``counter``: the role its counters come from."""

    local: int | None
    received: tuple[tuple[Role, int], ...]
    counter: Role | None


@dataclass(frozen=True, slots=True)
class PairWire:
    """Per round, the packed (not in place) bytes of one pair's messages on the sender and the receiver
    (transitions.transfer_plan.in_flight_bytes counts exactly these)."""

    sent: tuple[int, ...]
    received: tuple[int, ...]


def applies(prim: Primitive) -> bool:
    """Split, Merge and Extend whose targets share no GPU (every target GPU is filled by one target;
    a Merge's one target on the GPUs no part in final shape holds, ``target_gpus``)."""
    if not isinstance(prim, Split | Merge | Extend):
        return False
    gpus = [g for t in prim.targets for g in t.gpus]
    return len(set(gpus)) == len(gpus)


def _position(unit: EMU, gpu: int) -> int:
    return unit.gpus.index(gpu) if gpu in unit.gpus else -1


def _moved(position: int, tp: int, by: int) -> int:
    """A unit position (rank) with its TP coordinate moved by ``by`` mod ``tp``, its PP one kept; -1 (not
    in the unit) stays."""
    if position < 0:
        return position
    x = position % tp
    return position - x + (x + by) % tp


def _unit_key(unit: EMU, gpu: int, tp: int, by: int) -> tuple[object, ...]:
    home = unit.final
    final = None if home is None else (home.state, home.layout, tuple(home.gpus.index(g) for g in unit.gpus))
    return (unit.state, unit.layout, final, _moved(_position(unit, gpu), tp, by))


def dst_key(prim: Primitive, target: EMU, gpu: int, tp: int, by: int) -> tuple[object, ...]:
    """``gpu``'s relative key as a GPU of ``target``: what its pieces depend on (uids only by equality),
    its positions moved by ``by`` mod ``tp`` (1, 0: as they are; with ``tp_frame(prim) == tp`` and
    ``by = -tp_rank(...)``, its TP group's key)."""
    units = (target, *prim.sources)
    uids = [u.uid for u in units]
    return (_unit_key(target, gpu, tp, by), tuple(_unit_key(s, gpu, tp, by) for s in prim.sources),
            tuple(uids.index(u) for u in uids))


@lru_cache(maxsize=256)
def regular(model: ModelSpec, head: Head, tp: int) -> bool:
    """Whether every tensor's box on TP rank ``r`` of ``tp`` is rank 0's moved by ``r`` times its length
    along the split dim (a replicated one: the same on every rank), none empty (geometry.tp_box). Then
    every rank's buffer has the same slots at the same byte offsets (transitions.rank_table: sizes
    from lengths), only the boxes moved: no uneven chunks, no kv heads shared by a group of ranks."""
    if tp < 2:
        return False
    for tensor in _rules(model, head)[1]:
        (offsets, lengths) = base = tp_box(tensor, model, tp, 0)
        if 0 in lengths:
            return False
        dim = 1 if tensor.parallel is Parallel.ROW else 0
        for r in range(1, tp):
            box = tp_box(tensor, model, tp, r)
            if tensor.parallel is Parallel.REPLICATED:
                moved = base
            else:
                at = list(offsets)
                at[dim] += r * lengths[dim]
                moved = (tuple(at), lengths)
            if box != moved:
                return False
    return True


@lru_cache(maxsize=1024)
def _commutes(ranks: tuple[int, ...], tp: int) -> bool:
    """Whether a unit's map to its final's positions commutes with moving TP coordinates by one (both
    TP ``tp``): then with moving them by any amount."""
    return len(ranks) % tp == 0 and all(ranks[_moved(i, tp, 1)] == _moved(r, tp, 1) for i, r in enumerate(ranks))


def tp_frame(prim: Primitive) -> int | None:
    """The TP degree ``tp`` under which ``prim``'s target GPUs of one TP group are symmetric, else None.

    It holds when every unit and its final have TP ``tp`` >= 2 (finals of depth one, maps commuting
    with moving TP ranks), one model and head, ``regular`` boxes. Then a rank's box of a split tensor
    overlaps ``d``'s iff it has ``d``'s TP coordinate (a replicated one: every box is whole), so moving
    every position's TP coordinate by ``a`` (mod ``tp``) maps the boxes a cover takes onto the moved
    GPU's, moved by ``a`` times their length along the split dim, and keeps the others apart. It keeps
    every slot's byte offset (``regular``), which units hold the GPU, the holders' rank-aligned order
    (transitions.covers: TP rank ``(t + i) % tp`` becomes ``(t + a + i) % tp``) and every box relative
    to its slot: the covers, pieces and bucketized rounds of the moved GPU are the same, its sources'
    positions moved by ``a``. Only the counters' role (``_counter_role``: a position modulo the first
    source's size) does not follow; it is found for each GPU itself."""
    units = [*prim.targets, *prim.sources]
    levels = [v for u in units for v in ((u,) if u.final is None else (u, u.final))]
    shapes = {(v.layout.tp, v.state.model, v.state.head) for v in levels}
    if len(shapes) != 1:
        return None
    ((tp, model, head),) = shapes
    for u in units:
        home = u.final
        if home is not None and (home.final is not None
                                 or not _commutes(tuple(home.gpus.index(g) for g in u.gpus), tp)):
            return None
    return tp if regular(model, head, tp) else None


def tp_rank(target: EMU, gpu: int, tp: int) -> int:
    """``gpu``'s TP rank in ``target``'s owner (its final if any): the one covers aligns holders to."""
    owner = target.final if target.final is not None else target
    return owner.gpus.index(gpu) % tp


def _counter_role(prim: Primitive, target: EMU, gpu: int) -> Role | None:
    """The source role ``gpu``'s counters come from (transitions.covers.counter_pieces), None if local."""
    if any(s.holds(gpu) for s in prim.sources):
        return None
    first = prim.sources[0]
    return 0, target.gpus.index(gpu) % len(first.gpus)


def gpu_segments(prim: Primitive, target: EMU, gpu: int) -> list[Segment]:
    """``gpu``'s covers and pieces by runs of like layers (transitions.layer_runs), else all at once."""
    segs = segments(prim, target, gpu)
    if segs is None:
        cov = covers(target, prim.sources, gpu)
        segs = [Segment(cov, derive_target(target, prim.sources, gpu, covered=cov), None)]
    return segs


def _derive_traffic(prim: Primitive, target: EMU, gpu: int, segs: list[Segment]) -> DstTraffic:
    """``gpu``'s traffic from its covers, as footprints._traffic sums them (a run's layers alike); a
    piece's role is its source unit and the holder's position there."""
    index = {id(s): k for k, s in enumerate(prim.sources)}
    local: int | None = None
    received: dict[Role, int] = {}
    for seg in segs:
        for shard, dim, cover in seg.covers:
            row_bytes = shard.num_bytes // shard.lengths[dim] * seg.count
            for src_unit, src, _, lo, hi in cover:
                nbytes = row_bytes * (hi - lo)
                if src == gpu:
                    local = (local or 0) + nbytes
                else:
                    role = (index[id(src_unit)], src_unit.gpus.index(src))
                    received[role] = received.get(role, 0) + nbytes
    return DstTraffic(local, tuple(received.items()), _counter_role(prim, target, gpu))


def dst_traffic(prim: Primitive, target: EMU, gpu: int, key: tuple[object, ...], cache: PlanningCache,
                tp: int, by: int) -> tuple[DstTraffic, list[Segment] | None]:
    """``gpu``'s entry (memoised by ``key``) and, when derived now, its segments. ``key`` is ``dst_key``'s
    with positions moved by ``-by`` mod ``tp`` (``tp_frame``: its TP group's; 1, 0: its own): the memo
    holds the entry with its roles moved alike, moved back by ``by`` here, the counters' role (which
    does not follow the move) found for ``gpu`` itself."""
    got = cache.dst_traffic.get(key)
    if got is not None:
        return DstTraffic(got.local, _moved_roles(got.received, tp, by), _counter_role(prim, target, gpu)), None
    segs = gpu_segments(prim, target, gpu)
    entry = _derive_traffic(prim, target, gpu, segs)
    cache.dst_traffic.put(key, DstTraffic(entry.local, _moved_roles(entry.received, tp, -by), None))
    return entry, segs


def _moved_roles(received: tuple[tuple[Role, int], ...], tp: int, by: int) -> tuple[tuple[Role, int], ...]:
    return tuple([((k, _moved(i, tp, by)), n) for (k, i), n in received])


def _counter_piece(prim: Primitive, target: EMU, gpu: int, role: Role) -> Piece:
    src = prim.sources[role[0]]
    src_gpu = src.gpus[role[1]]
    key = (COUNTERS, COUNTERS_KIND)
    return Piece(src_worker=src_gpu, dst_worker=gpu, src_slot=unit_table(src, src_gpu).slot(key),
                 dst_slot=unit_table(target, gpu).slot(key), box=((0,), (NUM_COUNTERS,)), src_unit=src.uid,
                 dst_unit=target.uid)


def pair_wire(pieces: list[Piece], max_bucket_bytes: int | None = None) -> PairWire:
    """The rounds of packed bytes of the one pair ``pieces`` cross, from the bucketizer itself (buckets
    of transitions.transfer_plan.DEFAULT_BUCKET_BYTES unless given, as footprints.wire_buffers)."""
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    bucket = transfer_plan.DEFAULT_BUCKET_BYTES if max_bucket_bytes is None else max_bucket_bytes
    for m in messages(pieces, bucket):
        if m.src_start is None:
            sent[m.round] = sent.get(m.round, 0) + m.num_bytes
        if m.dst_start is None:
            received[m.round] = received.get(m.round, 0) + m.num_bytes
    return PairWire(*per_round(sent, received))


def streamed(prim: Primitive, target: EMU, gpu: int, src: int, segs: list[Segment], counter: Piece | None,
             max_bucket_bytes: int | None = None, cache: PlanningCache | None = None,
             senders: list[dict[int, list[Piece]]] | None = None) -> PairWire | None:
    """The pair ``src -> gpu``'s wire, each run of like layers streamed from its first layer's pieces
    (transitions.wire_stream); None if some layer's slots are not the first's shifted. With ``cache``,
    memoised by the stream's own input (``PairStream.content_key``): pairs of other target GPUs whose
    pieces lie alike in their buffers (middle PP stages, TP ranks) share one streaming. ``senders``:
    ``by_sender(segs)``, when the caller streams several senders' pairs of these segments."""
    feeds: list[tuple[list[Piece], list[tuple[tuple[int, ...], tuple[int, ...]]] | None]] = []
    alone = True  # every piece a zero-copy message by itself
    for k, seg in enumerate(segs):
        mine = [p for p in seg.pieces if p.src_worker == src] if senders is None else senders[k].get(src, [])
        moves = None
        if seg.count > 1 and mine:
            moves = piece_steps(prim, target, gpu, src, mine, seg.layers)  # type: ignore[arg-type]
            if moves is None:
                return None
        alone = alone and all(_direct_alone(p) for p in mine)
        feeds.append((mine, moves))
    if alone:
        # Every piece is contiguous on both sides and DIRECT_MIN_BYTES long, in every layer of a run
        # too (each is its first layer's moved), so every run the bucketizer coalesces goes direct; only
        # the counters may be packed, alone in a bucket that lies in place on both sides. Nothing is held.
        return PairWire((), ())
    stream = PairStream(max_bucket_bytes)
    head = [stream.rec(counter)] if counter is not None and counter.src_worker == src else []
    recs = [[stream.rec(p) for p in mine] for mine, _ in feeds]
    if cache is None:
        stream.feed_all(_laid_out(head, recs, feeds))
        return PairWire(*stream.finish())
    # the stream's input: its records as fed one by one (``content_key``; the counters, if any, first),
    # then each run's moves by piece as they are (the moves by layer, not laid out: most pairs are met again)
    key = (stream.content_key([(head, None), *[(r, None) for r in recs]]),
           tuple([None if m is None else tuple(m) for _, m in feeds]))
    wire = cache.pair_streams.get(key)
    if wire is None:
        stream.feed_all(_laid_out(head, recs, feeds))
        wire = cache.pair_streams.put(key, PairWire(*stream.finish()))
    return wire


def _laid_out(head: list[Rec], recs: list[list[Rec]],
              feeds: list[tuple[list[Piece], list[tuple[tuple[int, ...], tuple[int, ...]]] | None]]
              ) -> list[tuple[list[Rec], list[list[tuple[int, int]]] | None]]:
    """What ``PairStream.feed_all`` takes: the counters' records (if any) one by one, then each segment's,
    a run's with its moves laid out by layer (transitions.layer_runs.by_layer)."""
    return [(head, None), *[(r, None if m is None else by_layer(m)) for r, (_, m) in zip(recs, feeds)]]


def by_sender(segs: list[Segment]) -> list[dict[int, list[Piece]]]:
    """Per segment, its pieces by sending GPU, in their order (what ``streamed`` picks for one sender)."""
    out: list[dict[int, list[Piece]]] = []
    for seg in segs:
        mine: dict[int, list[Piece]] = {}
        for p in seg.pieces:
            mine.setdefault(p.src_worker, []).append(p)
        out.append(mine)
    return out


def _direct_alone(p: Piece) -> bool:
    """Whether ``p`` would go as a zero-copy message on its own (transitions.transfer_plan.messages): a
    box as long as its slot is the whole slot (a piece lies within both), contiguous without asking."""
    box, src, dst = p.box, p.src_slot, p.dst_slot
    return p.num_bytes >= transfer_plan.DIRECT_MIN_BYTES \
        and (box[1] == src.lengths or contiguous_range(src, box) is not None) \
        and (box[1] == dst.lengths or contiguous_range(dst, box) is not None)


def _wire(prim: Primitive, target: EMU, gpu: int, src: int, segs: list[Segment], counter: Piece | None,
          cache: PlanningCache, senders: list[dict[int, list[Piece]]] | None = None) -> PairWire:
    wire = streamed(prim, target, gpu, src, segs, counter, cache=cache, senders=senders)
    if wire is not None:
        return wire
    every = ([] if counter is None else [counter]) + derive_target(target, prim.sources, gpu)
    return pair_wire([p for p in every if p.src_worker == src])


def dst_wires(prim: Primitive, target: EMU, gpu: int, key: tuple[object, ...], entry: DstTraffic,
              segs: list[Segment] | None, cache: PlanningCache, tp: int, by: int) -> list[tuple[int, PairWire]]:
    """Per GPU sending to ``gpu`` (covers and counters), that pair's wire, memoised by ``key``, the
    sender's position in every source (moved by ``-by`` with ``key``, ``dst_traffic``) and whether it
    sends the counters; ``gpu``'s segments are derived once, on the first miss."""
    senders = [prim.sources[k].gpus[i] for (k, i), _ in entry.received]
    counter = None if entry.counter is None else _counter_piece(prim, target, gpu, entry.counter)
    if counter is not None:
        senders.insert(0, counter.src_worker)
    out: list[tuple[int, PairWire]] = []
    by_src: list[dict[int, list[Piece]]] | None = None
    for src in dict.fromkeys(senders):
        pkey = (key, tuple([_moved(_position(s, src), tp, -by) for s in prim.sources]),
                counter is not None and counter.src_worker == src)
        wire = cache.pair_wires.get(pkey)
        if wire is None:
            segs = gpu_segments(prim, target, gpu) if segs is None else segs
            by_src = by_sender(segs) if by_src is None else by_src  # once for every sender missed
            wire = cache.pair_wires.put(pkey, _wire(prim, target, gpu, src, segs, counter, cache, by_src))
        out.append((src, wire))
    return out


def peak_bytes(rounds: list[int]) -> int:
    """The most two consecutive rounds hold (transitions.transfer_plan.in_flight_bytes)."""
    return max((rounds[r] + (rounds[r + 1] if r + 1 < len(rounds) else 0) for r in range(len(rounds))), default=0)


def add_rounds(into: dict[int, list[int]], gpu: int, rounds: tuple[int, ...]) -> None:
    have = into.setdefault(gpu, [])
    if len(have) < len(rounds):
        have.extend([0] * (len(rounds) - len(have)))
    for r, n in enumerate(rounds):
        have[r] += n


def traffic(prim: Primitive, cache: PlanningCache, buffers: bool = True
            ) -> tuple[dict[int, int], dict[tuple[int, int], int], dict[int, int]]:
    """``prim``'s (local bytes, pair bytes, bucket memory) as transitions.footprints derives them from
    every piece, from the memoised entries of its target GPUs (``applies(prim)`` must hold); without
    ``buffers`` the bucket memory is left out (empty)."""
    local: dict[int, int] = {}
    pair: dict[tuple[int, int], int] = {}
    rounds: dict[int, list[int]] = {}
    tp = tp_frame(prim) or 1  # 1: every GPU its own key
    for target in prim.targets:
        for gpu in target_gpus(prim, target):
            by = tp_rank(target, gpu, tp)
            key = dst_key(prim, target, gpu, tp, -by)
            entry, segs = dst_traffic(prim, target, gpu, key, cache, tp, by)
            if entry.local is not None:
                local[gpu] = entry.local
            for (k, i), nbytes in entry.received:
                src = prim.sources[k].gpus[i]
                pair[(src, gpu)] = pair.get((src, gpu), 0) + nbytes
            if buffers:
                for src, wire in dst_wires(prim, target, gpu, key, entry, segs, cache, tp, by):
                    add_rounds(rounds, src, wire.sent)
                    add_rounds(rounds, gpu, wire.received)
    held = {g: peak_bytes(rounds[g]) for g in sorted(rounds)} if pair else {}
    return local, pair, {g: n for g, n in held.items() if n}
