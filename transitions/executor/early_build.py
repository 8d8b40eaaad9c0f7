"""Building a unit early, from the pages of the unit it is cut from (CPU): the build and its undo.

``transitions.early_builds`` decides which builds a worker makes (pure, derived alike by the
receivers); here the kept runs change buffers as pages where they sit at the same offset within a
page on both sides, the rest is copied, and until the DAG frees the donor a failure gives the pages
back (``Built.undo``), so the survivors are exactly those of the DAG's order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from transitions.dag_pieces import DagMemo
from transitions.early_builds import EarlyBuild, build_pieces
from transitions.executor.buffers import MAP_MIN_BYTES, RankState, allocate_unit, piece_view
from transitions.executor.pages import PagesMoved, move_or_copy
from transitions.global_dag import TransitionDAG
from transitions.layout import PAGE_BYTES


@dataclass(slots=True)
class Built(PagesMoved):
    """An early build done, kept until the DAG frees its donor so a failure can undo it."""

    build: EarlyBuild
    target: RankState


def build_early(build: EarlyBuild, units: dict[str, RankState], dag: TransitionDAG, memo: DagMemo) -> Built:
    """Make ``build``'s target from its donor's pages and bytes; undone on failure."""
    start = time.perf_counter()
    worker = build.worker
    donor = units[build.donor]
    target = allocate_unit(build.target, worker, donor.flat.device)
    done = Built(build=build, target=target)
    runs, strided = build_pieces(dag, build.node, worker, build.target.uid, memo)
    src, dst = donor.flat.data_ptr(), target.flat.data_ptr()
    # pages move only between mappings of our own (``alloc_bytes``), never in or out of malloc's heap
    pages = (target.flat.device.type == "cpu" and (src - dst) % PAGE_BYTES == 0
             and min(donor.flat.numel(), target.flat.numel()) >= MAP_MIN_BYTES)
    try:
        for s, d, n in runs:
            done.copied += move_or_copy(dst + d, src + s, n, done.moved, pages)[0]
        for p in strided:
            piece_view(target, p.dst_slot, p.box).copy_(piece_view(donor, p.src_slot, p.box))
            done.copied += p.num_bytes
    except BaseException:
        done.undo()
        raise
    units[build.target.uid] = target
    done.seconds = time.perf_counter() - start
    return done

