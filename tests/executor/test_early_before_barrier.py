"""A worker's first node's early builds are made before the opening barrier (CPU): local work nothing
before it waits for, done while the peers are still on their way (a TP split's sender used to build
its kept half after the barrier, in series before its send). The state stays bit-exact, the build is
still counted in its node's report, and a run that fails at the barrier gives the donor its pages back."""

from __future__ import annotations

from typing import Any

import pytest
from executor_helpers import assert_same_state, logical_state
from test_early_build import CLUSTER, _dag, _old_units

from agent.coordinator import LocalCoordinator


def _last_run(ctx: Any) -> dict[str, float]:
    from transitions.executor import runner

    return dict(runner.LAST_RUN)


def _fail_on_three(ctx: Any) -> None:
    if ctx.worker_id == 3:
        raise RuntimeError("release refused here")


@pytest.mark.multiprocess
def test_the_first_nodes_early_builds_run_before_the_barrier_and_stay_exact(pool: LocalCoordinator) -> None:
    pool.init_units(_old_units(), seed=21)
    before = logical_state(pool.dump())
    outcome = pool.run_dag(_dag(), CLUSTER)
    assert outcome.committed, outcome.errors
    assert_same_state(before, logical_state(pool.dump()))
    spans = pool.call(_last_run)
    for sender in (0, 1):  # each cuts its TP shard from the replica it gives up: built before the barrier
        assert spans[sender]["early_s"] > 0.0, spans[sender]
        built = [r for r in outcome.reports[sender] if r.in_place]
        assert len(built) == 1 and built[0].bytes_remapped > 0  # still its building node's report
    for receiver in (2, 3):  # nothing to build: straight to the barrier
        assert spans[receiver]["early_s"] == 0.0, spans[receiver]
        assert not any(r.in_place for r in outcome.reports[receiver])


@pytest.mark.multiprocess
def test_a_barrier_that_fails_after_an_early_build_gives_the_donor_back(pool: LocalCoordinator) -> None:
    pool.init_units(_old_units(), seed=22)
    before = logical_state(pool.dump())
    held = {w: set(units) for w, units in pool.held.items()}
    outcome = pool.run_dag(_dag(), CLUSTER, before=_fail_on_three)  # worker 3 breaks the generation
    assert not outcome.committed and not outcome.dead_workers and not outcome.lost
    assert "release refused here" in outcome.errors[3]
    spans = pool.call(_last_run, workers=(0, 1))
    assert all(spans[w]["early_s"] > 0.0 for w in (0, 1)), spans  # the builds were made, then undone
    assert {w: set(units) for w, units in pool.held.items()} == held  # no target kept, every donor held
    assert_same_state(before, logical_state(pool.dump()))
    pool.form_generation()  # the pool goes on for the next case
