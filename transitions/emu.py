"""Elastic Model Units: a model-stage's replica on a GPU set, and the exact shards on each of its GPUs.

An EMU is (model-stage state, Layout, GPU set in unit rank order, version). DP lives outside the unit:
a model-stage's DP degree is its number of EMUs. Its shards come from transitions.geometry, never
stored by hand. A T_sub *part* on its way into a Merge carries ``final`` (the merged unit): it holds
on each GPU exactly what ``final`` will hold there, so Split and Extend deliver bytes in their final
shape and the Merge only relabels them (shards already on their target rank are never copied twice).

Also here: T_sub (the largest layout two layouts both split into) and the strided placement of a
unit's T_sub parts on its GPUs, which keeps every GPU on a part rank whose state contains its own.
Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import gcd

from planner.errors import SpecError
from planner.models import Head, ModelSpec
from planner.plan import Layout
from planner.workflow import JobSpec, Role, StageKind
from transitions.geometry import (
    Shard,
    StateKind,
    layout_rank_bytes,
    rank_shard_tuple,
    state_kinds,
)

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, lengths) in global coordinates
StateKey = tuple[str, StateKind]  # (tensor name, state kind)


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitState:
    """What every unit of one model-stage holds: which model, which head, which state kinds."""

    model_stage: str
    stage_kind: StageKind
    role: Role
    model: ModelSpec
    head: Head
    kinds: tuple[StateKind, ...]

    def __post_init__(self) -> None:
        if not self.kinds or StateKind.PARAM not in self.kinds:
            raise SpecError(f"{self.model_stage}.kinds", f"must include param, got {self.kinds}",
                            ", ".join(k.value for k in StateKind))

    @property
    def stage_order(self) -> int:
        return self.stage_kind.order


def job_states(job: JobSpec, keep_grads: bool = False) -> dict[str, UnitState]:
    """The UnitState of every model-stage of a job (training stages hold master weights and Adam)."""
    return {
        ms.name: UnitState(model_stage=ms.name, stage_kind=ms.kind, role=ms.role, model=job.model_of(ms),
                           head=ms.role.head, kinds=state_kinds(ms.kind, keep_grads))
        for ms in job.workflow.model_stages
    }


@dataclass(frozen=True, kw_only=True, slots=True)
class EMU:
    """One replica of a model-stage. ``uid`` names it in DAGs, logs and the daemon's store."""

    uid: str
    state: UnitState
    layout: Layout
    gpus: tuple[int, ...]  # unit rank order: pp_rank * tp + tp_rank
    version: int
    final: EMU | None = None  # set on a T_sub part headed into a Merge: holds final's shards

    def __post_init__(self) -> None:
        if len(self.gpus) != self.layout.size:
            raise SpecError(f"{self.uid}.gpus", f"{len(self.gpus)} GPUs for layout {self.layout}",
                            f"exactly {self.layout.size}")
        if len(set(self.gpus)) != len(self.gpus):
            raise SpecError(f"{self.uid}.gpus", f"repeats a GPU: {self.gpus}")
        if self.final is not None and not set(self.gpus) <= set(self.final.gpus):
            raise SpecError(f"{self.uid}.final", "a part must sit on GPUs of the unit it merges into")

    @property
    def model_stage(self) -> str:
        return self.state.model_stage

    def rank_of(self, gpu: int) -> int:
        return self.gpus.index(gpu)

    def holds(self, gpu: int) -> bool:
        return gpu in self.gpus

    def shards(self, gpu: int) -> tuple[Shard, ...]:
        """Every shard this unit holds on ``gpu`` (empty if the GPU is not in the unit)."""
        if gpu not in self.gpus:
            return ()
        if self.final is not None:
            return self.final.shards(gpu)
        return rank_shards(self.state, self.layout, self.gpus.index(gpu))

    def boxes(self, gpu: int) -> dict[StateKey, Box]:
        if gpu not in self.gpus:
            return {}
        if self.final is not None:
            return self.final.boxes(gpu)
        return rank_boxes(self.state, self.layout, self.gpus.index(gpu))

    def bytes_on(self, gpu: int) -> int:
        if gpu not in self.gpus:
            return 0
        if self.final is not None:
            return self.final.bytes_on(gpu)
        return rank_bytes(self.state, self.layout)[self.gpus.index(gpu)]

    def total_bytes(self) -> int:
        return sum(self.bytes_on(g) for g in self.gpus)

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {"uid": self.uid, "model_stage": self.model_stage, "tp": self.layout.tp,
                                  "pp": self.layout.pp, "gpus": list(self.gpus), "version": self.version}
        if self.final is not None:
            out["final"] = self.final.uid
        return out


