"""The warm pool (CPU): a buffer's mapping is reused only once no tensor views it any more, by a
request of at most its size and at least half of it, within the pool's bound; and a transition whose
new units come from reused memory full of stale bytes is still bit-exact end to end over gloo."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from executor_helpers import assert_same_state, logical_state

from agent.coordinator import LocalCoordinator
from planner.hardware import cluster_preset
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.workflow import ACTOR_TRAIN
from transitions.executor import alloc_bytes, warm_pool
from transitions.executor.warm_pool import WarmPool
from transitions.global_dag import build_transition
from transitions.layout import unit_buffer_bytes
from transitions.local_dag import plan_units
from transitions.scenarios import stage_states

MIB = 1 << 20


@pytest.fixture
def bound() -> Iterator[None]:
    saved = warm_pool.WARM_POOL_BYTES
    yield
    warm_pool.WARM_POOL_BYTES = saved


def test_a_mapping_returns_only_when_its_last_view_dies_and_is_reused_warm(bound: None) -> None:
    pool = WarmPool()
    buf = pool.take(3 * MIB)
    buf.fill_(0x5A)
    view = buf[MIB: MIB + 10]
    addr = buf.data_ptr()
    del buf
    assert pool.free == []  # a view still reads it
    del view
    assert [a for a, _ in pool.free] == [addr] and pool.held_bytes == 3 * MIB
    again = pool.take(2 * MIB)  # smaller, more than half: the same pages, their bytes as left
    assert again.data_ptr() == addr and again.numel() == 2 * MIB
    assert bool((again == 0x5A).all())  # touched before: a fresh mapping would read zeros
    assert pool.stats.reused == 1 and pool.stats.fresh == 1 and pool.held_bytes == 0
    del again
    pool.trim()


def test_best_fit_within_twice_the_request_and_the_bound(bound: None) -> None:
    pool = WarmPool()
    small, large = pool.take(2 * MIB), pool.take(8 * MIB)
    small_addr, large_addr = small.data_ptr(), large.data_ptr()
    del small, large
    assert pool.take(3 * MIB).data_ptr() not in (small_addr, large_addr)  # 2 MiB too small, 8 MiB > 2x
    got = pool.take(5 * MIB)
    assert got.data_ptr() == large_addr
    del got
    held = pool.held_bytes  # 2 + 3 + 8 MiB
    warm_pool.WARM_POOL_BYTES = held  # full
    extra = pool.take(20 * MIB)
    del extra  # over the bound: unmapped, not held
    assert pool.held_bytes == held == 13 * MIB
    assert pool.trim() == held and pool.free == [] and pool.held_bytes == 0


def test_off_maps_every_buffer_fresh(bound: None) -> None:
    warm_pool.WARM_POOL_BYTES = 0
    before = warm_pool.POOL.stats.fresh + warm_pool.POOL.stats.reused
    buf = alloc_bytes(2 * MIB, torch.device("cpu"))
    assert bool((buf == 0).all())  # a fresh anonymous mapping
    assert warm_pool.POOL.stats.fresh + warm_pool.POOL.stats.reused == before


# --- end to end: stale bytes in reused memory never reach the state ----------------------------------

MODEL = ModelSpec(name="warm", num_layers=2, hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                  head_dim=32, ffn_hidden_size=512, vocab_size=256, rope_theta=10_000.0)
STATES = stage_states(MODEL, (ACTOR_TRAIN,))
CLUSTER = cluster_preset("cpu", 4)


def _plan(version: int, tp: int, sets: list[list[int]]) -> GlobalPlan:
    return GlobalPlan(version=version, stages=(StagePlan(model_stage="actor-train", layout=Layout(tp, 1),
                                                         gpu_sets=tuple(map(tuple, sets)), micro_batch_size=1),))


OLD, NEW = _plan(1, 1, [[0], [1]]), _plan(2, 2, [[0, 1], [2, 3]])  # TP1 x DP2 -> TP2 x DP2


def stale_pool(ctx: Any, *, sizes: list[int]) -> dict[str, int]:
    """Fill this worker's warm pool with mappings of ``sizes`` bytes full of 0xA5, then drop them."""
    warm_pool.POOL.trim()
    bufs = [alloc_bytes(n, ctx.device) for n in sizes]
    for b in bufs:
        b.fill_(0xA5)
    del bufs
    return {"held": warm_pool.POOL.held_bytes, "reused": warm_pool.POOL.stats.reused}


def reused(ctx: Any) -> int:
    return warm_pool.POOL.stats.reused


@pytest.mark.multiprocess
def test_a_transition_into_reused_stale_memory_is_exact(pool: LocalCoordinator) -> None:
    dag = build_transition(STATES, CLUSTER, OLD, NEW)
    new_units = [u for sp in NEW for u in plan_units(STATES[sp.model_stage], sp, 2)]
    # per worker: a stale mapping the size of each new unit share it will hold, and a bucket's worth
    sizes = {w: [unit_buffer_bytes(u, w) for u in new_units if u.holds(w)] * 2 + [4 * MIB] for w in range(4)}
    pool.init_units([u for sp in OLD for u in plan_units(STATES[sp.model_stage], sp, 1)], seed=5)
    before = logical_state(pool.dump())
    for w, s in sizes.items():
        pool.call(stale_pool, workers=[w], sizes=s)
    start = pool.call(reused)
    outcome = pool.run_dag(dag, CLUSTER)
    assert outcome.committed, outcome.errors
    after = logical_state(pool.dump())
    assert_same_state(before, after)
    took = {w: n - start[w] for w, n in pool.call(reused).items()}
    assert took[2] >= 1 and took[3] >= 1  # the receivers' new units came out of the stale memory


def test_the_bound_comes_from_the_environment_or_the_hosts_memory() -> None:
    import subprocess
    import sys

    import psutil

    code = "from transitions.executor import warm_pool as w; print(w.WARM_POOL_BYTES)"
    run = lambda env: subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,  # noqa: E731
                                     timeout=120)
    base = {k: v for k, v in __import__("os").environ.items() if k != "NEREUS_WARM_POOL_BYTES"}
    assert int(run(base).stdout) == min(8 << 30, psutil.virtual_memory().total // 16)
    assert int(run({**base, "NEREUS_WARM_POOL_BYTES": "0"}).stdout) == 0
    bad = run({**base, "NEREUS_WARM_POOL_BYTES": "lots"})
    assert bad.returncode != 0 and "NEREUS_WARM_POOL_BYTES must be a byte count" in bad.stderr
