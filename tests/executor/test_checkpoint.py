"""The checkpoint/restart fallback on real workers: DCP save of a job's EMUs through fsspec, restore
into other layouts (also in freshly spawned processes), atomic commit marker, coverage checks.
What is saved is the workers' one state map (EMU uid -> state), so units a DAG run built are saved."""

from __future__ import annotations

from pathlib import Path

import pytest
from executor_helpers import assert_same_state, init_placements, logical_state, move, placement

from agent.coordinator import LocalCoordinator, WorkerDied
from transitions.checkpoint import COMMIT_MARKER, is_committed
from transitions.layout import unit_slots
from transitions.placement_dag import placement_units
from transitions.primitives import Restore
from transitions.restore_dag import restore_dag

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


def test_restore_is_a_dag_the_runner_runs_into_another_layout_and_world_size(
        pool: LocalCoordinator, tmp_path: Path) -> None:
    """A restore is a TransitionDAG of restore nodes (one per unit, reading nothing from any other
    worker), run by each worker's runner: here saved from 4 workers, restored into 3 in another layout;
    every logical tensor comes back equal and each worker reports one restore node per unit share."""
    init_placements(pool, OLD, seed=41)
    before = logical_state(pool.dump())
    pool.save_checkpoint(str(tmp_path), "ck")
    other = [placement("train", 1, 2, [[2, 0]]), placement("ref", 2, 1, [[1, 2]], training=False)]
    units = placement_units(other, version=5)
    dag = restore_dag(units, str(tmp_path), "ck")
    assert [type(p) for p in dag.nodes] == [Restore] * len(units) and dag.bytes_moved == 0
    assert dag.new_units == tuple(units) and not dag.old_units
    assert dag.peak_bytes == {g: sum(u.bytes_on(g) for u in units if u.holds(g)) for g in range(3)}
    with LocalCoordinator(3, timeout_s=20) as fresh:
        fresh.form_generation()
        init_placements(fresh, [placement("ref", 1, 1, [[0], [1], [2]], training=False)], seed=1)
        replies = fresh.load_checkpoint(str(tmp_path), "ck", units)
        assert_same_state(before, logical_state(fresh.dump()))  # what was held before is gone
        for worker, reply in replies.items():
            mine = [i for i, u in enumerate(units) if u.holds(worker)]
            assert [r.primitive for r in reply.value] == [f"restore#{i}" for i in mine]
            assert [r.bytes_restored for r in reply.value] == [  # every slot, the unit's counters too
                sum(s.num_bytes for s in unit_slots(units[i], worker).values()) for i in mine]
            assert all(r.bytes_sent == r.bytes_received == 0 for r in reply.value)
        assert fresh.held == {0: ("train@v5#0",), 1: ("ref@v5#0",), 2: ("ref@v5#0", "train@v5#0")}


def test_restore_of_a_stage_the_checkpoint_lacks_is_refused(pool: LocalCoordinator, tmp_path: Path) -> None:
    init_placements(pool, OLD[:1], seed=5)
    pool.save_checkpoint(str(tmp_path), "train-only")
    with pytest.raises(WorkerDied, match="checkpoint train-only holds no stage") as failed:
        pool.load_checkpoint(str(tmp_path), "train-only", placement_units(NEW))
    assert "[0, 2]" in str(failed.value)  # the workers of the ref units
    assert pool.held[0] == pool.held[2] == ()  # checked before anything was read: nothing half-restored
