"""transitions.rank_table against the shards and slots it stands for, and its readers in transitions.covers
and transitions.layer_runs against the slot-by-slot derivations they replace: every slot field, every
box, the buffer size, absent keys, errors, the run shifts (stage boundaries included) and a rank's blocks
of shards, over models with GQA, uneven vocab splits, a tied embedding and fp32 parameters."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import pytest

from planner.errors import SpecError
from planner.models import LLAMA_31_8B, TINY_3M, Head, ModelSpec
from planner.plan import Layout
from planner.workflow import Role, StageKind
from transitions import covers, geometry, layer_runs, layout, rank_table
from transitions.emu import EMU, UnitState, rank_shards
from transitions.geometry import INFERENCE_KINDS, TRAINING_KINDS, StateKind, rank_shard_tuple, state_kinds
from transitions.layout import (
    COUNTERS,
    COUNTERS_KIND,
    DTYPE_BYTES,
    NUM_COUNTERS,
    Slot,
    align,
    dtype_of,
    slot_start,
)
from transitions.primitives import Extend
from transitions.rank_table import NOT_HELD, unit_table
from transitions.scenarios import stage_states

# GQA with fewer kv heads than TP ranks at TP 4, an uneven vocab (5 over TP 2 and 4: empty chunks), a
# tied embedding (held by the first and the last PP stage), fp32 parameters
ODD = ModelSpec(name="odd", num_layers=4, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                ffn_hidden_size=8, vocab_size=5, tie_word_embeddings=True)
FP32 = ModelSpec(name="fp32", num_layers=3, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                 ffn_hidden_size=12, vocab_size=8, bytes_per_param=4)
# slots of 64 KiB and more start on a page: a layer of ~1 MiB tensors and small norms between them
PAGED = ModelSpec(name="paged", num_layers=4, hidden_size=512, num_attention_heads=8, num_kv_heads=4,
                  head_dim=64, ffn_hidden_size=1024, vocab_size=1000)
KINDS = (INFERENCE_KINDS, TRAINING_KINDS, state_kinds(StageKind.TRAINING, keep_grads=True))
LAYOUTS = ((1, 1), (2, 1), (4, 2), (2, 4), (1, 3), (4, 1))


@pytest.fixture(autouse=True)
def _cold() -> None:
    """Every test derives its tables, shards and slots afresh (the memos hide what made them)."""
    for memo in (rank_table.rank_table, rank_table._tp_boxes, rank_table._stage_holds, rank_table._model_slots,
                 rank_table._kind_index, rank_table._tp_sizes, rank_table._rules, layer_runs._rank_blocks, layer_runs._run_shifts,
                 geometry._tensors, geometry.rank_shard_tuple, geometry._tp_rank_shards, geometry._common_shards,
                 layout._layout_slots, layout._slot_index, layout.unit_slots, rank_shards):
        memo.cache_clear()


def _cases(models: tuple[ModelSpec, ...] = (ODD, FP32, TINY_3M, PAGED)
           ) -> Iterator[tuple[ModelSpec, Head, tuple[StateKind, ...], Layout, int]]:
    for model, head, kinds, (tp, pp) in itertools.product(models, Head, KINDS, LAYOUTS):
        lay = Layout(tp, pp)
        if pp > model.num_layers or not model.valid_tp(tp):
            continue
        for rank in range(lay.size):
            yield model, head, kinds, lay, rank


def _plain_slots(model: ModelSpec, head: Head, lay: Layout, rank: int, kinds: tuple[StateKind, ...]
                 ) -> tuple[list[Slot], int]:
    """A rank's slots as the plain dataclass and ``slot_start`` give them, from its shards."""
    orders = {t.name: (1, 0, *range(2, len(t.shape))) for t in model.tensors(head)
              if t.parallel.value == "row" and len(t.shape) >= 2}
    entries = [(COUNTERS, COUNTERS_KIND, "int64", (NUM_COUNTERS,), (0,), (NUM_COUNTERS,))]
    entries += [(s.tensor, s.kind.value, dtype_of(s.kind, model), s.global_shape, s.offsets, s.lengths)
                for s in rank_shard_tuple(model, head, lay, rank, kinds)]
    out, offset = [], 0
    for tensor, kind, dtype, shape, offs, lens in entries:
        nbytes = math.prod(lens) * DTYPE_BYTES[dtype]
        offset = slot_start(offset, nbytes)
        out.append(Slot(tensor=tensor, kind=kind, dtype=dtype, global_shape=shape, offsets=offs, lengths=lens,
                        byte_offset=offset, order=orders.get(tensor, ())))
        offset += nbytes
    return out, align(offset)


