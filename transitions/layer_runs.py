"""A target GPU's covers and pieces by layer class: one layer derived per run of like layers. Pure.

The decoder layers of a model have the same tensors (shapes, splits), so two layers that sit on the
same PP stage of every unit involved (``layer_class``) get the same covers from the same holders
(transitions.covers): only names and byte offsets differ. ``segments`` cuts what a target GPU holds,
in its shards' order, into fixed segments (embedding, final norm, head: derived as they are) and runs
of consecutive layers of one class, of which only the first layer is derived. Byte totals are the
first layer's times the run's length; a pair's bucket memory streams the first layer's pieces once
per layer, shifted to where that layer's slots are (``steps``: checked slot by slot, None where a
layer's slots are not the first's moved as one block), transitions.wire_stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from planner.models import Head, ModelSpec, TensorSpec
from planner.plan import Layout
from transitions.covers import Cover, covers, derive_target
from transitions.emu import EMU, UnitState, rank_shards
from transitions.geometry import Shard, StateKind, layer_stages
from transitions.layout import Slot, _slot_index
from transitions.primitives import Primitive
from transitions.transfer_plan import Piece

Covers = list[tuple[Shard, int, Cover]]


@dataclass(frozen=True, slots=True)
class Segment:
    """Fixed tensors (``layers`` None) or a run of like layers, derived for its first layer only."""

    covers: Covers
    pieces: list[Piece]
    layers: tuple[int, ...] | None

    @property
    def count(self) -> int:
        return 1 if self.layers is None else len(self.layers)


@lru_cache(maxsize=64)
def layer_tensors(model: ModelSpec, head: Head) -> dict[int, tuple[TensorSpec, ...]] | None:
    """Each decoder layer's tensors in order; None unless every layer's match the first's in shape,
    split and heads (then layer ``L``'s ``i``-th tensor stands where the first layer's ``i``-th does)."""
    out: dict[int, list[TensorSpec]] = {}
    for t in model.tensors(head):
        if t.layer is not None:
            out.setdefault(t.layer, []).append(t)
    shapes = {tuple((t.shape, t.parallel, t.num_heads) for t in ts) for ts in out.values()}
    return {k: tuple(v) for k, v in out.items()} if len(shapes) <= 1 else None


def layer_class(prim: Primitive, layer: int) -> tuple[int, ...]:
    """The PP stage of ``layer`` in every source's layout (and its final's): what its covers depend on."""
    out = []
    for s in prim.sources:
        for u in (s, s.final) if s.final is not None else (s,):
            out.append(layer_stages(u.state.model.num_layers, u.layout.pp)[layer])
    return tuple(out)


def _groups(prim: Primitive, target: EMU, gpu: int) -> list[tuple[list[Shard], tuple[int, ...] | None]]:
    """The shards ``target`` holds on ``gpu`` in order: (shards, None) for fixed tensors, (first
    layer's shards, layers) for a run of consecutive layers of one class."""
    home = target
    while home.final is not None:  # a part in final shape holds its final unit's shards (EMU.shards)
        home = home.final
    out: list[tuple[list[Shard], tuple[int, ...] | None]] = []
    run_class: tuple[int, ...] | None = None
    # blocks are maximal (never two of fixed tensors, nor two of one layer, in a row): each fixed block is
    # a group, and a layer's block starts a run or extends the open one
    for layer, shards in _rank_blocks(home.state, home.layout, home.gpus.index(gpu)):
        last = out[-1][1] if out else None
        if layer is None:
            out.append((list(shards), None))
            continue
        cls = layer_class(prim, layer)
        if last is not None and cls == run_class and layer == last[-1] + 1:
            out[-1] = (out[-1][0], (*last, layer))
            continue
        out.append((list(shards), (layer,)))
        run_class = cls
    return out


@lru_cache(maxsize=1024)
def _rank_blocks(state: UnitState, layout: Layout, rank: int) -> tuple[tuple[int | None, tuple[Shard, ...]], ...]:
    """A unit rank's shards (transitions.emu.rank_shards, in order) cut into blocks of one decoder
    layer's or of consecutive fixed tensors' (layer None): ``_groups`` walks ~80 blocks where a 70B
    rank holds ~3,000 shards. Keyed by value, bounded, like the shards it cuts."""
    spec_layer = _spec_layers(state.model, state.head)
    blocks: list[tuple[int | None, list[Shard]]] = []
    for shard in rank_shards(state, layout, rank):
        layer = spec_layer.get(shard.tensor)
        if blocks and blocks[-1][0] == layer:
            blocks[-1][1].append(shard)
        else:
            blocks.append((layer, [shard]))
    return tuple((layer, tuple(shards)) for layer, shards in blocks)


@lru_cache(maxsize=64)
def _spec_layers(model: ModelSpec, head: Head) -> dict[str, int]:
    """The decoder layer of each layer tensor."""
    return {t.name: t.layer for t in model.tensors(head) if t.layer is not None}


def segments(prim: Primitive, target: EMU, gpu: int) -> list[Segment] | None:
    """What ``target`` fills on ``gpu``, as fixed segments and runs of like layers (None: the model's
    layers differ, derive every piece instead)."""
    layers = layer_tensors(target.state.model, target.state.head)
    if layers is None:
        return None
    out = []
    for shards, run in _groups(prim, target, gpu):
        cov = covers(target, prim.sources, gpu, shards)
        out.append(Segment(cov, derive_target(target, prim.sources, gpu, covered=cov), run))
    return out


def _same_place(a: Slot, b: Slot) -> bool:
    return (a.kind, a.dtype, a.global_shape, a.offsets, a.lengths, a.order) == \
        (b.kind, b.dtype, b.global_shape, b.offsets, b.lengths, b.order)


@lru_cache(maxsize=1024)
def _run_shifts(model: ModelSpec, head: Head, layout: Layout, rank: int, kinds: tuple[StateKind, ...],
                run: tuple[int, ...]) -> dict[tuple[str, str], tuple[int, ...] | None]:
    """Per slot of ``run``'s first layer in a rank's buffer: the bytes from it to its counterpart in
    each layer of the run (None if some counterpart is not the same box of the same kind)."""
    layers = layer_tensors(model, head)
    assert layers is not None
    slots = _slot_index(model, head, layout, rank, kinds)
    out: dict[tuple[str, str], tuple[int, ...] | None] = {}
    for i, tensor in enumerate(layers[run[0]]):
        for kind in kinds:
            slot = slots.get((tensor.name, kind.value))
            if slot is None:
                continue
            others = [slots.get((layers[layer][i].name, slot.kind)) for layer in run]
            if any(o is None or not _same_place(slot, o) for o in others):
                out[slot.key] = None
            else:
                out[slot.key] = tuple(o.byte_offset - slot.byte_offset for o in others)  # type: ignore[union-attr]
    return out


def _unit_shifts(unit: EMU, gpu: int, run: tuple[int, ...]) -> dict[tuple[str, str], tuple[int, ...] | None]:
    home = unit.final if unit.final is not None else unit
    state = home.state
    return _run_shifts(state.model, state.head, home.layout, home.gpus.index(gpu), state.kinds, run)


def steps(prim: Primitive, target: EMU, gpu: int, src: int, pieces: list[Piece], run: tuple[int, ...]
          ) -> list[list[tuple[int, int]]] | None:
    """Per layer of ``run``, per piece ``src`` sends in its first layer: the (source, target) bytes the
    piece's slots sit from the first layer's; None if some layer's slots are not the first's moved."""
    src_tables = {u.uid: _unit_shifts(u, src, run) for u in prim.sources if u.holds(src)}
    dst_table = _unit_shifts(target, gpu, run)
    per_piece = []
    for p in pieces:
        ts, td = src_tables[p.src_unit].get(p.src_slot.key), dst_table.get(p.dst_slot.key)
        if ts is None or td is None:
            return None
        per_piece.append(zip(ts, td))
    return [list(layer) for layer in zip(*per_piece)]
