"""The checkpoint/restart fallback on real workers: DCP save of a job's EMUs through fsspec, restore
into other layouts (also in freshly spawned processes), atomic commit marker, coverage checks.
What is saved is the workers' one state map (EMU uid -> state), so units a DAG run built are saved."""

from __future__ import annotations

from pathlib import Path

import pytest
from executor_helpers import assert_same_state, init_placements, logical_state, move, placement

from agent.coordinator import LocalCoordinator, WorkerDied
from transitions.checkpoint import COMMIT_MARKER, is_committed
from transitions.placement_dag import placement_units

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("executor-pool")]

OLD = [placement("train", 2, 1, [[0, 1], [2, 3]]), placement("ref", 4, 1, [[3, 2, 1, 0]], training=False)]
NEW = [placement("train", 1, 2, [[3, 1]]), placement("ref", 1, 1, [[0], [2]], training=False)]


def test_save_then_restore_into_another_layout(pool: LocalCoordinator, tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    init_placements(pool, OLD, seed=9)
    before = logical_state(pool.dump())
    replies = pool.save_checkpoint(url, "step-10")
    assert is_committed(url, "step-10") and (tmp_path / "step-10" / COMMIT_MARKER).exists()
    assert not list(tmp_path.glob("*.partial-*"))  # renamed away
    saved = next(r.value["bytes"] for r in replies.values())
    assert saved > 0
    init_placements(pool, OLD, seed=10)  # clobber the live state: only the checkpoint holds seed 9
    with pytest.raises(AssertionError):
        assert_same_state(before, logical_state(pool.dump()))
    pool.load_checkpoint(url, "step-10", placement_units(NEW))
    assert_same_state(before, logical_state(pool.dump()))
    # a checkpoint is never overwritten
    with pytest.raises(WorkerDied, match="already exists"):
        pool.save_checkpoint(url, "step-10")


def test_uncommitted_checkpoint_is_refused(pool: LocalCoordinator, tmp_path: Path) -> None:
    init_placements(pool, OLD, seed=3)
    pool.save_checkpoint(str(tmp_path), "s")
    (tmp_path / "s" / COMMIT_MARKER).unlink()  # what a save that died before its commit leaves
    with pytest.raises(WorkerDied, match="COMMITTED"):
        pool.load_checkpoint(str(tmp_path), "s", placement_units(NEW))


def test_restore_into_new_processes(tmp_path: Path) -> None:
    """The restart half of checkpoint/restart: other processes, another world size, another layout."""
    old = [placement("train", 1, 1, [[0]])]
    with LocalCoordinator(1, timeout_s=20) as first:
        first.form_generation()
        init_placements(first, old, seed=77)
        before = logical_state(first.dump())
        first.save_checkpoint(str(tmp_path), "ck")
    new = [placement("train", 2, 1, [[1, 0]])]
    with LocalCoordinator(2, timeout_s=20) as second:
        second.form_generation()
        second.load_checkpoint(str(tmp_path), "ck", placement_units(new))
        assert_same_state(before, logical_state(second.dump()))


def test_units_a_dag_built_are_saved_and_restore_in_new_processes(pool: LocalCoordinator, tmp_path: Path) -> None:
    """Units held after a DAG run (new uids, parts merged, old units freed) are what is saved: the
    checkpoint holds the whole logical state, and restores into a third layout in other processes."""
    init_placements(pool, OLD, seed=31)
    before = logical_state(pool.dump())
    assert move(pool, OLD, NEW).committed
    assert_same_state(before, logical_state(pool.dump()))
    replies = pool.save_checkpoint(str(tmp_path), "after-dag")
    assert sum(r.value["bytes"] for r in replies.values()) > 0
    other = [placement("train", 2, 1, [[2, 0]]), placement("ref", 1, 1, [[1]], training=False)]
    with LocalCoordinator(3, timeout_s=20) as fresh:
        fresh.form_generation()
        fresh.load_checkpoint(str(tmp_path), "after-dag", placement_units(other, version=7))
        assert fresh.held == {0: ("train@v7#0",), 1: ("ref@v7#0",), 2: ("train@v7#0",)}
        assert_same_state(before, logical_state(fresh.dump()))
