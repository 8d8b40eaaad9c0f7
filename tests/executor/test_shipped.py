"""The driver's derivation shipped to the workers (transitions.executor.shipped) and the work run
before a DAG in the same command (RunDag.before): the same steps as a worker derives itself, the
same bit-exact moves, and a failing ``before`` moves nothing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from executor_helpers import assert_same_state, init_placements, logical_state, placement

from agent.coordinator import LocalCoordinator
from transitions.dag_pieces import DagMemo
from transitions.executor import IN_PLACE, shipped
from transitions.executor.runner import _prepare
from transitions.node_steps import dag_messages
from transitions.placement_dag import placement_cluster, placement_dag
from transitions.transfer_plan import DEFAULT_BUCKET_BYTES

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("executor-pool")]

CHAINS = {
    "tp1xdp2->tp2xdp2": ([placement("a", 1, 1, [[0], [1]])], [placement("a", 2, 1, [[0, 1], [2, 3]])]),
    "tp4->tp2xdp2": ([placement("a", 4, 1, [[0, 1, 2, 3]])], [placement("a", 2, 1, [[3, 2], [1, 0]])]),
    "tp2pp2->tp1pp4": ([placement("a", 2, 2, [[0, 1, 2, 3]])], [placement("a", 1, 4, [[3, 1, 0, 2]])]),
    "dp4->dp2 shrink": ([placement("a", 1, 1, [[0], [1], [2], [3]])], [placement("a", 1, 1, [[3], [1]])]),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_shipped_steps_are_what_the_worker_derives(name: str) -> None:
    old, new = CHAINS[name]
    dag = placement_dag(old, new)
    driver = DagMemo()
    dag_messages(dag, driver, early=IN_PLACE)
    cpu = torch.device("cpu")
    for worker in sorted(dag.gpu_nodes):
        own = _prepare(dag, worker, cpu, None, DEFAULT_BUCKET_BYTES, None, None, DagMemo())
        blob = shipped.pack(dag, driver, worker)
        assert blob is not None
        memo = DagMemo()
        assert shipped.seed(memo, dag, blob) == len(shipped.entries_for(dag, driver, worker)) > 0
        seeded = memo.by_dag[dag]
        got = _prepare(dag, worker, cpu, None, DEFAULT_BUCKET_BYTES, None, None, memo)
        assert memo.by_dag[dag] is seeded and set(seeded) == set(shipped.entries_for(dag, driver, worker))
        assert got.steps == own.steps and got.builds == own.builds and got.plans == own.plans
        assert got.order == own.order


def test_the_steps_ship_as_plain_values_and_another_format_is_refused() -> None:
    import pickle

    dag = placement_dag(*CHAINS["tp1xdp2->tp2xdp2"])
    driver = DagMemo()
    dag_messages(dag, driver, early=IN_PLACE)
    blob = shipped.pack(dag, driver, 0)
    assert blob is not None
    # no record class is pickled by reference: steps, messages, pieces and slots are rows of values
    for name in (b"transfer_plan", b"Piece", b"Message", b"Step", b"Slot"):
        assert name not in blob, name
    fmt, *rest = pickle.loads(blob)
    other = pickle.dumps((fmt + 1, *rest))
    with pytest.raises(ValueError, match="format"):
        shipped.seed(DagMemo(), dag, other)


@pytest.mark.parametrize("name", list(CHAINS))
def test_shipped_run_is_bit_exact(pool: LocalCoordinator, name: str) -> None:
    old, new = CHAINS[name]
    init_placements(pool, old, seed=len(name) + 40)
    before = logical_state(pool.dump())
    dag = placement_dag(old, new)
    memo = DagMemo()
    dag_messages(dag, memo, early=IN_PLACE)
    outcome = pool.run_dag(dag, placement_cluster(old, new), derived=memo, before=_mark)
    assert outcome.committed, outcome.errors
    assert_same_state(before, logical_state(pool.dump()))
    assert pool.call(_marked) == {w: 1 for w in pool.alive}  # before ran once on each, in the run


_RUNS: list[int] = []  # in each worker process: one entry per ``_mark`` run


def _mark(ctx: Any) -> None:
    _RUNS.append(ctx.worker_id)


def _marked(ctx: Any) -> int:
    """How many times ``_mark`` ran in this worker since the last ask."""
    n = len(_RUNS)
    _RUNS.clear()
    return n


def _fail_on_two(ctx: Any) -> None:
    if ctx.worker_id == 2:
        raise RuntimeError("release refused here")


def test_failing_before_moves_nothing(pool: LocalCoordinator) -> None:
    old, new = CHAINS["tp1xdp2->tp2xdp2"]
    init_placements(pool, old, seed=77)
    before = logical_state(pool.dump())
    outcome = pool.run_dag(placement_dag(old, new), placement_cluster(old, new), before=_fail_on_two)
    assert not outcome.committed and not outcome.dead_workers
    assert "release refused here" in outcome.errors[2]
    assert not outcome.lost
    assert_same_state(before, logical_state(pool.dump()))
    pool.form_generation()  # the pool goes on for the next case