# --- cached geometry per (state, layout, rank) ----------------------------------------------------


@lru_cache(maxsize=65536)
def rank_shards(state: UnitState, layout: Layout, rank: int) -> tuple[Shard, ...]:
    return rank_shard_tuple(state.model, state.head, layout, rank, state.kinds)


@lru_cache(maxsize=65536)
def rank_boxes(state: UnitState, layout: Layout, rank: int) -> dict[StateKey, Box]:
    return {s.key: (s.offsets, s.lengths) for s in rank_shards(state, layout, rank)}


def rank_bytes(state: UnitState, layout: Layout) -> tuple[int, ...]:
    """Bytes each unit-local rank holds (the unit's memory footprint per GPU): the sum of its shards'
    bytes, from the TP boxes without building the shards (transitions.geometry.layout_rank_bytes,
    memoised there; a unit's memory is asked of plans whose shards nothing else needs)."""
    return layout_rank_bytes(state.model, state.head, layout, state.kinds)


# --- T_sub and strided part placement -------------------------------------------------------------


def t_sub(a: Layout, b: Layout) -> Layout:
    """The largest layout both ``a`` and ``b`` split into. gcd keeps it valid: if both TP degrees divide
    the heads, ffn and (or are multiples of) the kv heads, so does their gcd."""
    return Layout(gcd(a.tp, b.tp), gcd(a.pp, b.pp))


def split_factors(layout: Layout, sub: Layout) -> tuple[int, int]:
    if layout.tp % sub.tp or layout.pp % sub.pp:
        raise SpecError("layout", f"{layout} does not split into {sub}")
    return layout.tp // sub.tp, layout.pp // sub.pp


def part_gpus(layout: Layout, gpus: tuple[int, ...], sub: Layout, a: int, b: int) -> tuple[int, ...]:
    """GPUs of part (a, b) of a ``layout`` unit split into ``sub``, in the part's rank order.

    Strided: part rank (r', s') sits on the unit's rank (r' * k_tp + a, s' * k_pp + b). That rank's TP
    chunk lies inside the part's TP chunk r' and its layers inside the part's stage s' (when the splits
    nest), so every GPU already holds a share of what it needs and Merge needs no copies.
    """
    k_tp, k_pp = split_factors(layout, sub)
    out = []
    for s in range(sub.pp):
        for r in range(sub.tp):
            out.append(gpus[layout.rank_of(r * k_tp + a, s * k_pp + b)])
    return tuple(out)


def part_indices(layout: Layout, sub: Layout) -> list[tuple[int, int]]:
    k_tp, k_pp = split_factors(layout, sub)
    return [(a, b) for b in range(k_pp) for a in range(k_tp)]


def box_intersection(x: Box, y: Box) -> Box | None:
    offs, lens = [], []
    for o1, n1, o2, n2 in zip(x[0], x[1], y[0], y[1]):
        lo, hi = max(o1, o2), min(o1 + n1, o2 + n2)
        if hi <= lo:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return tuple(offs), tuple(lens)


def box_contains(outer: Box, inner: Box) -> bool:
    return all(o1 <= o2 and o2 + n2 <= o1 + n1
               for o1, n1, o2, n2 in zip(outer[0], outer[1], inner[0], inner[1]))


@lru_cache(maxsize=4096)
def parts_nest(state: UnitState, sub: Layout, final: Layout) -> bool:
    """True if every rank of a ``final`` unit holds a subset of its strided ``sub`` part rank's state
    (then a full part on the right GPUs can be merged by local slicing alone)."""
    k_tp, k_pp = split_factors(final, sub)
    for rank in range(final.size):
        tp_rank, pp_rank = final.coords(rank)
        sub_rank = sub.rank_of(tp_rank // k_tp, pp_rank // k_pp)
        outer = rank_boxes(state, sub, sub_rank)
        for key, box in rank_boxes(state, final, rank).items():
            if key not in outer or not box_contains(outer[key], box):
                return False
    return True
