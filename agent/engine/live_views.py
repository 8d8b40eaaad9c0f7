"""Engine tensors that live in EMU unit buffers: a parameter or an AdamW moment (of a DTensor, its
local shard) made to use its unit slot's memory, with no copy (``point_at``), every tensor of a
model-stage's engine at once (``bind_views``), a fresh unit filled from the engine's initial weights
(``fill_fresh``), and the check that a tensor's memory lies in its unit's buffer (``in_buffer``).
``agent.engine.live`` binds the engine with them.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from agent.engine.parallel import StageEngine
from planner.errors import SpecError
from transitions.executor import RankState


@torch.no_grad()
def point_at(t: torch.Tensor, view: torch.Tensor) -> None:
    """Make ``t`` (a parameter or an optimizer state; of a DTensor, its local shard) use ``view``'s
    memory: same storage, offset and strides, no copy. ``t``'s object stays (the optimizer and the
    pipeline schedules keep referring to it)."""
    local = t._local_tensor if isinstance(t, DTensor) else t  # noqa: SLF001 - the shard's own tensor
    if local.shape != view.shape or local.dtype != view.dtype:
        raise SpecError("unit", f"a {tuple(view.shape)} {view.dtype} slot cannot back a "
                        f"{tuple(local.shape)} {local.dtype} tensor")
    local.set_(view)  # type: ignore[call-overload]


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _kind_tensors(engine: StageEngine, kind: str) -> list[tuple[str, torch.Tensor]]:
    """(HF name, the tensor holding this rank's shard) for parameters or one AdamW moment."""
    assert engine.module is not None
    if kind == "param":
        return list(engine.module.named_parameters())
    return [(n, engine.optimizer_state(p)[kind]) for n, p in engine.module.named_parameters()]


def bind_views(engine: StageEngine, state: RankState) -> int:
    """Point every tensor of ``engine`` that ``state`` holds (its kinds) at ``state``'s slots; returns
    how many. Every slot but the counters must back one tensor (else the layouts disagree)."""
    bound = 0
    for kind in state.placement.kinds:
        for name, t in _kind_tensors(engine, kind.value):
            point_at(t, state.view(name, kind.value))
            bound += 1
    if bound != len(state.slots) - 1:
        raise SpecError(f"{engine.name}.module", f"backs {bound} of the {len(state.slots) - 1} shards of its "
                        f"unit rank in {engine.plan.layout}")
    return bound


@torch.no_grad()
def fill_fresh(engine: StageEngine, state: RankState) -> None:
    """A fresh start: the engine's initial weights (zero moments) into a newly allocated unit."""
    for kind in state.placement.kinds:
        for name, t in _kind_tensors(engine, kind.value):
            view = state.view(name, kind.value)
            if kind.value == "param":
                view.copy_(local_of(t))
            else:
                view.zero_()
    state.counters.zero_()


def in_buffer(t: torch.Tensor, state: RankState) -> bool:
    """Whether all of ``t``'s (local) memory lies inside ``state``'s flat buffer."""
    local = local_of(t)
    start, end = state.flat.data_ptr(), state.flat.data_ptr() + state.flat.numel()
    span = sum((n - 1) * s for n, s in zip(local.shape, local.stride())) + 1
    return start <= local.data_ptr() and local.data_ptr() + span * local.element_size() <= end
