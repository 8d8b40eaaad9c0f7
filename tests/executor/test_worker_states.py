"""The worker's state machine (agent.commands.WorkerState): the transition table, commands refused
where the state does not allow them, and, on real processes, a failed RunDag leaving the worker
BROKEN until the next Join."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from executor_helpers import assert_same_state, init_placements, logical_state, placement

from agent.commands import TRANSITIONS, Call, Dump, InitUnits, RunDag, WorkerState, WorkerStateError
from agent.coordinator import LocalCoordinator
from agent.worker import WorkerContext, handle
from transitions.channel import DataChannel
from transitions.placement_dag import placement_cluster, placement_dag, placement_units

OLD, NEW = [placement("a", 1, 1, [[0]])], [placement("a", 1, 1, [[1]])]


def test_worker_imports_no_driver() -> None:
    """The command set lives in agent.commands: the worker never imports the coordinator."""
    code = "import sys, agent.worker; print('agent.coordinator' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_transition_table() -> None:
    live = set(WorkerState) - {WorkerState.STOPPED}
    assert all((s, WorkerState.STOPPED) in TRANSITIONS for s in live)  # every live state can stop
    assert not any(src is WorkerState.STOPPED for src, _ in TRANSITIONS)  # nothing comes back
    assert {src for src, dst in TRANSITIONS if dst is WorkerState.RUNNING} == live - {WorkerState.RUNNING}
    assert {dst for src, dst in TRANSITIONS if src is WorkerState.RUNNING} == set(WorkerState) - {
        WorkerState.RUNNING}
    assert all(why for why in TRANSITIONS.values())


def _break(ctx: WorkerContext) -> None:
    ctx.channel.break_("peer 1 is gone")


def test_commands_without_a_working_channel_in_process() -> None:
    """No generation joined: INIT; units can be made and read, but nothing that needs the channel
    runs. A channel that failed (here declared broken) leaves BROKEN, and the units stay readable."""
    cpu = torch.device("cpu")
    ctx = WorkerContext(worker_id=0, device=cpu, channel=DataChannel(worker_id=0, device=cpu))
    assert ctx.state is WorkerState.INIT
    assert handle(ctx, InitUnits(units=tuple(placement_units(OLD)), seed=1)) == ["a@v1#0"]
    assert ctx.state is WorkerState.INIT
    dag = placement_dag(OLD, NEW)
    run = RunDag(dag=dag, predicted_s=tuple(0.0 for _ in dag.nodes))
    with pytest.raises(WorkerStateError, match="init"):
        handle(ctx, run)
    assert ctx.state is WorkerState.INIT
    handle(ctx, Call(fn=_break))
    assert ctx.state is WorkerState.BROKEN
    with pytest.raises(WorkerStateError, match="broken: peer 1 is gone"):
        handle(ctx, run)
    assert ctx.state is WorkerState.BROKEN and set(handle(ctx, Dump())) == {"a"}
    assert ctx.state is WorkerState.BROKEN


@pytest.mark.multiprocess
@pytest.mark.xdist_group("executor-states")
def test_failed_dag_run_leaves_broken_until_join() -> None:
    """Worker 1 runs its part of a DAG whose sender (worker 0) was never told to: its receive times
    out (bounded by the generation's timeout), its channel breaks, and it answers BROKEN. A second
    RunDag is refused at once; a Join makes both READY and the same DAG then runs."""
    timeout_s = 3.0
    dag = placement_dag(OLD, NEW)
    run = RunDag(dag=dag, predicted_s=tuple(0.0 for _ in dag.nodes))
    with LocalCoordinator(2, timeout_s=timeout_s) as pool:
        assert pool.state == {0: WorkerState.INIT, 1: WorkerState.INIT}
        pool.form_generation()
        assert pool.state == {0: WorkerState.READY, 1: WorkerState.READY}
        init_placements(pool, OLD, seed=3)
        before = logical_state(pool.dump())
        failed = pool.request({1: run})[1]
        assert not failed.ok and failed.state is WorkerState.BROKEN and "ChannelBroken" in (failed.error or "")
        refused = pool.request({1: run}, timeout_s=timeout_s)[1]  # refused before any wait
        assert not refused.ok and refused.state is WorkerState.BROKEN and "WorkerStateError" in (refused.error or "")
        assert pool.request({1: Dump()})[1].state is WorkerState.BROKEN
        pool.form_generation()
        assert pool.state == {0: WorkerState.READY, 1: WorkerState.READY}
        outcome = pool.run_dag(dag, placement_cluster(OLD, NEW))
        assert outcome.committed, outcome.errors
        assert pool.state == {0: WorkerState.READY, 1: WorkerState.READY} and pool.held == {0: (), 1: ("a@v2#0",)}
        assert_same_state(before, logical_state(pool.dump()))