def test_every_slot_is_the_plain_slot_and_no_other_key_has_one() -> None:
    paged = 0
    for model, head, kinds, lay, rank in _cases():
        want, size = _plain_slots(model, head, lay, rank, kinds)
        table = rank_table.rank_table(model, head, lay, rank, kinds)
        assert table.size == size
        for slot in want:
            got = table.slot(slot.key)
            assert type(got) is Slot and got == slot, (model.name, lay, rank, slot.key)
        paged += sum(s.byte_offset % layout.PAGE_BYTES == 0 and s.num_bytes >= layout.PAGE_ALIGN_MIN_BYTES
                     for s in want)
        have = {s.key for s in want}
        for tensor, kind in itertools.product([*(t.name for t in model.tensors(head)), "nope"], StateKind):
            if (tensor, kind.value) not in have:
                with pytest.raises(KeyError) as err:
                    table.slot((tensor, kind.value))
                assert err.value.args == ((tensor, kind.value),)
        with pytest.raises(KeyError):
            table.slot((COUNTERS, "param"))
    assert paged > 0  # the page-aligned branch was taken


def test_every_box_is_the_ranks_shard_box_and_none_elsewhere() -> None:
    absent = 0
    for model, head, kinds, lay, rank in _cases():
        want = {s.key: (s.offsets, s.lengths) for s in rank_shard_tuple(model, head, lay, rank, kinds)}
        table = rank_table.rank_table(model, head, lay, rank, kinds)
        for tensor, kind in itertools.product([*(t.name for t in model.tensors(head)), "nope"], StateKind):
            assert table.box((tensor, kind)) == want.get((tensor, kind)), (model.name, lay, rank, tensor, kind)
            absent += (tensor, kind) not in want
        held = [t.name for t in model.tensors(head) if any((t.name, k) in want for k in kinds)]
        assert [table.boxes[table.position[n]] for n in held] == [want[(n, kinds[0])] for n in held]
    assert absent > 0


def test_a_slot_is_made_once_and_the_counters_lead_every_buffer() -> None:
    table = rank_table.rank_table(ODD, Head.LM, Layout(2, 2), 3, TRAINING_KINDS)
    key = ("model.layers.2.self_attn.q_proj.weight", "exp_avg")
    assert table.slot(key) is table.slot(key)
    counters = table.slot((COUNTERS, COUNTERS_KIND))
    assert counters == Slot(tensor=COUNTERS, kind=COUNTERS_KIND, dtype="int64", global_shape=(NUM_COUNTERS,),
                            offsets=(0,), lengths=(NUM_COUNTERS,), byte_offset=0)
    first = min(o for o in table.offsets if o != NOT_HELD)
    assert first == NUM_COUNTERS * DTYPE_BYTES["int64"]  # the first shard right after the counters


def test_a_rank_outside_the_unit_or_a_bad_layout_is_refused() -> None:
    for rank in (-1, 4):
        with pytest.raises(SpecError):
            rank_table.rank_table(ODD, Head.LM, Layout(2, 2), rank, INFERENCE_KINDS)
    with pytest.raises(SpecError):
        rank_table.rank_table(ODD, Head.LM, Layout(3, 1), 0, INFERENCE_KINDS)  # 4 heads over TP 3


STATE = UnitState(model_stage="actor-train", stage_kind=StageKind.TRAINING, role=Role.ACTOR, model=ODD, head=Head.LM,
                  kinds=TRAINING_KINDS)


def test_a_part_in_final_shape_reads_its_final_units_table() -> None:
    final = EMU(uid="f", state=STATE, layout=Layout(2, 2), gpus=(4, 5, 6, 7), version=1)
    part = EMU(uid="p", state=STATE, layout=Layout(1, 2), gpus=(5, 7), version=1, final=final)
    assert unit_table(part, 7) is rank_table.rank_table(ODD, Head.LM, Layout(2, 2), 3, TRAINING_KINDS)
    assert unit_table(final, 4) is rank_table.rank_table(ODD, Head.LM, Layout(2, 2), 0, TRAINING_KINDS)
    assert layout.unit_slots(part, 7) == {k: unit_table(part, 7).slot(k) for k in layout.unit_slots(part, 7)}
    # a source's boxes for the covers: EMU.boxes, the part's through its final, none off the unit
    for unit, gpu in ((part, 5), (part, 7), (final, 6), (part, 4), (final, 0)):
        box_of = covers._box_of(unit, gpu)
        for t, kind in itertools.product(ODD.tensors(Head.LM), StateKind):
            assert box_of((t.name, kind)) == unit.boxes(gpu).get((t.name, kind))
    assert covers._box_of(part, 4)(("model.norm.weight", StateKind.PARAM)) is None


