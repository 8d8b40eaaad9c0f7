"""transitions.covers worked out by hand on TINY_3M (q_proj: 256 x 256, column-split; o_proj: row-split;
layer norms replicated): interval subtraction, the split dimension, the rank-aligned-then-rotating
holder order, same-GPU sources first, the from_gpu filter, the coverage error's fields and the
counters a Merge copies (issue 18)."""

from __future__ import annotations

import pytest

from planner.models import TINY_3M
from planner.plan import Layout
from planner.workflow import ACTOR_TRAIN, REF_INF
from transitions.covers import _split_dim, _subtract, counter_pieces, covers, derive_target
from transitions.emu import EMU
from transitions.errors import CoverageError
from transitions.geometry import StateKind
from transitions.layout import NUM_COUNTERS
from transitions.primitives import Merge
from transitions.scenarios import stage_states

REF = stage_states(TINY_3M, (ACTOR_TRAIN, REF_INF))["ref-inf"]  # parameters only: one kind per tensor
Q = "model.layers.0.self_attn.q_proj.weight"
OPROJ = "model.layers.0.self_attn.o_proj.weight"
NORM = "model.layers.0.input_layernorm.weight"


def _u(uid: str, tp: int, gpus: tuple[int, ...], final: EMU | None = None) -> EMU:
    return EMU(uid=uid, state=REF, layout=Layout(tp, 1), gpus=gpus, version=1, final=final)


def _of(pieces: list, tensor: str) -> list[tuple[int, tuple]]:
    return [(p.src_worker, p.box) for p in pieces if p.src_slot.key[0] == tensor]


def test_subtract_keeps_every_interval_it_does_not_touch() -> None:
    assert _subtract([(0, 4), (10, 20)], 12, 15) == ([(12, 15)], [(0, 4), (10, 12), (15, 20)])
    assert _subtract([(0, 4), (10, 20)], 20, 30) == ([], [(0, 4), (10, 20)])


def test_row_parallel_tensors_split_along_dim_1() -> None:
    index = {t.name: t for t in TINY_3M.tensors(REF.head)}
    assert (_split_dim(index[OPROJ]), _split_dim(index[Q]), _split_dim(index[NORM])) == (1, 0, 0)


def test_two_remote_halves_and_the_from_gpu_filter() -> None:
    """tp1 target on GPU 2 from a tp2 source on GPUs 0, 1: q_proj's rows 0-128 from GPU 0 and 128-256
    from GPU 1; o_proj's columns likewise; with from_gpu=1 only GPU 1's pieces, every one for "t"."""
    t, s = _u("t", 1, (2,)), _u("s", 2, (0, 1))
    every = derive_target(t, (s,), 2)
    assert _of(every, Q) == [(0, ((0, 0), (128, 256))), (1, ((128, 0), (128, 256)))]
    assert _of(every, OPROJ) == [(0, ((0, 0), (256, 128))), (1, ((0, 128), (256, 128)))]
    one = derive_target(t, (s,), 2, from_gpu=1)
    assert _of(one, Q) == [(1, ((128, 0), (128, 256)))]
    assert {p.src_worker for p in one} == {1} and {p.dst_unit for p in one} == {"t"}
    assert len(one) == len([p for p in every if p.src_worker == 1])
    assert _of(every, NORM) == [(0, ((0,), (256,)))] and _of(one, NORM) == []  # replicated: GPU 0 holds it all


def test_holders_rotate_upward_from_the_rank_aligned_one() -> None:
    """tp2 target on GPUs 4, 5 from a tp4 source on GPUs 0-3: GPU 5 (TP rank 1) needs q_proj rows
    128-256, held by source ranks 2 (GPU 2) and 3 (GPU 3); tried 1, 2, 3, 0: GPU 2's rows first."""
    got = derive_target(_u("t", 2, (4, 5)), (_u("s", 4, (0, 1, 2, 3)),), 5)
    assert _of(got, Q) == [(2, ((128, 0), (64, 256))), (3, ((192, 0), (64, 256)))]
    assert _of(got, NORM) == [(1, ((0,), (256,)))]


def test_the_tp_rank_is_the_finals() -> None:
    """A tp1 share on GPU 3 of a tp2 final on GPUs 2, 3 holds its final's rank-1 shards and is TP rank 1:
    the source's rank 1 (GPU 1) is tried first, so the replicated norm comes from GPU 1."""
    final = _u("f", 2, (2, 3))
    got = derive_target(_u("t", 1, (3,), final=final), (_u("s", 2, (0, 1)),), 3)
    assert _of(got, Q) == [(1, ((128, 0), (128, 256)))]
    assert _of(got, NORM) == [(1, ((0,), (256,)))]


def test_a_source_on_the_same_gpu_comes_first() -> None:
    """tp2 target on GPUs 1, 2 from a tp2 source on GPUs 0, 1: on GPU 1 (target rank 0) the norm comes
    from the source on GPU 1 itself, not the rank-aligned GPU 0; q_proj rows 0-128 only GPU 0 holds."""
    got = derive_target(_u("t", 2, (1, 2)), (_u("s", 2, (0, 1)),), 1)
    assert _of(got, NORM) == [(1, ((0,), (256,)))]
    assert _of(got, Q) == [(0, ((0, 0), (128, 256)))]


def test_no_source_raises_with_the_target_gpu_key_and_rows() -> None:
    with pytest.raises(CoverageError) as err:
        covers(_u("t", 1, (2,)), (), 2)
    e = err.value
    assert (e.target, e.gpu, e.key, e.rows) == ("t", 2, ("model.embed_tokens.weight", StateKind.PARAM), ((0, 512),))


def test_a_merge_copies_counters_only_where_no_part_becomes_the_unit() -> None:
    """Unit m (tp2 on GPUs 1, 0) merged from p0 on GPU 1 (relabelled to m) and p1 on GPU 5: GPU 1 takes the
    part's buffer; GPU 0 (m's rank 1) copies the counters from the first part's GPU 1."""
    m = _u("m", 2, (1, 0))
    parts = (_u("p0", 1, (1,), final=m), _u("p1", 1, (5,)))
    got = counter_pieces(Merge(parts=parts, unit=m))
    assert [(p.src_worker, p.dst_worker, p.src_unit, p.dst_unit, p.box) for p in got] == \
        [(1, 0, "p0", "m", ((0,), (NUM_COUNTERS,)))]
