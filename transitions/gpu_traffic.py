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
model's layers or slots do not allow it, from every piece as before. The entries reproduce
``footprints``' own derivation exactly, dict insertion order included;
tests/transitions/test_gpu_traffic.py compares them with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from transitions import transfer_plan
from transitions.covers import Cover, covers, derive_target
from transitions.emu import EMU
from transitions.geometry import Shard
from transitions.layer_runs import Segment, segments, steps
from transitions.layout import COUNTERS, COUNTERS_KIND, NUM_COUNTERS, contiguous_range
from transitions.planning_cache import PlanningCache
from transitions.primitives import Extend, Merge, Primitive, Split, target_gpus
from transitions.rank_table import unit_table
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


def _unit_key(unit: EMU, gpu: int) -> tuple[object, ...]:
    home = unit.final
    final = None if home is None else (home.state, home.layout, tuple(home.gpus.index(g) for g in unit.gpus))
    return (unit.state, unit.layout, final, _position(unit, gpu))


def dst_key(prim: Primitive, target: EMU, gpu: int) -> tuple[object, ...]:
    """``gpu``'s relative key as a GPU of ``target``: what its pieces depend on (uids only by equality)."""
    units = (target, *prim.sources)
    uids = [u.uid for u in units]
    return (_unit_key(target, gpu), tuple(_unit_key(s, gpu) for s in prim.sources),
            tuple(uids.index(u) for u in uids))


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


def dst_traffic(prim: Primitive, target: EMU, gpu: int, key: tuple[object, ...], cache: PlanningCache
                ) -> tuple[DstTraffic, list[Segment] | None]:
    """``gpu``'s entry (memoised by ``key``) and, when derived now, its segments."""
    got = cache.dst_traffic.get(key)
    if got is not None:
        return got, None
    segs = gpu_segments(prim, target, gpu)
    return cache.dst_traffic.put(key, _derive_traffic(prim, target, gpu, segs)), segs


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
    feeds: list[tuple[list[Piece], list[list[tuple[int, int]]] | None]] = []
    alone = True  # every piece a zero-copy message by itself
    for k, seg in enumerate(segs):
        mine = [p for p in seg.pieces if p.src_worker == src] if senders is None else senders[k].get(src, [])
        shifts = None
        if seg.count > 1 and mine:
            shifts = steps(prim, target, gpu, src, mine, seg.layers)  # type: ignore[arg-type]
            if shifts is None:
                return None
        alone = alone and all(_direct_alone(p) for p in mine)
        feeds.append((mine, shifts))
    if alone:
        # Every piece is contiguous on both sides and DIRECT_MIN_BYTES long, in every layer of a run
        # too (each is its first layer's moved), so every run the bucketizer coalesces goes direct; only
        # the counters may be packed, alone in a bucket that lies in place on both sides. Nothing is held.
        return PairWire((), ())
    stream = PairStream(max_bucket_bytes)
    recs: list[tuple[list[Rec], list[list[tuple[int, int]]] | None]] = []
    if counter is not None and counter.src_worker == src:
        recs.append(([stream.rec(counter)], None))
    recs += [([stream.rec(p) for p in mine], shifts) for mine, shifts in feeds]
    if cache is None:
        stream.feed_all(recs)
        return PairWire(*stream.finish())
    key = stream.content_key(recs)
    wire = cache.pair_streams.get(key)
    if wire is None:
        stream.feed_all(recs)
        wire = cache.pair_streams.put(key, PairWire(*stream.finish()))
    return wire


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
    """Whether ``p`` would go as a zero-copy message on its own (transitions.transfer_plan.messages)."""
    return p.num_bytes >= transfer_plan.DIRECT_MIN_BYTES and contiguous_range(p.src_slot, p.box) is not None \
        and contiguous_range(p.dst_slot, p.box) is not None


def _wire(prim: Primitive, target: EMU, gpu: int, src: int, segs: list[Segment], counter: Piece | None,
          cache: PlanningCache, senders: list[dict[int, list[Piece]]] | None = None) -> PairWire:
    wire = streamed(prim, target, gpu, src, segs, counter, cache=cache, senders=senders)
    if wire is not None:
        return wire
    every = ([] if counter is None else [counter]) + derive_target(target, prim.sources, gpu)
    return pair_wire([p for p in every if p.src_worker == src])


def dst_wires(prim: Primitive, target: EMU, gpu: int, key: tuple[object, ...], entry: DstTraffic,
              segs: list[Segment] | None, cache: PlanningCache) -> list[tuple[int, PairWire]]:
    """Per GPU sending to ``gpu`` (covers and counters), that pair's wire, memoised by ``key`` and the
    sender's position in every source; ``gpu``'s segments are derived once, on the first miss."""
    senders = [prim.sources[k].gpus[i] for (k, i), _ in entry.received]
    if entry.counter is not None:
        senders.insert(0, prim.sources[entry.counter[0]].gpus[entry.counter[1]])
    counter = None if entry.counter is None else _counter_piece(prim, target, gpu, entry.counter)
    out: list[tuple[int, PairWire]] = []
    by_src: list[dict[int, list[Piece]]] | None = None
    for src in dict.fromkeys(senders):
        pkey = (key, tuple(_position(s, src) for s in prim.sources))
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
    for target in prim.targets:
        for gpu in target_gpus(prim, target):
            key = dst_key(prim, target, gpu)
            entry, segs = dst_traffic(prim, target, gpu, key, cache)
            if entry.local is not None:
                local[gpu] = entry.local
            for (k, i), nbytes in entry.received:
                src = prim.sources[k].gpus[i]
                pair[(src, gpu)] = pair.get((src, gpu), 0) + nbytes
            if buffers:
                for src, wire in dst_wires(prim, target, gpu, key, entry, segs, cache):
                    add_rounds(rounds, src, wire.sent)
                    add_rounds(rounds, gpu, wire.received)
    held = {g: peak_bytes(rounds[g]) for g in sorted(rounds)} if pair else {}
    return local, pair, {g: n for g, n in held.items() if n}
