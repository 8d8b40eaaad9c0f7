"""A Qwen2-shaped model (q/k/v biases) through live transitions: the biases are split over TP with
their projections' rows and move with them, bit-exact (the same pool of real workers as the other
executor cases)."""

from __future__ import annotations

import pytest
from executor_helpers import assert_same_state, init_placements, logical_state, move, placement

from agent.coordinator import LocalCoordinator
from planner.models import ModelSpec

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("executor-pool")]

QKV_BIAS = ModelSpec(name="micro-qkv-bias", num_layers=2, hidden_size=48, num_attention_heads=4, num_kv_heads=2,
                     head_dim=12, ffn_hidden_size=96, vocab_size=64, qkv_bias=True)


def test_qkv_biases_move_bit_exact_through_tp_and_pp_changes(pool: LocalCoordinator) -> None:
    chain = [[placement("a", 1, 1, [[0], [1]], model=QKV_BIAS)],
             [placement("a", 2, 1, [[1, 2]], model=QKV_BIAS)],
             [placement("a", 1, 2, [[3, 0]], model=QKV_BIAS)]]
    init_placements(pool, chain[0], seed=5)
    start = logical_state(pool.dump())
    biases = [k for k in start if k[1].endswith(".bias")]
    assert biases, sorted(map(str, start))[:8]  # the state really holds them
    for version, (old, new) in enumerate(zip(chain, chain[1:]), start=1):
        outcome = move(pool, old, new, old_version=version)
        assert outcome.committed, outcome.errors
        assert_same_state(start, logical_state(pool.dump()))
