"""transitions.layer_runs term by term, pure, no processes: how a target GPU's shards fall into fixed
segments and runs of like layers (by the PP stage of each source and of its final), the segments'
pieces against the derivation from every piece, and the byte steps from a run's first layer to the
others against the slots of the pieces derived for those layers."""

from __future__ import annotations

from planner.models import ModelSpec
from planner.plan import Layout
from planner.workflow import ACTOR_GEN
from transitions.covers import derive_target
from transitions.emu import EMU
from transitions.layer_runs import _groups, _run_shifts, by_layer, layer_class, piece_steps, segments, steps
from transitions.primitives import Extend
from transitions.scenarios import stage_states
from transitions.transfer_plan import Piece

# 4 layers of 9 tensors each (no q/k/v bias, no q/k norm), untied head: embedding, the layers, the
# final norm and lm_head, in that order on every GPU
MICRO = ModelSpec(name="micro", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                  head_dim=16, ffn_hidden_size=176, vocab_size=96, rope_theta=10_000.0)
GEN = stage_states(MICRO, (ACTOR_GEN,))["actor-gen"]  # parameters only: one shard per tensor
PER_LAYER = 9


def _u(uid: str, tp: int, pp: int, gpus: tuple[int, ...], final: EMU | None = None) -> EMU:
    return EMU(uid=uid, state=GEN, layout=Layout(tp, pp), gpus=gpus, version=1, final=final)


TARGET = _u("t", 2, 1, (1, 2))  # TP 2: GPU 1 holds TP rank 0 of every tensor, all 4 layers
WHOLE = _u("s", 1, 1, (0,))  # everything on GPU 0
STAGED = _u("s2", 1, 2, (0, 3))  # PP 2: layers 0, 1 on GPU 0, layers 2, 3 on GPU 3


def _layer(name: str) -> int | None:
    return int(name.split(".")[2]) if name.startswith("model.layers.") else None


def _shape(groups: list[tuple[list, tuple[int, ...] | None]]) -> list[tuple[list[str], tuple[int, ...] | None]]:
    return [([s.key[0] for s in shards], run) for shards, run in groups]


def _names(layer: int) -> list[str]:
    return [s.key[0] for s in TARGET.shards(1) if _layer(s.key[0]) == layer]


def test_one_source_stage_makes_one_run_between_the_fixed_tensors() -> None:
    groups = _shape(_groups(Extend(sources=(WHOLE,), target=TARGET), TARGET, 1))
    assert len(_names(0)) == PER_LAYER
    assert groups == [(["model.embed_tokens.weight"], None),
                      (_names(0), (0, 1, 2, 3)),  # the first layer's shards stand for the run
                      (["model.norm.weight", "lm_head.weight"], None)]


def test_a_source_stage_boundary_cuts_the_run() -> None:
    groups = _shape(_groups(Extend(sources=(STAGED,), target=TARGET), TARGET, 1))
    assert groups == [(["model.embed_tokens.weight"], None), (_names(0), (0, 1)), (_names(2), (2, 3)),
                      (["model.norm.weight", "lm_head.weight"], None)]


def test_a_sources_final_counts_in_its_layers_class() -> None:
    # a part on GPU 0 (its own layout PP 1) headed into a PP 2 unit on (0, 3): layers 0, 1 sit on the
    # final's stage 0, layers 2, 3 on its stage 1 (4 layers on 2 stages, 2 each)
    part = _u("p", 1, 1, (0,), final=STAGED)
    ext = Extend(sources=(part, WHOLE), target=TARGET)
    assert [layer_class(ext, layer) for layer in range(4)] == [(0, 0, 0), (0, 0, 0), (0, 1, 0), (0, 1, 0)]
    assert [run for _, run in _groups(ext, TARGET, 1)] == [None, (0, 1), (2, 3), None]


def test_segments_derive_the_first_layer_of_each_run_and_add_up_to_every_piece() -> None:
    for source in (WHOLE, STAGED):
        ext = Extend(sources=(source,), target=TARGET)
        segs = segments(ext, TARGET, 1)
        assert segs is not None
        assert [s.layers for s in segs] == [r for _, r in _groups(ext, TARGET, 1)]
        every = derive_target(TARGET, ext.sources, 1)
        # each segment's pieces are every piece of its tensors (the run's first layer)
        for seg in segs:
            tensors = {shard.key[0] for shard, _, _ in seg.covers}
            assert sorted(map(repr, seg.pieces)) == sorted(repr(p) for p in every if p.dst_slot.tensor in tensors)
        # and the runs' bytes times their lengths are every piece's bytes
        assert sum(p.num_bytes * s.count for s in segs for p in s.pieces) == sum(p.num_bytes for p in every)


