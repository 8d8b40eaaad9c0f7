"""Direct weight sync between two model-stages of one role (actor-train -> actor-gen, critic-train ->
critic-inf), each on its own layout and GPU set; moves only what must move.

The plan is pure and computed identically on every rank from the two StagePlans and the EMU geometry
(``transitions.geometry.unit_shards``): each destination shard takes its box from the source replica
that already holds the most of it on the same rank; boxes on the same rank are copied in memory, the
rest goes point-to-point as one contiguous buffer per (source, destination) pair. The executor of
``transitions/`` may replace this path; its plan has the same shape (tensor, box, source, destination).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from agent.engine.parallel import StageEngine
from planner.models import Head, ModelSpec
from planner.plan import StagePlan
from transitions.emu import box_intersection
from transitions.geometry import unit_shards

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, lengths)


@dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    tensor: str
    src_rank: int
    dst_rank: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


def _holders(spec: ModelSpec, head: Head, plan: StagePlan, replica: int) -> dict[str, list[tuple[int, Box]]]:
    out: dict[str, list[tuple[int, Box]]] = defaultdict(list)
    for u, rank in enumerate(plan.gpu_sets[replica]):
        for s in unit_shards(spec, head, plan.layout, u):
            out[s.tensor].append((rank, (s.offsets, s.lengths)))
    return out


def sync_plan(spec: ModelSpec, head: Head, src: StagePlan, dst: StagePlan) -> tuple[Transfer, ...]:
    """Every box every destination rank needs, and where it comes from."""
    src_holders = [_holders(spec, head, src, d) for d in range(src.dp)]
    out: list[Transfer] = []
    for d in range(dst.dp):
        for u, dst_rank in enumerate(dst.gpu_sets[d]):
            for s in unit_shards(spec, head, dst.layout, u):
                need: Box = (s.offsets, s.lengths)

                def local_elems(r: int, need: Box = need, dst_rank: int = dst_rank, name: str = s.tensor) -> int:
                    total = 0
                    for rank, box in src_holders[r][name]:
                        cut = box_intersection(need, box)
                        if cut is not None and rank == dst_rank:
                            total += Transfer(tensor=name, src_rank=rank, dst_rank=rank, offsets=cut[0],
                                              lengths=cut[1]).numel
                    return total

                # most bytes already on this rank wins; ties spread destinations over source replicas
                best = max(range(src.dp), key=lambda r: (local_elems(r), -((r - d) % src.dp)))
                # TP boxes are disjoint or identical (replicated, GQA-shared): take each box once,
                # from this rank if it holds one
                by_box: dict[Box, list[int]] = defaultdict(list)
                for rank, box in src_holders[best][s.tensor]:
                    by_box[box].append(rank)
                for box, ranks in by_box.items():
                    cut = box_intersection(need, box)
                    if cut is not None:
                        rank = dst_rank if dst_rank in ranks else ranks[u % len(ranks)]
                        out.append(Transfer(tensor=s.tensor, src_rank=rank, dst_rank=dst_rank,
                                            offsets=cut[0], lengths=cut[1]))
    return tuple(out)


def _view(local: torch.Tensor, local_box: Box, t: Transfer) -> torch.Tensor:
    v = local
    for dim, (o, k) in enumerate(zip(t.offsets, t.lengths)):
        v = v.narrow(dim, o - local_box[0][dim], k)
    return v


def _local_boxes(engine: StageEngine, kind: str) -> dict[str, tuple[torch.Tensor, Box]]:
    if engine.coord is None:
        return {}
    lay = engine.plan.layout
    u = lay.rank_of(engine.coord.tp_rank, engine.coord.pp_rank)
    boxes = {s.tensor: (s.offsets, s.lengths) for s in unit_shards(engine.spec, engine.head, lay, u)}
    return {n: (t, boxes[n]) for n, t in engine.local_tensors(kind) if n in boxes}


@torch.no_grad()
def sync_weights(src: StageEngine, dst: StageEngine, plan: tuple[Transfer, ...] | None = None,
                 kind: str = "param") -> dict[str, int]:
    """Run ``sync_plan`` (every rank calls) for parameters or one optimizer state ``kind``;
    returns the elements this rank copied locally, sent and received."""
    plan = plan if plan is not None else sync_plan(src.spec, src.head, src.plan, dst.plan)
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine_src, mine_dst = _local_boxes(src, kind), _local_boxes(dst, kind)
    sends: dict[int, list[Transfer]] = defaultdict(list)
    recvs: dict[int, list[Transfer]] = defaultdict(list)
    copied = 0
    for t in plan:
        if t.is_local and t.dst_rank == rank:
            s_tensor, s_box = mine_src[t.tensor]
            d_tensor, d_box = mine_dst[t.tensor]
            _view(d_tensor, d_box, t).copy_(_view(s_tensor, s_box, t))
            copied += t.numel
        elif t.src_rank == rank and not t.is_local:
            sends[t.dst_rank].append(t)
        elif t.dst_rank == rank and not t.is_local:
            recvs[t.src_rank].append(t)
    ops: list[dist.P2POp] = []
    bufs: list[tuple[torch.Tensor, list[Transfer]]] = []
    for peer, ts in sorted(sends.items()):
        flat = torch.cat([_view(*mine_src[t.tensor], t).reshape(-1) for t in ts])
        ops.append(dist.P2POp(dist.isend, flat, peer))
    for peer, ts in sorted(recvs.items()):
        n = sum(t.numel for t in ts)
        buf = torch.empty(n, dtype=mine_dst[ts[0].tensor][0].dtype)
        bufs.append((buf, ts))
        ops.append(dist.P2POp(dist.irecv, buf, peer))
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    for buf, ts in bufs:
        off = 0
        for t in ts:
            view = _view(*mine_dst[t.tensor], t)
            view.copy_(buf[off:off + t.numel].view_as(view))
            off += t.numel
    return {"copied_elems": copied, "sent_elems": sum(t.numel for ts in sends.values() for t in ts),
            "recv_elems": sum(t.numel for ts in recvs.values() for t in ts)}


def move_training_state(src: StageEngine, dst: StageEngine, optimizer_steps: int) -> dict[str, int]:
    """Parameters and AdamW moments of a training model-stage onto a new layout or DP degree (a
    replan), so training continues as if the layout had never changed."""
    plan = sync_plan(src.spec, src.head, src.plan, dst.plan)
    stats = sync_weights(src, dst, plan)
    for kind in ("exp_avg", "exp_avg_sq"):
        for k, v in sync_weights(src, dst, plan, kind).items():
            stats[k] += v
    if dst.is_member:
        dst.set_optimizer_steps(optimizer_steps)
    return stats
