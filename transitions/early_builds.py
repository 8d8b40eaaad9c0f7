"""Building a unit early, from the pages of the unit it is cut from: which, and what it copies. Pure.

On a worker, a node may cut its target from a donor (a TP or PP Split/Merge keeping part of a
shard) while earlier nodes send from that donor only bytes the target keeps (a TP1 -> TP2 change
sends the very half it keeps to the new replica). The target is then built right before the first
of those readers, and their reads come from it: its buffer is laid out as the receiver's, so the
sends go out as one zero-copy message instead of packed strided halves. Receivers derive the
senders' early builds themselves (``redirected``), so both ends agree on the messages.
``transitions.executor.early_build`` runs the build (moving pages where it can).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from transitions.dag_pieces import DagMemo, node_pieces
from transitions.emu import EMU, box_contains
from transitions.global_dag import TransitionDAG
from transitions.in_place_plan import cut_here
from transitions.layout import contiguous_range, unit_slots
from transitions.primitives import Merge, relabels
from transitions.transfer_plan import Piece


@dataclass(frozen=True, kw_only=True, slots=True)
class EarlyBuild:
    """On ``worker``, node ``node`` cuts ``target`` from ``donor`` (a TP or PP Split/Merge keeping
    part of a shard), and the earlier nodes ``readers`` send from the donor only bytes the target
    keeps (a TP1 -> TP2 change sends the very half it keeps to the new replica). The target is then
    built right before the first reader and those reads come from it: its buffer is laid out as the
    receiver's, so the sends go out as one zero-copy message instead of packed strided halves.

    The build moves the donor's pages where a kept run sits at the same offset within a page on both
    sides (no byte copied; page-aligned slots make that the common case) and copies the rest, strided
    rows included. Until the DAG frees the donor, a failure moves the pages back: what survives is
    what the DAG's order keeps."""

    node: int
    worker: int
    donor: str
    target: EMU
    readers: tuple[int, ...]  # nodes whose reads from the donor come from the target (incl. ``node``'s sends)
    frees_at: int  # the node that frees the donor here (``node`` or a later one)


def _original_units(dag: TransitionDAG) -> frozenset[str]:
    made = {t.uid for prim in dag.nodes for t in prim.targets}
    return frozenset(u.uid for prim in dag.nodes for u in prim.sources if u.uid not in made)


def early_builds(dag: TransitionDAG, worker: int, memo: DagMemo) -> dict[int, EarlyBuild]:
    """The early builds (``EarlyBuild``) of ``worker``, by building node. The receivers of a
    worker's sends derive the same, so both ends agree on the messages."""
    return memo.get(dag, ("early", worker), lambda: _early_builds(dag, worker, memo))


def _early_builds(dag: TransitionDAG, worker: int, memo: DagMemo) -> dict[int, EarlyBuild]:
    order = dag.nodes_on(worker)
    original = _original_units(dag)
    out: dict[int, EarlyBuild] = {}
    for i, node in enumerate(order):
        prim = dag.nodes[node]
        if relabels(prim) or sum(t.holds(worker) for t in prim.targets) != 1 or not any(
                u.holds(worker) and u.uid in original for u in prim.sources):
            continue  # not cut here from a unit held since the start (checked before deriving pieces)
        cut = cut_here(prim, [p for p in node_pieces(dag, node, worker, memo) if p.dst_worker == worker], worker)
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
            reads = [p for p in node_pieces(dag, n, worker, memo) if p.src_worker == worker and p.src_unit == donor_uid
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


def redirected(dag: TransitionDAG, node: int, worker: int, pieces: list[Piece], memo: DagMemo) -> list[Piece]:
    """``pieces`` of ``node`` as run with early builds: reads from a donor built early come from its
    target, and ``worker``'s own copies into a target it builds early are dropped (done by the build)."""
    mine = early_builds(dag, worker, memo).get(node)
    out = []
    for p in pieces:
        if mine is not None and p.src_worker == p.dst_worker == worker and p.dst_unit == mine.target.uid:
            continue
        for build in early_builds(dag, p.src_worker, memo).values():
            if p.src_unit == build.donor and node in build.readers:
                p = replace(p, src_unit=build.target.uid, src_slot=unit_slots(build.target, p.src_worker)[p.src_slot.key])
                break
        out.append(p)
    return out


def build_pieces(dag: TransitionDAG, node: int, worker: int, target: str, memo: DagMemo
                 ) -> tuple[tuple[tuple[int, int, int], ...], tuple[Piece, ...]]:
    """What an early build of ``target`` on ``worker`` copies: byte runs contiguous on both sides as
    (donor offset, target offset, bytes), back-to-back ones merged, and the strided pieces. Pure."""
    runs: list[tuple[int, int, int]] = []
    strided: list[Piece] = []
    for p in node_pieces(dag, node, worker, memo):
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


