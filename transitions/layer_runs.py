"""A target GPU's covers and pieces by layer class: one layer derived per run of like layers. Pure.

The decoder layers of a model have the same tensors (shapes, splits), so two layers that sit on the
same PP stage of every unit involved (``layer_class``) get the same covers from the same holders
(transitions.covers): only names and byte offsets differ. ``segments`` cuts what a target GPU holds,
in its shards' order, into fixed segments (embedding, final norm, head: derived as they are) and runs
of consecutive layers of one class, of which only the first layer is derived. Byte totals are the
first layer's times the run's length; a pair's bucket memory streams the first layer's pieces once
per layer, shifted to where that layer's slots are (``steps``: from the slots' byte offsets, None where
a rank does not hold some layer's counterpart), transitions.wire_stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from planner.models import Head, ModelSpec, TensorSpec
from planner.plan import Layout
from transitions.covers import Cover, covers, derive_target
from transitions.emu import EMU, Box, UnitState
from transitions.geometry import Shard, StateKind, _tensors, layer_stages, make_shard
from transitions.primitives import Primitive
from transitions.rank_table import NOT_HELD, rank_table
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
    for t in _tensors(model, head):
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
    layer's shards, layers) for a run of consecutive layers of one class; only those shards are made."""
    home = target
    while home.final is not None:  # a part in final shape holds its final unit's shards (EMU.shards)
        home = home.final
    state, rank = home.state, home.gpus.index(gpu)
    boxes = rank_table(state.model, state.head, home.layout, rank, state.kinds).boxes
    out: list[tuple[list[Shard], tuple[int, ...] | None]] = []
    run_class: tuple[int, ...] | None = None
    # blocks are maximal (never two of fixed tensors, nor two of one layer, in a row): each fixed block is
    # a group, and a layer's block starts a run or extends the open one
    for layer, block in _rank_blocks(state, home.layout, rank):
        last = out[-1][1] if out else None
        if layer is None:
            out.append((_block_shards(state, boxes, block), None))
            continue
        cls = layer_class(prim, layer)
        if last is not None and cls == run_class and layer == last[-1] + 1:
            out[-1] = (out[-1][0], (*last, layer))
            continue
        out.append((_block_shards(state, boxes, block), (layer,)))
        run_class = cls
    return out


@lru_cache(maxsize=1024)
def _rank_blocks(state: UnitState, layout: Layout, rank: int) -> tuple[tuple[int | None, tuple[int, ...]], ...]:
    """The tensors a unit rank holds (transitions.rank_table: a box, in model order), by their
    positions, cut into blocks of one decoder layer's or of consecutive fixed tensors' (layer None):
    ``_groups`` walks ~80 blocks where a 70B rank holds ~3,000 shards, and makes the shards of a run's
    first layer only. Keyed by value, bounded."""
    tensors = _tensors(state.model, state.head)
    blocks: list[tuple[int | None, list[int]]] = []
    for t, box in enumerate(rank_table(state.model, state.head, layout, rank, state.kinds).boxes):
        if box is None:
            continue
        layer = tensors[t].layer
        if blocks and blocks[-1][0] == layer:
            blocks[-1][1].append(t)
        else:
            blocks.append((layer, [t]))
    return tuple((layer, tuple(block)) for layer, block in blocks)


def _block_shards(state: UnitState, boxes: tuple[Box | None, ...], block: tuple[int, ...]) -> list[Shard]:
    """The shards of the tensors at ``block`` (positions in model order) with these boxes, tensor-major,
    kinds in order: those transitions.emu.rank_shards lists for them, made here."""
    model, tensors = state.model, _tensors(state.model, state.head)
    per_kind = [(kind, kind.bytes_per_element(model)) for kind in state.kinds]
    out = []
    for t in block:
        tensor, (offsets, lengths) = tensors[t], boxes[t]  # type: ignore[misc]
        out += [make_shard(tensor.name, kind, tensor.shape, offsets, lengths, nbytes) for kind, nbytes in per_kind]
    return out


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


@lru_cache(maxsize=1024)
def _run_shifts(model: ModelSpec, head: Head, layout: Layout, rank: int, kinds: tuple[StateKind, ...],
                run: tuple[int, ...]) -> dict[tuple[str, str], tuple[int, ...] | None]:
    """Per slot of ``run``'s first layer in a rank's buffer: the bytes from it to its counterpart in
    each layer of the run (None if the rank holds some counterpart not). Every layer's ``i``-th tensor
    has the first layer's shape, split and heads (``layer_tensors``), hence of each kind the same box,
    dtype and storage order: wherever the rank holds it, its slot is the first's moved, by the
    difference of their byte offsets (transitions.rank_table: no slot is made)."""
    layers = layer_tensors(model, head)
    assert layers is not None
    table = rank_table(model, head, layout, rank, kinds)
    position, offsets, width = table.position, table.offsets, len(kinds)
    out: dict[tuple[str, str], tuple[int, ...] | None] = {}
    for i, tensor in enumerate(layers[run[0]]):
        rows: list[int] | None = None
        first = position[tensor.name] * width
        for k, kind in enumerate(kinds):
            start = offsets[first + k]
            if start == NOT_HELD:
                continue
            if rows is None:
                rows = [position[layers[layer][i].name] * width for layer in run]
            others = [offsets[row + k] for row in rows]
            out[(tensor.name, kind.value)] = None if NOT_HELD in others else tuple([o - start for o in others])
    return out


def _unit_shifts(unit: EMU, gpu: int, run: tuple[int, ...]) -> dict[tuple[str, str], tuple[int, ...] | None]:
    home = unit.final if unit.final is not None else unit
    state = home.state
    return _run_shifts(state.model, state.head, home.layout, home.gpus.index(gpu), state.kinds, run)


def piece_steps(prim: Primitive, target: EMU, gpu: int, src: int, pieces: list[Piece], run: tuple[int, ...]
                ) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """Per piece ``src`` sends in ``run``'s first layer: the (source, target) bytes its slots sit from the
    first layer's in each layer of the run (``_run_shifts``' tuples, shared); None if some layer's slots
    are not the first's moved. ``steps`` by piece: what tells a pair whose every piece goes direct
    (transitions.gpu_traffic.streamed) without laying the moves out by layer."""
    src_tables = {u.uid: _unit_shifts(u, src, run) for u in prim.sources if u.holds(src)}
    dst_table = _unit_shifts(target, gpu, run)
    per_piece = []
    for p in pieces:
        ts, td = src_tables[p.src_unit].get(p.src_slot.key), dst_table.get(p.dst_slot.key)
        if ts is None or td is None:
            return None
        per_piece.append((ts, td))
    return per_piece


def by_layer(per_piece: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[list[tuple[int, int]]]:
    """``piece_steps`` laid out per layer: per layer of the run, per piece its (source, target) bytes."""
    return [list(layer) for layer in zip(*(zip(ts, td) for ts, td in per_piece))]


def steps(prim: Primitive, target: EMU, gpu: int, src: int, pieces: list[Piece], run: tuple[int, ...]
          ) -> list[list[tuple[int, int]]] | None:
    """Per layer of ``run``, per piece ``src`` sends in its first layer: the (source, target) bytes the
    piece's slots sit from the first layer's; None if some layer's slots are not the first's moved."""
    per_piece = piece_steps(prim, target, gpu, src, pieces, run)
    return None if per_piece is None else by_layer(per_piece)