def _same_tensor_other_layer(p: Piece, layer: int, every: list[Piece]) -> Piece:
    name = p.dst_slot.tensor.replace("model.layers.0.", f"model.layers.{layer}.", 1)
    (q,) = [q for q in every if q.dst_slot.tensor == name and q.box[1] == p.box[1]
            and q.src_worker == p.src_worker and q.src_unit == p.src_unit]
    return q


def test_steps_are_where_each_layers_pieces_sit_from_the_first_layers() -> None:
    _run_shifts.cache_clear()  # a rank's shifts are memoised: derive them here
    ext = Extend(sources=(WHOLE,), target=TARGET)
    segs = segments(ext, TARGET, 1)
    assert segs is not None
    (run,) = [s for s in segs if s.layers is not None]
    every = derive_target(TARGET, ext.sources, 1)
    got = steps(ext, TARGET, 1, 0, run.pieces, run.layers)  # type: ignore[arg-type]
    assert got is not None and len(got) == 4 and all(len(layer) == len(run.pieces) for layer in got)
    for layer, shifts in enumerate(got):
        for p, shift in zip(run.pieces, shifts):
            q = _same_tensor_other_layer(p, layer, every)
            assert shift == (q.src_slot.byte_offset - p.src_slot.byte_offset,
                             q.dst_slot.byte_offset - p.dst_slot.byte_offset)
    assert got[0] == [(0, 0)] * len(run.pieces) and got[1][0][0] > 0


def test_no_steps_when_a_runs_layers_are_not_all_on_the_sending_or_receiving_rank() -> None:
    _run_shifts.cache_clear()
    def first(ext: Extend, target: EMU, layer: int) -> list[Piece]:
        return [p for p in derive_target(target, ext.sources, 1) if p.src_worker == 0
                and _layer(p.dst_slot.tensor) == layer]

    # the PP 2 source: GPU 0 holds layers 0 and 1, not layer 2
    ext = Extend(sources=(STAGED,), target=TARGET)
    assert first(ext, TARGET, 1)
    assert steps(ext, TARGET, 1, 0, first(ext, TARGET, 1), (1, 2)) is None
    assert steps(ext, TARGET, 1, 0, first(ext, TARGET, 0), (0, 1)) is not None
    # the other way round: a PP 2 target on (1, 2) holds layers 0, 1 on GPU 1, a whole source sends
    staged_target = _u("t2", 1, 2, (1, 2))
    ext = Extend(sources=(WHOLE,), target=staged_target)
    assert first(ext, staged_target, 1)
    assert steps(ext, staged_target, 1, 0, first(ext, staged_target, 1), (1, 2)) is None
    assert steps(ext, staged_target, 1, 0, first(ext, staged_target, 0), (0, 1)) is not None


def test_piece_steps_are_the_steps_by_piece() -> None:
    """Per piece, its moves in every layer of the run (one tuple a side), the same as ``steps`` by layer."""
    ext = Extend(sources=(WHOLE,), target=TARGET)
    segs = segments(ext, TARGET, 1)
    assert segs is not None
    (run,) = [s for s in segs if s.layers is not None]
    per = piece_steps(ext, TARGET, 1, 0, run.pieces, run.layers)  # type: ignore[arg-type]
    assert per is not None and len(per) == len(run.pieces) and all(len(ts) == len(td) == 4 for ts, td in per)
    assert by_layer(per) == steps(ext, TARGET, 1, 0, run.pieces, run.layers)  # type: ignore[arg-type]
    assert [layer[0] for layer in by_layer(per)] == list(zip(*per[0]))
    staged = Extend(sources=(STAGED,), target=TARGET)
    firsts = [p for p in derive_target(TARGET, staged.sources, 1) if p.src_worker == 0
              and _layer(p.dst_slot.tensor) == 1]
    assert piece_steps(staged, TARGET, 1, 0, firsts, (1, 2)) is None
    assert by_layer([]) == []
