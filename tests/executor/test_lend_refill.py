"""Pages lent by a merge's local runs and the warm pool's refill (CPU): a TP or PP merge keeping its
own part moves that part's pages into the new unit once its transfers are done, end to end bit-exact
over gloo; the pool's refill populates exactly the pages a move or a release emptied, keeping the
bytes of the pages still there."""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import pytest
from executor_helpers import assert_same_state, logical_state

from agent.coordinator import LocalCoordinator
from planner.hardware import cluster_preset
from planner.models import ModelSpec
from planner.plan import GlobalPlan, Layout, StagePlan
from planner.workflow import ACTOR_TRAIN
from transitions.executor.pages import move_pages, release_tail
from transitions.executor.warm_pool import WarmPool
from transitions.global_dag import build_transition
from transitions.layout import unit_buffer_bytes
from transitions.local_dag import plan_units
from transitions.scenarios import stage_states

MIB = 1 << 20
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def resident(addr: int, length: int) -> list[bool]:
    """Per page of [addr, addr + length) (page-aligned): whether it is in memory (mincore)."""
    n = length // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * n)()
    assert _LIBC.mincore(addr, length, vec) == 0, ctypes.get_errno()
    return [bool(v & 1) for v in vec]


def test_refill_populates_the_emptied_pages_and_keeps_the_rest(bound: None) -> None:
    pool = WarmPool()
    buf, other = pool.take(4 * MIB), pool.take(4 * MIB)
    buf.fill_(0x5A)
    other.fill_(0x11)
    addr = buf.data_ptr()
    assert move_pages(other.data_ptr(), addr, MIB)  # the first MiB moves out: it reads zeros, unmapped
    assert release_tail(buf, 3 * MIB) == MIB  # the last MiB goes back to the OS
    del buf, other
    got = resident(addr, 4 * MIB)
    assert not any(got[: MIB // mmap.PAGESIZE]) and not any(got[3 * MIB // mmap.PAGESIZE:])
    assert all(got[MIB // mmap.PAGESIZE: 3 * MIB // mmap.PAGESIZE])
    assert pool.refill() == 8 * MIB  # both held mappings walked
    assert all(resident(addr, 4 * MIB)) and pool.held_bytes == 8 * MIB and pool.stats.refills == 1
    again = pool.take(4 * MIB)
    assert again.data_ptr() == addr or pool.take(4 * MIB).data_ptr() == addr
    pool.trim()


def test_refill_async_runs_once_at_a_time_and_settles(bound: None) -> None:
    pool = WarmPool()
    bufs = [pool.take(2 * MIB) for _ in range(3)]
    del bufs
    thread = pool.refill_async()
    assert thread is not None
    pool.settle()
    assert not thread.is_alive() and pool.stats.refills == 1 and pool.held_bytes == 6 * MIB
    pool.trim()


# --- end to end: merges keep their own part as pages --------------------------------------------------

MODEL = ModelSpec(name="lend", num_layers=2, hidden_size=256, num_attention_heads=4, num_kv_heads=2,
                  head_dim=64, ffn_hidden_size=1024, vocab_size=512, rope_theta=10_000.0)
STATES = stage_states(MODEL, (ACTOR_TRAIN,))
CLUSTER = cluster_preset("cpu", 4)


def _plan(version: int, tp: int, pp: int, sets: list[list[int]]) -> GlobalPlan:
    return GlobalPlan(version=version, stages=(StagePlan(model_stage="actor-train", layout=Layout(tp, pp),
                                                         gpu_sets=tuple(map(tuple, sets)), micro_batch_size=1),))


def _units(plan: GlobalPlan) -> list[Any]:
    return [u for sp in plan for u in plan_units(STATES[sp.model_stage], sp, plan.version)]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp-merge", "pp-merge"])
def test_a_merge_lends_its_own_part_and_is_exact(pool: LocalCoordinator, tp: int, pp: int) -> None:
    old, new = _plan(1, tp, pp, [[0, 1], [2, 3]]), _plan(2, 1, 1, [[0], [1], [2], [3]])  # TP2/PP2 x DP2 -> DP4
    dag = build_transition(STATES, CLUSTER, old, new)
    pool.init_units(_units(old), seed=9)
    before = logical_state(pool.dump())
    outcome = pool.run_dag(dag, CLUSTER)
    assert outcome.committed, outcome.errors
    assert_same_state(before, logical_state(pool.dump()))
    for worker, reps in outcome.reports.items():
        lent = sum(r.bytes_remapped for r in reps)
        kept = sum(r.bytes_copied_locally for r in reps)
        # about half of every worker's new replica was its own part: moved as pages, barely copied
        share = sum(unit_buffer_bytes(u, worker) for u in _units(new) if u.holds(worker))
        assert lent > 0.3 * share, (worker, lent, share)
        assert kept < lent, (worker, kept, lent)
    # and back: the lent pages' mappings, refilled, serve the next run (no state changes meanwhile)
    back = build_transition(STATES, CLUSTER, _plan(2, 1, 1, [[0], [1], [2], [3]]), _plan(3, tp, pp, [[0, 1], [2, 3]]))
    outcome = pool.run_dag(back, CLUSTER)
    assert outcome.committed, outcome.errors
    assert_same_state(before, logical_state(pool.dump()))
