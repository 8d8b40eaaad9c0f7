"""Every piece of every layout change is one contiguous run on both sides (row-parallel weights are
stored column-major, so a TP shard of any weight is a range of its outermost stored dim, and PP moves
whole tensors). The executor's strided paths (row-by-row compaction in place, strided copies of an
early build) are therefore reached by no transition today; tests/executor/test_raw_moves.py pins them
on hand-made pieces. Should a layout ever make a strided piece, this test names it."""

from __future__ import annotations

import itertools

import pytest

from planner.hardware import cluster_preset
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.workflow import ACTOR_TRAIN
from transitions.dag_pieces import DagMemo, node_pieces
from transitions.global_dag import build_transition
from transitions.layout import contiguous_range
from transitions.scenarios import stage_states

# GQA (2 KV heads under TP4), an embedding tied across PP, a vocabulary TP does not divide
MODEL = ModelSpec(name="strided-probe", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                  head_dim=16, ffn_hidden_size=96, vocab_size=30, tie_word_embeddings=True)
STATES = stage_states(MODEL, (ACTOR_TRAIN,))
CLUSTER = cluster_preset("cpu", 8)
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2), (1, 4)]


def _plan(version: int, tp: int, pp: int, first: int) -> GlobalPlan:
    size = tp * pp
    gpus = [(first + i) % 8 for i in range(size)]
    return GlobalPlan(version=version, stages=(StagePlan(model_stage="actor-train", layout=Layout(tp, pp),
                                                         gpu_sets=(tuple(gpus),), micro_batch_size=1),))


@pytest.mark.parametrize("old,new", [(a, b) for a, b in itertools.product(LAYOUTS, LAYOUTS) if a != b])
def test_no_piece_is_strided(old: tuple[int, int], new: tuple[int, int]) -> None:
    dag = build_transition(STATES, CLUSTER, _plan(1, *old, first=0), _plan(2, *new, first=3))
    memo = DagMemo()
    seen = 0
    for node in range(len(dag.nodes)):
        for gpu in dag.footprints[node].gpus:
            for p in node_pieces(dag, node, gpu, memo):
                seen += 1
                assert contiguous_range(p.src_slot, p.box) is not None, (p.src_slot.key, p.src_slot.order, p.box)
                assert contiguous_range(p.dst_slot, p.box) is not None, (p.dst_slot.key, p.dst_slot.order, p.box)
    assert seen > 0
