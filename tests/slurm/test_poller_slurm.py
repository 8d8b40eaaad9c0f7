"""The batched poller on a real cluster: one squeue for all jobs, filtering by id, per-node GRES indices
(squeue and scontrol agree), terminal states cached, job-id reuse guarded, failing and hanging Slurm
commands tolerated with back-off."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from lab import SlurmLab, wait_for

from nereusd.allocation import EventKind
from nereusd.slurm.commands import SlurmCommands, node_gpu_indices
from nereusd.slurm.poller import SlurmPoller
from nereusd.slurm.states import Phase

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]


def _running(poller: SlurmPoller, *job_ids: str) -> None:
    def ready() -> bool:
        poller.refresh(force=True)
        return all((i := poller.info(j)) is not None and i.mapping.phase is Phase.RUNNING for j in job_ids)

    wait_for(ready, 30, f"jobs {job_ids} to run", 0.2)


def _squeue_calls(cmds: SlurmCommands, log: list[tuple[str, ...]]) -> None:
    original = cmds.run

    def run(argv, **kw):  # type: ignore[no-untyped-def]
        log.append(tuple(argv))
        return original(argv, **kw)

    cmds.run = run  # type: ignore[method-assign]


def test_one_squeue_for_all_jobs_and_gres_per_node(lab: SlurmLab) -> None:
    cmds = SlurmCommands(timeout_s=10, env=lab.env)
    calls: list[tuple[str, ...]] = []
    _squeue_calls(cmds, calls)
    poller = SlurmPoller(cmds, interval_s=0.2)
    first = lab.sbatch("-N", "1", "-w", "node1", "--gres=gpu:2", "-J", "first")
    second = lab.sbatch("-N", "1", "-w", "node1", "--gres=gpu:2", "-J", "second")  # takes GPUs 2-3
    pair = lab.sbatch("-N", "2", "-w", "node[2-3]", "--gres=gpu:3", "-J", "pair")
    stranger = lab.sbatch("-N", "1", "-w", "node4", "-J", "not-watched")
    for job in (first, second, pair):
        poller.watch(job)
    _running(poller, first, second, pair)

    calls.clear()
    assert poller.refresh(force=True)
    assert sum(c[0] == "squeue" for c in calls) == 1  # one call answers for every job
    assert poller.info(stranger) is None  # squeue listed it; we did not ask
    assert poller.info(first).gpu_indices == {"node1": (0, 1)}  # type: ignore[union-attr]
    assert poller.info(second).gpu_indices == {"node1": (2, 3)}  # type: ignore[union-attr]
    info = poller.info(pair)
    assert info is not None and info.nodes == ("node2", "node3") and info.batch_host == "node2"
    assert info.gpu_indices == {"node2": (0, 1, 2), "node3": (0, 1, 2)}
    # scontrol -o show job -d says the same per node
    assert node_gpu_indices(cmds.show_job(second) or {}) == {"node1": (2, 3)}
    assert node_gpu_indices(cmds.show_job(pair) or {}) == {"node2": (0, 1, 2), "node3": (0, 1, 2)}

    # terminal states: mapped, cached, and no longer change
    lab.run("scancel", first)
    wait_for(lambda: poller.refresh(force=True) and poller.info(first).terminal, 20, "cancel seen", 0.2)  # type: ignore[union-attr]
    ended = poller.info(first)
    assert ended is not None and ended.mapping.ended_by is EventKind.CANCELLED and ended.nodes == ()
    poller.refresh(force=True)
    assert poller.info(first) is ended


def test_job_id_reuse_is_not_adopted(lab: SlurmLab) -> None:
    poller = SlurmPoller(SlurmCommands(timeout_s=10, env=lab.env), interval_s=0.2)
    job = lab.sbatch("-N", "1", "-J", "new-incarnation")
    real = SlurmPoller(SlurmCommands(timeout_s=10, env=lab.env))
    real.watch(job)
    _running(real, job)
    submitted = real.info(job).submit_time_s  # type: ignore[union-attr]
    # The daemon remembers an older job under the same id (slurmctld state wiped, ids restarted).
    poller.watch(job, submitted_at_s=submitted - 3600)
    poller.refresh(force=True)
    poller.refresh(force=True)
    info = poller.info(job)
    assert info is not None and info.terminal and info.nodes == ()
    assert "reused" in info.reason and info.state == "VANISHED"
    # a watch by name that does not match is refused the same way
    named = SlurmPoller(SlurmCommands(timeout_s=10, env=lab.env))
    named.watch(job, name="some-other-job")
    named.refresh(force=True)
    named.refresh(force=True)
    assert named.info(job).terminal  # type: ignore[union-attr]


def _stand_in(bin_dir: Path, body: str) -> None:
    script = bin_dir / "squeue"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)


def test_failing_and_hanging_squeue_back_off_and_recover(lab: SlurmLab, tmp_path: Path) -> None:
    real_squeue = shutil.which("squeue")
    assert real_squeue
    job = lab.sbatch("-N", "1", "-J", "survivor")
    now = [0.0]
    cmds = SlurmCommands(timeout_s=0.5, env=lab.env, bin_dir=str(tmp_path))
    poller = SlurmPoller(cmds, interval_s=1.0, backoff_max_s=8.0, clock=lambda: now[0])
    poller.watch(job)
    _stand_in(tmp_path, f'exec {real_squeue} "$@"')
    wait_for(lambda: poller.refresh(force=True) and poller.info(job).mapping.phase is Phase.RUNNING,  # type: ignore[union-attr]
             30, "job to run", 0.2)
    good = poller.info(job)

    _stand_in(tmp_path, "exec sleep 30")  # hangs: killed at the 0.5 s timeout
    now[0] += 1.0  # the normal interval passes
    assert poller.refresh() is False
    assert poller.consecutive_failures == 1 and poller.due()  # first retry at once
    _stand_in(tmp_path, "echo 'slurm_load_jobs error: Socket timed out' >&2; exit 1")
    delays = []
    for _ in range(5):
        assert poller.refresh() is False
        start = now[0]
        while not poller.due():
            now[0] += 0.5
        delays.append(now[0] - start)
    assert delays == [2.0, 4.0, 8.0, 8.0, 8.0]  # 0, 2, 4, 8 ... capped
    assert poller.info(job) is good  # the last good answer stays in place

    _stand_in(tmp_path, "echo 'not json'")
    assert poller.refresh() is False and poller.consecutive_failures == 7

    _stand_in(tmp_path, f'exec {real_squeue} "$@"')
    cmds.timeout_s = 20.0  # the real squeue again: 0.5 s (for the hang above) is too short on a loaded machine
    now[0] += 8.0
    assert poller.refresh() is True
    assert poller.consecutive_failures == 0 and poller.info(job).mapping.phase is Phase.RUNNING  # type: ignore[union-attr]
    assert not poller.due()  # back to the normal interval
    now[0] += 1.0
    assert poller.due()


def test_a_requeued_job_is_the_same_job(lab: SlurmLab) -> None:
    """Slurm restamps a requeued job's submit time: under the same id, name and comment it is followed
    on (PENDING, then RUNNING again), not reported VANISHED as a reused id."""
    job = lab.sbatch("-N", "1", "-J", "nereus-rq-anchor", "--comment", "nereus:rq", "--requeue")
    poller = SlurmPoller(SlurmCommands(timeout_s=10, env=lab.env), interval_s=0.2)
    poller.watch(job, comment="nereus:rq")
    _running(poller, job)
    first = poller.info(job).submit_time_s  # type: ignore[union-attr]
    lab.run("scontrol", "requeue", job)

    def requeued() -> bool:
        poller.refresh(force=True)
        info = poller.info(job)
        assert info is not None and not info.terminal, info
        return info.submit_time_s > first

    wait_for(requeued, 30, "the requeued job's new submit time", 0.2)
    _running(poller, job)  # and it runs again, the same watch
    assert not poller.info(job).terminal  # type: ignore[union-attr]
    # the same comment with an EARLIER submit time is not a requeue: another job under a reused id
    older = SlurmPoller(SlurmCommands(timeout_s=10, env=lab.env))
    older.watch(job, comment="nereus:rq", submitted_at_s=poller.info(job).submit_time_s + 3600)  # type: ignore[union-attr]
    older.refresh(force=True)
    older.refresh(force=True)
    assert older.info(job).terminal and "reused" in older.info(job).reason  # type: ignore[union-attr]