def _slot_by_slot(model: ModelSpec, head: Head, lay: Layout, rank: int, kinds: tuple[StateKind, ...],
                  run: tuple[int, ...]) -> dict[tuple[str, str], tuple[int, ...] | None]:
    """The run shifts as they were derived from every slot: a counterpart must exist and lie alike."""
    layers = layer_runs.layer_tensors(model, head)
    assert layers is not None
    slots = layout._slot_index(model, head, lay, rank, kinds)

    def place(s: Slot) -> tuple[object, ...]:
        return (s.kind, s.dtype, s.global_shape, s.offsets, s.lengths, s.order)

    out: dict[tuple[str, str], tuple[int, ...] | None] = {}
    for i, tensor in enumerate(layers[run[0]]):
        for kind in kinds:
            slot = slots.get((tensor.name, kind.value))
            if slot is None:
                continue
            others = [slots.get((layers[layer][i].name, slot.kind)) for layer in run]
            if any(o is None or place(o) != place(slot) for o in others):
                out[slot.key] = None
            else:
                out[slot.key] = tuple(o.byte_offset - slot.byte_offset for o in others)  # type: ignore[union-attr]
    return out


def test_run_shifts_are_the_slot_by_slot_shifts_across_stage_boundaries() -> None:
    nones = moved = 0
    for model, head, kinds, lay, rank in _cases((ODD, FP32, PAGED, LLAMA_31_8B)):
        if model is LLAMA_31_8B and (kinds is not TRAINING_KINDS or head is not Head.LM or lay.tp > 2):
            continue
        n = model.num_layers
        for run in {(0,), tuple(range(n)), tuple(range(1, n)), (0, 1), tuple(range(n - 2, n)), (n - 1,)}:
            got = layer_runs._run_shifts(model, head, lay, rank, kinds, run)
            want = _slot_by_slot(model, head, lay, rank, kinds, run)
            assert got == want and list(got) == list(want), (model.name, lay, rank, run)
            nones += sum(v is None for v in got.values())
            moved += sum(v is not None and any(v) for v in got.values())
    assert nones and moved


def test_a_ranks_blocks_make_its_shards_in_order() -> None:
    for model, head, kinds, lay, rank in _cases((ODD, FP32, TINY_3M)):
        state = UnitState(model_stage="x", stage_kind=StageKind.TRAINING, role=Role.ACTOR, model=model, head=head,
                          kinds=kinds)
        blocks = layer_runs._rank_blocks(state, lay, rank)
        boxes = rank_table.rank_table(model, head, lay, rank, kinds).boxes
        made = [s for _, block in blocks for s in layer_runs._block_shards(state, boxes, block)]
        want = list(rank_shards(state, lay, rank))
        assert made == want and [type(s) for s in made] == [type(s) for s in want]
        layers = [layer for layer, _ in blocks]
        assert all(a != b for a, b in zip(layers, layers[1:]))  # maximal blocks
        specs = model.tensors(head)
        assert [specs[t].layer for _, block in blocks for t in block for _ in kinds] == \
            [next(t.layer for t in specs if t.name == s.tensor) for s in want]


def test_a_real_models_groups_are_its_shards_first_layers() -> None:
    gen = stage_states(LLAMA_31_8B)["actor-gen"]
    target = EMU(uid="t", state=gen, layout=Layout(2, 2), gpus=(0, 1, 2, 3), version=2)
    source = EMU(uid="s", state=gen, layout=Layout(1, 4), gpus=(0, 1, 2, 3), version=1)
    groups = layer_runs._groups(Extend(sources=(source,), target=target), target, 3)
    shards = list(target.shards(3))  # TP rank 1, PP stage 1: layers 16-31, the final norm and the head
    runs = [run for _, run in groups]
    assert runs == [tuple(range(16, 24)), tuple(range(24, 32)), None]
    first = [s for s in shards if s.tensor.startswith(("model.layers.16.", "model.layers.24."))]
    assert [s for g, run in groups if run for s in g] == first
    assert groups[-1][0] == [s for s in shards if not s.tensor.startswith("model.layers.")]
