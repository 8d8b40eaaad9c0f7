"""Rounds of posted sends and receives: how one worker runs one node's ``Step`` (torch).

Rounds are pipelined: round r+1 is posted before round r is waited for and unpacked, so at most two
rounds of buckets live, at most ``max_bucket_bytes`` per pair per round. In each round receives and
in-place sends are posted before the buckets are packed; local copies run once the last round is
posted. Bucket buffers come from a per-transition ``BucketPool`` and are reused once unpacked, since
first-touching fresh pages costs more than the packing itself.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from transitions.channel import DataChannel, InFlight, P2POp
from transitions.executor.buffers import RankState, alloc_bytes, piece_view, typed
from transitions.transfer_plan import Message, Piece, Step

Resolve = Callable[[Piece, bool], RankState]  # (piece, is_source) -> the rank state it reads/writes
OnRound = Callable[[str, int], None]  # (model_stage, round), before each round: progress, fault injection


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
    bytes_restored: int = 0  # of a Restore node: bytes read from the checkpoint


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


def post_round(step: Step, rnd: int, worker: int, resolve: Resolve, channel: DataChannel,
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
            for p, off in zip(m.pieces, m.layout):
                typed(buf, off, p).copy_(piece_view(resolve(p, True), p.src_slot, p.box))
            sends.append(P2POp(peer=m.dst_worker, tensor=buf, is_send=True))
        out.pack_s = time.perf_counter() - start
        out.handles.append(channel.start(sends))
    return out


def run_step(step: Step, worker: int, resolve: Resolve, channel: DataChannel, timeout_s: float | None,
              on_round: OnRound | None, pool: BucketPool | None = None,
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
            posted = post_round(step, rnd, worker, resolve, channel, counts, pool)
            pack_s += posted.pack_s
        if rnd == max(step.num_rounds - 1, 0):
            # once every round is posted: copies overlap the last transfers and never hold back a
            # round the peers wait for (the sender's packing, not the copies, paces the receivers)
            copy_start = time.perf_counter()
            copied = local_copies(step, worker, resolve)
            copy_s = time.perf_counter() - copy_start
            for rider in riders:
                rider_start = time.perf_counter()
                local_copies(rider, worker, resolve)
                rider_s.append(time.perf_counter() - rider_start)
        if in_flight is not None:
            for handle in in_flight.handles:
                handle.wait(timeout_s)
            unpack_start = time.perf_counter()
            for m, buf in in_flight.unpack:
                for p, off in zip(m.pieces, m.layout):
                    piece_view(resolve(p, False), p.dst_slot, p.box).copy_(typed(buf, off, p))
            unpack_s += time.perf_counter() - unpack_start
            pool.give(in_flight.buffers)  # the round's buckets are free for the next rounds
        in_flight = posted
    report = StepReport(model_stage=step.model_stage, primitive=step.primitive, predicted_s=step.predicted_s,
                        measured_s=time.perf_counter() - start - sum(rider_s), bytes_sent=counts["sent"],
                        bytes_received=counts["received"], bytes_copied_locally=copied,
                        peak_bucket_bytes=pool.peak_bytes if counts["sent"] or counts["received"] else 0,
                        local_copy_s=copy_s, pack_s=pack_s, unpack_s=unpack_s)
    return report, rider_s


def local_copies(step: Step, worker: int, resolve: Resolve) -> int:
    copied = 0
    for p in step.local:
        if p.dst_worker != worker:
            continue
        piece_view(resolve(p, False), p.dst_slot, p.box).copy_(piece_view(resolve(p, True), p.src_slot, p.box))
        copied += p.num_bytes
    return copied

