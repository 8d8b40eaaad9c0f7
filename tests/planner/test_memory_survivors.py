"""planner/memory.py, what its other tests left open (mutation testing, tests/mutate.py --module
planner/memory.py: 14 of 325 mutants survived tests/planner, 10 of them equivalent): a vocabulary
that TP does not divide gives each rank the floor of its share of logits, in whole bytes; inference
and training hold no KV cache."""

from __future__ import annotations

import dataclasses

from planner.memory import transient_parts
from planner.models import ModelSpec
from planner.plan import Layout
from planner.workflow import ACTOR_GEN, ACTOR_TRAIN, REF_INF, Workload

M = ModelSpec(name="m", num_layers=4, hidden_size=64, num_attention_heads=8, num_kv_heads=2, head_dim=16,
              ffn_hidden_size=96, vocab_size=1000, rope_theta=10_000.0)
ODD = dataclasses.replace(M, vocab_size=1001)
W = Workload(prompts_per_step=4, prompt_tokens=10, response_tokens=20, max_response_tokens=50)


def test_a_vocabulary_tp_does_not_divide_gives_each_rank_the_floor_of_its_share() -> None:
    # TP2: 1001 // 2 = 500 rows of logits a rank, as for 1000; the rest of the terms do not read the vocabulary
    for ms, b, recompute in ((ACTOR_GEN, 1, False), (REF_INF, 3, False), (ACTOR_TRAIN, 3, True), (ACTOR_TRAIN, 1, False)):
        odd = transient_parts(ODD, ms, Layout(2, 1), W, b, 1, recompute)
        assert odd == transient_parts(M, ms, Layout(2, 1), W, b, 1, recompute), ms.name
        assert all(type(x) is int for x in odd)
    # generation's sampled logits, fp32: 1 x 1001 // 2 x 4 B, and one layer's prefill of 10 tokens (880 B each)
    assert transient_parts(ODD, ACTOR_GEN, Layout(2, 1), W, 1, 1, False)[1] == 500 * 4 + 10 * 880


def test_inference_and_training_hold_no_kv_cache() -> None:
    for ms in (REF_INF, ACTOR_TRAIN):
        for recompute in (False, True):
            assert transient_parts(M, ms, Layout(1, 2), W, 2, 2, recompute)[0] == 0, ms.name
